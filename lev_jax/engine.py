"""predict(): calibrated probabilities over supplied candidates, read from next-token logits (Mode A).

    engine = lev_jax.load()                      # the embedded SmolLM2-135M-Instruct
    engine.predict({"ticket": "..."}, {"intent": {"type": "choice", "instructions": "...",
                                                 "criteria": {"refund": None, "delivery": "late parcel"}}})

The state prefix (chat header + state) is prefilled once; every question row (and every option-order
averaging row) continues from that cache in one batched call, padded to shape buckets. Only the
answer position goes through the vocabulary head, and only the label-token rows of it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lev_jax import buckets, labels, models, prompt
from lev_jax.backbone import Backbone, load_backbone
from lev_jax.calibrate import Calibration
from lev_jax.errors import RequestError, TokenLimitError

MAX_STATE_PLUS_QUESTION_TOKENS = 32768
MAX_REQUEST_TOKENS = 65536
CHOICE_OPTIONS = (2, 255)
SCORE_LEVELS = (2, 10)
QUESTION_TYPES = ("choice", "score", "noul")
NOUL_READOUTS = (labels.BINARY, labels.RATING)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _read_rows(params, cache, tokens_BT, valid_BT, answer_B, label_ids_BC, cfg):
    hidden_BRE, _ = models.forward(params, tokens_BT, cache, cfg, valid_BT=valid_BT, readout_BR=answer_B[:, None],
                                   update_cache=False)
    return models.label_logits(params, hidden_BRE[:, 0], label_ids_BC, cfg)


@dataclasses.dataclass
class _Row:
    tokens: list[int]  # the row's suffix; the answer is read after its last token
    label_ids: list[int]  # head rows to read, one per code


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


class _Plan:
    """A request turned into token rows: the shared prefix and each question's readouts."""

    def __init__(self, prefix_ids, questions):
        self.prefix_ids = prefix_ids
        self.questions = questions  # [(qid, q, [readouts of round 1], grouping or None)]


