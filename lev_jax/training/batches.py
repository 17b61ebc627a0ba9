"""Training batches: data-build records -> readout rows (through the serving Planner) -> padded arrays.

A record is one (state, question, target distribution) of a `python -m data build` split. It is laid
out by `lev_jax.readout.Planner`, the planner predict() uses, so a fine-tuned model is trained on
exactly the token rows and label codes it is served:

* a choice within the code capacity: its readout's rows (both option orders with option averaging);
* a large choice (more options than `planner.group_size`): served in two rounds, so trained on both:
  the round-1 readout of the group holding the gold option, and the round-2 readout of the group
  winners (`planner.winners_readout`: the gold for its group, a seeded random member of every other
  group standing in for that group's winner);
* a Mode B choice (a planner with a head routes it there: `readout.route`): its marked row, the
  options in a seeded random order (the head must not learn positions; with `mode_b_options` a
  sampled subset holding the target's options), and with `mode_b_joint` also its Mode A rows as
  above (the fallback stays trained, and A and B can be compared);
* a score: its one row (ordinal loss on);
* a noul: the binary rows (target P(yes) = the rating target's expectation) or the 0..8 rating row
  (ordinal loss on), whichever `noul_readout` predict() serves.

Layouts: every example in the planner's layout, or (a `Renderer` given a planner per layout and
`mix`) each in a layout drawn per (seed, epoch, record) -- its own generator stream, so the draws
above stay as they were -- with large choices in `large_layout` when it is set.

Rows that share a token prefix continue one computed prefix (`group_rows`): with the state first,
an example's option orders share its state; with the schema first and question-grouped batches
(`question_keys`), every row of a question shares the whole question. Shapes are padded to a few
buckets (bounded compiles); the random choices are a pure function of (seed, epoch, record index),
so a resumed run draws the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lev_jax import buckets, domain
from lev_jax.readout import MODE_B, Planner, Row, pack_prefixes, pack_rows

# Training shape buckets: four lengths per octave (at most 25 % padding; fewer compiles than
# serving's eight, and on the smollm2 mixture 9 shapes in 100 steps against 6 with two per octave),
# two row counts per octave (rows come in pairs of option orders and question-sized groups).
LENGTHS = buckets.geometric(16, domain.MAX_STATE_PLUS_QUESTION_TOKENS, 4)
ROWS = buckets.geometric(1, 1 << 14, 2)
CODES = buckets.CODES
# floors that cost next to nothing and spare compiles: two rows per group (an example's two option
# orders), nine code slots (a binary noul pads up to the score / rating shapes)
MIN_ROWS, MIN_CODES = 2, 9
MODE_INDEX = {m: i for i, m in enumerate(domain.READOUT_MODES)}
ORDINAL_QTYPES = (domain.SCORE,)
LAYOUT_STREAM = 1  # the layout draw's generator: [seed, epoch, index, LAYOUT_STREAM]


@dataclasses.dataclass
class Example:
    """One record laid out: its state prefix and every row it trains, with per-row targets."""

    prefix: list[int]
    rows: list[Row]
    targets: list[np.ndarray]  # per row: target distribution over its code positions
    levels: list[list[int]]  # per row: the candidate (level) index of each code position
    ordinal: list[bool]  # per row: ordinal term on (score, noul rating)
    modes: list[int]  # per row: index into domain.READOUT_MODES
    source: str = ""
    layout: str = ""  # the prompt layout it was rendered in

    @property
    def tokens(self) -> int:
        """Real (unpadded) tokens the example puts through the model: the prefix once, every row."""
        return len(self.prefix) + sum(len(r.tokens) for r in self.rows)

    @property
    def longest(self) -> int:
        return len(self.prefix) + max(len(r.tokens) for r in self.rows)


def _normalised(p: np.ndarray) -> np.ndarray:
    s = float(p.sum())
    return p / s if s > 0 else np.full(len(p), 1.0 / len(p))


def _normalised_on(dist: np.ndarray, subset: Sequence[int]) -> np.ndarray:
    """`dist` restricted to `subset` (zero elsewhere) and renormalised there."""
    out = np.zeros(len(dist), np.float64)
    out[list(subset)] = _normalised(np.asarray(dist, np.float64)[list(subset)])
    return out


def _rows_of(ro, target_n: np.ndarray, ordinal: bool, ex: Example) -> None:
    """Add a readout's rows to `ex`, its candidate-order target mapped to each row's code order."""
    for row, m in zip(ro.rows, ro.maps):
        ex.rows.append(row)
        ex.targets.append(np.asarray(target_n, np.float32)[np.asarray(m)])
        ex.levels.append(list(m))
        ex.ordinal.append(ordinal)
        ex.modes.append(MODE_INDEX[ro.mode])


class Renderer:
    """Records -> Examples through the serving planner's settings: one Planner, or one per layout
    (`planners`, the same settings otherwise) with each example's layout drawn from `mix`."""

    def __init__(
        self,
        planner: Planner,
        *,
        seed: int = 0,
        round2: bool = True,
        max_tokens: int | None = None,
        mode_b_joint: bool = True,
        mode_b_options: int = 0,
        planners: Mapping[str, Planner] | None = None,
        mix: Sequence[str] = (),
        large_layout: str = "",
    ):
        self.planner = planner
        self.planners = {planner.layout: planner, **dict(planners or {})}
        missing = sorted({*mix, *([large_layout] if large_layout else [])} - set(self.planners))
        if missing:
            raise ValueError(f"no planner for layout(s) {', '.join(missing)}")
        self.mix = tuple(mix)
        self.large_layout = large_layout
        self.seed = seed
        self.round2 = round2
        self.max_tokens = max_tokens
        self.mode_b_joint = mode_b_joint
        self.mode_b_options = mode_b_options

    def layout_of(self, record: Mapping[str, Any], epoch: int, index: int) -> str:
        """The layout record `index` is rendered in during `epoch`: a pure function of them and the
        seed (a resumed run, any host, draws the same)."""
        q = record["question"]
        if self.large_layout and q["type"] == domain.CHOICE and domain.band_of(len(q["criteria"])) == "large":
            return self.large_layout
        if not self.mix:
            return self.planner.layout
        rng = np.random.default_rng([self.seed, int(epoch), int(index), LAYOUT_STREAM])
        return self.mix[int(rng.integers(len(self.mix)))]

    def example(
        self,
        record: Mapping[str, Any],
        rng: np.random.Generator,
        orders: dict[int, list[int]] | None = None,
        layout: str | None = None,
    ) -> Example | None:
        """The record's rows, or None when its prefix + longest row exceeds `max_tokens`. `orders`
        (a batch's, `batch`): the Mode B option order per option count, shared by the batch's records.
        `layout`: the planner to render it with (default: the renderer's own)."""
        p = self.planners[layout] if layout else self.planner
        text = p.state_text(record["state"])
        qp = p.question(text, "q", record["question"])
        ex = Example(p.prefix_ids(text), [], [], [], [], [], record.get("source", ""), p.layout)
        dist = np.asarray(record["target_dist"], np.float64)
        qtype = qp.question["type"]
        if qtype == domain.NOUL:
            ro = qp.readouts[0]
            if ro.mode == domain.BINARY:
                p_yes = float(dist @ domain.RATING_WEIGHTS)
                _rows_of(ro, np.array([p_yes, 1.0 - p_yes]), False, ex)
            else:
                _rows_of(ro, dist, True, ex)
        elif qp.route == MODE_B:
            order = self.marked_order(dist, rng, orders)
            _rows_of(p.marked_readout(text, qp.question, order), _normalised_on(dist, order), False, ex)
            if self.mode_b_joint:
                self.mode_a_rows(p.question(text, "q", record["question"], allow_b=False), text, dist, rng, ex, p)
        else:
            self.mode_a_rows(qp, text, dist, rng, ex, p)
        if self.max_tokens is not None and ex.longest > self.max_tokens:
            return None
        return ex

    def marked_order(
        self, dist: np.ndarray, rng: np.random.Generator, orders: dict[int, list[int]] | None = None
    ) -> list[int]:
        """The options of a Mode B training row, in a seeded random order: all of them, or with
        `mode_b_options` > 0 that many: the options the target gives most mass to (the gold), then
        others drawn at random (the target renormalised over them).

        Every option: one order per option count in `orders` (a batch's), drawn by its first
        record, so with the schema first a question-grouped batch's marked rows share the whole
        options block -- computed once as their group's prefix, markers and all (`group_rows`),
        each state then a short row after it, as in Mode A. A sampled subset holds each record's
        gold, so its rows share only the question's opening (a 150-option row with the schema
        first is ~1,000 tokens: sampled, a fraction of that per state)."""
        n = len(dist)
        if 0 < self.mode_b_options < n:
            ranked = np.lexsort((rng.random(n), -dist))  # most mass first, ties in random order
            return [int(i) for i in rng.permutation(ranked[: self.mode_b_options])]
        if orders is None:
            return [int(i) for i in rng.permutation(n)]
        if n not in orders:
            orders[n] = [int(i) for i in rng.permutation(n)]
        return orders[n]

    def mode_a_rows(
        self, qp, text: str, dist: np.ndarray, rng: np.random.Generator, ex: Example, planner: Planner | None = None
    ) -> None:
        """A choice or score read with label codes: its readout's rows, or a grouped choice's round 1
        (the gold's group) and round 2."""
        p = planner or self.planner
        if qp.groups is None:
            _rows_of(qp.readouts[0], dist, qp.question["type"] in ORDINAL_QTYPES, ex)
        else:
            # round 1: the gold's group (abstain rows, uniform over all options: a random group)
            gold = int(np.argmax(dist)) if dist.max() > dist.min() else None
            gi = (
                next(i for i, g in enumerate(qp.groups) if gold in g)
                if gold is not None
                else int(rng.integers(len(qp.groups)))
            )
            group = qp.groups[gi]
            _rows_of(qp.readouts[gi], _normalised(dist[group]), False, ex)
            if self.round2:
                winners = [
                    gold if (i == gi and gold is not None) else int(g[rng.integers(len(g))])
                    for i, g in enumerate(qp.groups)
                ]
                _rows_of(p.winners_readout(text, qp, winners), _normalised(dist[winners]), False, ex)

    def rng(self, epoch: int, index: int) -> np.random.Generator:
        """The seeded generator of one record in one epoch (same draws on resume, on any host)."""
        return np.random.default_rng([self.seed, int(epoch), int(index)])

    def batch(self, grain_batch: Mapping[str, Any]) -> tuple[list[Example], int]:
        """(examples, skipped) of a grain batch ({"rows", "index", "epoch", ...})."""
        out, skipped, orders = [], 0, {}
        epoch = grain_batch["epoch"]
        for record, index in zip(grain_batch["rows"], grain_batch["index"]):
            layout = self.layout_of(record, epoch, int(index))
            ex = self.example(record, self.rng(epoch, int(index)), orders, layout)
            if ex is None:
                skipped += 1
            else:
                out.append(ex)
        return out, skipped


