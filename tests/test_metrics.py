"""lev_jax.metrics against hand-computed values on small fixed examples."""

import math

import numpy as np
import pytest

from lev_jax import metrics as M

# Ragged rows used by several tests.
#   row  probs              gold  argmax  conf  correct  bin (10 right-closed bins)
#   0    [.95, .05]         0     0       .95   yes      9  (0.9, 1.0]
#   1    [.85, .15]         1     0       .85   no       8  (0.8, 0.9]
#   2    [.6, .4]           0     0       .6    yes      5  (0.5, 0.6]
#   3    [.4, .3, .3]       0     0       .4    yes      3  (0.3, 0.4]
#   4    [.7, .3]           0     0       .7    yes      6  (0.6, 0.7]  <- exactly on an edge
ROWS = [[0.95, 0.05], [0.85, 0.15], [0.6, 0.4], [0.4, 0.3, 0.3], [0.7, 0.3]]
GOLD = [0, 1, 0, 0, 0]


def test_accuracy_ragged_and_tie_goes_to_lowest_index():
    rows = [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.5], [0.2, 0.8]]
    # predictions 0, 1, 0 (tie -> lowest index), 1 -> correct T, F, F, T
    assert M.accuracy(rows, [0, 2, 1, 1]) == 0.5
    assert M.accuracy([[0.5, 0.5]], [0]) == 1.0
    assert M.accuracy([[0.5, 0.5]], [1]) == 0.0
    assert M.predictions([[0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]]).tolist() == [1, 0]


def test_2d_array_and_list_inputs_agree():
    a = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    assert M.accuracy(a, np.array([0, 2])) == M.accuracy(a.tolist(), [0, 2]) == 0.5
    assert M.nll(a, [0, 2]) == pytest.approx(M.nll(list(a), [0, 2]))


def test_macro_accuracy_weights_families_equally():
    rows = [[0.9, 0.1], [0.2, 0.8], [0.3, 0.7], [0.6, 0.4]]
    gold = [0, 0, 0, 0]  # correct: T F F T
    fams = ["a", "a", "a", "b"]
    assert M.accuracy(rows, gold) == 0.5
    assert M.accuracy_by_family(rows, gold, fams) == {"a": pytest.approx(1 / 3), "b": 1.0}
    assert M.macro_accuracy(rows, gold, fams) == pytest.approx(2 / 3)


def test_reliability_bins_hand_computed_and_edge_is_right_closed():
    bins = M.reliability_bins(ROWS, GOLD)
    assert len(bins) == 10
    assert [b["count"] for b in bins] == [0, 0, 0, 1, 0, 1, 1, 0, 1, 1]
    assert bins[6] == {"lower": 0.6, "upper": 0.7, "count": 1, "confidence": 0.7, "accuracy": 1.0}
    assert bins[8]["accuracy"] == 0.0 and bins[8]["confidence"] == 0.85
    assert bins[0]["confidence"] is None and bins[0]["accuracy"] is None
    # 0.3 and 1.0 sit on edges too: (0.2, 0.3] and (0.9, 1.0]
    b = M.reliability_bins([[0.3, 0.3, 0.2, 0.2], [1.0, 0.0]], [0, 0])
    assert b[2]["count"] == 1 and b[9]["count"] == 1
    # a uniform 10-way row has confidence 0.1 -> first bin (0, 0.1]
    assert M.reliability_bins([[0.1] * 10], [3])[0]["count"] == 1


def test_ece_hand_computed():
    # (|1-.95| + |0-.85| + |1-.6| + |1-.4| + |1-.7|) / 5
    assert M.ece(ROWS, GOLD) == pytest.approx((0.05 + 0.85 + 0.4 + 0.6 + 0.3) / 5)


