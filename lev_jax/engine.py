"""predict(): calibrated probabilities over supplied candidates, read from next-token logits (Mode A).

    engine = lev_jax.load()                      # the embedded SmolLM2-135M-Instruct
    engine.predict({"ticket": "..."}, {"intent": {"type": "choice", "instructions": "...",
                                                 "criteria": {"refund": None, "delivery": "late parcel"}}})

The state prefix (chat header + state) is prefilled once; every question row (and every option-order
averaging row) continues from that cache in batched calls, padded to shape buckets. When it pays,
each question's header (its text before the options, identical in both option orders) is computed
once as a per-question cache segment, and the rows continue from their question's segment. Only the
answer position goes through the vocabulary head, and only the label-token rows of it.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lev_jax import buckets, labels, models, prompt
from lev_jax.backbone import Backbone, load_backbone
from lev_jax.calibrate import Calibration
from lev_jax.errors import RequestError, TokenLimitError
from lev_jax.models import cache as cache_lib

MAX_STATE_PLUS_QUESTION_TOKENS = 32768
MAX_REQUEST_TOKENS = 65536
# Question headers shared by a readout's rows become a cache segment when that saves at least this
# many row tokens (and a tenth of them): below it the extra device call costs more than it saves.
MIN_SEGMENT_SAVING = 64
CHOICE_OPTIONS = (2, 255)
SCORE_LEVELS = (2, 10)
QUESTION_TYPES = ("choice", "score", "noul")
NOUL_READOUTS = (labels.BINARY, labels.RATING)


@functools.partial(jax.jit, static_argnames=("cfg", "anchored"))
def _read_rows(params, cache, prefix_B, tokens_BT, valid_BT, answer_B, label_ids_BC, cfg, anchored=True):
    """Label logits of B rows continuing a prefix cache. `prefix_B` (None: one shared prefix) picks,
    per row, its request's prefix out of a cache that stacks several requests' prefixes.
    `anchored`: the anchored attention softmax (layers.attend); a row it cannot serve is NaN."""
    if prefix_B is not None:
        cache = jax.tree.map(lambda x: x if x.ndim == 0 else jnp.take(x, prefix_B, axis=0), cache)
    hidden_BRE, _ = models.forward(params, tokens_BT, cache, cfg, valid_BT=valid_BT, readout_BR=answer_B[:, None],
                                   update_cache=False, anchored_softmax=anchored)
    return models.label_logits(params, hidden_BRE[:, 0], label_ids_BC, cfg)


@functools.partial(jax.jit, static_argnames=("cfg", "anchored"))
def _read_segment_rows(params, cache, segment_B, tokens_BT, valid_BT, answer_B, label_ids_BC, cfg, anchored=True):
    """`_read_rows` for rows that continue a segment cache: row b reads segment `segment_B[b]`."""
    return _read_rows.__wrapped__(params, cache_lib.select_rows(cache, segment_B), None, tokens_BT, valid_BT,
                                  answer_B, label_ids_BC, cfg, anchored)


@functools.partial(jax.jit, static_argnames=("cfg", "anchored"))
def _segments(params, cache, tokens_BT, valid_BT, cfg, anchored=True):
    """(segment cache, finite): B question headers continuing a shared prefix, kept per row; `finite`
    is False where the anchored softmax could not serve them (then: rerun exact)."""
    readout = jnp.zeros((tokens_BT.shape[0], 1), jnp.int32)  # the hidden state is not needed; keep it small
    _, seg = models.forward(params, tokens_BT, cache, cfg, valid_BT=valid_BT, readout_BR=readout,
                            update_cache="segment", anchored_softmax=anchored)
    rows = [x for layer in seg["layers"] for k, x in layer.items() if k in cache_lib.SEGMENT_ROW_KEYS]
    return seg, jnp.all(jnp.stack([jnp.isfinite(x).all() for x in rows]))


@dataclasses.dataclass
class _Usage:
    processed: int = 0  # tokens that went through the model (state prefix once, every row)
    cached: int = 0  # state-prefix tokens served from the cross-request cache
    prefix_seen: bool = False

    def as_dict(self) -> dict:
        return {"input_tokens": self.processed, "cached_input_tokens": self.cached}


@dataclasses.dataclass
class _Row:
    tokens: list[int]  # the row's suffix; the answer is read after its last token
    label_ids: list[int]  # head rows to read, one per code
    header: int = 0  # leading tokens the row shares with the other rows of its readout (option orders)


def _share_header(rows: list[_Row]) -> list[_Row]:
    """Mark the token prefix a readout's rows have in common (a question's text before its options):
    it can be computed once for all of them (a cache segment) instead of once per row."""
    if len(rows) > 1:
        n = len(os.path.commonprefix([r.tokens for r in rows]))
        n = min(n, min(len(r.tokens) for r in rows) - 1)  # every row keeps its answer position
        for r in rows:
            r.header = n
    return rows


@dataclasses.dataclass
class _Readout:
    """One distribution over `n` candidates, read from one row per presentation order."""

    qtype: str
    mode: str
    n: int
    rows: list[_Row]
    maps: list[list[int]]  # per row: code position -> candidate index

    def probs(self, logits_per_row, calibration: Calibration) -> np.ndarray:
        t = calibration.temperature(self.qtype, self.mode, self.n if self.qtype == "choice" else None)
        out = np.zeros(self.n)
        for logits, m in zip(logits_per_row, self.maps):
            z = np.asarray(logits[: len(m)], np.float64) / t
            p = np.exp(z - z.max())
            p /= p.sum()
            out[m] += p
        return out / len(self.maps)


def _validate(questions) -> list[tuple[str, dict]]:
    if not isinstance(questions, dict) or not questions:
        raise RequestError("questions must be a non-empty object mapping question ids to questions")
    out = []
    for qid, q in questions.items():
        if not isinstance(qid, str) or not qid:
            raise RequestError("question ids must be non-empty strings")
        if not isinstance(q, dict):
            raise RequestError(f"question {qid!r} must be an object")
        qtype = q.get("type")
        if qtype == "box":
            raise RequestError(f"question {qid!r}: this model cannot locate boxes (type 'box' needs a vision model)")
        if qtype not in QUESTION_TYPES:
            raise RequestError(f"question {qid!r}: unknown type {qtype!r}; expected one of {QUESTION_TYPES}")
        instructions = q.get("instructions", "")
        if not isinstance(instructions, str):
            raise RequestError(f"question {qid!r}: instructions must be a string")
        criteria = q.get("criteria")
        if qtype == "choice":
            lo, hi = CHOICE_OPTIONS
            if not isinstance(criteria, dict) or not lo <= len(criteria) <= hi:
                raise RequestError(f"question {qid!r}: choice criteria must map {lo}-{hi} option names to descriptions")
            if any(not isinstance(k, str) or not k for k in criteria):
                raise RequestError(f"question {qid!r}: option names must be non-empty strings")
        elif qtype == "score":
            lo, hi = SCORE_LEVELS
            if not isinstance(criteria, list) or not lo <= len(criteria) <= hi:
                raise RequestError(f"question {qid!r}: score criteria must be a list of {lo}-{hi} levels")
            if any(not isinstance(level, str) for level in criteria):
                raise RequestError(f"question {qid!r}: score levels must be strings")
        else:
            if criteria is not None and (not isinstance(criteria, dict) or set(criteria) - {"yes", "no"}):
                raise RequestError(f"question {qid!r}: noul criteria must be null or an object with 'yes' and/or 'no'")
        out.append((qid, {"type": qtype, "instructions": instructions, "criteria": criteria}))
    return out


def choice_confidence(p: np.ndarray) -> float:
    k = len(p)
    return 1.0 if k <= 1 else float((k * p.max() - 1) / (k - 1))


def score_confidence(p: np.ndarray) -> float:
    k = len(p)
    if k <= 1:
        return 1.0
    idx = np.arange(k)
    mode = int(np.argmax(p))
    uniform_spread = np.abs(idx - (k - 1) / 2).mean()
    return float(max(0.0, 1.0 - float((p * np.abs(idx - mode)).sum()) / uniform_spread))


class Plan:
    """A request turned into token rows: the shared prefix and each question's readouts. Planning
    tokenizes everything and checks the limits; a server plans once (to count tokens and reject
    over-budget requests before queueing) and hands the plan to `predict_many`."""

    def __init__(self, state_text, prefix_ids, questions):
        self.state_text = state_text
        self.prefix_ids = prefix_ids
        self.questions = questions  # [(qid, q, [readouts of round 1], grouping or None)]

    def token_counts(self) -> dict:
        lens = [len(r.tokens) for _, _, rs, _ in self.questions for ro in rs for r in ro.rows]
        return {"input_tokens": len(self.prefix_ids) + sum(lens), "state_tokens": len(self.prefix_ids),
                "max_question_tokens": max(lens)}


class Engine:
    def __init__(self, backbone: Backbone, *, prompt_style: str = "chat", calibration: Calibration | None = None,
                 option_averaging: bool = True, noul_readout: str = labels.BINARY, layout: str = "state_first",
                 model_name: str | None = None, checkpoint: str | None = None,
                 prefix_cache_bytes: int = 256 << 20):
        if backbone.tokenizer is None:
            raise ValueError("predict() needs a tokenizer; this checkpoint ships none")
        if noul_readout not in NOUL_READOUTS:
            raise ValueError(f"noul_readout must be one of {NOUL_READOUTS}")
        if layout not in prompt.LAYOUTS:
            raise ValueError(f"layout must be one of {prompt.LAYOUTS}")
        self.backbone = backbone
        self.tokenizer = backbone.tokenizer
        self.platform = jax.default_backend()  # sizes device calls (buckets.row_tokens_per_call)
        self.format = prompt.PromptFormat(self.tokenizer, prompt_style)
        self.prompt_style = prompt_style
        self.layout = layout
        self.calibration = calibration or Calibration.identity(model_name or backbone.name)
        self.option_averaging = option_averaging
        self.noul_readout = noul_readout
        self.model_name = model_name or backbone.name
        self.checkpoint = checkpoint
        self.supports_images = False
        self.codes = labels.LabelCodes(self.tokenizer, self.format.answer_context, self.format.sep)
        self.group_size = min(self.codes.capacity(), buckets.CODES[-1])
        if self.group_size < 2:
            raise ValueError("the tokenizer offers fewer than two single-token label codes")
        self.yes_no_lead, self.yes_no = self.codes.fixed(labels.YES_NO)
        self.rating_lead, self.rating = self.codes.fixed(labels.RATING_CODES)
        # computed state prefixes kept across requests (LRU, bounded by bytes): a client asking a
        # second batch of questions about the same state pays only for the questions
        self.prefix_cache_bytes = prefix_cache_bytes
        self._prefixes: collections.OrderedDict[tuple, tuple[object, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.exact_reruns = 0  # device calls (rows or headers) the anchored softmax could not serve

    # -- planning ------------------------------------------------------------------------------
    def _row(self, state_text: str, question_text: str, label_ids, lead: str = "") -> _Row:
        p = self.format.build(state_text, question_text, self.layout)
        return _Row(self.tokenizer.encode(p.suffix + lead), list(label_ids))

    def _prefix_ids(self, state_text: str) -> list[int]:
        return self.format.encode_prefix(self.format.build(state_text, "", self.layout).prefix)

    def _choice_readout(self, state_text, q, idx: list[int]) -> _Readout:
        options = list(q["criteria"].items())
        codes = self.codes.letters(len(idx))
        orders = [idx] + ([idx[::-1]] if self.option_averaging and len(idx) > 1 else [])
        pos = {opt: j for j, opt in enumerate(idx)}
        rows, maps = [], []
        for order in orders:
            text = prompt.choice_text(q["instructions"], [options[i] for i in order], [c for c, _ in codes])
            rows.append(self._row(state_text, text, [t for _, t in codes]))
            maps.append([pos[i] for i in order])
        return _Readout("choice", labels.LETTER, len(idx), _share_header(rows), maps)

    def _readouts(self, state_text, q):
        """Round-1 readouts of a question and, for choices beyond the code capacity, its groups."""
        qtype, criteria = q["type"], q["criteria"]
        if qtype == "choice":
            k = len(criteria)
            if k <= self.group_size:
                return [self._choice_readout(state_text, q, list(range(k)))], None
            n_groups = math.ceil(k / self.group_size)
            if n_groups > self.group_size:
                raise RequestError(f"{k} options exceed what this tokenizer's {self.group_size} label codes can read")
            groups = [list(g) for g in np.array_split(np.arange(k), n_groups)]
            return [self._choice_readout(state_text, q, g) for g in groups], groups
        if qtype == "score":
            codes = self.codes.letters(len(criteria))
            text = prompt.score_text(q["instructions"], criteria, [c for c, _ in codes])
            row = self._row(state_text, text, [t for _, t in codes])
            return [_Readout("score", labels.LETTER, len(criteria), [row], [list(range(len(criteria)))])], None
        if self.noul_readout == labels.RATING:
            text = prompt.noul_rating_text(q["instructions"], criteria)
            row = self._row(state_text, text, [t for _, t in self.rating], self.rating_lead)
            return [_Readout("noul", labels.RATING, 9, [row], [list(range(9))])], None
        orders = [labels.YES_NO] + ([labels.YES_NO[::-1]] if self.option_averaging else [])
        rows = [self._row(state_text, prompt.noul_binary_text(q["instructions"], criteria, o),
                          [t for _, t in self.yes_no], self.yes_no_lead) for o in orders]
        return [_Readout("noul", labels.BINARY, 2, _share_header(rows), [[0, 1]] * len(rows))], None

    def _plan(self, state, questions) -> Plan:
        if not isinstance(state, (str, dict, list)):
            raise RequestError("state must be a string, an object or an array")
        state_text = prompt.render_state(state)
        plan = Plan(state_text, self._prefix_ids(state_text), [])
        for qid, q in _validate(questions):
            readouts, groups = self._readouts(state_text, q)
            plan.questions.append((qid, q, readouts, groups))
        self._check_limits(plan)
        return plan

    def _check_limits(self, plan: Plan):
        rows = [r for _, _, rs, _ in plan.questions for ro in rs for r in ro.rows]
        longest = max(len(r.tokens) for r in rows)
        p = len(plan.prefix_ids)
        if p + longest > MAX_STATE_PLUS_QUESTION_TOKENS:
            raise TokenLimitError(f"state + longest question is {p + longest} tokens; the limit is "
                                  f"{MAX_STATE_PLUS_QUESTION_TOKENS}")
        total = p + sum(len(r.tokens) for r in rows)
        if total > MAX_REQUEST_TOKENS:
            raise TokenLimitError(f"the request is {total} tokens (state once + every question row); the limit is "
                                  f"{MAX_REQUEST_TOKENS}")

    # -- execution -----------------------------------------------------------------------------
    def _prefix_cache(self, prefix_ids):
        """(cache, hit): the prefix's cache, from the LRU when this exact prefix was seen before."""
        p = len(prefix_ids)
        if p == 0:
            return None, False
        key = tuple(prefix_ids)
        with self._lock:
            if key in self._prefixes:
                self._prefixes.move_to_end(key)
                return self._prefixes[key][0], True
        pb = buckets.fit(p, buckets.PREFIX[1:], "prefix length")
        tokens = np.zeros((1, pb), np.int32)
        valid = np.zeros((1, pb), bool)
        tokens[0, :p], valid[0, :p] = prefix_ids, True
        cache = self.backbone.prefill(tokens, valid, chunk=buckets.PREFILL_CHUNK)
        size = sum(x.nbytes for x in jax.tree.leaves(cache))
        if size <= self.prefix_cache_bytes:
            with self._lock:
                self._prefixes[key] = (cache, size)
                while sum(n for _, n in self._prefixes.values()) > self.prefix_cache_bytes:
                    self._prefixes.popitem(last=False)
        return cache, False

    def _calls(self, rows: list[_Row]) -> list[tuple[list[int], int, int, int]]:
        """Group rows (shortest first) into device calls: (row indices, rows, suffix, codes buckets).
        As few calls as keep rows x suffix bucket within the device's per-call budget
        (`buckets.row_tokens_per_call`), then rows spread evenly over them (20 rows run as 2 x 10,
        not 16 + 4: a small call costs more per token)."""
        cap = buckets.row_tokens_per_call(self.platform)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].tokens))
        suffix = lambda g: buckets.fit(max(len(rows[i].tokens) for i in g), buckets.SUFFIX, "question length")
        fits = lambda g: len(g) == 1 or (len(g) <= buckets.ROWS[-1]
                                         and buckets.fit(len(g), buckets.ROWS, "rows") * suffix(g) <= cap)
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
        return [(g, buckets.fit(len(g), buckets.ROWS, "rows"), suffix(g),
                 buckets.fit(max(len(rows[i].label_ids) for i in g), buckets.CODES, "label codes")) for g in groups]

    def _segment_plan(self, rows: list[_Row]):
        """(headers, each row's header index, the rows without their headers) when computing every
        distinct question header once, as a cache segment both option orders continue, saves enough
        row tokens to pay for its extra device call; else None."""
        headers, index, seg_of_row, rest = [], {}, [], []
        for r in rows:
            key = tuple(r.tokens[: r.header])
            if key not in index:
                index[key] = len(headers)
                headers.append(list(key))
            seg_of_row.append(index[key])
            rest.append(_Row(r.tokens[r.header :], r.label_ids))
        total = sum(len(r.tokens) for r in rows)
        saved = total - sum(map(len, headers)) - sum(len(r.tokens) for r in rest)
        if saved < max(MIN_SEGMENT_SAVING, total // 10):
            return None
        return headers, seg_of_row, rest

    def _segment_calls(self, headers: list[list[int]]) -> tuple[int, list[tuple[list[int], int]]]:
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

    def programs(self, state, questions) -> set[tuple]:
        """The device programs (shape-bucket keys) a request's first round needs; a request whose
        keys were all seen before compiles nothing."""
        plan = self._plan(state, questions)
        rows = [r for _, _, rs, _ in plan.questions for ro in rs for r in ro.rows]
        p = len(plan.prefix_ids)
        pb = buckets.fit(p, buckets.PREFIX[1:], "prefix length") if p else 0
        keys = {("prefill", pb)} if pb else set()
        seg = self._segment_plan(rows) if pb else None
        if seg is None:
            return keys | {("rows", pb, b, t, c) for _, b, t, c in self._calls(rows)}
        headers, _, rest = seg
        sg, calls = self._segment_calls(headers)
        return (keys | {("segment", pb, b, sg) for _, b in calls}
                | {("rows", pb, sg, b, t, c) for _, b, t, c in self._calls(rest)})

    def _read_many(self, entries, usages) -> list[list[np.ndarray]]:
        """Label logits for every row of every (prefix_ids, rows) entry: each prefix computed once
        (or taken from the cross-request cache), then all rows of all entries in as few batched
        calls as fit; several entries' prefixes are stacked and each row reads its own."""
        caches = []
        for (prefix_ids, rows), usage in zip(entries, usages):
            cache, hit = self._prefix_cache(prefix_ids)
            if not usage.prefix_seen:
                usage.prefix_seen = True
                usage.processed += len(prefix_ids)
                usage.cached += len(prefix_ids) if hit else 0
            usage.processed += sum(len(r.tokens) for r in rows)
            caches.append(cache)
        if len(entries) == 1 or any(c is None for c in caches):
            return [self._read_rows(c, rows, None) for c, (_, rows) in zip(caches, entries)]
        out = []
        per_call = buckets.ROWS[-1]
        for start in range(0, len(entries), per_call):
            part = entries[start : start + per_call]
            stacked = _stack_caches(caches[start : start + per_call], buckets.fit(len(part), buckets.ROWS, "requests"))
            flat = [(k, r) for k, (_, rows) in enumerate(part) for r in rows]
            it = iter(self._read_rows(stacked, [r for _, r in flat], [k for k, _ in flat]))
            out.extend([next(it) for _ in rows] for _, rows in part)
        return out

    def _read(self, prefix_ids, rows: list[_Row]) -> list[np.ndarray]:
        """Label logits of `rows` after `prefix_ids` (one entry of `_read_many`; benchmarks and
        calibration fitting read raw logits through it)."""
        return self._read_many([(prefix_ids, rows)], [_Usage()])[0]

    def _read_rows(self, cache, rows: list[_Row], prefix_of_row) -> list[np.ndarray]:
        seg = self._segment_plan(rows) if prefix_of_row is None and cache is not None else None
        if seg is None:
            return self._read_calls(cache, rows, prefix_of_row=prefix_of_row)
        headers, seg_of_row, rest = seg
        seg_cache, where = self._compute_segments(cache, headers)
        return self._read_calls(seg_cache, rest, segment_of_row=[where[h] for h in seg_of_row])

    def _compute_segments(self, cache, headers: list[list[int]]):
        """(segment cache of every header after the shared prefix, header index -> its cache row)."""
        bb = self.backbone
        sg, calls = self._segment_calls(headers)
        parts, where, first_row = [], {}, 0
        for idx, bsz in calls:
            tokens = np.zeros((bsz, sg), np.int32)
            valid = np.zeros((bsz, sg), bool)
            for j, h in enumerate(idx):
                tokens[j, : len(headers[h])], valid[j, : len(headers[h])] = headers[h], True
                where[h] = first_row + j
            first_row += bsz
            args = (bb.params, cache, jnp.asarray(tokens), jnp.asarray(valid), bb.config)
            part, finite = _segments(*args)
            if not bool(finite):  # the anchored softmax could not serve a header (layers.attend)
                self.exact_reruns += 1
                part, _ = _segments(*args, anchored=False)
            parts.append(part)
        return cache_lib.concat_segments(parts), where

    def _read_calls(self, cache, rows: list[_Row], *, prefix_of_row=None, segment_of_row=None) -> list[np.ndarray]:
        """Label logits of `rows` in bucketed batched calls. Each row continues `cache` (a shared
        prefix), its request's prefix in a stacked cache (`prefix_of_row`), or its header's segment
        (`segment_of_row`)."""
        out: list[np.ndarray | None] = [None] * len(rows)
        bb = self.backbone
        per_row = prefix_of_row if segment_of_row is None else segment_of_row
        for call, bsz, tb, cb in self._calls(rows):
            tokens = np.zeros((bsz, tb), np.int32)
            valid = np.zeros((bsz, tb), bool)
            answer = np.zeros((bsz,), np.int32)
            ids = np.zeros((bsz, cb), np.int32)
            which = None if per_row is None else np.zeros((bsz,), np.int32)
            for j, i in enumerate(call):
                r = rows[i]
                tokens[j, : len(r.tokens)], valid[j, : len(r.tokens)] = r.tokens, True
                answer[j] = len(r.tokens) - 1
                ids[j, : len(r.label_ids)] = r.label_ids
                if which is not None:
                    which[j] = per_row[i]
            fn = _read_rows if segment_of_row is None else _read_segment_rows
            args = (bb.params, cache, None if which is None else jnp.asarray(which), jnp.asarray(tokens),
                    jnp.asarray(valid), jnp.asarray(answer), jnp.asarray(ids), bb.config)
            logits = np.asarray(fn(*args))
            if not np.isfinite(logits[: len(call)]).all():
                # the anchored softmax met a cached score far above a row's own ones (layers.attend):
                # the exact stabiliser, for this call only
                self.exact_reruns += 1
                logits = np.asarray(fn(*args, anchored=False))
            for j, i in enumerate(call):
                out[i] = logits[j, : len(rows[i].label_ids)]
        return out

    def _read_reference(self, entries, usages) -> list[list[np.ndarray]]:
        """One independent full forward per row: no shared prefix, no bucketing (verification)."""
        out = []
        for (prefix_ids, rows), usage in zip(entries, usages):
            usage.processed += sum(len(prefix_ids) + len(r.tokens) for r in rows)
            per = []
            for r in rows:
                logits = np.asarray(self.backbone.logits([list(prefix_ids) + r.tokens]))[0, -1]
                per.append(logits[r.label_ids])
            out.append(per)
        return out

    def _run(self, plans: list[Plan], reader, usages) -> list[dict]:
        """Round 1 (every readout of every plan), round 2 (group winners of large choices), compose."""
        round1 = [[ro for _, _, rs, _ in plan.questions for ro in rs] for plan in plans]
        logits = reader([(plan.prefix_ids, [r for ro in ros for r in ro.rows]) for plan, ros in zip(plans, round1)],
                        usages)
        probs = {}
        for ros, per_plan in zip(round1, logits):
            it = iter(per_plan)
            for ro in ros:
                probs[id(ro)] = ro.probs([next(it) for _ in ro.rows], self.calibration)
        finals = [{qid: self._choice_readout(plan.state_text, q,
                                             [g[int(np.argmax(probs[id(ro)]))] for g, ro in zip(groups, rs)])
                   for qid, q, rs, groups in plan.questions if groups is not None} for plan in plans]
        final_p = [{} for _ in plans]
        todo = [k for k, f in enumerate(finals) if f]
        if todo:
            logits2 = reader([(plans[k].prefix_ids, [r for ro in finals[k].values() for r in ro.rows]) for k in todo],
                             [usages[k] for k in todo])
            for k, per_plan in zip(todo, logits2):
                it = iter(per_plan)
                final_p[k] = {qid: ro.probs([next(it) for _ in ro.rows], self.calibration)
                              for qid, ro in finals[k].items()}
        return [self._answers(plan, probs, fp) for plan, fp in zip(plans, final_p)]

    def _answers(self, plan: Plan, probs: dict, final_p: dict) -> dict:
        answers = {}
        for qid, q, rs, groups in plan.questions:
            if q["type"] == "choice":
                keys = list(q["criteria"])
                if groups is None:
                    p = probs[id(rs[0])]
                else:  # P(option) = P(option | its group) * P(its group's winner | winners)
                    p = np.zeros(len(keys))
                    for gi, (g, ro) in enumerate(zip(groups, rs)):
                        p[g] = probs[id(ro)] * final_p[qid][gi]
                p = p / p.sum()
                answers[qid] = {"type": "choice", "choice": keys[int(np.argmax(p))],
                                "probabilities": {k: float(v) for k, v in zip(keys, p)},
                                "confidence": choice_confidence(p)}
            elif q["type"] == "score":
                p = probs[id(rs[0])]
                p = p / p.sum()
                answers[qid] = {"type": "score", "score": float((np.arange(len(p)) * p).sum()),
                                "legend": {str(i): level for i, level in enumerate(q["criteria"])},
                                "probabilities": {str(i): float(v) for i, v in enumerate(p)},
                                "confidence": score_confidence(p)}
            else:
                p = probs[id(rs[0])]
                p_yes = float(p[0]) if rs[0].mode == labels.BINARY else float((np.arange(9) / 8 * p).sum())
                answers[qid] = {"type": "noul", "noul": p_yes}
        return answers

    # -- public API ----------------------------------------------------------------------------
    def predict(self, state, questions, *, reference: bool = False) -> dict:
        """Answers in the Jev shapes. `reference=True` runs one independent full forward per row
        (no shared prefix, no bucketing): slow, for checking the fast path."""
        return self.predict_with_usage(state, questions, reference=reference)[0]

    def predict_with_usage(self, state, questions, *, reference: bool = False) -> tuple[dict, dict]:
        """(answers, usage): usage = {"input_tokens": state prefix once + every question row,
        including round-2 rows of grouped choices, "cached_input_tokens": of those, prefix tokens
        reused from an earlier request with the same state}."""
        plan = self._plan(state, questions)
        usage = _Usage()
        answers = self._run([plan], self._read_reference if reference else self._read_many, [usage])[0]
        return answers, usage.as_dict()

    def predict_many(self, requests, *, with_usage: bool = False) -> list:
        """Many requests in one go (a server's micro-batch): every request's rows share the same
        batched device calls. A request is a (state, questions) pair, or (plan, None) with a plan from
        `engine.plan()` (not tokenized again). Returns, per request, its answers ((answers, usage)
        with `with_usage`) or the RequestError that request raised; one bad request spoils no other."""
        out: list = [None] * len(requests)
        plans, where = [], []
        for i, (state, questions) in enumerate(requests):
            try:
                plans.append(state if isinstance(state, Plan) else self._plan(state, questions))
                where.append(i)
            except RequestError as e:
                out[i] = e
        if plans:
            usages = [_Usage() for _ in plans]
            for i, answers, usage in zip(where, self._run(plans, self._read_many, usages), usages):
                out[i] = (answers, usage.as_dict()) if with_usage else answers
        return out

    def plan(self, state, questions) -> Plan:
        """Validate, lay out and tokenize a request, checking the token limits (RequestError /
        TokenLimitError) before any device work."""
        return self._plan(state, questions)

    def count_tokens(self, state, questions) -> dict:
        return self._plan(state, questions).token_counts()

    @property
    def compiled_programs(self) -> int:
        """Device programs compiled so far (prefill chunks + row readouts)."""
        from lev_jax import backbone as backbone_lib

        return (_read_rows._cache_size() + _read_segment_rows._cache_size() + _segments._cache_size()
                + backbone_lib._extend._cache_size())

    def info(self) -> dict:
        return {
            "model": self.model_name,
            "checkpoint": self.checkpoint,
            "prompt_style": self.prompt_style,
            "layout": self.layout,
            "calibrated": not self.calibration.is_identity,
            "mode_b": False,
            "noul_readout": self.noul_readout,
            "option_averaging": self.option_averaging,
            "option_cap": CHOICE_OPTIONS[1],
            "label_codes": self.group_size,
            "dtype": self.backbone.dtype,
            "platform": self.platform,
            "row_tokens_per_call": buckets.row_tokens_per_call(self.platform),
            "compiled_programs": self.compiled_programs,
            "buckets": {"prefix": buckets.PREFIX, "suffix": buckets.SUFFIX, "rows": buckets.ROWS,
                        "codes": buckets.CODES},
        }


def load(model=None, checkpoint=None, prompt_style: str = "chat", dtype: str = "float32", *,
         calibration="auto", noul_readout: str | None = None, **engine_kwargs) -> Engine:
    """An engine over `model` (None = the embedded default, a checkpoint directory, a .gguf file or
    a hub id). `calibration`: "auto" (calibration.json beside the weights, else the profile shipped
    for the embedded model, else none), a path, a Calibration, or None."""
    if checkpoint is not None:
        raise ValueError("fine-tuned checkpoints (LoRA + heads) are not supported yet; pass checkpoint=None")
    bb = load_backbone(model, dtype=dtype)
    cal = _resolve_calibration(calibration, model, bb)
    return Engine(bb, prompt_style=prompt_style, calibration=cal,
                  noul_readout=noul_readout or labels.BINARY, model_name=bb.name, checkpoint=checkpoint,
                  **engine_kwargs)


def _stack_caches(caches: list[dict], n: int) -> dict:
    """Several 1-row prefix caches as one n-row cache (rows past len(caches) repeat the first),
    every one grown to the same number of slots."""
    slots = max(c["valid"].shape[1] for c in caches)
    grown = [cache_lib.grow(c, slots) for c in caches]
    grown += [grown[0]] * (n - len(grown))
    return jax.tree.map(lambda *xs: jnp.max(jnp.stack(xs)) if xs[0].ndim == 0 else jnp.concatenate(xs, axis=0), *grown)


PROFILES = Path(__file__).parent / "profiles"


def _resolve_calibration(calibration, model, bb) -> Calibration:
    if isinstance(calibration, Calibration):
        return calibration
    if calibration is None:
        return Calibration.identity(bb.name)
    if calibration != "auto":
        return Calibration.load(calibration)
    candidates = []
    if model is not None and Path(str(model)).is_dir():
        candidates.append(Path(str(model)) / "calibration.json")
    if model is None:
        candidates.append(PROFILES / bb.name / "calibration.json")
    for c in candidates:
        if c.is_file():
            return Calibration.load(c)
    return Calibration.identity(bb.name)