@dataclasses.dataclass
class Group:
    """Rows that continue one computed token prefix: (example index, row index, suffix tokens).
    `markers`: Mode B rows whose options (and markers) the prefix holds -- their positions in it,
    read once for every row (each row's answer position points into them)."""

    prefix: list[int]
    rows: list[tuple[int, int, list[int]]]
    markers: list[int] | None = None

    def row(self, examples: Sequence[Example], member: int):
        """Member `member`'s row as the group reads it: its tokens after the prefix (a Mode B row
        whose markers the prefix holds keeps none of its own: they are its `keys_before`)."""
        e, i, tokens = self.rows[member]
        row = examples[e].rows[i]
        if self.markers:
            return Row(list(tokens), row.label_ids, markers=[], keys_before=len(row.markers))
        return row.rebased(tokens)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def group_rows(examples: Sequence[Example]) -> list[Group]:
    """Rows that share a token prefix, grouped so the prefix is computed once per group.

    An example's rows form a group over their common prefix (its state, and the question header
    its option orders share). Sorted, examples whose rows share a prefix are neighbours; one joins
    the previous group where that puts fewer tokens through the model than keeping them apart:
    the joined group computes the common prefix once, but every row then carries what it no longer
    shares (with the schema first and question-grouped batches every example of a question joins,
    the whole question computed once; states that share only the system header stay apart, their
    state computed once for both option orders). Each row keeps >= 1 token of its own.

    Mode B (marked) rows and Mode A rows never share a group: the marked row lists its options
    with markers where the Mode A rows carry codes, so it shares only the question's opening
    with them, and kept together they would make every Mode A row carry the whole
    question; apart, the Mode A rows of a question-grouped batch join over the question. A marked
    group's prefix holds all of its markers (rows that list one option order: the head reads the
    markers once, in the prefix) or none (it stops before the first: each row reads its own)."""
    units = []
    for e, ex in enumerate(examples):
        kinds: dict[bool, list[int]] = {}
        for i, r in enumerate(ex.rows):
            kinds.setdefault(r.markers is not None, []).append(i)
        for marked, idx in kinds.items():
            seqs = [ex.prefix + ex.rows[i].tokens for i in idx]
            marks = sorted({len(ex.prefix) + m for i in idx for m in ex.rows[i].markers}) if marked else []
            shared = _marker_cut(min(len(_common(seqs)), min(len(q) for q in seqs) - 1), marks)
            units.append((marked, seqs[0][:shared], shared, [(q, e, i) for q, i in zip(seqs, idx)], marks))
    units.sort(key=lambda g: (g[0], g[1]))
    groups: list[tuple[list[int], int, list, list[int]]] = []  # (a member's tokens, shared, members, marks)
    kinds_of: list[bool] = []
    for marked, first, shared, members, marks in units:
        # never across kinds: greedily, one question's first Mode A row would join the marked rows
        # over the question's opening, and the rest of its Mode A rows follow it there
        if groups and kinds_of[-1] == marked:
            g_first, g_shared, g_members, g_marks = groups[-1]
            joined = _marker_cut(_marker_cut(min(g_shared, shared, _lcp(g_first, first)), g_marks), marks)
            apart = _tokens(g_shared, g_members) + _tokens(shared, members)
            if joined > 0 and _tokens(joined, g_members + members) <= apart:
                groups[-1] = (g_first, joined, g_members + members, g_marks)
                continue
        groups.append((first, shared, members, marks))
        kinds_of.append(marked)
    return [
        Group(
            first[:shared], [(e, i, q[shared:]) for q, e, i in members], marks if marks and shared > marks[-1] else None
        )
        for first, shared, members, marks in groups
    ]


