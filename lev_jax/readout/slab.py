"""Packed rows: the short rows of one or several prefixes read in a few fixed-shape device calls.

A call is a slab of L lanes x T tokens (`buckets.slab_shapes`): each lane continues one prefix and
holds several rows one after another, each row attending to the prefix, to its own earlier tokens,
and to its question header, which the rows of one question share (both option orders continue it:
the header's tokens are in the lane once, as a segment whose continuations name it as their
parent). Every row keeps its own positions (from the prefix's end), so a row reads exactly what it
would alone. Answers are read at R positions per lane, each against C label codes.

The shapes are fixed, not fitted to each request: every short row after a prefix of up to a chunk
(with the schema first: after its question's lead) is served by a few programs (one per slab shape,
shared prefix or stacked prefixes), where a (rows bucket x row-length bucket x label-codes bucket)
grid made a server compile dozens. Rows after a longer prefix are read one by one
(readout.execute.read_plan).

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
    stacked: bool  # its lanes continue several prefixes (a stacked cache, read by index)

    def key(self, slots: int) -> tuple:
        """The program key: ("slab", cache slots, L, T, "stacked" | "shared")."""
        return ("slab", slots, *self.shape, "stacked" if self.stacked else "shared")


def calls(packed: list[Lane], shapes: tuple[tuple[int, int], ...], *, stackable=lambda a, b: True) -> list[Call]:
    """Lanes into calls of the slab shapes (`shapes`, (L, T) pairs). Lanes of one prefix take the
    lane counts whose sum they are, largest first (7 lanes: 4 + 1 + 1 + 1, no empty lane computed), a lone
    short lane the short shape; lanes of several prefixes (a micro-batch, or schema-first leads) are
    stacked in calls of the most lanes, spread evenly, so a stacked cache comes in one shape. Lanes
    of prefixes that `stackable` says cannot share a call (no cache, say) never do."""
    counts = sorted({L for L, _ in shapes}, reverse=True)

    def shape(part: list[int]) -> tuple[int, int]:
        longest = max(len(packed[i].tokens) for i in part)
        return next((L, T) for L, T in shapes if L >= len(part) and T >= longest)

    order = sorted(range(len(packed)), key=lambda i: (packed[i].prefix, -len(packed[i].tokens)))
    classes: list[list[int]] = []
    for i in order:
        for c in classes:
            if stackable(packed[c[0]].prefix, packed[i].prefix):
                c.append(i)
                break
        else:
            classes.append([i])
    out = []
    for c in classes:
        if len({packed[i].prefix for i in c}) == 1:
            while c:
                n = next(L for L in counts if L <= len(c))
                out.append(Call(c[:n], shape(c[:n]), False))
                c = c[n:]
            continue
        for part in np.array_split(np.asarray(c), -(-len(c) // counts[0])):  # near-equal stacked calls
            part = [int(i) for i in part]
            stacked = len({packed[i].prefix for i in part}) > 1
            out.append(Call(part, (counts[0], shape(part)[1]) if stacked else shape(part), stacked))
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
