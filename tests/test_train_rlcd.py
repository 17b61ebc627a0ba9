"""The RLCD loss on hand-computed values: reward (log score with its floor, spherical score, RPS on
ordered rows), advantages, the policy term, masks; its gradient against finite differences."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lev_jax import domain
from lev_jax.training import loss

LETTER = domain.READOUT_MODES.index(domain.LETTER)
KW = dict(log_floor=1e-4, spherical_weight=0.75)


def _batch(target, valid, level, ordinal, weight=None):
    n = len(target)
    return {
        "target_BC": np.asarray(target, np.float32),
        "valid_BC": np.asarray(valid, bool),
        "level_BC": np.asarray(level, np.float32),
        "ordinal_B": np.asarray(ordinal, bool),
        "mode_B": np.full(n, LETTER, np.int32),
        "weight_B": np.asarray(weight if weight is not None else [1.0] * n, np.float32),
    }


def _reward(actions, b):
    return np.asarray(
        loss.rlcd_reward(
            jnp.asarray(actions, jnp.float32), b["target_BC"], b["valid_BC"], b["level_BC"], b["ordinal_B"], **KW
        )
    )


def test_reward_of_a_three_candidate_choice():
    # p = (1/2, 1/4, 1/4), gold 0: log 0.5 + 0.75 * 0.5 / |p|, |p| = sqrt(0.375)
    b = _batch([[1, 0, 0]], [[1, 1, 1]], [[0, 1, 2]], [False])
    r = _reward(np.log([[[2.0, 1.0, 1.0]]]), b)
    assert r[0, 0] == pytest.approx(math.log(0.5) + 0.75 * 0.5 / math.sqrt(0.375), abs=1e-6)
    # gold 1 with p_1 ~ 1e-9: the log score is floored at log 1e-4; spherical ~ 0
    b = _batch([[0, 1, 0]], [[1, 1, 1]], [[0, 1, 2]], [False])
    r = _reward(np.array([[[0.0, -20.0, 0.0]]]), b)
    assert r[0, 0] == pytest.approx(math.log(1e-4), abs=1e-5)


def test_reward_of_a_four_level_score_subtracts_rps():
    # p = (.1, .2, .3, .4) over levels 0..3, target level 1: cumulative P (.1, .3, .6) vs T (0, 1, 1)
    # RPS = .01 + .49 + .16 = .66, over K - 1 = 3 -> .22
    b = _batch([[0, 1, 0, 0]], [[1, 1, 1, 1]], [[0, 1, 2, 3]], [True])
    acts = np.log([[[0.1, 0.2, 0.3, 0.4]]])
    want = math.log(0.2) + 0.75 * 0.2 / math.sqrt(0.01 + 0.04 + 0.09 + 0.16) - 0.22
    assert _reward(acts, b)[0, 0] == pytest.approx(want, abs=1e-6)
    # the same row read as unordered: no RPS
    b_unordered = _batch([[0, 1, 0, 0]], [[1, 1, 1, 1]], [[0, 1, 2, 3]], [False])
    assert _reward(acts, b_unordered)[0, 0] == pytest.approx(want + 0.22, abs=1e-6)
    # levels shown in another order (codes carry their level): the same reward
    b_perm = _batch([[0, 0, 1, 0]], [[1, 1, 1, 1]], [[3, 0, 1, 2]], [True])
    assert _reward(np.log([[[0.4, 0.1, 0.2, 0.3]]]), b_perm)[0, 0] == pytest.approx(want, abs=1e-6)


def test_padded_candidates_are_masked():
    b = _batch([[1, 0, 0]], [[1, 1, 1]], [[0, 1, 2]], [True])
    padded = _batch([[1, 0, 0, 0, 0]], [[1, 1, 1, 0, 0]], [[0, 1, 2, 0, 1]], [True])
    acts = np.array([[[0.3, -0.2, 0.1]]], np.float32)
    acts_pad = np.array([[[0.3, -0.2, 0.1, 40.0, -7.0]]], np.float32)
    assert _reward(acts_pad, padded)[0, 0] == pytest.approx(_reward(acts, b)[0, 0], abs=1e-6)
    # the noise: centred over the valid codes, zero on the padded slots
    logits = jnp.asarray([[0.3, -0.2, 0.1, 40.0, -7.0]], jnp.float32)
    a = np.asarray(loss.rlcd_actions(jax.random.key(0), logits, padded["valid_BC"], samples=512, sigma=0.3))
    eps = a - np.asarray(logits)[None]
    assert a.shape == (512, 1, 5)
    np.testing.assert_allclose(eps[..., :3].sum(-1), 0.0, atol=1e-5)
    assert np.all(eps[..., 3:] == 0.0)
    # centring 3 draws of N(0, .3^2) leaves variance .09 * 2/3 per code
    assert eps[..., :3].std() == pytest.approx(0.3 * math.sqrt(2 / 3), rel=0.1)
    again = loss.rlcd_actions(jax.random.key(0), logits, padded["valid_BC"], samples=512, sigma=0.3)
    assert np.array_equal(a, np.asarray(again))  # the key alone decides the noise


def test_advantages_by_hand():
    # S=2 samples x B=3 rows; row 2 is padding (weight 0) and must not enter the std
    reward = np.array([[1.0, 3.0, 100.0], [3.0, 7.0, -50.0]], np.float32)
    adv = np.asarray(loss.rlcd_advantages(jnp.asarray(reward), jnp.asarray([1.0, 1.0, 0.0])))
    centred = np.array([[-1.0, -2.0, 75.0], [1.0, 2.0, -75.0]])
    std = math.sqrt((1 + 4 + 1 + 4) / 4)
    np.testing.assert_allclose(adv, centred / (std + 1e-6), rtol=1e-6)


def test_policy_term_by_hand():
    # one row, 2 valid codes + 1 padded, S=2; sigma .5 -> log N = -(a - l)^2 / 0.5
    logits = np.array([[1.0, 2.0, 9.0]], np.float32)
    acts = np.array([[[1.5, 1.5, 9.0]], [[0.8, 2.2, 9.0]]], np.float32)
    adv = np.array([[1.0], [-1.0]], np.float32)
    valid = np.array([[1, 1, 0]], bool)
    got = float(loss.rlcd_policy(logits, acts, adv, valid, np.ones(1, np.float32), sigma=0.5))
    logn = [[-(0.5**2) / 0.5, -(0.5**2) / 0.5], [-(0.2**2) / 0.5, -(0.2**2) / 0.5]]
    want = -(1.0 * sum(logn[0]) - 1.0 * sum(logn[1])) / 4
    assert got == pytest.approx(want, abs=1e-6)


def _mixed_batch():
    # a 3-candidate choice, a 4-level score, a padded row
    return _batch(
        [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]],
        [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]],
        [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 0, 0]],
        [False, True, False],
        [1.0, 1.0, 0.0],
    )


def test_total_is_policy_plus_weighted_plain_loss():
    b = _mixed_batch()
    logits = jnp.asarray([[0.5, -0.3, 0.2, 0.0], [0.1, 0.4, -0.2, 0.3], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
    acts = loss.rlcd_actions(jax.random.key(3), logits, b["valid_BC"], samples=4, sigma=0.3)
    opts = dict(sigma=0.3, brier_weight=0.5, ordinal_weight=0.25, **KW)
    plain, _ = loss.loss(logits, b)
    only_policy, stats = loss.rlcd_given_actions(logits, acts, b, ce_weight=0.0, **opts)
    assert float(only_policy) == pytest.approx(float(stats["policy"]), abs=1e-7)
    both, _ = loss.rlcd_given_actions(logits, acts, b, ce_weight=2.0, **opts)
    assert float(both) == pytest.approx(float(stats["policy"]) + 2.0 * float(plain), abs=1e-6)
    via_key, _ = loss.rlcd(logits, b, jax.random.key(3), samples=4, ce_weight=2.0, **opts)
    assert float(via_key) == pytest.approx(float(both), abs=1e-7)


def test_gradient_matches_finite_differences():
    b = _mixed_batch()
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4)).astype(np.float32)
    acts = loss.rlcd_actions(jax.random.key(1), jnp.asarray(logits), b["valid_BC"], samples=4, sigma=0.3)
    opts = dict(sigma=0.3, ce_weight=1.0, brier_weight=0.5, ordinal_weight=0.25, **KW)

    def f(lg):  # the actions (and so the advantages) are fixed: a function of the logits alone
        return loss.rlcd_given_actions(lg, acts, b, **opts)[0]

    grad = np.asarray(jax.grad(f)(jnp.asarray(logits)))
    h = 1e-2
    fd = np.zeros_like(logits)
    for i in range(3):
        for j in range(4):
            up, dn = logits.copy(), logits.copy()
            up[i, j] += h
            dn[i, j] -= h
            fd[i, j] = (float(f(jnp.asarray(up))) - float(f(jnp.asarray(dn)))) / (2 * h)
    np.testing.assert_allclose(grad, fd, atol=2e-3, rtol=0)
    assert np.all(grad[2] == 0) and np.all(grad[0, 3] == 0)  # padding row and slot get no gradient
    assert np.abs(grad[:2]).max() > 0.05