def _marker_cut(shared: int, marks: Sequence[int]) -> int:
    """A shared length that holds all of `marks` (sorted marker positions) or none of them."""
    return shared if not marks or shared > marks[-1] else min(shared, marks[0])


def _tokens(shared: int, members) -> int:
    """Tokens a group puts through the model: its prefix once, then every row's own tokens."""
    return shared + sum(len(q) - shared for q, _, _ in members)


def _common(seqs: Sequence[Sequence[int]]) -> Sequence[int]:
    out = seqs[0]
    for q in seqs[1:]:
        out = out[: _lcp(out, q)]
    return out


def _fit(n: int, sizes: Sequence[int], floor: int = 1, multiple: int = 1) -> int:
    size = buckets.fit(max(n, floor, 1), sizes, "training batch dimension")
    return -(-size // multiple) * multiple


MARKED_PART = "marked:"  # key prefix of a batch's second part: the groups of Mode B rows


def layout(examples: Sequence[Example], *, shared: bool = True) -> list[list[Group]]:
    """The groups of a step in the parts `pack` lays them out in: one part, or with Mode B rows
    beside Mode A rows two -- the groups holding marked rows apart, so each part is padded to its own
    row count and lengths (a question's Mode A rows are its short states after the shared question;
    its marked rows carry the options: in one part every Mode A row would be padded to a marked
    row's length). `shared=False` gives every row its own group over its example's state prefix (no
    sharing: the reference the shared computation must equal)."""
    if not shared:
        return [[Group(ex.prefix, [(e, i, r.tokens)]) for e, ex in enumerate(examples) for i, r in enumerate(ex.rows)]]
    groups = group_rows(examples)
    marked = [any(examples[e].rows[i].markers is not None for e, i, _ in g.rows) for g in groups]
    parts = [[g for g, m in zip(groups, marked) if not m], [g for g, m in zip(groups, marked) if m]]
    return [p for p in parts if p]


def pack(
    examples: Sequence[Example], *, multiple: int = 1, min_length: int = 16, shared: bool = True
) -> tuple[dict[str, np.ndarray], int]:
    """Padded numpy arrays of one step: E groups of rows sharing a computed prefix (`group_rows`),
    R rows per group, every size bucketed (E also rounded up to `multiple`, the devices the batch is
    split over; lengths at least `min_length`). Keys: prefix_EP, prefix_valid_EP, prefix_markers_EC
    and prefix_keyed_E (a group whose prefix holds its Mode B rows' markers), and per group row,
    tokens_ERT, valid_ERT, answer_ER, label_ids_ERC, markers_ERC and marked_ER (Mode B rows),
    target_ERC, valid_ERC (real codes or markers), level_ERC, ordinal_ER, mode_ER, weight_ER (0 for
    padding rows; padding groups have no valid token). Where `layout` makes two parts, the second
    (the Mode B groups) has the same keys prefixed with MARKED_PART (`parts` splits them again; both
    parts share C). Also returns the real tokens the step puts through the model (each prefix once,
    every suffix)."""
    if not examples:
        raise ValueError("a step needs at least one example")
    groups = layout(examples, shared=shared)
    C = _fit(max(r.width for ex in examples for r in ex.rows), CODES, MIN_CODES)
    out = {}
    for part, prefix in zip(groups, ("", MARKED_PART)):
        out.update({prefix + k: v for k, v in _arrays(examples, part, C, multiple, min_length).items()})
    tokens = sum(len(g.prefix) + sum(len(t) for _, _, t in g.rows) for part in groups for g in part)
    return out, tokens


def parts(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A packed batch's parts (`pack`): the first, and the Mode B part where there is one, each with
    the unprefixed keys."""
    main = {k: v for k, v in batch.items() if not k.startswith(MARKED_PART)}
    marked = {k[len(MARKED_PART) :]: v for k, v in batch.items() if k.startswith(MARKED_PART)}
    return [main, marked] if marked else [main]


def row_positions(examples: Sequence[Example], batch: Mapping[str, Any]) -> dict[tuple[int, int], int]:
    """{(example index, row index): its index in the flat rows of `pack(examples)`'s batch (the parts'
    E*R rows one after another, as `flat_rows` and the step's scores lay them out)}."""
    out, base = {}, 0
    for part, arrays in zip(layout(examples), parts(batch)):
        R = arrays["tokens_ERT"].shape[1]
        for g_i, g in enumerate(part):
            for r_i, (e, i, _) in enumerate(g.rows):
                out[(e, i)] = base + g_i * R + r_i
        base += arrays["answer_ER"].size
    return out


def _arrays(examples: Sequence[Example], groups: Sequence[Group], C: int, multiple: int, min_length: int) -> dict:
    E = _fit(len(groups), ROWS, multiple, multiple)
    R = _fit(max(len(g.rows) for g in groups), ROWS, MIN_ROWS)
    P = _fit(max(len(g.prefix) for g in groups), LENGTHS, min_length)
    T = _fit(max(len(t) for g in groups for _, _, t in g.rows), LENGTHS, min_length)
    prefix_EP, prefix_valid_EP = pack_prefixes([g.prefix for g in groups], E, P)
    out = {
        "prefix_EP": prefix_EP,
        "prefix_valid_EP": prefix_valid_EP,
        "prefix_markers_EC": np.zeros((E, C), np.int32),
        "prefix_keyed_E": np.zeros((E,), bool),
        "tokens_ERT": np.zeros((E, R, T), np.int32),
        "valid_ERT": np.zeros((E, R, T), bool),
        "answer_ER": np.zeros((E, R), np.int32),
        "label_ids_ERC": np.zeros((E, R, C), np.int32),
        "markers_ERC": np.zeros((E, R, C), np.int32),
        "marked_ER": np.zeros((E, R), bool),
        "target_ERC": np.zeros((E, R, C), np.float32),
        "valid_ERC": np.zeros((E, R, C), bool),
        "level_ERC": np.zeros((E, R, C), np.float32),
        "ordinal_ER": np.zeros((E, R), bool),
        "mode_ER": np.zeros((E, R), np.int32),
        "weight_ER": np.zeros((E, R), np.float32),
    }
    for g_i, g in enumerate(groups):
        # each row after the group's prefix: what it does not share (its markers move with it, or
        # stay in the prefix, read there once for the group)
        if g.markers:
            out["prefix_markers_EC"][g_i, : len(g.markers)], out["prefix_keyed_E"][g_i] = g.markers, True
        rb = pack_rows([g.row(examples, m) for m in range(len(g.rows))], R, T, C)
        out["tokens_ERT"][g_i], out["valid_ERT"][g_i] = rb.tokens_BT, rb.valid_BT
        out["answer_ER"][g_i], out["label_ids_ERC"][g_i] = rb.answer_B, rb.label_ids_BC
        out["markers_ERC"][g_i], out["marked_ER"][g_i] = rb.markers_BC, rb.marked_B
        for r_i, (e, i, _) in enumerate(g.rows):
            ex, n = examples[e], examples[e].rows[i].width
            out["target_ERC"][g_i, r_i, :n] = ex.targets[i]
            out["valid_ERC"][g_i, r_i, :n] = True
            out["level_ERC"][g_i, r_i, :n] = ex.levels[i]
            out["ordinal_ER"][g_i, r_i] = ex.ordinal[i]
            out["mode_ER"][g_i, r_i] = ex.modes[i]
            out["weight_ER"][g_i, r_i] = 1.0
    return out


def question_keys(data_dir, split: str = "train", min_count: int = 0) -> list[str]:
    """Per record of a split: its readout and a digest of its question. Batches keyed by these hold
    one question each, so with the schema first all their rows share the question as one prefix.
    `min_count` > 0: a question fewer records ask is keyed by its readout alone (batched with the
    other such questions of that readout): one-question batches need that many records of it."""
    import hashlib
    import json
    from collections import Counter

    from lev_jax.data.build import read_split

    records = read_split(data_dir, split)
    keys = [
        r["readout"]
        + "|"
        + hashlib.blake2b(json.dumps(r["question"], sort_keys=True).encode(), digest_size=8).hexdigest()
        for r in records
    ]
    if min_count > 0:
        counts = Counter(keys)
        keys = [k if counts[k] >= min_count else k.split("|")[0] for k in keys]
    return keys


class _PlanSource:
    """Random access over a BatchPlan's batches, epochs laid end to end (grain MapDataset source)."""

    def __init__(self, plan):
        self.plan = plan

    def __len__(self) -> int:
        import sys

        return sys.maxsize

    def __getitem__(self, i: int):
        return self.plan.batch(int(i))


def keyed_iterator(
    data_dir,
    keys: Sequence[str],
    *,
    keep: Sequence[bool] | None = None,
    batch_size: int,
    seed: int,
    window_batches: int,
    transform,
    shard_index: int = 0,
    shard_count: int = 1,
):
    """A checkpointable grain iterator of length-bucketed batches (lev_jax.data.pipeline.BatchPlan)
    whose records share a key (`question_keys`), read from the train split (the records `keep`
    marks) and transformed."""
    import grain

    from lev_jax.data.build import decode_row
    from lev_jax.data.pipeline import BatchPlan, load_index

    lengths = np.asarray(load_index(data_dir, "train")["length"])
    positions = np.nonzero(np.asarray(keep, bool) if keep is not None else np.ones(len(keys), bool))[0]
    plan = BatchPlan(
        [keys[i] for i in positions],
        lengths[positions].tolist(),
        batch_size,
        seed=seed,
        window_batches=window_batches,
        shard_index=shard_index,
        shard_count=shard_count,
    )
    path = str(Path(data_dir) / "train.array_record")
    source = []

    def read(element):
        if not source:
            source.append(grain.sources.ArrayRecordDataSource(path))
        epoch, step, idx = element
        idx = positions[idx]
        rows = [decode_row(source[0][int(i)]) for i in idx]
        return transform({"rows": rows, "index": idx.copy(), "epoch": epoch, "step": step})

    ds = grain.MapDataset.source(_PlanSource(plan)).map(read)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)).__iter__()


def flat_rows(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The per-row arrays of a packed batch with groups and rows flattened ([E, R, ...] -> [E*R, ...])
    under the loss's names (target_BC, valid_BC, level_BC, ordinal_B, mode_B, weight_B); a batch of
    two parts (`pack`) gives the first part's rows, then the second's."""
    import jax.numpy as jnp

    names = {
        "target_ERC": "target_BC",
        "valid_ERC": "valid_BC",
        "level_ERC": "level_BC",
        "ordinal_ER": "ordinal_B",
        "mode_ER": "mode_B",
        "weight_ER": "weight_B",
    }
    per_part = [
        {new: part[old].reshape((-1,) + tuple(part[old].shape[2:])) for old, new in names.items()}
        for part in parts(batch)
    ]
    if len(per_part) == 1:
        return per_part[0]
    return {k: jnp.concatenate([p[k] for p in per_part]) for k in per_part[0]}
