"""The training loss, on the readout distribution over a row's label codes.

    loss = CE + brier_weight * Brier + ordinal_weight * ordinal          (defaults 0.5 and 0.25)

per readout row, with p = softmax(label logits) over the row's real codes and t the target
distribution over the same codes (one-hot, or soft: abstain rows, a noul rating target read as
binary):

* CE       = -sum_c t_c log p_c
* Brier    = sum_c (p_c - t_c)^2                      (the multiclass Brier score, 0..2)
* ordinal  = sum_c sum_j p_c t_j ((l_c - l_j) / (n - 1))^2  for ordered rows (score levels and the
             0..8 noul rating), 0 elsewhere: probability mass weighted by its squared level
             distance from the target, so a near miss costs less than a far one.

CE and Brier are proper scoring rules: their minimum is at p = t, so the trained readout stays a
probability the calibration step only has to fine-tune. Padded code slots (beyond a row's codes)
are masked out of the softmax; padded rows have weight 0. Everything here is fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lev_jax import domain

MODES = domain.READOUT_MODES  # per-mode logging order: letter, binary, rating
_MASKED = -1e30


def row_terms(logits_BC, target_BC, valid_BC, level_BC, ordinal_B):
    """(ce_B, brier_B, ordinal_B): the three terms per row (see the module docstring)."""
    logits_BC = jnp.where(valid_BC, logits_BC.astype(jnp.float32), _MASKED)
    logp_BC = jax.nn.log_softmax(logits_BC, axis=-1)
    p_BC = jnp.where(valid_BC, jnp.exp(logp_BC), 0.0)
    t_BC = jnp.where(valid_BC, target_BC.astype(jnp.float32), 0.0)
    ce_B = -jnp.sum(jnp.where(valid_BC, t_BC * logp_BC, 0.0), axis=-1)
    brier_B = jnp.sum((p_BC - t_BC) ** 2, axis=-1)
    # sum_cj p_c t_j (l_c - l_j)^2 = E_p[l^2] - 2 E_p[l] E_t[l] + E_t[l^2]  (p and t each sum to 1)
    n_B = jnp.sum(valid_BC, axis=-1).astype(jnp.float32)
    l_BC = jnp.where(valid_BC, level_BC.astype(jnp.float32), 0.0) / jnp.maximum(n_B - 1.0, 1.0)[:, None]
    ep, ep2 = jnp.sum(p_BC * l_BC, -1), jnp.sum(p_BC * l_BC**2, -1)
    et, et2 = jnp.sum(t_BC * l_BC, -1), jnp.sum(t_BC * l_BC**2, -1)
    ord_B = jnp.where(ordinal_B, jnp.maximum(ep2 - 2.0 * ep * et + et2, 0.0), 0.0)
    return ce_B, brier_B, ord_B


def loss(logits_BC, batch, *, brier_weight: float = 0.5, ordinal_weight: float = 0.25):
    """(scalar loss, stats) for a batch of rows. `batch` holds target_BC, valid_BC (real codes),
    level_BC, ordinal_B, mode_B (index into MODES) and weight_B (0 for padding rows).
    The loss is the weighted mean over rows; stats carries per-mode sums for logging:
    {"loss_sum_M", "rows_M", "ce_sum_M"} (M = len(MODES))."""
    ce, brier, ordinal = row_terms(
        logits_BC, batch["target_BC"], batch["valid_BC"], batch["level_BC"], batch["ordinal_B"]
    )
    per_row = ce + brier_weight * brier + ordinal_weight * ordinal
    w = batch["weight_B"].astype(jnp.float32)
    total = jnp.sum(per_row * w) / jnp.maximum(jnp.sum(w), 1e-9)
    onehot_BM = jax.nn.one_hot(batch["mode_B"], len(MODES), dtype=jnp.float32) * w[:, None]
    stats = {"loss_sum_M": per_row @ onehot_BM, "rows_M": jnp.sum(onehot_BM, 0), "ce_sum_M": ce @ onehot_BM}
    return total, stats


def distill(logits_BC, teacher_BC, batch):
    """The weighted mean over rows of KL(teacher || softmax(logits)) over each row's real codes: how
    far a reading (an elastic-depth exit) is from another one's distribution (the full depth's)."""
    valid_BC = batch["valid_BC"]
    logq_BC = jax.nn.log_softmax(jnp.where(valid_BC, logits_BC.astype(jnp.float32), _MASKED), axis=-1)
    logp_BC = jax.nn.log_softmax(jnp.where(valid_BC, teacher_BC.astype(jnp.float32), _MASKED), axis=-1)
    kl_B = jnp.sum(jnp.where(valid_BC, jnp.exp(logp_BC) * (logp_BC - logq_BC), 0.0), axis=-1)
    w = batch["weight_B"].astype(jnp.float32)
    return jnp.sum(kl_B * w) / jnp.maximum(jnp.sum(w), 1e-9)


# --------------------------------------------------------------------------- RLCD
# Reinforcement on the calibrated decision (`--loss rlcd`): a Gaussian policy over each row's label
# logits, rewarded by proper scoring rules of the perturbed distribution against the target.
#
#   a       = stop_gradient(logits) + eps,  eps ~ N(0, sigma^2) on the valid codes, centred over them
#   reward  = sum_c t_c max(log p_c, log floor) + spherical_weight * (p . t) / |p|
#             - RPS / (K - 1)  on ordered rows (score levels, the noul rating), p = softmax(a)
#   A       = (reward - its mean over the row's S samples) / (one std of the batch's A + 1e-6)
#   policy  = -mean over (samples, rows, valid codes) of A * log N(a_c; logits_c, sigma^2)
#   total   = policy + ce_weight * (the plain loss above, on the unperturbed logits)
#
# Only the quadratic part of log N depends on the logits: its gradient is A * eps / sigma^2, which
# moves each row's logits toward the perturbations that scored above the row's mean.


def rlcd_actions(key, logits_BC, valid_BC, *, samples: int, sigma: float):
    """[S, B, C] perturbed logits: the (gradient-stopped) logits plus noise centred over each row's
    valid codes; padded slots carry the logits unchanged (they are masked everywhere)."""
    lg_BC = jax.lax.stop_gradient(logits_BC.astype(jnp.float32))
    eps_SBC = sigma * jax.random.normal(key, (samples, *lg_BC.shape), jnp.float32)
    eps_SBC = jnp.where(valid_BC, eps_SBC, 0.0)
    n_B = jnp.maximum(jnp.sum(valid_BC, axis=-1), 1).astype(jnp.float32)
    eps_SBC = jnp.where(valid_BC, eps_SBC - (jnp.sum(eps_SBC, -1) / n_B)[..., None], 0.0)
    return lg_BC + eps_SBC


def rlcd_reward(actions_SBC, target_BC, valid_BC, level_BC, ordinal_B, *, log_floor: float, spherical_weight: float):
    """[S, B] reward of softmax(actions) against the target (see the section comment)."""
    logp_SBC = jax.nn.log_softmax(jnp.where(valid_BC, actions_SBC, _MASKED), axis=-1)
    p_SBC = jnp.where(valid_BC, jnp.exp(logp_SBC), 0.0)
    t_BC = jnp.where(valid_BC, target_BC.astype(jnp.float32), 0.0)
    log_term = jnp.sum(jnp.where(valid_BC, t_BC * jnp.maximum(logp_SBC, jnp.log(log_floor)), 0.0), -1)
    spherical = jnp.sum(p_SBC * t_BC, -1) / jnp.maximum(jnp.linalg.norm(p_SBC, axis=-1), 1e-12)
    # ranked probability score over the cumulative distributions of the ordered levels 0..K-1
    n_B = jnp.sum(valid_BC, axis=-1)
    k_K = jnp.arange(min(valid_BC.shape[-1], domain.MAX_ORDERED_LEVELS))
    below_BCK = valid_BC[..., None] & (level_BC[..., None] <= k_K)  # code c counts toward P(level <= k)
    cum_p_SBK = jnp.einsum("sbc,bck->sbk", p_SBC, below_BCK.astype(jnp.float32))
    cum_t_BK = jnp.einsum("bc,bck->bk", t_BC, below_BCK.astype(jnp.float32))
    inner_BK = k_K < (n_B - 1)[:, None]  # the last cumulative is 1 for both
    rps_SB = jnp.sum(jnp.where(inner_BK, (cum_p_SBK - cum_t_BK) ** 2, 0.0), -1)
    rps_SB = rps_SB / jnp.maximum(n_B - 1, 1).astype(jnp.float32)
    return log_term + spherical_weight * spherical - jnp.where(ordinal_B, rps_SB, 0.0)


def rlcd_advantages(reward_SB, weight_B):
    """Each sample's reward minus its row's mean over the S samples, over one global std of the
    batch's (real rows') advantages."""
    adv_SB = reward_SB - jnp.mean(reward_SB, axis=0, keepdims=True)
    w_SB = jnp.broadcast_to((weight_B > 0).astype(jnp.float32), adv_SB.shape)
    std = jnp.sqrt(jnp.sum(w_SB * adv_SB**2) / jnp.maximum(jnp.sum(w_SB), 1.0))  # the mean is 0
    return adv_SB / (std + 1e-6)


def rlcd_policy(logits_BC, actions_SBC, adv_SB, valid_BC, weight_B, *, sigma: float):
    """-mean(A * log N(a; logits, sigma^2)) over the valid codes of the real rows (each weighted)."""
    logn_SBC = -((actions_SBC - logits_BC.astype(jnp.float32)[None]) ** 2) / (2.0 * sigma**2)
    m_SBC = jnp.broadcast_to((valid_BC * weight_B.astype(jnp.float32)[:, None])[None], actions_SBC.shape)
    adv_SBC = jax.lax.stop_gradient(adv_SB)[..., None]
    return -jnp.sum(adv_SBC * logn_SBC * m_SBC) / jnp.maximum(jnp.sum(m_SBC), 1e-9)


def rlcd_given_actions(logits_BC, actions_SBC, batch, *, sigma, log_floor, spherical_weight, ce_weight, **plain):
    """(total, stats) for fixed actions: the RLCD loss as a function of the logits alone (what
    its gradient is; a finite-difference check holds the actions fixed)."""
    reward_SB = rlcd_reward(
        actions_SBC,
        batch["target_BC"],
        batch["valid_BC"],
        batch["level_BC"],
        batch["ordinal_B"],
        log_floor=log_floor,
        spherical_weight=spherical_weight,
    )
    adv_SB = rlcd_advantages(reward_SB, batch["weight_B"])
    policy = rlcd_policy(logits_BC, actions_SBC, adv_SB, batch["valid_BC"], batch["weight_B"], sigma=sigma)
    base, stats = loss(logits_BC, batch, **plain)
    w = (batch["weight_B"] > 0).astype(jnp.float32)
    stats = {**stats, "policy": policy, "reward": jnp.sum(reward_SB * w) / jnp.maximum(w.sum() * reward_SB.shape[0], 1)}
    return policy + ce_weight * base, stats


def rlcd(logits_BC, batch, key, *, samples: int, sigma: float, **kw):
    """The RLCD loss (see the section comment): (scalar, stats); `key` draws the noise."""
    actions_SBC = rlcd_actions(key, logits_BC, batch["valid_BC"], samples=samples, sigma=sigma)
    return rlcd_given_actions(logits_BC, actions_SBC, batch, sigma=sigma, **kw)
