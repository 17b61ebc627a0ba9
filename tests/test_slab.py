"""Slab packing (readout.slab), on the host: every short row is read exactly once, at its own last
token, after exactly its own tokens and its question header, in one of the few fixed call shapes."""

import numpy as np
import pytest

from lev_jax import buckets
from lev_jax.readout import slab
from lev_jax.readout.plan import Row

SHAPES = buckets.slab_shapes("cpu")


def _rows(rng, n, header=0, lo=5, hi=60):
    head = list(rng.integers(100, 200, header))
    out = []
    for _ in range(n):
        tail = list(rng.integers(300, 400, int(rng.integers(lo, hi))))
        out.append(Row(head + tail, [1, 2, 3], header=header))
    return out


def _seen(lane: slab.Lane, at: int) -> list[int]:
    """The lane tokens that token `at` attends (what read_slab's mask lets it see), in order."""
    seg, parent = lane.segments[at], lane.parents[at]
    return [lane.tokens[j] for j in range(at + 1) if lane.segments[j] in (seg, parent)]


@pytest.mark.parametrize("packable", [True, False])
def test_every_row_is_read_once_after_exactly_its_own_tokens(packable):
    rng = np.random.default_rng(0)
    rows = _rows(rng, 9, header=12) + _rows(rng, 7) + _rows(rng, 5, header=30, lo=100, hi=200)
    prefix_of_row = [i % 3 for i in range(len(rows))]
    lanes = slab.lanes(rows, prefix_of_row, packable=packable, width=buckets.PREFILL_CHUNK)
    reads = sorted(r for ln in lanes for r, _ in ln.reads)
    assert reads == list(range(len(rows)))
    for ln in lanes:
        assert len(ln.tokens) <= buckets.PREFILL_CHUNK
        assert len(ln.reads) <= slab.READS
        for r, at in ln.reads:
            assert prefix_of_row[r] == ln.prefix  # a lane continues one prefix
            assert _seen(ln, at) == rows[r].tokens  # its own tokens, header included, nothing else
            # positions count from the prefix's end along the row, wherever it sits in the lane
            seq = [ln.positions[j] for j in range(at + 1) if ln.segments[j] in (ln.segments[at], ln.parents[at])]
            assert seq == list(range(len(rows[r].tokens)))
    if packable:  # several rows to a lane, each shared header once per lane
        assert len(lanes) < len(rows) / 2
        for ln in lanes:
            headers = [s for s in set(ln.segments) if s in ln.parents]
            assert all(ln.parents[ln.segments.index(s)] == -1 for s in headers)  # a header has no header
    else:
        assert all(len(ln.reads) == 1 and max(ln.parents) == -1 for ln in lanes)


def test_calls_take_the_smallest_shape_and_stack_only_what_may_meet():
    rng = np.random.default_rng(1)
    rows = _rows(rng, 3, lo=5, hi=20)
    lanes = slab.lanes(rows, [0, 0, 0], packable=True, width=buckets.PREFILL_CHUNK)
    (call,) = slab.calls(lanes, SHAPES)
    assert call.shape == (1, buckets.SHORT_LANE) and not call.stacked
    rows = _rows(rng, 40, header=8, lo=30, hi=60)
    prefix_of_row = [i % 5 for i in range(len(rows))]
    lanes = slab.lanes(rows, prefix_of_row, packable=True, width=buckets.PREFILL_CHUNK)
    calls = slab.calls(lanes, SHAPES)
    assert sorted(i for c in calls for i in c.lanes) == list(range(len(lanes)))
    assert all(c.shape in SHAPES and len(c.lanes) <= c.shape[0] for c in calls)
    assert any(c.stacked for c in calls)
    sizes = [len(c.lanes) for c in calls]
    assert max(sizes) - min(sizes) <= 1  # spread evenly
    # the lanes of one prefix: the lane counts they sum to, largest first, no empty lane computed
    one = [slab.Lane(0, tokens=[1] * 200) for _ in range(7)]
    assert [c.shape for c in slab.calls(one, SHAPES)] == [(4, 256), (1, 256), (1, 256), (1, 256)]
    assert not any(c.stacked for c in slab.calls(one, SHAPES))
    # prefixes that may not share a call (no cache and a cache) never do
    apart = slab.calls(lanes, SHAPES, stackable=lambda a, b: (a == 0) == (b == 0))
    assert all(len({lanes[i].prefix == 0 for i in c.lanes}) == 1 for c in apart)


def test_the_arrays_of_a_call_hold_its_lanes_and_only_them():
    rng = np.random.default_rng(2)
    rows = _rows(rng, 6, header=10)
    lanes = slab.lanes(rows, [0, 0, 0, 1, 1, 1], packable=True, width=buckets.PREFILL_CHUNK)
    (call,) = slab.calls(lanes, SHAPES)
    a = slab.arrays(lanes, call, rows, {0: 0, 1: 1})
    L, T = call.shape
    assert a.tokens_LT.shape == (L, T) and a.label_ids_LRC.shape[2] == slab.CODES
    for j, i in enumerate(call.lanes):
        n = len(lanes[i].tokens)
        assert a.valid_LT[j, :n].all() and not a.valid_LT[j, n:].any()
        assert a.prefix_L[j] == lanes[i].prefix
        for k, (r, at) in enumerate(lanes[i].reads):
            assert a.answer_LR[j, k] == at and list(a.label_ids_LRC[j, k, :3]) == rows[r].label_ids
    assert not a.valid_LT[len(call.lanes) :].any()


def test_a_short_lane_of_many_tiny_rows_reads_every_one():
    rows = [Row([7, 8, 9, 10, 11], [1, 2]) for _ in range(12)]  # 60 tokens: the short lane, 12 answers
    lanes = slab.lanes(rows, [0] * len(rows), packable=True, width=buckets.PREFILL_CHUNK)
    (call,) = slab.calls(lanes, SHAPES)
    assert call.shape == (1, buckets.SHORT_LANE)
    a = slab.arrays(lanes, call, rows, {0: 0})
    assert sorted(a.answer_LR[0, : len(rows)]) == [5 * k + 4 for k in range(len(rows))]


def test_rows_a_slab_does_not_read():
    assert slab.eligible(Row([1] * 10, [5, 6]))
    assert not slab.eligible(Row([1] * (buckets.PREFILL_CHUNK + 1), [5, 6]))  # long: chunks and a tail
    assert not slab.eligible(Row([1] * 10, list(range(slab.CODES + 1))))  # wide: read alone
    assert not slab.eligible(Row([1] * 10, [], markers=[3, 6]))  # Mode B
