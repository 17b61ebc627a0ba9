"""`levbench depth` (lev_jax.bench.depth) on a tiny 4-layer model with exits at 1, 2, 3 and a small
synthetic eval set: every exit and policy reported with its verdicts, the fixed full depth is the
engine's own full-depth answers, the oracle bounds every fixed exit; a model without exits is refused."""

import json

import numpy as np
import pytest

import lev_jax
from lev_jax import metrics, testing
from lev_jax.bench import cli as bench_cli
from lev_jax.bench import depth
from lev_jax.bench.evalset import EvalSet, answer_row, gold_index
from tests.test_elastic_serving import with_exits

TEAMS = {"Billing": "money", "Shipping": "parcels", "Sales": "buying"}
WORDS = "charged twice refund parcel late box buy seats upgrade invoice card lost".split()


def eval_set(n=8, seed=0):
    rng = np.random.default_rng(seed)
    questions = {
        "team": {"type": "choice", "instructions": "Which team?", "criteria": TEAMS},
        "late": {"type": "noul", "instructions": "Is something late?"},
    }
    items = [
        {
            "state": " ".join(rng.choice(WORDS, int(rng.integers(5, 15)))),
            "labels": {"team": str(rng.choice(list(TEAMS))), "late": bool(rng.integers(0, 2))},
        }
        for _ in range(n)
    ]
    return EvalSet("tiny-depth", questions, items, {})


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    engine = lev_jax.Engine(with_exits(testing.tiny_backbone("llama", seed=4, layers=4), (1, 2, 3)))
    es = eval_set()
    out = tmp_path_factory.mktemp("depth")
    rep = depth.run(engine, [es], out, timing_items=2, folds=3)
    return engine, es, out, rep


def test_every_exit_and_policy_is_reported_with_its_verdicts(report):
    engine, es, out, rep = report
    names = [p["policy"] for p in rep["policies"]]
    assert [n for n in names if n.startswith("fixed")] == ["fixed 1", "fixed 2", "fixed 3", "fixed 4"]
    assert sum(n.startswith("threshold") for n in names) == len(depth.THRESHOLDS)
    assert sum(n.startswith("controller") for n in names) == len(depth.LAMBDAS)
    assert sum(n.startswith("static mixture") for n in names) == len(depth.LAMBDAS) and "oracle (bound)" in names
    assert rep["questions"] == 2 * len(es.items) and rep["states"] == len(es.items) and rep["folds"] == 3
    by = {p["policy"]: p for p in rep["policies"]}
    for p in rep["policies"]:
        assert 0 <= p["accuracy"] <= 1 and 0 <= p["ece"] <= 1 and 1 <= p["mean_depth"] <= 4
        assert p["ms_per_decision"] > 0
        if p["policy"] not in ("fixed 4", "oracle (bound)"):
            v = p["vs_full"]
            assert isinstance(v["holds"], bool) and v["ci95"][0] <= v["delta"] <= v["ci95"][1] and v["why"]
            # non-inferiority needs the lower bound above -0.02 and a lower cost, nothing else
            assert v["holds"] == (v["ci95"][0] > -0.02 and p["mean_depth"] < by["fixed 4"]["mean_depth"])
        if p["policy"].startswith("controller"):
            assert p["vs_mixture"]["holds"] == (p["vs_mixture"]["ci95"][0] > 0)
    assert by["fixed 1"]["mean_depth"] == 1 and by["fixed 4"]["mean_depth"] == 4
    # the oracle is a bound: at least as accurate as every fixed exit
    assert by["oracle (bound)"]["accuracy"] >= max(by[f"fixed {d}"]["accuracy"] for d in (1, 2, 3, 4))
    assert rep["timing"]["decisions_per_s"]["full"] > 0 and rep["timing"]["decisions_per_s"]["auto"] > 0
    assert rep["timing"]["decisions_per_s"]["auto_every_exit"] > 0 and rep["timing"]["ms_per_visit"] >= 0
    assert rep["timing"]["compiled_while_timed"] == 0  # each clock ran after an untimed pass of the same work
    md = (out / "depth.md").read_text()
    assert "| controller lambda=0.1 |" in md and "non-inferior to full" in md
    assert json.loads((out / "depth.json").read_text())["policies"][0]["policy"] == "fixed 1"


def test_fixed_full_depth_is_the_engines_full_depth_answers(report):
    engine, es, _, rep = report
    rows, gold = [], []
    for item in es.items:
        qs = es.questions_for(item)
        answers = engine.predict(item["state"], qs)
        for name, q in qs.items():
            rows.append(answer_row(q, answers[name]))
            gold.append(gold_index(q, item["labels"][name]))
    full = next(p for p in rep["policies"] if p["policy"] == "fixed 4")
    assert full["accuracy"] == pytest.approx(metrics.accuracy(rows, gold))
    assert full["ece"] == pytest.approx(metrics.ece(rows, gold), abs=1e-9)


def test_a_model_without_exits_is_refused(tmp_path, capsys):
    es_path = eval_set(n=4).save(tmp_path / "tiny-depth.json")
    model = testing.save_tiny_checkpoint(tmp_path / "tiny")
    args = ["depth", str(es_path), "--model", str(model), "--out", str(tmp_path / "out"), "--no-progress"]
    args += ["--calibration", "none"]  # read as "no calibration", not as a file named none
    assert bench_cli.main(args) == 2
    assert "has no exits" in capsys.readouterr().err


def test_serving_cost_is_the_deepest_exit_plus_each_stop_before_it():
    """The vertical cascade runs a question's layers once: a question read at exits 1 and 2 costs
    exit 2's ms plus one stop, not exit 1's ms and exit 2's."""
    ms = {1: 10.0, 2: 20.0, 4: 40.0}
    assert depth.serving_ms(np.array([1, 4]), ms) == 25.0
    visits = [[1], [1, 2], [1, 2, 4]]
    assert depth.serving_ms(np.array([1, 2, 4]), ms, visits, per_visit=1.5) == pytest.approx((10 + 21.5 + 43) / 3)
