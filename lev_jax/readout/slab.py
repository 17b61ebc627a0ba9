"""Packed rows: the short rows of one or several prefixes read in a few fixed-shape device calls.

A call is a slab of L lanes x T tokens (`buckets.slab_shapes`): each lane continues one prefix and
holds several rows one after another, each row attending to the prefix, to its own earlier tokens,
and to its question header, which the rows of one question share (both option orders continue it:
the header's tokens are in the lane once, as a segment whose continuations name it as their
parent). Every row keeps its own positions (from the prefix's end), so a row reads exactly what it
would alone. Answers are read at R positions per lane, each against C label codes.

The shapes are fixed, not fitted to each request: every short row after a prefix of up to a chunk
(with the schema first: after its question's lead) is served by a few programs (one per slab shape:
a lane reads its prefix's cache as is, several lanes a cache stacked from theirs), where a (rows
bucket x row-length bucket x label-codes bucket) grid made a server compile dozens. Which shapes a
request's lanes take is planned at the least cost (`calls`). Rows after a longer prefix are read one
by one (readout.execute.read_plan).

A recurrent layer (Qwen3.5's Gated DeltaNet) runs through every token of a lane, so for a model that
has one each lane holds one row (`packable=False`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lev_jax import buckets
from lev_jax.readout.plan import Row

CODES = 32  # label codes a slab row reads: wider rows (large choices) are read one by one
CACHE_SLOTS = buckets.CAPACITY[0]  # the one cache capacity slabs read (a prefix of up to a chunk)
READS_PER_TOKENS = 8  # a lane of a chunk's tokens reads at most a chunk / 8 rows (rows are rarely shorter)
READS = buckets.PREFILL_CHUNK // READS_PER_TOKENS  # answers read per lane, in every slab shape


def eligible(row: Row) -> bool:
    """A row a slab reads: Mode A, at most a chunk long, at most CODES label codes."""
    return (
        row.markers is None
        and not row.keys_before
        and 0 < len(row.tokens) <= buckets.PREFILL_CHUNK
        and len(row.label_ids) <= CODES
    )


@dataclasses.dataclass
class Lane:
    prefix: int  # the group (prefix) every row of the lane continues
    tokens: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)  # from the prefix's end
    segments: list[int] = dataclasses.field(default_factory=list)  # per token: its segment
    parents: list[int] = dataclasses.field(default_factory=list)  # per token: its segment's header (-1: none)
    reads: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (row, answer index in the lane)

    def add(self, tokens: list[int], start: int, parent: int) -> int:
        """Append a segment of `tokens` at positions start.. continuing segment `parent`; its id."""
        seg = len(set(self.segments))
        self.tokens += tokens
        self.positions += range(start, start + len(tokens))
        self.segments += [seg] * len(tokens)
        self.parents += [parent] * len(tokens)
        return seg


@dataclasses.dataclass(frozen=True)
class Unit:
    """Rows packed together: a shared header (possibly empty) and the rows continuing it."""

    prefix: int
    header: list[int]
    rows: list[int]  # row indices

    def cost(self, rows: list[Row]) -> int:
        return len(self.header) + sum(len(rows[i].tokens) - len(self.header) for i in self.rows)


def units(rows: list[Row], prefix_of_row: list[int], *, packable: bool, width: int, reads: int) -> list[Unit]:
    """Rows grouped by prefix and question header (when `packable`), each unit fitting one lane of
    `width` tokens and `reads` answers; a header shared by more rows than fit is repeated."""
    if not packable:
        return [Unit(prefix_of_row[i], [], [i]) for i in range(len(rows))]
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        h = r.header if 0 < r.header < len(r.tokens) else 0
        groups.setdefault((prefix_of_row[i], tuple(r.tokens[:h])), []).append(i)
    out = []
    for (prefix, header), idx in groups.items():
        current: list[int] = []
        for i in idx:
            trial = Unit(prefix, list(header), current + [i])
            if current and (trial.cost(rows) > width or len(trial.rows) > reads):
                out.append(Unit(prefix, list(header), current))
                current = []
            current.append(i)
        out.append(Unit(prefix, list(header), current))
    return out


def lanes(rows: list[Row], prefix_of_row: list[int], *, packable: bool, width: int) -> list[Lane]:
    """The rows packed into lanes of at most `width` tokens (first fit, longest units first), each
    lane one prefix's."""
    reads = READS
    out: list[Lane] = []
    todo = units(rows, prefix_of_row, packable=packable, width=width, reads=reads)
    for u in sorted(todo, key=lambda u: -u.cost(rows)):
        lane = next(
            (
                ln
                for ln in out
                if packable
                and ln.prefix == u.prefix
                and len(ln.tokens) + u.cost(rows) <= width
                and len(ln.reads) + len(u.rows) <= reads
            ),
            None,
        )
        if lane is None:
            lane = Lane(u.prefix)
            out.append(lane)
        h = len(u.header)
        parent = lane.add(u.header, 0, -1) if h else -1
        for i in u.rows:
            lane.add(rows[i].tokens[h:], h, parent)
            lane.reads.append((i, len(lane.tokens) - 1))
    return out


