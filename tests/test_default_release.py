"""The fine-tuned default shipped inside the package (lev_jax/default, a `python -m train release` of
the smollm2 preset): what `lev_jax.load()` and `python -m serve` use with no model, `base_only` /
`--base-only` for the raw embedded model, and the release named with its held-out metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lev_jax
from lev_jax.engine import DEFAULT_RELEASE

REPO = Path(__file__).resolve().parents[1]
MANIFEST = json.loads((DEFAULT_RELEASE / "lev_release.json").read_text())
STATE = "I was charged twice for the same card payment yesterday, please refund one of them."
QUESTION = {
    "intent": {
        "type": "choice",
        "instructions": "What does the customer want?",
        "criteria": {"refund": "money back", "card_lost": "a lost card", "transfer_failed": "a failed transfer"},
    }
}


@pytest.fixture(scope="module")
def default():
    return lev_jax.load()


def test_the_shipped_release_is_the_default_and_base_only_is_the_raw_model(default, embedded):
    info = default.info()
    assert info["release"]["name"] == MANIFEST["name"] and "shipped default" in info["checkpoint"]
    assert MANIFEST["base"]["model"] == "embedded" and default.model_name == MANIFEST["name"]
    assert {m["task"] for m in info["release"]["metrics"]} >= {"banking77-test", "clinc150-test"}
    assert default.layout == MANIFEST["engine"]["layout"] and not default.calibration.is_identity
    raw = lev_jax.load(embedded, calibration="auto")
    base = lev_jax.load(base_only=True)
    assert base.info()["release"] is None and base.model_name == raw.model_name != default.model_name
    # the adapter changes the answers
    p_default = np.asarray(list(default.predict(STATE, QUESTION)["intent"]["probabilities"].values()))
    p_base = np.asarray(list(base.predict(STATE, QUESTION)["intent"]["probabilities"].values()))
    assert np.abs(p_default - p_base).max() > 1e-3


def test_release_metrics_are_the_cards(default):
    card = (DEFAULT_RELEASE / "README.md").read_text()
    for t in MANIFEST["metrics"]:
        assert f"| {t['task']} | {t['n']} |" in card and t["n"] >= 250
    assert sum(p.stat().st_size for p in DEFAULT_RELEASE.rglob("*") if p.is_file()) <= 20 << 20


def test_serve_base_only_with_a_model_is_one_line_and_exit_2():
    p = subprocess.run(
        [sys.executable, "-m", "serve", "--base-only", "--model", "x"], cwd=REPO, capture_output=True, text=True
    )
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "--base-only" in p.stderr


def test_the_load_test_s_fresh_requests_after_ready_compile_nothing_the_warm_up_did_not(default):
    """The load test's after-ready phase (lev_jax/bench/loadtest.py) sends both halves' fresh tickets,
    one by one and eight at a time: on the shipped default every program they run -- alone or as a
    micro-batch of 8 -- is one the warm-up grid runs (the fixed program set), so neither loop of the
    crossover compiles on the request path and both halves cost the same."""
    from lev_jax.bench import loadtest
    from lev_jax.server import warmup

    w = warmup.Warmup(default)
    grid = w.plan_programs(
        warmup.default_batches(default), warmup.long_row_shapes(default) + warmup.prefill_shapes(default)
    )
    assert grid and len(grid) <= 16
    for half in loadtest.HALVES:
        reqs = loadtest.fresh_payloads(half, len(loadtest.TICKETS), 1, iter(range(100)))
        plans = [default.plan(p["state"], p["questions"]) for p in reqs]
        keys = set().union(*(default.batch_programs([p]) for p in plans)) | default.batch_programs(plans)
        assert keys and keys <= grid, (half, keys - grid)


def test_the_sdk_request_and_jevcompat_s_option_ladder_run_only_the_grid_s_programs(default):
    """The acceptance's SDK request (a ~2 KB state, a noul, a 3-option choice and a 3-level score)
    and jevcompat's option ladder (a choice of 2 to 255 options: Mode A, then the Mode B head) need
    no program the warm-up grid does not build: the shipped default is served by at most 16."""
    from lev_jax.server import warmup

    w = warmup.Warmup(default)
    grid = w.plan_programs(
        warmup.default_batches(default), warmup.long_row_shapes(default) + warmup.prefill_shapes(default)
    )
    assert grid and len(grid) <= 16
    state = " ".join(warmup.WORDS[i % len(warmup.WORDS)] for i in range(380))
    three = {"billing": "Payments, invoices, refunds", "delivery": None, "account": None}
    sdk = {"refund": warmup.NOUL, "team": {**warmup.CHOICE, "criteria": three}}
    sdk["urgency"] = warmup.SCORE
    requests = [(state, sdk)]
    for n in (2, 26, 64, 128, 255):
        queues = {f"Queue {i:03d}": f"Tickets routed to queue {i}" for i in range(n)}
        q = {"type": "choice", "instructions": "Which queue should this ticket go to?", "criteria": queues}
        requests.append(("My invoice shows a charge I do not recognise", {"q": q}))
    for s, q in requests:
        keys = default.programs(s, q)
        assert keys and keys <= grid, (len(q), keys - grid)


def test_the_default_reads_a_large_taxonomy_with_its_mode_b_head_in_one_row(default):
    """The shipped release carries a Mode B pointer head: a choice of at least its threshold's options
    is read in one marked row (equal to one full forward), a small one by label codes."""
    from lev_jax.data.registry import REGISTRY

    assert MANIFEST["mode_b"] is not None and default.backbone.mode_b_head is not None
    assert default.info()["mode_b"]["min_options"] == MANIFEST["mode_b"]["min_options"] <= 77
    big = {
        "type": "choice",
        "instructions": "What does the customer want?",
        "criteria": {o.key: None for o in REGISTRY["banking77"].options},
    }
    questions = {"big": big, **QUESTION}
    assert {qp.qid: qp.route for qp in default.plan(STATE, questions).questions} == {
        "big": "mode_b",
        "intent": "mode_a",
    }
    fast = default.predict(STATE, questions)["big"]
    ref = default.predict(STATE, {"big": big}, reference=True)["big"]
    p = np.asarray(list(fast["probabilities"].values()))
    assert abs(p.sum() - 1) < 1e-9 and fast["choice"] == "transaction_charged_twice"
    np.testing.assert_allclose(p, np.asarray(list(ref["probabilities"].values())), atol=1e-5, rtol=0)
