"""Execution (serving only): rows of planned requests -> label logits, in a few fixed-shape device
programs.

Each request's state prefix is computed once (or taken from a cross-request LRU), in fixed chunks into
a cache of one of a few capacities (`buckets.chunks`); with the schema first, the question before the
state joins the prefix in that LRU (`Row.stateless`), so a stream of states asked one question
computes the question once. Short Mode A rows are packed into slabs (readout.slab: lanes of a fixed
length, several rows to a lane, a question header once per lane with both option orders continuing
it; the lanes of one call may continue several requests' prefixes, stacked and read in place);
every other row -- longer than a chunk, Mode B, or with many label codes -- is read alone, its
leading chunks written into its own copy of the cache by the prefill's programs, then its tail. A
call the anchored softmax cannot serve is rerun with the exact one.

A reader is `reader(entries, usages) -> per entry, one logits array per row` with entries
`[(prefix_ids, rows)]`: `Executor.read` is the fast one, `Executor.read_reference` runs one
independent full forward per row (verification).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np

from lev_jax import buckets, programs
from lev_jax.models import cache as cache_lib
from lev_jax.readout import logits as logits_lib
from lev_jax.readout import modeb
from lev_jax.readout import slab as slab_lib
from lev_jax.readout.plan import MarkedPrefix, Row, prefix_key


@dataclasses.dataclass
class Usage:
    processed: int = 0  # tokens that went through the model (state prefix once, every row)
    cached: int = 0  # state-prefix tokens served from the cross-request cache
    prefix_seen: bool = False
    image_tokens: int = 0  # of `processed`, the state's image tokens
    cached_image_tokens: int = 0  # of those, image tokens whose features (or whole prefix) were cached
    depths: dict = dataclasses.field(default_factory=dict)  # question id -> the depth that answered it

    def as_dict(self) -> dict:
        out = {"input_tokens": self.processed, "cached_input_tokens": self.cached}
        if self.depths:
            out["depths"] = dict(self.depths)
        if self.image_tokens:
            out |= {"image_tokens": self.image_tokens, "cached_image_tokens": self.cached_image_tokens}
        return out


@dataclasses.dataclass(frozen=True)
class Call:
    rows: list[int]  # indices of the rows it reads
    batch: int  # rows bucket
    length: int  # suffix-length bucket
    codes: int  # label-codes (or Mode B markers) bucket
    marked: bool = False  # holds Mode B rows (another program: the head reads their markers)
    keyed: bool = False  # its Mode B rows continue an options block whose markers' keys are given

    @property
    def key(self) -> tuple:
        """The program key's tail: (rows, length, codes), "modeb" appended for a call with Mode B rows
        ("keyed" after it where they score against keys read before them)."""
        return (
            (self.batch, self.length, self.codes)
            + (("modeb",) if self.marked else ())
            + (("keyed",) if self.keyed else ())
        )


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    rows: list[Row]  # the slab rows, in `flat` order
    flat: list[tuple[int, int]]  # slab row -> (group, row in its group)
    single: list[tuple[int, int]]  # the (group, row) pairs read one by one
    packed: list  # readout.slab.Lane
    calls: list  # readout.slab.Call


class Executor:
    """Runs rows of a backbone in bucketed calls; owns the cross-request prefix cache."""

    def __init__(self, backbone, *, prefix_cache_bytes: int = 256 << 20):
        self.backbone = backbone
        self.platform = jax.default_backend()  # sizes device calls (buckets.row_tokens_per_call)
        # computed state prefixes kept across requests (LRU, bounded by bytes): a client asking a
        # second batch of questions about the same state pays only for the questions
        self.prefix_cache_bytes = prefix_cache_bytes
        # (cache, bytes, Mode B keys of a MarkedPrefix's markers or None) by prefix_key
        self.prefixes: collections.OrderedDict[tuple, tuple[object, int, np.ndarray | None]] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.exact_reruns = 0  # device calls the anchored softmax could not serve
        # rows packed several to a lane (readout.slab) only where every layer is attention
        self.packable = all(kind == "full_attention" for kind in backbone.config.layer_types)

    # -- planning device calls ---------------------------------------------------------------------
    def calls(self, rows: list[Row]) -> list[Call]:
        """Group rows (shortest first) into device calls. As few calls as keep rows x suffix bucket
        within the device's per-call budget (`buckets.row_tokens_per_call`), then rows spread evenly
        over them (20 rows run as 2 x 10, not 16 + 4: a small call costs more per token)."""
        cap = buckets.row_tokens_per_call(self.platform)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].tokens))

        def suffix(g):
            sizes = buckets.SUFFIX if len(g) == 1 else buckets.STACKED_SUFFIX
            return buckets.fit(max(len(rows[i].tokens) for i in g), sizes, "question length")

        def batch(g):
            return buckets.fit(len(g), buckets.STACKED_ROWS, "rows")

        def fits(g):
            return len(g) == 1 or (len(g) <= buckets.STACKED_ROWS[-1] and batch(g) * suffix(g) <= cap)

        groups, current = [], []
        for i in order:
            if current and not fits(current + [i]):
                groups.append(current)
                current = []
            current.append(i)
        groups.append(current)
        if len(groups) > 1:
            size = math.ceil(len(order) / len(groups))
            even = [order[j : j + size] for j in range(0, len(order), size)]
            if len(even) == len(groups) and all(map(fits, even)):
                groups = even
        return [
            Call(
                g,
                batch(g),
                suffix(g),
                buckets.fit(max(rows[i].width for i in g), buckets.CODES, "label codes"),
                any(rows[i].markers is not None for i in g),
                any(rows[i].keys_before for i in g),
            )
            for g in groups
        ]

    @staticmethod
    def stateless_groups(prefix_ids: list[int], rows: list[Row]) -> list[tuple[list[int], list[int], list[Row]]]:
        """Rows by their state-independent lead: (prefix_ids + that lead, row indices, the rows
        without it), in first-seen order. A Mode B row's lead holds its options block: its prefix is
        a `MarkedPrefix` (the markers' keys are computed with it) and its rest keyed by them."""
        groups: dict[tuple, tuple[list[int], list[int], list[Row]]] = {}
        for i, r in enumerate(rows):
            lead = list(prefix_ids) + r.tokens[: r.stateless]
            marks = [len(prefix_ids) + m for m in r.markers or () if m < r.stateless]
            if marks:
                lead = MarkedPrefix(lead, marks)
            _, idx, rest = groups.setdefault(prefix_key(lead), (lead, [], []))
            idx.append(i)
            rest.append(r.after(r.stateless))
        return list(groups.values())

    @classmethod
    def stateless_batch(cls, entries) -> list[tuple[list[int], list[tuple[int, int]], list[Row]]]:
        """`stateless_groups` over a micro-batch: rows of every entry with the same prefix + lead (one
        question asked about several requests' states, schema first) form one group, read together
        after one cache. Per group: (prefix_ids + lead, (entry, row) indices, the rows without it)."""
        groups: dict[tuple, tuple[list[int], list[tuple[int, int]], list[Row]]] = {}
        for e, (prefix_ids, rows) in enumerate(entries):
            for key, idx, rest in cls.stateless_groups(prefix_ids, rows):
                _, where, rows_of = groups.setdefault(prefix_key(key), (key, [], []))
                where.extend((e, i) for i in idx)
                rows_of.extend(rest)
        return list(groups.values())

    def groups_of(self, entries) -> tuple[list[tuple[list[int], list[Row]]], list[list[tuple[int, int]]]]:
        """The (prefix_ids, rows) groups `read` computes a micro-batch of entries as, and where each
        group's rows come from ((entry, row) pairs): one per entry, or with the schema first one per
        distinct prefix + state-independent lead (`stateless_batch`)."""
        if any(r.stateless for _, rows in entries for r in rows):
            groups = self.stateless_batch(entries)
            return [(key, rest) for key, _, rest in groups], [where for _, where, _ in groups]
        return [(p, rows) for p, rows in entries], [
            [(e, i) for i in range(len(rows))] for e, (_, rows) in enumerate(entries)
        ]

    def read_plan(self, groups_rows: list[list[Row]], slots: list[int]) -> ReadPlan:
        """How the rows of several groups (each continuing its own prefix cache of `slots` slots, 0 for
        none) are read: the short Mode A rows after a prefix of up to a chunk packed into slabs
        (readout.slab), shared across groups where a call's lanes continue several prefixes; every
        other row (long, Mode B, wide, or after a longer prefix) alone. Slabs read caches of one
        capacity only, so they are a few programs in all, not a few per capacity; a row after a
        longer prefix is read by its capacity's tail program, which long rows need anyway."""
        flat, single = [], []
        for g, rows in enumerate(groups_rows):
            for i, r in enumerate(rows):
                packs = slab_lib.eligible(r) and slots[g] <= slab_lib.CACHE_SLOTS
                (flat if packs else single).append((g, i))
        rows = [groups_rows[g][i] for g, i in flat]
        packed = slab_lib.lanes(rows, [g for g, _ in flat], packable=self.packable, width=buckets.PREFILL_CHUNK)
        calls = slab_lib.calls(
            packed, buckets.slab_shapes(self.platform), slots=slots, call_tokens=buckets.call_tokens(self.platform)
        )
        return ReadPlan(rows, flat, single, packed, calls)

    def programs(self, prefix_ids: list[int], rows: list[Row]) -> set[tuple]:
        """The device programs (keys) reading `rows` after `prefix_ids` needs; a request whose keys
        were all seen before compiles nothing."""
        return self.batch_programs([(prefix_ids, rows)])

    def batch_programs(self, entries) -> set[tuple]:
        """The programs `read(entries)` runs for a micro-batch of (prefix_ids, rows) entries: each
        prefix's prefill (`prefill_programs`), the slab calls of the short rows (keyed by their
        cache's capacity, shape and whether it stacks several prefixes), and each other row's
        chunks and tail (`long_row_calls`). A batch whose keys were all seen before compiles nothing
        (round 2 of a grouped choice aside)."""
        return {key for key, _, _ in self.batch_work(entries)}

    def batch_work(self, entries) -> list[tuple[tuple, int, int]]:
        """The device calls `read(entries)` makes, as (program key, tokens of the request in it,
        tokens it computes): what `batch_programs` names, once per call, and the padding each call
        computes (a prefix counted as computed, as on its first sight; a later request finds it in
        the prefix cache)."""
        groups, _ = self.groups_of(entries)
        work: list[tuple[tuple, int, int]] = []
        for p, _ in groups:
            work += prefill_work(p) if len(p) else []
            work += [(("vision", img.grid_thw), img.n_tokens, img.n_tokens) for img in getattr(p, "images", ())]
        filled = [buckets.prefilled(len(p)) for p, _ in groups]
        plan = self.read_plan([rows for _, rows in groups], [s for _, s in filled])
        for call in plan.calls:
            key = call.key(max(filled[plan.packed[i].prefix][1] for i in call.lanes))
            work.append((key, sum(len(plan.packed[i].tokens) for i in call.lanes), call.shape[0] * call.shape[1]))
        for g, i in plan.single:
            work += self.long_row_work(*filled[g], groups[g][1][i])
        return work

    # -- readers -----------------------------------------------------------------------------------
    def prefix_cache(self, prefix_ids, usage: Usage | None = None):
        """(cache, hit): the prefix's cache, from the LRU when this exact prefix (and its images) was
        seen before. A prefix with images (readout.plan.ImagePrefix) has their features put in at
        their placeholders; `usage` counts its image tokens and those whose features were cached."""
        cache, _, hit = self.prefix_entry(prefix_ids, usage)
        return cache, hit

    def prefix_entry(self, prefix_ids, usage: Usage | None = None):
        """(cache, keys, hit): `prefix_cache`, and for a prefix ending in a Mode B options block
        (readout.plan.MarkedPrefix) the head's keys of its markers ([R, K] fp32, else None), read
        from the prefill's own hidden states and kept with the cache."""
        p = len(prefix_ids)
        if p == 0:
            return None, None, False
        key = prefix_key(prefix_ids)
        images = getattr(prefix_ids, "images", ())
        markers = getattr(prefix_ids, "markers", None)
        n_image = sum(img.n_tokens for img in images)
        with self.lock:
            if key in self.prefixes:
                self.prefixes.move_to_end(key)
                if usage is not None:
                    usage.image_tokens += n_image
                    usage.cached_image_tokens += n_image
                cache, _, keys = self.prefixes[key]
                return cache, keys, True
        pb = buckets.fit(p, buckets.PREFIX[1:], "prefix length")
        tokens, valid = logits_lib.pack_prefixes([prefix_ids], 1, pb)
        keys = None
        if images:
            embeds, mask, positions, cached = self.backbone.vision.prefix_inputs(prefix_ids, images, pb)
            cache = self.backbone.prefill(
                tokens, valid, chunk=buckets.PREFILL_CHUNK, embeds=embeds, embeds_mask=mask, positions=positions
            )
            if usage is not None:
                usage.image_tokens += n_image
                usage.cached_image_tokens += cached
        elif markers:
            cache, hidden = self.backbone.prefill(tokens, valid, chunk=buckets.PREFILL_CHUNK, markers=markers)
            keys = np.asarray(modeb.marker_keys(self.backbone.mode_b_head, jnp.asarray(hidden)))
        else:
            cache = self.backbone.prefill(tokens, valid, chunk=buckets.PREFILL_CHUNK)
        size = sum(x.nbytes for x in jax.tree.leaves(cache)) + (0 if keys is None else keys.nbytes)
        if size <= self.prefix_cache_bytes and programs.computing():  # never a compile-only run's zeros
            with self.lock:
                self.prefixes[key] = (cache, size, keys)
                while sum(n for _, n, _ in self.prefixes.values()) > self.prefix_cache_bytes:
                    self.prefixes.popitem(last=False)
        return cache, keys, False

    def read(self, entries, usages) -> list[list[np.ndarray]]:
        """Label logits for every row of every (prefix_ids, rows) entry: each prefix computed once
        (or taken from the cross-request cache), then all rows of all entries in as few calls as
        fit (`read_groups`: short rows of several entries share slab calls, each lane reading its
        own prefix)."""
        if any(r.stateless for _, rows in entries for r in rows):
            return self.read_stateless(entries, usages)
        groups = []
        for (prefix_ids, rows), usage in zip(entries, usages):
            cache, keys, hit = self.prefix_entry(prefix_ids, None if usage.prefix_seen else usage)
            if not usage.prefix_seen:
                usage.prefix_seen = True
                usage.processed += len(prefix_ids)
                usage.cached += len(prefix_ids) if hit else 0
            usage.processed += sum(len(r.tokens) for r in rows)
            groups.append((cache, keys, rows, len(prefix_ids)))
        return self.read_groups(groups)

    def read_stateless(self, entries, usages) -> list[list[np.ndarray]]:
        """Rows whose state-independent lead joins the prefix (schema first): each distinct prefix +
        lead computed once or taken from the cross-request cache, then the rest of its rows -- of
        every request of the micro-batch that asks it, in the same calls. A request counts the lead
        as cached when an earlier request (or an earlier one in this batch) computed it."""
        out: list = [[None] * len(rows) for _, rows in entries]
        groups, wheres = [], []
        for key, where, rest in self.stateless_batch(entries):
            cache, keys, hit = self.prefix_entry(key)
            seen: set[int] = set()
            for (e, _), r in zip(where, rest):
                if e not in seen:
                    usages[e].processed += len(key)
                    usages[e].cached += len(key) if hit or seen else 0
                    seen.add(e)
                usages[e].processed += len(r.tokens)
            groups.append((cache, keys, rest, len(key)))
            wheres.append(where)
        for where, logits in zip(wheres, self.read_groups(groups)):
            for (e, i), x in zip(where, logits):
                out[e][i] = x
        return out

    def read_groups(self, groups) -> list[list[np.ndarray]]:
        """Label logits of the rows of (cache, Mode B keys or None, rows, prefix tokens) groups, each
        continuing its own prefix cache (None: no prefix): the short Mode A rows of every group in
        slab calls (`read_plan`), every other row alone (`read_long_row`). Every shape is planned on
        the host from the prefixes' lengths (`buckets.prefilled`), nothing read back from the device,
        so a compile-only run (programs.compile_only) takes the same programs as a computed one."""
        out: list = [[None] * len(rows) for _, _, rows, _ in groups]
        filled = [buckets.prefilled(n) for *_, n in groups]
        plan = self.read_plan([rows for _, _, rows, _ in groups], [s for _, s in filled])
        for call in plan.calls:
            logits = self.read_call(plan, call, [c for c, *_ in groups])
            for j, lane in enumerate(call.lanes):
                for k, (r, _) in enumerate(plan.packed[lane].reads):
                    g, i = plan.flat[r]
                    out[g][i] = logits[j, k, : len(plan.rows[r].label_ids)]
        for g, i in plan.single:
            cache, keys, rows, _ = groups[g]
            out[g][i] = self.read_long_row(cache, filled[g][0], rows[i], keys)
        return out

    def read_call(self, plan: ReadPlan, call, caches) -> np.ndarray:
        """[L, R, C] label logits of one slab call: its lanes' rows after their prefixes' caches (one
        shared, or stacked: each prefix's cache grown to the largest capacity, padded to one per lane)."""
        bb = self.backbone
        members = sorted({plan.packed[i].prefix for i in call.lanes})
        stacked = call.stacked
        if not stacked:  # one lane's prefix, or lanes without a prefix cache
            cache, stack_row = caches[members[0]], {g: 0 for g in members}
        else:
            cap = max(int(caches[g]["valid"].shape[1]) for g in members)
            grown = [cache_lib.grow(caches[g], cap) for g in members]
            cache = cache_lib.concat_rows(grown + grown[:1] * (call.shape[0] - len(grown)))
            stack_row = {g: k for k, g in enumerate(members)}
        a = slab_lib.arrays(plan.packed, call, plan.rows, stack_row)
        packed = self.packable
        args = (
            bb.params,
            cache,
            jnp.asarray(a.prefix_L) if stacked else None,
            *map(jnp.asarray, (a.tokens_LT, a.valid_LT, a.positions_LT)),
            jnp.asarray(a.segments_LT) if packed else None,
            jnp.asarray(a.parents_LT) if packed else None,
            jnp.asarray(a.answer_LR),
            jnp.asarray(a.label_ids_LRC),
            bb.config,
        )
        logits = np.asarray(logits_lib.read_slab(*args))
        read = np.zeros(logits.shape[:2], bool)
        for j, lane in enumerate(call.lanes):
            read[j, : len(plan.packed[lane].reads)] = True
        if not np.isfinite(logits[read]).all():
            # the anchored softmax met a cached score far above a row's own ones (layers.attend):
            # the exact stabiliser, for this call only
            self.exact_reruns += 1
            logits = np.asarray(logits_lib.read_slab(*args, anchored=False))
        return logits

    def read_reference(self, entries, usages) -> list[list[np.ndarray]]:
        """One independent full forward per row (verification): no shared prefix, no cache, no
        batching; a text row is padded on the right to a `buckets.REFERENCE` length, which no token
        of it can see (a sequence with images runs at its own length)."""
        out = []
        for (prefix_ids, rows), usage in zip(entries, usages):
            usage.processed += sum(len(prefix_ids) + len(r.tokens) for r in rows)
            images = getattr(prefix_ids, "images", ())
            per = []
            for r in rows:
                ids = list(prefix_ids) + r.tokens
                mm = {}
                if images:  # the whole sequence in one call: image features and positions included
                    embeds, mask, positions, _ = self.backbone.vision.prefix_inputs(ids, images, len(ids))
                    mm = {"embeds": embeds, "embeds_mask": mask, "positions": positions}
                tokens, valid = [ids], None
                if not mm:
                    tokens, valid = logits_lib.pack_prefixes(
                        [ids], 1, buckets.fit(len(ids), buckets.REFERENCE, "a row")
                    )
                if r.markers is not None:  # Mode B: the head over the markers' and the answer's hidden states
                    at = np.asarray([[len(ids) - 1] + [len(prefix_ids) + m for m in r.markers]], np.int32)
                    hidden = self.backbone.hidden_at(tokens, at, attention_mask_BT=valid, **mm)
                    scores = modeb.head_scores(self.backbone.mode_b_head, hidden[:, 0], hidden[:, 1:])
                    per.append(np.asarray(scores)[0])
                    continue
                # the whole vocabulary's logits at the answer position only (not at every padded position),
                # then the label tokens picked from them: independent of the fast path's label-row gather
                at = np.asarray([[len(ids) - 1]], np.int32)
                hidden = self.backbone.hidden_at(tokens, at, attention_mask_BT=valid, **mm)
                logits = np.asarray(self.backbone.head(hidden))[0, 0]
                per.append(logits[r.label_ids])
            out.append(per)
        return out

    @staticmethod
    def long_row_calls(offset: int, slots: int, row: Row) -> list[tuple]:
        """The device calls (program keys) of a long row continuing a cache whose next slot is
        `offset` of `slots`: its leading chunks as `buckets.chunks` runs them, ("chunk", capacity,
        chunk) each, written into the cache grown to a `buckets.CAPACITY` size (the programs a
        prefill's later chunks run, shared by every prefix and row length), ("chunk-marked",
        capacity, chunk, markers bucket) for a chunk holding Mode B markers (the head reads them on
        the way), then ("tail", capacity, tail bucket, codes bucket) reading the row's last tokens
        (`tail_start`: the last `buckets.TAIL[0]` of a row longer than that, padded to a `buckets.TAIL`
        size), a Mode A or a Mode B row alike."""
        return [key for key, _, _ in Executor.long_row_work(offset, slots, row)]

    @staticmethod
    def long_row_work(offset: int, slots: int, row: Row) -> list[tuple[tuple, int, int]]:
        """`long_row_calls` as (key, the row's tokens in the call, tokens the call computes)."""
        n = len(row.tokens)
        lead = tail_start(row)
        calls = []
        for start, size, cap in buckets.chunks(lead, offset, slots) if lead else ():
            inside = markers_in(row, start, min(start + size, lead))
            if not slots:  # no prefix: the row's lead is one (prefill_programs)
                key = ("prefill" if not cap else "chunk", cap, size)
            elif inside:
                key = ("chunk-marked", cap, size, buckets.fit(len(inside), buckets.READ_CODES, "markers"))
            else:
                key = ("chunk", cap, size)
            calls.append((key, min(size, lead - start), size))
            slots = max(cap, size)
        tail = row.after(lead)
        # a Mode B tail reads its own markers (their keys and the query; the earlier ones are joined on
        # the host), a Mode A tail its label codes: one program, one codes bucket for both
        width = max(1, len(tail.label_ids) if tail.markers is None else len(tail.markers))
        tail_len = buckets.fit(n - lead, buckets.TAIL, "question length")
        key = ("tail", slots, tail_len, buckets.fit(width, buckets.READ_CODES, "label codes"))
        return calls + [(key, n - lead, tail_len)]

    def read_long_row(self, cache, offset: int, row: Row, lead_keys=None) -> np.ndarray:
        """Scores of one row read alone (`read_plan`: long, Mode B, wide, or after a prefix of more
        than a chunk), continuing a 1-row `cache` (or none) whose next slot is `offset` (planned on
        the host: `read_groups`): its leading chunks (`tail_start`) extend a private copy of the
        cache exactly as a prefill does (a Mode B row's markers inside them scored on the way), then
        its last tokens are read like any row. The cost
        follows the row's tokens at the prefill rate; one call over all of them would score every
        token against every other at once (a T x T block per head that leaves the CPU's caches far
        behind: several times slower per token at 2k tokens, BENCHMARKS.md). A row with
        `keys_before` scores against `lead_keys` (the cache's markers') first."""
        bb = self.backbone
        start, keys = 0, [] if not row.keys_before else [np.asarray(lead_keys)[: row.keys_before]]
        calls = self.long_row_calls(0, 0, row) if cache is None else None
        if cache is None:  # no prefix: the row's leading chunks are one, computed as a prefix is
            start = tail_start(row)
            inside = markers_in(row, 0, start)
            if not start:
                pass
            elif inside:
                cache, hidden = bb.prefill(row.tokens[:start], markers=inside)
                keys.append(np.asarray(modeb.marker_keys(bb.mode_b_head, jnp.asarray(hidden))))
            else:
                cache = bb.prefill(row.tokens[:start])
            calls = calls[-1:]
        else:
            calls = self.long_row_calls(offset, int(cache["valid"].shape[1]), row)
        lead = tail_start(row)
        for call in calls:
            kind, size, length = call[:3]
            if kind == "tail":
                break
            stop = min(start + length, lead)  # the last chunk stops where the tail starts (padded)
            tokens, valid = logits_lib.pack_prefixes([row.tokens[start:stop]], 1, length)
            if kind == "chunk-marked":
                inside = [m - start for m in markers_in(row, start, stop)]
                pos = np.zeros((1, call[3]), np.int32)
                pos[0, : len(inside)] = inside
                part, cache = logits_lib.extend_cache_marked(
                    bb.params,
                    bb.mode_b_head,
                    cache_lib.grow(cache, size),
                    jnp.asarray(tokens),
                    jnp.asarray(valid),
                    jnp.asarray(pos),
                    bb.config,
                )
                keys.append(np.asarray(part)[0, : len(inside)])
            else:
                cache = bb.extend_chunk(cache, tokens, valid, size)
            start = stop
        tail = row.after(start)
        batch = logits_lib.pack_rows([tail], 1, call[2], call[3])
        logits, tail_keys, query = logits_lib.read_tail(
            bb.params,
            bb.mode_b_head,  # with or without markers in the row: one program
            cache,
            *map(jnp.asarray, (batch.tokens_BT, batch.valid_BT, batch.answer_B, batch.label_ids_BC, batch.markers_BC)),
            bb.config,
        )
        if batch.marked:  # the answer position's query against every marker's key, the chunks' first
            all_keys = np.concatenate(keys + [np.asarray(tail_keys)[0, : len(tail.markers)]])
            return all_keys @ np.asarray(query)[0]
        return np.asarray(logits)[0, : tail.width]


def tail_start(row: Row) -> int:
    """Where a row read alone splits into leading chunks and its tail, a `buckets.TAIL[0]`-token tail
    wherever its text ends (the chunks take the rest, the last one padded), so its tail is one
    program per capacity: a Mode A row of more than a tail, or a Mode B row of more than a chunk
    (shorter ones are all tail: their markers would otherwise need a marked chunk of their own)."""
    n = len(row.tokens)
    whole = buckets.TAIL[0] if row.markers is None else buckets.PREFILL_CHUNK
    return 0 if n <= whole else n - buckets.TAIL[0]


def prefill_program(prefix_ids) -> str:
    """The name of the program family computing a prefix: with images it takes image features and
    3-axis positions too (another program for the same length)."""
    return "prefill-image" if getattr(prefix_ids, "images", ()) else "prefill"


def prefill_programs(prefix_ids) -> set[tuple]:
    """The programs computing a prefix (`Backbone.prefill` in `buckets.chunks` calls): its first chunk
    (kind, 0, size) and each later chunk (kind, capacity, size). A text prefix's later chunks are the
    "chunk" programs long rows run too (a Mode B options block's too: every chunk returns its hidden
    states); one with images has programs of its own."""
    return {key for key, _, _ in prefill_work(prefix_ids)}


def prefill_work(prefix_ids) -> list[tuple[tuple, int, int]]:
    """`prefill_programs` once per call, as (key, the prefix's tokens in it, tokens it computes)."""
    kind = prefill_program(prefix_ids)
    later = "chunk" if kind == "prefill" else kind
    n = max(1, len(prefix_ids))
    return [
        ((kind if cap == 0 else later, cap, size), min(size, n - start), size) for start, size, cap in buckets.chunks(n)
    ]


def markers_in(row: Row, start: int, stop: int) -> list[int]:
    """A Mode B row's marker positions within tokens [start, stop) (none for a Mode A row)."""
    return [m for m in row.markers or () if start <= m < stop]


def is_long(row: Row) -> bool:
    """A row read chunk by chunk (`Executor.read_long_row`) rather than in one call."""
    return len(row.tokens) > buckets.PREFILL_CHUNK