@dataclasses.dataclass(frozen=True)
class Call:
    lanes: list[int]  # indices into the lanes
    shape: tuple[int, int]  # (L lanes, T tokens)
    stacked: bool  # its lanes read a cache stacked from their prefixes' (by index), one row per lane

    def key(self, slots: int) -> tuple:
        """The program key: ("slab", cache slots, L, T, "stacked" | "shared")."""
        return ("slab", slots, *self.shape, "stacked" if self.stacked else "shared")


def calls(packed: list[Lane], shapes: tuple[tuple[int, int], ...], *, slots=None, call_tokens: int = 0) -> list[Call]:
    """Lanes into calls of the slab shapes (`shapes`, (L, T) pairs) at the least cost, a call costing
    its L x T tokens plus `call_tokens` (buckets.call_tokens: what a call costs beyond its tokens):
    three short lanes take one 4 x 64 call, not three calls or a 4 x 256 one; seven chunk-long lanes
    4 + 1 + 1 + 1 on a CPU (no empty lane computed). Fewer calls break a tie.

    A call of one lane reads its prefix's cache as it is ("shared"); a call of more lanes reads a
    cache stacked from its lanes' prefixes, one row per lane, whether they are one prefix's or a
    micro-batch's, so one program serves both. `slots` (per prefix, its cache's slots; None: every
    prefix has a cache) keeps lanes without a prefix cache out of calls with one: they never meet."""
    slots = slots if slots is not None else [1] * (1 + max((ln.prefix for ln in packed), default=0))
    out = []
    for cached in (True, False):
        c = [i for i in range(len(packed)) if bool(slots[packed[i].prefix]) == cached]
        c.sort(key=lambda i: (-len(packed[i].tokens), packed[i].prefix))
        out += [
            Call(c[a:b], shape, cached and shape[0] > 1)
            for a, b, shape in _least_cost([len(packed[i].tokens) for i in c], shapes, call_tokens)
        ]
    return out


def _least_cost(lengths: list[int], shapes, call_tokens: int) -> list[tuple[int, int, tuple[int, int]]]:
    """(start, end, shape) calls over `lengths` (longest first) at the least (cost, calls). With the
    lanes sorted, some cheapest plan gives every call a run of consecutive lanes (a call's width is
    its longest lane's), so a call starting at lane i takes as many as it holds: a dynamic
    programme over i."""
    n = len(lengths)
    best: list[tuple] = [(0, 0, 0, None)] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = min(
            (
                L * T + call_tokens + best[min(n, i + L)][0],
                1 + best[min(n, i + L)][1],
                -L,  # ties aside, the larger call first
                (L, T),
            )
            for L, T in shapes
            if T >= lengths[i]
        )
    out, i = [], 0
    while i < n:
        shape = best[i][3]
        out.append((i, min(n, i + shape[0]), shape))
        i = min(n, i + shape[0])
    return out


@dataclasses.dataclass
class Arrays:
    """One call's inputs."""

    tokens_LT: np.ndarray  # int32
    valid_LT: np.ndarray  # bool
    positions_LT: np.ndarray  # int32, from the prefix's end
    segments_LT: np.ndarray  # int32 (padding: -1, a segment nothing else is in)
    parents_LT: np.ndarray  # int32 (-1: no header)
    answer_LR: np.ndarray  # int32
    label_ids_LRC: np.ndarray  # int32 (padding: id 0, never read)
    prefix_L: np.ndarray  # int32: each lane's row of the call's stacked cache


def arrays(packed: list[Lane], call: Call, rows: list[Row], stack_row: dict[int, int]) -> Arrays:
    """The call's lanes as arrays of its shape; `stack_row`: group -> its row in the call's cache."""
    L, T = call.shape
    R = READS  # a short lane may hold as many rows as a long one (a few tokens each)
    out = Arrays(
        np.zeros((L, T), np.int32),
        np.zeros((L, T), bool),
        np.zeros((L, T), np.int32),
        np.full((L, T), -1, np.int32),
        np.full((L, T), -1, np.int32),
        np.zeros((L, R), np.int32),
        np.zeros((L, R, CODES), np.int32),
        np.zeros((L,), np.int32),
    )
    for j, i in enumerate(call.lanes):
        lane, n = packed[i], len(packed[i].tokens)
        out.tokens_LT[j, :n] = lane.tokens
        out.valid_LT[j, :n] = True
        out.positions_LT[j, :n] = lane.positions
        out.segments_LT[j, :n] = lane.segments
        out.parents_LT[j, :n] = lane.parents
        out.prefix_L[j] = stack_row[lane.prefix]
        for k, (r, at) in enumerate(lane.reads):
            out.answer_LR[j, k] = at
            out.label_ids_LRC[j, k, : len(rows[r].label_ids)] = rows[r].label_ids
    return out