class Engine:
    def __init__(self, backbone: Backbone, *, prompt_style: str = "chat", calibration: Calibration | None = None,
                 option_averaging: bool = True, noul_readout: str = labels.BINARY, layout: str = "state_first",
                 model_name: str | None = None, checkpoint: str | None = None):
        if backbone.tokenizer is None:
            raise ValueError("predict() needs a tokenizer; this checkpoint ships none")
        if noul_readout not in NOUL_READOUTS:
            raise ValueError(f"noul_readout must be one of {NOUL_READOUTS}")
        if layout not in prompt.LAYOUTS:
            raise ValueError(f"layout must be one of {prompt.LAYOUTS}")
        self.backbone = backbone
        self.tokenizer = backbone.tokenizer
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
        self._prefill_chunk = buckets.PREFILL_CHUNK

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
        return _Readout("choice", labels.LETTER, len(idx), rows, maps)

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
        return [_Readout("noul", labels.BINARY, 2, rows, [[0, 1]] * len(rows))], None

    def _plan(self, state, questions) -> _Plan:
        if not isinstance(state, (str, dict, list)):
            raise RequestError("state must be a string, an object or an array")
        state_text = prompt.render_state(state)
        plan = _Plan(self._prefix_ids(state_text), [])
        for qid, q in _validate(questions):
            readouts, groups = self._readouts(state_text, q)
            plan.questions.append((qid, q, readouts, groups))
        self._check_limits(plan)
        return plan

    def _check_limits(self, plan: _Plan):
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
        p = len(prefix_ids)
        if p == 0:
            return None
        pb = buckets.fit(p, buckets.PREFIX[1:], "prefix length")
        tokens = np.zeros((1, pb), np.int32)
        valid = np.zeros((1, pb), bool)
        tokens[0, :p], valid[0, :p] = prefix_ids, True
        return self.backbone.prefill(tokens, valid, chunk=self._prefill_chunk)

    def _read(self, prefix_ids, rows: list[_Row]) -> list[np.ndarray]:
        """Label logits for every row: the prefix once, the rows in as few batched calls as fit."""
        cache = self._prefix_cache(prefix_ids)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].tokens))
        calls, current = [], []
        for i in order:
            cand = current + [i]
            tb = buckets.fit(len(rows[i].tokens), buckets.SUFFIX, "question length")
            if current and buckets.fit(len(cand), buckets.ROWS, "rows") * tb > buckets.MAX_PADDED_ROW_TOKENS:
                calls.append(current)
                cand = [i]
            current = cand
        calls.append(current)
        out: list[np.ndarray | None] = [None] * len(rows)
        bb = self.backbone
        for call in calls:
            n = len(call)
            bsz = buckets.fit(n, buckets.ROWS, "rows")
            tb = buckets.fit(max(len(rows[i].tokens) for i in call), buckets.SUFFIX, "question length")
            cb = buckets.fit(max(len(rows[i].label_ids) for i in call), buckets.CODES, "label codes")
            tokens = np.zeros((bsz, tb), np.int32)
            valid = np.zeros((bsz, tb), bool)
            answer = np.zeros((bsz,), np.int32)
            ids = np.zeros((bsz, cb), np.int32)
            for j, i in enumerate(call):
                r = rows[i]
                tokens[j, : len(r.tokens)], valid[j, : len(r.tokens)] = r.tokens, True
                answer[j] = len(r.tokens) - 1
                ids[j, : len(r.label_ids)] = r.label_ids
            logits = np.asarray(_read_rows(bb.params, cache, jnp.asarray(tokens), jnp.asarray(valid),
                                           jnp.asarray(answer), jnp.asarray(ids), bb.config))
            for j, i in enumerate(call):
                out[i] = logits[j, : len(rows[i].label_ids)]
        return out

    def _read_reference(self, prefix_ids, rows: list[_Row]) -> list[np.ndarray]:
        """One independent full forward per row: no shared prefix, no bucketing (verification)."""
        out = []
        for r in rows:
            logits = np.asarray(self.backbone.logits([list(prefix_ids) + r.tokens]))[0, -1]
            out.append(logits[r.label_ids])
        return out

    def _run(self, plan: _Plan, reader) -> dict:
        readouts = [ro for _, _, rs, _ in plan.questions for ro in rs]
        logits = reader(plan.prefix_ids, [r for ro in readouts for r in ro.rows])
        it = iter(logits)
        probs = {id(ro): ro.probs([next(it) for _ in ro.rows], self.calibration) for ro in readouts}
        # round 2 for grouped choices: read the group winners, then compose
        state_text = None
        finals = {}
        for qid, q, rs, groups in plan.questions:
            if groups is None:
                continue
            winners = [g[int(np.argmax(probs[id(ro)]))] for g, ro in zip(groups, rs)]
            if state_text is None:
                state_text = self._state_text
            finals[qid] = (winners, self._choice_readout(state_text, q, winners))
        if finals:
            final_ro = [ro for _, ro in finals.values()]
            it2 = iter(reader(plan.prefix_ids, [r for ro in final_ro for r in ro.rows]))
            final_p = {qid: ro.probs([next(it2) for _ in ro.rows], self.calibration) for qid, (_, ro) in finals.items()}
        answers = {}
        for qid, q, rs, groups in plan.questions:
            if q["type"] == "choice":
                keys = list(q["criteria"])
                if groups is None:
                    p = probs[id(rs[0])]
                else:
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
        plan = self._plan(state, questions)
        self._state_text = prompt.render_state(state)
        return self._run(plan, self._read_reference if reference else self._read)

    def predict_many(self, requests) -> list:
        out = []
        for state, questions in requests:
            try:
                out.append(self.predict(state, questions))
            except RequestError as e:
                out.append(e)
        return out

    def count_tokens(self, state, questions) -> dict:
        plan = self._plan(state, questions)
        lens = [len(r.tokens) for _, _, rs, _ in plan.questions for ro in rs for r in ro.rows]
        return {"input_tokens": len(plan.prefix_ids) + sum(lens), "state_tokens": len(plan.prefix_ids),
                "max_question_tokens": max(lens)}

    @property
    def compiled_programs(self) -> int:
        """Device programs compiled so far (prefill chunks + row readouts)."""
        from lev_jax import backbone as backbone_lib

        return _read_rows._cache_size() + backbone_lib._extend._cache_size()

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
