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
