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


CALL = buckets.call_tokens("cpu")


def _cost(lanes, calls):
    for c in calls:  # every call holds its lanes
        assert c.shape in SHAPES and len(c.lanes) <= c.shape[0]
        assert max(len(lanes[i].tokens) for i in c.lanes) <= c.shape[1]
    assert sorted(i for c in calls for i in c.lanes) == list(range(len(lanes)))  # each lane once
    return sum(L * T + CALL for L, T in (c.shape for c in calls))


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1 :]


def _cheapest(lengths):
    """The least cost of any split of the lanes into calls (every set partition, each block in its
    cheapest shape)."""
    inf = float("inf")
    block = lambda b: min(
        (L * T + CALL for L, T in SHAPES if L >= len(b) and T >= max(lengths[i] for i in b)), default=inf
    )  # noqa: E731
    return min(sum(block(b) for b in p) for p in _partitions(list(range(len(lengths)))))


def test_calls_cost_the_least_of_any_split():
    rng = np.random.default_rng(1)
    for _ in range(40):
        lengths = [int(x) for x in rng.choice([20, 64, 65, 120, 256], size=int(rng.integers(1, 8)))]
        lanes = [slab.Lane(int(rng.integers(0, 3)), tokens=[1] * n) for n in lengths]
        assert _cost(lanes, slab.calls(lanes, SHAPES, call_tokens=CALL)) == _cheapest(lengths)


def test_calls_take_the_cheapest_shapes_and_stack_only_what_may_meet():
    rng = np.random.default_rng(1)
    rows = _rows(rng, 3, lo=5, hi=20)
    lanes = slab.lanes(rows, [0, 0, 0], packable=True, width=buckets.PREFILL_CHUNK)
    (call,) = slab.calls(lanes, SHAPES, call_tokens=CALL)
    assert call.shape == (1, buckets.SHORT_LANE) and not call.stacked  # a lone short lane: as it is
    # a lone request with the schema first: three questions' leads, a short lane each -- one stacked
    # call of short lanes (three calls, or a 4 x 256 call, compute more)
    three = [slab.Lane(p, tokens=[1] * 50) for p in range(3)]
    (call,) = slab.calls(three, SHAPES, call_tokens=CALL)
    assert call.shape == (4, buckets.SHORT_LANE) and call.stacked
    # the lanes of one prefix: the lane counts they sum to, largest first, no empty lane computed;
    # a call of several lanes reads a stacked cache even when they are one prefix's (one program)
    one = [slab.Lane(0, tokens=[1] * 200) for _ in range(7)]
    calls = slab.calls(one, SHAPES, call_tokens=CALL)
    assert [(c.shape, c.stacked) for c in calls] == [((4, 256), True)] + [((1, 256), False)] * 3
    # many prefixes' lanes: stacked, at the least cost
    rows = _rows(rng, 40, header=8, lo=30, hi=60)
    prefix_of_row = [i % 5 for i in range(len(rows))]
    lanes = slab.lanes(rows, prefix_of_row, packable=True, width=buckets.PREFILL_CHUNK)
    calls = slab.calls(lanes, SHAPES, call_tokens=CALL)
    assert any(c.stacked and len({lanes[i].prefix for i in c.lanes}) > 1 for c in calls)
    assert _cost(lanes, calls) == _cheapest([len(ln.tokens) for ln in lanes])
    # prefixes that may not share a call (no cache and a cache) never do
    apart = slab.calls(lanes, SHAPES, slots=[0, 256, 256, 256, 256], call_tokens=CALL)
    _cost(lanes, apart)
    assert all(len({lanes[i].prefix == 0 for i in c.lanes}) == 1 for c in apart)
    assert not any(c.stacked for c in apart if lanes[c.lanes[0]].prefix == 0)  # no cache to stack


def test_the_arrays_of_a_call_hold_its_lanes_and_only_them():
    rng = np.random.default_rng(2)
    rows = _rows(rng, 6, header=10, lo=60, hi=100)  # four lanes past the short width: one 4-lane call
    lanes = slab.lanes(rows, [0, 0, 1, 1, 2, 3], packable=True, width=buckets.PREFILL_CHUNK)
    (call,) = slab.calls(lanes, SHAPES, call_tokens=CALL)
    assert call.stacked and len(call.lanes) == 4
    a = slab.arrays(lanes, call, rows, {0: 0, 1: 1, 2: 2, 3: 3})
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
    (call,) = slab.calls(lanes, SHAPES, call_tokens=CALL)
    assert call.shape == (1, buckets.SHORT_LANE)
    a = slab.arrays(lanes, call, rows, {0: 0})
    assert sorted(a.answer_LR[0, : len(rows)]) == [5 * k + 4 for k in range(len(rows))]


def test_rows_a_slab_does_not_read():
    assert slab.eligible(Row([1] * 10, [5, 6]))
    assert not slab.eligible(Row([1] * (buckets.PREFILL_CHUNK + 1), [5, 6]))  # long: chunks and a tail
    assert not slab.eligible(Row([1] * 10, list(range(slab.CODES + 1))))  # wide: read alone
    assert not slab.eligible(Row([1] * 10, [], markers=[3, 6]))  # Mode B