def test_ece_all_rows_in_one_bin():
    rows = [[0.72, 0.28], [0.75, 0.25], [0.78, 0.22]]
    gold = [0, 1, 0]  # accuracy 2/3, mean confidence 0.75, all in (0.7, 0.8]
    assert M.ece(rows, gold) == pytest.approx(0.75 - 2 / 3)
    # n_bins=1: one bin holds everything, ECE = |accuracy - mean confidence|
    assert M.ece(ROWS, GOLD, n_bins=1) == pytest.approx(abs(4 / 5 - (0.95 + 0.85 + 0.6 + 0.4 + 0.7) / 5))
    assert M.ece([[1.0, 0.0]], [0]) == 0.0


def test_ece_floor_matches_the_binomial_expectation():
    # 40 rows at confidence 0.5, one bin: a calibrated model's ECE is |k/40 - 0.5|, k ~ Bin(40, 0.5)
    n = 40
    exact = sum(math.comb(n, k) / 2**n * abs(k / n - 0.5) for k in range(n + 1))
    fl = M.ece_floor([[0.5, 0.5]] * n, draws=4000)
    assert fl["mean"] == pytest.approx(exact, abs=0.004)  # Monte-Carlo error ~0.001
    assert fl["p95"] > fl["mean"]
    # certain rows: a calibrated model is always right, the floor is 0
    assert M.ece_floor([[1.0, 0.0]] * 10) == {"mean": 0.0, "p95": 0.0, "draws": 2000}
    # seeded: the same call gives the same answer
    assert M.ece_floor(ROWS) == M.ece_floor(ROWS)


def test_ece_floor_shrinks_as_one_over_root_n():
    rows = [[0.6, 0.4], [0.8, 0.2], [0.95, 0.05], [0.35, 0.35, 0.3]] * 50
    small, large = M.ece_floor(rows)["mean"], M.ece_floor(rows * 4)["mean"]
    assert 0.4 < large / small < 0.6


def test_noul_scored_as_two_class_distribution():
    rows, gold = M.binary_rows([0.8, 0.3], [True, True])
    np.testing.assert_allclose(rows, [[0.8, 0.2], [0.3, 0.7]])
    assert gold.tolist() == [0, 0]
    # confidences .8 (right) and .7 (wrong): (0.2 + 0.7) / 2
    assert M.ece(rows, gold) == pytest.approx(0.45)
    assert M.brier(*M.binary_rows([0.8], [True])) == pytest.approx(2 * 0.2**2)
    assert M.nll(*M.binary_rows([0.8], [False])) == pytest.approx(-math.log(0.2))
    with pytest.raises(ValueError):
        M.binary_rows([0.5], [1])  # gold must be bool
    with pytest.raises(ValueError):
        M.binary_rows([1.5], [True])


def test_brier_sums_over_classes():
    # [.7,.2,.1] gold 0: .09+.04+.01 = .14 ; [.5,.5] gold 1: .25+.25 = .5
    assert M.brier([[0.7, 0.2, 0.1], [0.5, 0.5]], [0, 1]) == pytest.approx(0.32)
    assert M.brier([[0.0, 1.0]], [0]) == pytest.approx(2.0)


def test_nll_natural_log_floor_and_weights():
    rows, gold = [[0.5, 0.5], [0.25, 0.75]], [0, 1]
    assert M.nll(rows, gold) == pytest.approx((math.log(2) - math.log(0.75)) / 2)
    assert M.nll(rows, gold, weights=[1, 3]) == pytest.approx((math.log(2) - 3 * math.log(0.75)) / 4)
    assert M.nll([[1.0, 0.0]], [1]) == pytest.approx(-math.log(M.NLL_FLOOR))
    with pytest.raises(ValueError):
        M.nll(rows, gold, weights=[1.0])


