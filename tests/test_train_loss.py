"""The training loss on hand-computed values: CE + 0.5 Brier + 0.25 ordinal, masks, per-mode sums."""

import math

import numpy as np
import pytest

from lev_jax import domain
from lev_jax.training import loss


def _batch(target, valid, level, ordinal, mode, weight):
    return {
        "target_BC": np.asarray(target, np.float32),
        "valid_BC": np.asarray(valid, bool),
        "level_BC": np.asarray(level, np.float32),
        "ordinal_B": np.asarray(ordinal, bool),
        "mode_B": np.asarray(mode, np.int32),
        "weight_B": np.asarray(weight, np.float32),
    }


def test_terms_by_hand():
    # row 0: a 3-level score, p = (1/2, 1/4, 1/4), target level 2 (ordinal on)
    # row 1: a binary noul with a soft target (0.75, 0.25), p = (0.5, 0.5), one padded code slot
    logits = np.log(np.array([[2.0, 1.0, 1.0], [1.0, 1.0, 123.0]], np.float32))
    b = _batch(
        [[0, 0, 1], [0.75, 0.25, 0]],
        [[1, 1, 1], [1, 1, 0]],
        [[0, 1, 2], [0, 1, 0]],
        [True, False],
        [domain.READOUT_MODES.index(domain.LETTER), domain.READOUT_MODES.index(domain.BINARY)],
        [1, 1],
    )
    ce, brier, ordinal = (
        np.asarray(x) for x in loss.row_terms(logits, b["target_BC"], b["valid_BC"], b["level_BC"], b["ordinal_B"])
    )
    assert ce == pytest.approx([math.log(4), -(0.75 * math.log(0.5) + 0.25 * math.log(0.5))], abs=1e-6)
    assert brier == pytest.approx([0.25 + 0.0625 + 0.5625, 0.0625 + 0.0625], abs=1e-6)
    # mass x squared level distance / (n-1)^2: 1/2 * (2/2)^2 + 1/4 * (1/2)^2 = 0.5625; binary rows: 0
    assert ordinal == pytest.approx([0.5625, 0.0], abs=1e-6)
    total, stats = loss.loss(logits, b)
    per_row = ce + 0.5 * brier + 0.25 * ordinal
    assert float(total) == pytest.approx(per_row.mean(), abs=1e-6)
    modes = list(domain.READOUT_MODES)
    assert np.asarray(stats["loss_sum_M"])[modes.index(domain.LETTER)] == pytest.approx(per_row[0], abs=1e-6)
    assert np.asarray(stats["loss_sum_M"])[modes.index(domain.BINARY)] == pytest.approx(per_row[1], abs=1e-6)
    assert np.asarray(stats["rows_M"]).tolist() == [1.0, 1.0] + [0.0] * (len(modes) - 2)


def test_padding_rows_and_slots_do_not_count():
    logits = np.array([[0.0, 0.0, 50.0], [9.0, -9.0, 0.0]], np.float32)
    b = _batch(
        [[1, 0, 0], [0.3, 0.7, 0]], [[1, 1, 0], [1, 1, 0]], [[0, 1, 0], [0, 1, 0]], [False, False], [0, 0], [1, 0]
    )
    total, stats = loss.loss(logits, b, brier_weight=0.0, ordinal_weight=0.0)
    assert float(total) == pytest.approx(math.log(2), abs=1e-6)  # the padded slot's 50 is masked
    assert float(np.asarray(stats["rows_M"]).sum()) == 1.0


def test_a_near_miss_costs_less_than_a_far_one():
    level = [[0, 1, 2, 3, 4]] * 2
    logits = np.log(np.array([[0.01, 0.01, 0.01, 0.96, 0.01], [0.96, 0.01, 0.01, 0.01, 0.01]], np.float32))
    b = _batch([[0, 0, 0, 0, 1]] * 2, [[1] * 5] * 2, level, [True, True], [0, 0], [1, 1])
    _, _, ordinal = loss.row_terms(logits, b["target_BC"], b["valid_BC"], b["level_BC"], b["ordinal_B"])
    near, far = np.asarray(ordinal)
    assert near < 0.1 < 0.9 < far
