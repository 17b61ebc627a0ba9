"""`levbench compare`: paired bootstrap of B - A on synthetic results with a known answer."""

import json

import numpy as np
import pytest

from lev_jax.bench import cli
from lev_jax.bench import compare as C


def _rows(correct, conf=0.8, k=3):
    """One row per item: `conf` on the gold (index 0) when correct, else on option 1."""
    rest = (1 - conf) / (k - 1)
    out = []
    for c in correct:
        r = [rest] * k
        r[0 if c else 1] = conf
        out.append(r)
    return out


def test_identical_results_differ_by_exactly_zero():
    rows = _rows([1, 0, 1, 1, 0, 1])
    stats = C.paired_bootstrap(rows, rows, [0] * 6, resamples=200)
    for m in C.METRICS:
        assert stats[m]["delta"] == 0.0 and stats[m]["ci95"] == [0.0, 0.0]


def test_accuracy_interval_matches_the_paired_standard_error():
    # per item, B - A is +1 (30 %), 0 (60 %), -1 (10 %): mean 0.2, sd 0.6, SE 0.6 / sqrt(400)
    rng = np.random.default_rng(1)
    n = 400
    d = rng.choice([1, 0, -1], size=n, p=[0.3, 0.6, 0.1])
    a = np.where(d == 1, 0, np.where(d == -1, 1, rng.integers(0, 2, n)))
    b = np.where(d == 1, 1, np.where(d == -1, 0, a))
    stats = C.paired_bootstrap(_rows(a), _rows(b), [0] * n, resamples=2000)["accuracy"]
    assert stats["delta"] == pytest.approx(d.mean())
    se = d.std() / np.sqrt(n)
    lo, hi = stats["ci95"]
    assert (hi - lo) / 2 == pytest.approx(1.96 * se, rel=0.12)
    assert lo > 0 and stats["p_b_not_lower"] == 1.0


def test_clustered_resampling_moves_a_states_questions_together():
    # every item asked twice about one state, both answers identical: resampling by state gives
    # exactly the intervals of the de-duplicated items (same seed), resampling rows does not
    rng = np.random.default_rng(2)
    a, b = _rows(rng.integers(0, 2, 60), 0.7), _rows(rng.integers(0, 2, 60), 0.9)
    single = C.paired_bootstrap(a, b, [0] * 60, resamples=300, seed=5)
    twice = [r for r in a for _ in range(2)], [r for r in b for _ in range(2)]
    clusters = [i for i in range(60) for _ in range(2)]
    clustered = C.paired_bootstrap(*twice, [0] * 120, clusters, resamples=300, seed=5)
    by_row = C.paired_bootstrap(*twice, [0] * 120, resamples=300, seed=5)
    for m in C.METRICS:
        assert clustered[m]["ci95"] == pytest.approx(single[m]["ci95"], abs=1e-12)
    assert by_row["accuracy"]["ci95"] != pytest.approx(single["accuracy"]["ci95"], abs=1e-12)


def _result(task, rows, gold, uncal=None):
    recs = [{"i": i, "question": "q", "gold": g, "probs": r} for i, (r, g) in enumerate(zip(rows, gold))]
    if uncal is not None:
        for rec, u in zip(recs, uncal):
            rec["uncalibrated_probs"] = u
    return {"task": task, "records": recs + [{"i": len(rows), "error": "timeout"}]}


def test_cli_compares_shared_tasks_and_refuses_mismatched_gold(tmp_path, capsys):
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    ra, rb = _rows([1, 0, 0, 1]), _rows([1, 1, 0, 1])
    (a_dir / "t.json").write_text(json.dumps(_result("t", ra, [0] * 4, ra)))
    (a_dir / "only-a.json").write_text(json.dumps(_result("only-a", ra, [0] * 4)))
    (b_dir / "t.json").write_text(json.dumps(_result("t", rb, [0] * 4, rb)))
    assert cli.main([*map(str, ("compare", a_dir, b_dir)), "--resamples", "50", "--out", str(tmp_path / "cmp")]) == 0
    doc = json.loads((tmp_path / "cmp.json").read_text())
    assert [(r["task"], r["readout"]) for r in doc["results"]] == [("t", "calibrated"), ("t", "uncalibrated")]
    assert doc["results"][0]["metrics"]["accuracy"]["delta"] == pytest.approx(0.25)
    assert "| t | calibrated | 4 | accuracy | 0.500 | 0.750 | +0.250 |" in (tmp_path / "cmp.md").read_text()
    (b_dir / "t.json").write_text(json.dumps(_result("t", rb, [0, 0, 1, 0])))
    assert cli.main(["compare", str(a_dir), str(b_dir)]) == 2
    assert "disagree on the gold answers" in capsys.readouterr().err