def test_selective_accuracy_thresholds_inclusive():
    out = M.selective_accuracy(ROWS, GOLD)
    assert [o["threshold"] for o in out] == [0.5, 0.7, 0.9]
    # >= .5: .95 .85 .6 .7 -> 4/5 kept, 3 right ; >= .7: .95 .85 .7 ; >= .9: .95
    assert out[0] == {"threshold": 0.5, "n": 4, "coverage": 0.8, "accuracy": 0.75}
    assert out[1]["n"] == 3 and out[1]["coverage"] == pytest.approx(0.6)
    assert out[1]["accuracy"] == pytest.approx(2 / 3)
    assert out[2] == {"threshold": 0.9, "n": 1, "coverage": 0.2, "accuracy": 1.0}
    none = M.selective_accuracy(ROWS, GOLD, thresholds=[0.99])[0]
    assert none["n"] == 0 and none["coverage"] == 0.0 and none["accuracy"] is None


def test_position_bias_rstd():
    # Two items, each shown with the gold at positions 0, 1, 2 (gold = position).
    # The model favours position 0: recall pos0 = 2/2, pos1 = 1/2, pos2 = 0/2.
    rows = [
        [0.8, 0.1, 0.1],
        [0.6, 0.2, 0.2],  # gold 0: both right
        [0.3, 0.6, 0.1],
        [0.5, 0.4, 0.1],  # gold 1: one right
        [0.5, 0.2, 0.3],
        [0.4, 0.4, 0.2],  # gold 2: none right
    ]
    gold = [0, 0, 1, 1, 2, 2]
    assert M.per_position_recall(rows, gold) == {0: 1.0, 1: 0.5, 2: 0.0}
    assert M.position_bias_rstd(rows, gold) == pytest.approx(math.sqrt(1 / 6))  # std([1, .5, 0]), ddof=0
    unbiased = [[0.9, 0.05, 0.05], [0.05, 0.9, 0.05], [0.05, 0.05, 0.9]]
    assert M.position_bias_rstd(unbiased, [0, 1, 2]) == 0.0


def test_agreement():
    a = [[0.6, 0.4], [0.2, 0.8], [0.5, 0.3, 0.2]]
    b = [[0.7, 0.3], [0.6, 0.4], [0.1, 0.3, 0.6]]
    out = M.agreement(a, b)
    assert out["n"] == 3
    assert out["argmax_agreement"] == pytest.approx(1 / 3)
    assert out["mean_tv"] == pytest.approx((0.1 + 0.4 + 0.4) / 3)
    assert M.agreement(a, a) == {"n": 3, "argmax_agreement": 1.0, "mean_tv": 0.0}
    with pytest.raises(ValueError):
        M.agreement(a, [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])


@pytest.mark.parametrize(
    "rows, gold",
    [
        ([[0.5, 0.6]], [0]),  # does not sum to 1
        ([[1.2, -0.2]], [0]),  # negative
        ([[0.5, 0.5]], [2]),  # gold out of range
        ([[0.5, 0.5], [0.2, 0.3, 0.5]], [0, 3]),  # out of range for a ragged row
        ([[0.5, 0.5]], [True]),  # bool gold
        ([], []),  # empty
        ([[0.5, 0.5]], [0, 1]),  # length mismatch
        ([[float("nan"), 1.0]], [0]),
    ],
)
def test_invalid_inputs_raise(rows, gold):
    with pytest.raises(ValueError):
        M.accuracy(rows, gold)


def test_summarize_is_consistent_and_json_ready():
    import json

    s = M.summarize(ROWS, GOLD, families=["x", "x", "y", "y", "y"])
    json.dumps(s)
    assert s["n"] == 5
    assert s["accuracy"] == M.accuracy(ROWS, GOLD) == 0.8
    assert s["ece"] == M.ece(ROWS, GOLD)
    assert s["macro_accuracy"] == pytest.approx((0.5 + 1.0) / 2)
    assert s["reliability"] == M.reliability_bins(ROWS, GOLD)


def test_reliability_diagram_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = M.reliability_diagram_png(M.reliability_bins(ROWS, GOLD), tmp_path / "sub" / "task.png", title="t")
    assert out == tmp_path / "sub" / "task.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
