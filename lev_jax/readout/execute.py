"""Execution (serving only): rows of planned requests -> label logits, in as few bucketed device
calls as fit.

Each request's state prefix is computed once (or taken from a cross-request LRU); with the schema
first, the question before the state joins the prefix in that LRU (`Row.stateless`), so a stream of
states asked one question computes the question once; when it pays, the question headers its rows
share become a per-question cache segment; rows are grouped shortest
first into calls padded to shape buckets; several requests' prefixes are stacked so their rows
share calls (each row, and each header segment, reads its own request's prefix in place); a call
the anchored softmax cannot serve is rerun with the exact one.

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

from lev_jax import buckets
from lev_jax.models import cache as cache_lib
from lev_jax.readout import logits as logits_lib
from lev_jax.readout import modeb
from lev_jax.readout.plan import MarkedPrefix, Row, prefix_key

# Question headers shared by a readout's rows become a cache segment when that saves at least this
# many row tokens (and a tenth of them): below it the extra device call costs more than it saves.
MIN_SEGMENT_SAVING = 64
# the row counts a segment cache is padded to (its rows are read by index: padding costs memory only),
# so the programs reading it come in a few shapes
SEGMENT_ROWS = buckets.geometric(1, 1 << 20, 2)


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
class SegmentPlan:
    headers: list[list[int]]  # distinct question headers (per prefix: the same text after two prefixes is two)
    header_of_row: list[int]
    rest: list[Row]  # the rows without their headers
    prefix_of_header: list[int]  # the stacked prefix each header continues (all 0 for one prefix)


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
        self.exact_reruns = 0  # device calls (rows or headers) the anchored softmax could not serve

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
    def segment_plan(rows: list[Row], prefix_of_row: list[int] | None = None) -> SegmentPlan | None:
        """The question headers as cache segments both option orders continue, when computing each
        distinct header once saves enough row tokens to pay for its extra device call; else None.
        With `prefix_of_row` (rows of several stacked prefixes) a header is distinct per prefix."""
        headers, index, header_of_row, rest, prefix_of_header = [], {}, [], [], []
        for i, r in enumerate(rows):
            prefix = 0 if prefix_of_row is None else prefix_of_row[i]
            key = (prefix, tuple(r.tokens[: r.header]))
            if key not in index:
                index[key] = len(headers)
                headers.append(list(key[1]))
                prefix_of_header.append(prefix)
            header_of_row.append(index[key])
            rest.append(r.after(r.header))
        total = sum(len(r.tokens) for r in rows)
        saved = total - sum(map(len, headers)) - sum(len(r.tokens) for r in rest)
        if saved < max(MIN_SEGMENT_SAVING, total // 10):
            return None
        return SegmentPlan(headers, header_of_row, rest, prefix_of_header)

    def segment_calls(self, headers: list[list[int]]) -> tuple[int, list[tuple[list[int], int]]]:
        """(segment length bucket, calls of (header indices, rows bucket)): every header padded to one
        length, so all segments stack into one cache; calls sized like row calls."""
        sg = buckets.fit(max(1, max(map(len, headers))), buckets.SUFFIX, "question header length")
        cap = buckets.row_tokens_per_call(self.platform)
        n_calls = 1
        while True:
            size = math.ceil(len(headers) / n_calls)
            if size == 1 or buckets.fit(size, buckets.ROWS, "rows") * sg <= cap:
                break
            n_calls += 1
        calls = [list(range(j, min(j + size, len(headers)))) for j in range(0, len(headers), size)]
        return sg, [(c, buckets.fit(len(c), buckets.ROWS, "rows")) for c in calls]

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

    def programs(self, prefix_ids: list[int], rows: list[Row]) -> set[tuple]:
        """The device programs (shape-bucket keys) reading `rows` after `prefix_ids` needs; a request
        whose keys were all seen before compiles nothing."""
        if any(r.stateless for r in rows):
            return set().union(*(self.programs(key, rest) for key, _, rest in self.stateless_groups(prefix_ids, rows)))
        p = len(prefix_ids)
        pb = buckets.fit(p, buckets.PREFIX[1:], "prefix length") if p else 0
        keys = {(prefill_program(prefix_ids), pb)} if pb else set()
        keys |= {("vision", img.grid_thw) for img in getattr(prefix_ids, "images", ())}
        if any(map(is_long, rows)):
            for r in filter(is_long, rows):
                keys |= set(self.long_row_calls(pb, pb, r))
            rows = [r for r in rows if not is_long(r)]
            if not rows:
                return keys
        return keys | self.read_programs(("rows", pb), rows, segments=bool(pb))

    def read_programs(self, base: tuple, rows: list[Row], prefix_of_row=None, *, segments=True) -> set[tuple]:
        """The programs `read_rows` runs for short `rows` after a cache keyed `base`: ("rows", pb) for
        one prefix of pb slots, ("stacked", n, slots) for n stacked prefixes (`prefix_of_row`: each
        row's). With header segments (never without a prefix), the segment calls ("segment" or
        "stacked-segment", ..., rows bucket, header bucket) and the row calls, keyed also by the
        header bucket and the segment cache's row count (SEGMENT_ROWS)."""
        seg = self.segment_plan(rows, prefix_of_row) if segments else None
        if seg is None:
            return {(*base, *c.key) for c in self.calls(rows)}
        sg, calls = self.segment_calls(seg.headers)
        n_seg = buckets.fit(sum(b for _, b in calls), SEGMENT_ROWS, "question headers")
        name = "segment" if base[0] == "rows" else "stacked-segment"
        return {(name, *base[1:], b, sg) for _, b in calls} | {(*base, sg, n_seg, *c.key) for c in self.calls(seg.rest)}

    def batch_programs(self, entries) -> set[tuple]:
        """The programs `read(entries)` runs for a micro-batch of (prefix_ids, rows) entries: each
        entry's own where they are read one by one, else the stacked calls (keyed by the number of
        stacked prefixes and their common slot count; header segments as in `read_programs`) plus
        each prefix's prefill. A batch whose keys were all seen before compiles nothing (round 2 of
        a grouped choice aside)."""
        if any(r.stateless for _, rows in entries for r in rows):
            return set().union(*(self.programs(key, rest) for key, _, rest in self.stateless_batch(entries)))
        if len(entries) == 1 or any(not p for p, _ in entries):
            return set().union(*(self.programs(p, rows) for p, rows in entries))
        keys = set()
        per_call = buckets.ROWS[-1]
        for start in range(0, len(entries), per_call):
            part = entries[start : start + per_call]
            pbs = [buckets.fit(len(p), buckets.PREFIX[1:], "prefix length") for p, _ in part]
            keys |= {(prefill_program(p), pb) for (p, _), pb in zip(part, pbs)}
            keys |= {("vision", img.grid_thw) for p, _ in part for img in getattr(p, "images", ())}
            n, slots = buckets.fit(len(part), buckets.ROWS, "requests"), max(pbs)
            flat = [(k, r) for k, (_, rows) in enumerate(part) for r in rows]
            for _, r in flat:
                if is_long(r):
                    keys |= set(self.long_row_calls(slots, slots, r))
            short = [(k, r) for k, r in flat if not is_long(r)]
            if short:
                keys |= self.read_programs(("stacked", n, slots), [r for _, r in short], [k for k, _ in short])
        return keys

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
        if size <= self.prefix_cache_bytes:
            with self.lock:
                self.prefixes[key] = (cache, size, keys)
                while sum(n for _, n, _ in self.prefixes.values()) > self.prefix_cache_bytes:
                    self.prefixes.popitem(last=False)
        return cache, keys, False

    def read(self, entries, usages) -> list[list[np.ndarray]]:
        """Label logits for every row of every (prefix_ids, rows) entry: each prefix computed once
        (or taken from the cross-request cache), then all rows of all entries in as few batched
        calls as fit; several entries' prefixes are stacked and each row reads its own."""
        if any(r.stateless for _, rows in entries for r in rows):
            return self.read_stateless(entries, usages)
        caches = []
        for (prefix_ids, rows), usage in zip(entries, usages):
            cache, hit = self.prefix_cache(prefix_ids, None if usage.prefix_seen else usage)
            if not usage.prefix_seen:
                usage.prefix_seen = True
                usage.processed += len(prefix_ids)
                usage.cached += len(prefix_ids) if hit else 0
            usage.processed += sum(len(r.tokens) for r in rows)
            caches.append(cache)
        if len(entries) == 1 or any(c is None for c in caches):
            return [self.read_rows(c, rows, None) for c, (_, rows) in zip(caches, entries)]
        out = []
        per_call = buckets.ROWS[-1]
        for start in range(0, len(entries), per_call):
            part = entries[start : start + per_call]
            stacked = stack_caches(caches[start : start + per_call], buckets.fit(len(part), buckets.ROWS, "requests"))
            flat = [(k, r) for k, (_, rows) in enumerate(part) for r in rows]
            it = iter(self.read_rows(stacked, [r for _, r in flat], [k for k, _ in flat]))
            out.extend([next(it) for _ in rows] for _, rows in part)
        return out

    def read_stateless(self, entries, usages) -> list[list[np.ndarray]]:
        """Rows whose state-independent lead joins the prefix (schema first): each distinct prefix +
        lead computed once or taken from the cross-request cache, then the rest of its rows -- of
        every request of the micro-batch that asks it, in the same calls. A request counts the lead
        as cached when an earlier request (or an earlier one in this batch) computed it."""
        out: list = [[None] * len(rows) for _, rows in entries]
        for key, where, rest in self.stateless_batch(entries):
            cache, keys, hit = self.prefix_entry(key)
            seen: set[int] = set()
            for (e, _), r in zip(where, rest):
                if e not in seen:
                    usages[e].processed += len(key)
                    usages[e].cached += len(key) if hit or seen else 0
                    seen.add(e)
                usages[e].processed += len(r.tokens)
            for (e, i), logits in zip(where, self.read_rows(cache, rest, None, keys=keys)):
                out[e][i] = logits
        return out

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

    def read_rows(self, cache, rows: list[Row], prefix_of_row, *, keys=None) -> list[np.ndarray]:
        """Label logits of `rows` continuing `cache` (one shared prefix, or a stacked cache with
        `prefix_of_row`), through question-header segments where they pay (over a stacked cache,
        each header continues its own prefix); rows longer than a prefill chunk one by one, chunk by
        chunk (`read_long_row`). `keys`: the Mode B keys of markers in `cache` (one shared prefix
        ending in an options block), which rows with `keys_before` score against."""
        if any(r.keys_before for r in rows) and (keys is None or prefix_of_row is not None):
            raise ValueError("Mode B rows after an options block read the keys of its one shared prefix")
        long = [i for i, r in enumerate(rows) if is_long(r)]
        if long:
            out: list = [None] * len(rows)
            short = [i for i, r in enumerate(rows) if not is_long(r)]
            if short:
                which = None if prefix_of_row is None else [prefix_of_row[i] for i in short]
                for i, logits in zip(short, self.read_rows(cache, [rows[i] for i in short], which, keys=keys)):
                    out[i] = logits
            for i in long:
                own = cache if prefix_of_row is None else cache_lib.take_row(cache, prefix_of_row[i])
                out[i] = self.read_long_row(own, rows[i], keys)
            return out
        seg = self.segment_plan(rows, prefix_of_row) if cache is not None else None
        if seg is None:
            return self.read_calls(cache, rows, prefix_of_row=prefix_of_row, keys=keys)
        prefix_of_header = None if prefix_of_row is None else seg.prefix_of_header
        seg_cache, where = self.compute_segments(cache, seg.headers, prefix_of_header)
        return self.read_calls(seg_cache, seg.rest, segment_of_row=[where[h] for h in seg.header_of_row])

    @staticmethod
    def long_row_calls(offset: int, slots: int, row: Row) -> list[tuple]:
        """The device calls (program keys) of a long row continuing a cache whose next slot is
        `offset` of `slots`: ("chunk", slots, PREFILL_CHUNK) per leading chunk, each written into
        the cache grown to hold it (to a multiple of `buckets.LONG_ROW_SLOTS`, so these programs are
        shared by every prefix of the same multiple, and a chunk scores few empty slots),
        ("chunk-marked", slots, chunk, markers bucket) for a chunk holding Mode B markers (the head
        reads them on the way), then ("tail", slots, tail bucket, codes bucket [, "modeb"]) reading
        the row's last tokens (padded to a `buckets.TAIL` size) like any row."""
        chunk = buckets.PREFILL_CHUNK
        n = len(row.tokens)
        calls, start = [], 0
        while n - start > chunk:
            slots = max(slots, -(-(offset + chunk) // buckets.LONG_ROW_SLOTS) * buckets.LONG_ROW_SLOTS)
            inside = markers_in(row, start, start + chunk)
            if inside:
                calls.append(("chunk-marked", slots, chunk, buckets.fit(len(inside), buckets.CODES, "markers")))
            else:
                calls.append(("chunk", slots, chunk))
            offset, start = offset + chunk, start + chunk
        tail = row.after(start)
        key = ("tail", slots, buckets.fit(n - start, buckets.TAIL, "question length"))
        # a Mode B tail reads its own markers (their keys and the query); the earlier ones are joined on the host
        width = tail.width if tail.markers is None else max(1, len(tail.markers))
        key += (buckets.fit(width, buckets.CODES, "label codes"),)
        return calls + [key + (("modeb",) if tail.markers is not None else ())]

    def read_long_row(self, cache, row: Row, lead_keys=None) -> np.ndarray:
        """Scores of one row longer than a prefill chunk, continuing a 1-row `cache` (or none): its
        leading chunks extend a private copy of the cache exactly as a prefill does (a Mode B row's
        markers inside them scored on the way), then its last tokens are read like any row. The cost
        follows the row's tokens at the prefill rate; one call over all of them would score every
        token against every other at once (a T x T block per head that leaves the CPU's caches far
        behind: several times slower per token at 2k tokens, BENCHMARKS.md). A row with
        `keys_before` scores against `lead_keys` (the cache's markers') first."""
        bb = self.backbone
        offset, slots = (0, 0) if cache is None else (int(cache["offset"]), int(cache["valid"].shape[1]))
        start, keys = 0, [] if not row.keys_before else [np.asarray(lead_keys)[: row.keys_before]]
        for call in self.long_row_calls(offset, slots, row):
            kind, size, length = call[:3]
            if kind == "tail":
                break
            tokens, valid = map(jnp.asarray, logits_lib.pack_prefixes([row.tokens[start : start + length]], 1, length))
            if cache is not None:
                cache = cache_lib.grow(cache, size)
            if kind == "chunk-marked":
                inside = [m - start for m in markers_in(row, start, start + length)]
                pos = np.zeros((1, call[3]), np.int32)
                pos[0, : len(inside)] = inside
                part, cache = logits_lib.extend_cache_marked(
                    bb.params, bb.mode_b_head, cache, tokens, valid, jnp.asarray(pos), bb.config
                )
                keys.append(np.asarray(part)[0, : len(inside)])
            else:
                cache = logits_lib.extend_cache(bb.params, cache, tokens, valid, bb.config)
            start += length
        tail = row.after(start)
        batch = logits_lib.pack_rows([tail], 1, length, call[3])
        if batch.marked:  # the answer position's query against every marker's key, the chunks' first
            tail_keys, query = logits_lib.read_marked_tail(
                bb.params,
                bb.mode_b_head,
                cache,
                *map(jnp.asarray, (batch.tokens_BT, batch.valid_BT, batch.answer_B, batch.markers_BC)),
                bb.config,
            )
            all_keys = np.concatenate(keys + [np.asarray(tail_keys)[0, : len(tail.markers)]])
            return all_keys @ np.asarray(query)[0]
        logits = logits_lib.read_rows(
            bb.params,
            None,
            cache,
            None,
            *map(jnp.asarray, (batch.tokens_BT, batch.valid_BT, batch.answer_B, batch.label_ids_BC)),
            None,
            None,
            bb.config,
            anchored=False,  # one row, one call, no rerun to fall back on: the exact softmax
        )
        return np.asarray(logits)[0, : tail.width]

    def compute_segments(self, cache, headers: list[list[int]], prefix_of_header: list[int] | None = None):
        """(segment cache of every header after the shared prefix, or after its own prefix of a
        stacked cache (`prefix_of_header`), header index -> its cache row)."""
        bb = self.backbone
        sg, calls = self.segment_calls(headers)
        parts, where, first_row = [], {}, 0
        for idx, bsz in calls:
            tokens, valid = logits_lib.pack_prefixes([headers[h] for h in idx], bsz, sg)
            for j, h in enumerate(idx):
                where[h] = first_row + j
            first_row += bsz
            which = None
            if prefix_of_header is not None:
                which = np.zeros((bsz,), np.int32)
                which[: len(idx)] = [prefix_of_header[h] for h in idx]
                which = jnp.asarray(which)
            args = (bb.params, cache, jnp.asarray(tokens), jnp.asarray(valid), bb.config)
            part, finite = logits_lib.compute_segments(*args, prefix_B=which)
            if not np.asarray(finite)[: len(idx)].all():  # the anchored softmax could not serve a header
                self.exact_reruns += 1
                part, _ = logits_lib.compute_segments(*args, anchored=False, prefix_B=which)
            parts.append(part)
        return cache_lib.concat_segments(parts, buckets.fit(first_row, SEGMENT_ROWS, "question headers")), where

    def read_calls(
        self, cache, rows: list[Row], *, prefix_of_row=None, segment_of_row=None, keys=None
    ) -> list[np.ndarray]:
        """Label logits of `rows` in bucketed batched calls. Each row continues `cache` (a shared
        prefix), its request's prefix in a stacked cache (`prefix_of_row`), or its header's segment
        (`segment_of_row`, which knows its prefix). Every call first with the anchored softmax. A
        row with `keys_before` (all its markers in the shared prefix) scores against `keys`."""
        out: list[np.ndarray | None] = [None] * len(rows)
        bb = self.backbone
        per_row = prefix_of_row if segment_of_row is None else segment_of_row
        fn = logits_lib.read_rows if segment_of_row is None else logits_lib.read_segment_rows
        for call in self.calls(rows):
            batch = logits_lib.pack_rows([rows[i] for i in call.rows], call.batch, call.length, call.codes)
            which = None
            if per_row is not None:
                which = np.zeros((call.batch,), np.int32)
                which[: len(call.rows)] = [per_row[i] for i in call.rows]
            keyed = {}
            if call.keyed:
                keyed = keyed_inputs([rows[i] for i in call.rows], keys, call.batch, call.codes)
            args = (
                bb.params,
                bb.mode_b_head if batch.marked else None,
                cache,
                None if which is None else jnp.asarray(which),
                jnp.asarray(batch.tokens_BT),
                jnp.asarray(batch.valid_BT),
                jnp.asarray(batch.answer_B),
                jnp.asarray(batch.label_ids_BC),
                # a call without Mode B rows neither sends nor reads markers (the Mode A program)
                jnp.asarray(batch.markers_BC) if batch.marked else None,
                jnp.asarray(batch.marked_B) if batch.marked else None,
                bb.config,
            )
            logits = np.asarray(fn(*args, **keyed))
            if not np.isfinite(logits[: len(call.rows)]).all():
                # the anchored softmax met a cached score far above a row's own ones (layers.attend):
                # the exact stabiliser, for this call only
                self.exact_reruns += 1
                logits = np.asarray(fn(*args, anchored=False, **keyed))
            for j, i in enumerate(call.rows):
                out[i] = logits[j, : rows[i].width]
        return out


def prefill_program(prefix_ids) -> str:
    """The name of the program family computing a prefix: with images it takes image features and
    3-axis positions too (another program for the same length)."""
    return "prefill-image" if getattr(prefix_ids, "images", ()) else "prefill"


def markers_in(row: Row, start: int, stop: int) -> list[int]:
    """A Mode B row's marker positions within tokens [start, stop) (none for a Mode A row)."""
    return [m for m in row.markers or () if start <= m < stop]


def keyed_inputs(rows: list[Row], keys, n_rows: int, n_codes: int) -> dict:
    """A keyed call's `keys_BCK` / `keyed_B`: each row with `keys_before` gets the first of `keys`
    (its options block's markers, read with the prefix); it must hold no markers of its own."""
    keys = np.asarray(keys, np.float32)
    keys_BCK = np.zeros((n_rows, n_codes, keys.shape[-1]), np.float32)
    keyed_B = np.zeros((n_rows,), bool)
    for j, r in enumerate(rows):
        if r.keys_before:
            if r.markers:
                raise ValueError("a Mode B row reads its markers all in its row or all in the prefix it continues")
            keys_BCK[j, : r.keys_before], keyed_B[j] = keys[: r.keys_before], True
    return {"keys_BCK": jnp.asarray(keys_BCK), "keyed_B": jnp.asarray(keyed_B)}


def is_long(row: Row) -> bool:
    """A row read chunk by chunk (`Executor.read_long_row`) rather than in one call."""
    return len(row.tokens) > buckets.PREFILL_CHUNK


def stack_caches(caches: list[dict], n: int) -> dict:
    """Several 1-row prefix caches as one n-row cache (rows past len(caches) repeat the first),
    every one grown to the same number of slots."""
    slots = max(c["valid"].shape[1] for c in caches)
    grown = [cache_lib.grow(c, slots) for c in caches]
    grown += [grown[0]] * (n - len(grown))
    return cache_lib.concat_rows(grown)
