"""Depth policies and their verdicts (lev_jax.elastic.policy) on synthetic data with known answers."""

import numpy as np
import pytest

from lev_jax.elastic import policy


def rows(p_first):
    """Two-option rows whose first option has probability p (gold 0 is right when p > 0.5)."""
    return [[p, 1 - p] for p in p_first]


def test_threshold_stops_at_the_first_sure_exit_and_costs_what_it_reached():
    exit_rows = {
        1: rows([0.95, 0.6, 0.55, 0.7]),
        2: rows([0.5, 0.9, 0.6, 0.7]),
        4: rows([0.5, 0.5, 0.99, 0.6]),
    }
    chosen = policy.threshold(exit_rows, 0.85)
    assert chosen.tolist() == [1, 2, 4, 4]  # the last item is never sure: it goes to the end
    assert policy.cascade_cost(chosen, {1: 1.0, 2: 2.0, 4: 4.0}) == pytest.approx((1 + 2 + 4 + 4) / 4)
    assert policy.threshold(exit_rows, 0.0).tolist() == [1, 1, 1, 1]
    assert policy.select(exit_rows, chosen)[1] == pytest.approx([0.9, 0.1])


def test_oracle_is_the_shallowest_right_exit():
    exit_rows = {1: rows([0.9, 0.4, 0.3]), 2: rows([0.2, 0.8, 0.3]), 3: rows([0.9, 0.9, 0.4])}
    assert policy.oracle(exit_rows, [0, 0, 0]).tolist() == [1, 2, 3]  # nobody right on the last: deepest


def test_static_mixture_hits_the_target_cost_with_the_best_pair():
    rng = np.random.default_rng(0)
    n = 20000
    gold = np.zeros(n, int)
    # exit accuracies 0.6, 0.7, 0.9 at costs 1, 2, 4
    exit_rows = {d: rows(np.where(rng.random(n) < acc, 0.8, 0.2)) for d, acc in ((1, 0.6), (2, 0.7), (4, 0.9))}
    costs = {1: 1.0, 2: 2.0, 4: 4.0}
    mix = policy.static_mixture(exit_rows, costs, gold, target_cost=3.0, seed=1)
    # at cost 3: (2, 4) with w = 0.5 expects 0.80; (1, 4) with w = 1/3 expects 0.80 too, minus noise:
    # both bracket the target; the chosen one is the better of the measured accuracies
    acc = {d: np.mean(np.asarray(exit_rows[d])[:, 0] > 0.5) for d in exit_rows}
    want = max(0.5 * acc[2] + 0.5 * acc[4], acc[1] / 3 + 2 * acc[4] / 3)
    assert mix["expected_accuracy"] == pytest.approx(want)
    assert policy.cascade_cost(mix["chosen"], costs) == pytest.approx(3.0, abs=0.05)
    with pytest.raises(ValueError, match="outside"):
        policy.static_mixture(exit_rows, costs, gold, target_cost=5.0)


def test_non_inferiority_needs_the_interval_and_the_cost():
    rng = np.random.default_rng(3)
    n = 400
    gold = np.zeros(n, int)
    full = rows(np.where(rng.random(n) < 0.8, 0.9, 0.1))
    same = policy.verdict(full, full, gold, None, kind="non-inferior", cost_policy=2.0, cost_other=4.0, resamples=200)
    assert same["holds"] and same["ci95"] == [0.0, 0.0]
    dearer = policy.verdict(full, full, gold, None, kind="non-inferior", cost_policy=4.0, cost_other=4.0, resamples=200)
    assert not dearer["holds"] and "cost" in dearer["why"]
    # 10 % of the full model's right answers turned wrong: about -0.08, far below -0.02
    worse = [list(r) for r in full]
    right = [i for i in range(n) if full[i][0] > 0.5]
    for i in right[: len(right) // 10]:
        worse[i] = [0.1, 0.9]
    v = policy.verdict(worse, full, gold, None, kind="non-inferior", cost_policy=2.0, cost_other=4.0, resamples=200)
    assert not v["holds"] and v["ci95"][0] < -0.02 and v["delta"] == pytest.approx(-(len(right) // 10) / n)


def test_beats_needs_a_lower_bound_above_zero():
    rng = np.random.default_rng(4)
    n = 300
    gold = np.zeros(n, int)
    base = rows(np.where(rng.random(n) < 0.6, 0.9, 0.1))
    better = [[0.9, 0.1] if i % 4 == 0 else list(r) for i, r in enumerate(base)]  # fixes ~a tenth
    assert policy.verdict(better, base, gold, None, kind="beats", resamples=300)["holds"]
    assert not policy.verdict(base, base, gold, None, kind="beats", resamples=300)["holds"]  # 0 is not > 0
    with pytest.raises(ValueError, match="kind"):
        policy.verdict(base, base, gold, None, kind="better")


def test_clustered_intervals_are_wider_when_questions_about_a_state_move_together():
    rng = np.random.default_rng(5)
    states, per = 60, 5
    gold = np.zeros(states * per, int)
    # per state, one coin decides whether the policy fixes all five of its questions
    fixes = np.repeat(rng.random(states) < 0.3, per)
    base = rows(np.full(states * per, 0.1))
    pol = rows(np.where(fixes, 0.9, 0.1))
    clusters = np.repeat(np.arange(states), per)
    kw = dict(kind="beats", resamples=400)
    flat = policy.verdict(pol, base, gold, None, **kw)["ci95"]
    clustered = policy.verdict(pol, base, gold, clusters, **kw)["ci95"]
    assert (clustered[1] - clustered[0]) > 1.6 * (flat[1] - flat[0])  # ~sqrt(5) wider in theory


def test_intervals_cover_a_known_difference():
    """30 synthetic evaluations with a true accuracy gain of 0.1: the 95 % interval covers it in
    most of them (at least 25 of 30; a binomial(30, 0.95) falls below that ~1 % of the time)."""
    covered = 0
    for seed in range(30):
        rng = np.random.default_rng(100 + seed)
        n = 200
        gold = np.zeros(n, int)
        u = rng.random(n)
        a = rows(np.where(u < 0.6, 0.9, 0.1))
        b = rows(np.where(u < 0.7, 0.9, 0.1))  # right wherever a is, and on a further 10 % (in law)
        low, high = policy.verdict(b, a, gold, None, kind="beats", resamples=200, seed=seed)["ci95"]
        covered += low <= 0.1 <= high
    assert covered >= 25
