"""The depth controller (lev_jax.elastic.controller) on synthetic items whose difficulty is known."""

import numpy as np
import pytest

from lev_jax.elastic import controller as ctl
from lev_jax.elastic import policy


def synthetic(n_states=200, per=3, seed=0):
    """Easy items (a shallow exit's top probability is high) are right at every exit; hard ones only
    at the last. Returns exit rows, gold, clusters."""
    rng = np.random.default_rng(seed)
    n = n_states * per
    easy = rng.random(n) < 0.6
    gold = np.zeros(n, int)
    first = np.where(easy, rng.uniform(0.8, 0.99, n), rng.uniform(0.3, 0.7, n))
    exit_rows = {
        1: [[p, 1 - p] for p in first],  # right when p > 0.5: all easy ones, about half of the hard
        2: [[0.9, 0.1] if e else [0.4, 0.6] for e in easy],
        4: [[0.9, 0.1] for _ in easy],
    }
    return exit_rows, gold, np.repeat(np.arange(n_states), per), easy


COSTS = {1: 1.0, 2: 2.0, 4: 4.0}


def test_probe_features_read_the_first_exit():
    x = ctl.probe_features([[0.7, 0.2, 0.1], [0.5, 0.5]], prompt_tokens=[10, 100])
    assert x.shape == (2, 5)
    np.testing.assert_allclose(x[:, 0], [0.7, 0.5])  # top probability
    np.testing.assert_allclose(x[:, 1], [0.5, 0.0])  # margin
    np.testing.assert_allclose(x[1, 2], 1.0)  # a flat two-way answer has entropy log 2 / log 2


def test_the_controller_sends_easy_items_shallow_and_hard_ones_deep():
    exit_rows, gold, clusters, easy = synthetic()
    x = ctl.probe_features(exit_rows[1])
    choices = ctl.cross_fit(x, ctl.outcomes(exit_rows, gold), COSTS, clusters, lams=[0.0, 0.2, 5.0])
    cheap = choices[0.2]
    assert np.mean(cheap[easy] == 1) > 0.9 and np.mean(cheap[~easy] == 4) > 0.9
    auto = policy.select(exit_rows, cheap)
    full = exit_rows[4]
    v = policy.verdict(
        auto,
        full,
        gold,
        clusters,
        kind="non-inferior",
        cost_policy=policy.cascade_cost(cheap, COSTS),
        cost_other=4.0,
        resamples=300,
    )
    assert v["holds"], v
    assert (choices[5.0] == 1).all()  # cost dominates: everything at the first exit
    assert set(np.unique(choices[0.0])) <= {1, 2, 4}


def test_out_of_fold_choices_never_see_their_own_outcomes():
    exit_rows, gold, clusters, _ = synthetic(seed=1)
    x = ctl.probe_features(exit_rows[1])
    correct = ctl.outcomes(exit_rows, gold)
    base = ctl.cross_fit(x, correct, COSTS, clusters, lams=[0.2], k=5, seed=3)[0.2]
    # scramble the outcomes of one fold's items: that fold's choices cannot move (their controller
    # never saw them)
    fold = ctl.folds_by_cluster(clusters, 5, seed=3)
    rng = np.random.default_rng(9)
    scrambled = {d: np.where(fold == 0, rng.random(len(c)) < 0.5, c) for d, c in correct.items()}
    again = ctl.cross_fit(x, scrambled, COSTS, clusters, lams=[0.2], k=5, seed=3)[0.2]
    assert (again[fold == 0] == base[fold == 0]).all()
    # ... though a controller that does see them is moved by the scramble
    seen = ctl.Controller.fit(x, scrambled, COSTS).p_right(x)
    assert np.abs(seen - ctl.Controller.fit(x, correct, COSTS).p_right(x)).max() > 0.05


def test_folds_keep_a_state_together():
    clusters = np.repeat(np.arange(20), 3)
    fold = ctl.folds_by_cluster(clusters, 4)
    assert all(len(set(fold[clusters == c])) == 1 for c in range(20))
    assert sorted(np.bincount(fold)) == [15, 15, 15, 15]
    with pytest.raises(ValueError, match="clusters"):
        ctl.folds_by_cluster(np.arange(3), 5)


def test_a_pooled_state_tells_the_controller_what_the_first_exit_cannot():
    """The first exit's answer is equally unsure on every item; only the pooled hidden state (one
    direction of 48, under noise) says which items are easy. With it the controller sends easy items
    shallow and hard ones deep; without it, it cannot tell them apart."""
    rng = np.random.default_rng(4)
    n_states, per = 200, 3
    n = n_states * per
    easy = rng.random(n) < 0.5
    gold = np.zeros(n, int)
    exit_rows = {
        1: [[0.9, 0.1] if e else [0.1, 0.9] for e in easy],  # right on easy items only ...
        4: [[0.9, 0.1] for _ in easy],
    }
    flat = ctl.probe_features([[0.9, 0.1]] * n)  # ... and looks the same on every item
    direction = rng.normal(size=48)
    pooled = rng.normal(size=(n, 48)) * 0.3 + np.outer(np.where(easy, 2.0, -2.0), direction / np.linalg.norm(direction))
    clusters = np.repeat(np.arange(n_states), per)
    costs = {1: 1.0, 4: 4.0}
    correct = ctl.outcomes(exit_rows, gold)
    seen = ctl.cross_fit(flat, correct, costs, clusters, lams=[0.2], pooled=pooled, pooled_dims=4)[0.2]
    assert np.mean(seen[easy] == 1) > 0.9 and np.mean(seen[~easy] == 4) > 0.9
    blind = ctl.cross_fit(flat, correct, costs, clusters, lams=[0.2])[0.2]
    assert len(set(blind.tolist())) == 1  # one depth for everything


def test_the_projection_keeps_the_widest_directions_of_its_training_rows():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(300, 10)) * np.array([5.0, 3.0] + [0.1] * 8) + 7.0
    proj = ctl.Projection.fit(h, dims=2)
    np.testing.assert_allclose(np.abs(proj.components[:, :2]), np.eye(2), atol=0.05)
    z = proj(h)
    assert z.shape == (300, 2) and abs(z.mean()) < 1e-9
    np.testing.assert_allclose(z.std(axis=0), [5.0, 3.0], rtol=0.15)
