"""Planning: (state, questions) -> token rows, label ids and presentation-order maps. No JAX.

A question becomes one or more `Readout`s (a distribution over its candidates), each read from one
`Row` per presentation order (option averaging reads a choice in both orders). A choice with more
options than the tokenizer has single-token label codes is split into groups (round 1); the group
winners are read again as one choice (round 2, `Planner.winners_readout`). predict() and training
both plan through here, so a fine-tuned checkpoint is trained on exactly the rows it is served.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np

from lev_jax import buckets, domain, labels, prompt
from lev_jax.errors import RequestError, TokenLimitError
from lev_jax.readout import modeb

# Option averaging reads a choice in both presentation orders (cancelling position bias) while its
# row stays within this many tokens; a longer listing (over ~100 options with descriptions) is read in
# the given order only: a second order would double the cost of the request's most expensive row
# (255 options: ~4.5k tokens a row), and the calibration fitted for large choices absorbs the order bias
# that remains.
AVERAGING_MAX_ROW_TOKENS = 2048

# how a question is read (the router's answer; the answer's metadata on the wire)
MODE_A, MODE_A_GROUPED, MODE_B = "mode_a", "mode_a_grouped", "mode_b"


def route(n_options: int, group_size: int, *, head: bool, min_options: int = domain.MODE_B_MIN_OPTIONS) -> str:
    """The router, one function: Mode B where a head is loaded and the choice is large (at least
    `min_options`) or its codes would split (more options than the tokenizer has single-token
    codes); else Mode A where every option gets a single-token code; else grouped Mode A (round 1 per
    group, round 2 over the winners). A missing head never fails a request: Mode A reads it."""
    if head and (n_options >= min_options or n_options > group_size):
        return MODE_B
    return MODE_A if n_options <= group_size else MODE_A_GROUPED


class ImagePrefix(list):
    """A state prefix's token ids (a list, usable wherever prefix ids are) that carries the images its
    `<|image_pad|>` runs stand for, in order (`images.PreparedImage`). Two prefixes with the same ids
    but other pictures are different prefixes: `prefix_key` tells them apart."""

    def __init__(self, ids, images):
        super().__init__(ids)
        self.images = tuple(images)


class MarkedPrefix(list):
    """A prefix's token ids (a list) ending in a Mode B options block: `markers` are the positions
    of its markers, whose hidden states the executor turns into the head's keys as it computes the
    prefix (rows after it score their answer against them, `Row.keys_before`)."""

    def __init__(self, ids, markers):
        super().__init__(ids)
        self.markers = tuple(markers)


def prefix_key(prefix_ids) -> tuple:
    """The cross-request cache key of a prefix: its ids, the content keys of its images, and
    its markers (a prefix computed with its markers' keys is another entry)."""
    return (
        tuple(prefix_ids)
        + tuple(("image", img.key) for img in getattr(prefix_ids, "images", ()))
        + tuple(("marker", m) for m in getattr(prefix_ids, "markers", ()))
    )


@dataclasses.dataclass
class Row:
    tokens: list[int]  # the row's suffix after the shared prefix; the answer is read after its last token
    label_ids: list[int]  # vocabulary ids to read, one per code position
    header: int = 0  # leading tokens the row shares with the other rows of its readout (a cache segment)
    # leading tokens that do not depend on the state (schema first: the question before the state);
    # the executor keeps them with the prefix in its cross-request cache, so a stream of states asked
    # one question computes the question once
    stateless: int = 0
    # Mode B: the positions (in `tokens`) of the marker after each candidate, in code order; the
    # pointer head reads the hidden state there (against the answer position's) and `label_ids` is empty
    markers: list[int] | None = None
    # Mode B: markers read before the row's tokens (in the cache it continues, whose keys the reader
    # holds); the row's scores are its answer query against their keys first, then its own markers'
    keys_before: int = 0

    @property
    def width(self) -> int:
        """The scores the row yields: one per label code, or per marker (those read before it too)."""
        return len(self.label_ids) if self.markers is None else self.keys_before + len(self.markers)

    def after(self, k: int) -> Row:
        """The row without its first k tokens (read after a cache holding them); markers among
        those become `keys_before` (the caller read them and holds their keys)."""
        if self.markers is None:
            return Row(self.tokens[k:], self.label_ids)
        markers = [m - k for m in self.markers if m >= k]
        return Row(self.tokens[k:], self.label_ids, markers=markers, keys_before=self.width - len(markers))

    def rebased(self, tokens: list[int]) -> Row:
        """This row read as `tokens`, which end with the row's own last tokens (more or fewer of
        them before: a training group's shared prefix cut elsewhere); markers move with them."""
        shift = len(tokens) - len(self.tokens)
        markers = None if self.markers is None else [m + shift for m in self.markers]
        if markers and min(markers) < 0:
            raise ValueError("a Mode B row's markers cannot be shared with another row")
        return Row(list(tokens), self.label_ids, markers=markers)


@dataclasses.dataclass
class Readout:
    """One distribution over `n` candidates, read from one row per presentation order."""

    qtype: str
    mode: str  # domain.LETTER / BINARY / RATING
    n: int
    rows: list[Row]
    maps: list[list[int]]  # per row: code position -> candidate index


@dataclasses.dataclass
class QuestionPlan:
    qid: str
    question: dict  # normalised: {"type", "instructions", "criteria"} (noul criteria keyed "true"/"false")
    readouts: list[Readout]  # round 1
    groups: list[list[int]] | None = None  # candidates of each round-1 readout (a large choice), else None
    route: str = MODE_A  # how it is read: MODE_A, MODE_A_GROUPED or MODE_B

    @property
    def rows(self) -> list[Row]:
        return [r for ro in self.readouts for r in ro.rows]


@dataclasses.dataclass
class RequestPlan:
    """A request turned into token rows: the shared prefix and each question's readouts. Planning
    tokenizes everything and checks the limits; a server plans once (to count tokens and reject
    over-budget requests before queueing) and hands the plan to the engine."""

    state_text: str
    prefix_ids: list[int]
    questions: list[QuestionPlan]
    depth: int | str | None = None  # elastic depth it is read at (Engine.resolve_depth; None: the full depth)

    @property
    def rows(self) -> list[Row]:
        return [r for q in self.questions for r in q.rows]

    def token_counts(self) -> dict:
        lens = [len(r.tokens) for r in self.rows]
        return {
            "input_tokens": len(self.prefix_ids) + sum(lens),
            "state_tokens": len(self.prefix_ids),
            "max_question_tokens": max(lens),
        }


def share_header(rows: list[Row]) -> list[Row]:
    """Mark the token prefix a readout's rows have in common (a question's text before its options):
    it can be computed once for all of them (a cache segment) instead of once per row."""
    if len(rows) > 1:
        n = len(os.path.commonprefix([r.tokens for r in rows]))
        n = min(n, min(len(r.tokens) for r in rows) - 1)  # every row keeps its answer position
        for r in rows:
            r.header = n
    return rows


def _noul_criteria(qid: str, criteria) -> dict | None:
    """Noul criteria in the wire's shape {"true": ..., "false": ...}; "yes"/"no" are aliases."""
    if criteria is None:
        return None
    if not isinstance(criteria, dict):
        raise RequestError(f"question {qid!r}: noul criteria must be null or an object with 'true' and/or 'false'")
    out = {}
    for key, value in criteria.items():
        name = domain.NOUL_CRITERIA_ALIASES.get(key, key)
        if name not in domain.NOUL_CRITERIA or name in out:
            raise RequestError(
                f"question {qid!r}: noul criteria must be null or an object with 'true' and/or "
                f"'false' (aliases 'yes'/'no'), got keys {sorted(criteria)}"
            )
        if value is not None:
            text = _text(qid, f"noul criterion {key!r}", value)
            if value:  # a side sent as null or empty says nothing
                out[name] = text
    return out or None


def _text(qid: str, what: str, value) -> str:
    """Structured text as the wire allows it (a string, an object or an array) rendered once."""
    if not isinstance(value, (str, dict, list)):
        raise RequestError(f"question {qid!r}: {what} must be a string, an object or an array")
    return prompt.render_value(value)


def normalize_question(qid, q) -> dict:
    """A validated question in the one shape predict() and the Jev wire share (instructions, score
    levels and noul criteria may be structured JSON: rendered to text here; option descriptions are
    rendered by the prompt). Noul criteria come keyed "true"/"false" ("yes"/"no" accepted)."""
    if not isinstance(qid, str) or not qid:
        raise RequestError("question ids must be non-empty strings")
    if not isinstance(q, dict):
        raise RequestError(f"question {qid!r} must be an object")
    qtype = q.get("type")
    if qtype == "box":
        raise RequestError(
            f"question {qid!r}: this engine cannot locate boxes (type 'box' asks for coordinates; "
            "it reads decisions: noul, choice, score)"
        )
    if qtype not in domain.QUESTION_TYPES:
        raise RequestError(f"question {qid!r}: unknown type {qtype!r}; expected one of {domain.QUESTION_TYPES}")
    instructions = q.get("instructions")
    instructions = "" if instructions is None else _text(qid, "instructions", instructions)
    criteria = q.get("criteria")
    if qtype == domain.CHOICE:
        lo, hi = domain.CHOICE_OPTIONS
        if not isinstance(criteria, dict) or not lo <= len(criteria) <= hi:
            raise RequestError(f"question {qid!r}: choice criteria must map {lo}-{hi} option names to descriptions")
        if any(not isinstance(k, str) or not k for k in criteria):
            raise RequestError(f"question {qid!r}: option names must be non-empty strings")
        if any(d is not None and not isinstance(d, (str, dict, list)) for d in criteria.values()):
            raise RequestError(f"question {qid!r}: option descriptions must be null, a string, an object or an array")
    elif qtype == domain.SCORE:
        lo, hi = domain.SCORE_LEVELS
        if not isinstance(criteria, list) or not lo <= len(criteria) <= hi:
            raise RequestError(f"question {qid!r}: score criteria must be a list of {lo}-{hi} levels")
        criteria = [_text(qid, "a score level", level) for level in criteria]
    else:
        criteria = _noul_criteria(qid, criteria)
    return {"type": qtype, "instructions": instructions, "criteria": criteria}


class Planner:
    """Prompt layout + label codes of one tokenizer: the rows a (state, question) is read from."""

    def __init__(
        self,
        tokenizer,
        *,
        prompt_style: str = "chat",
        layout: str = "state_first",
        noul_readout: str = domain.BINARY,
        option_averaging: bool = True,
        vision=None,
        mode_b: bool = False,
        mode_b_min_options: int = domain.MODE_B_MIN_OPTIONS,
    ):
        if noul_readout not in domain.NOUL_READOUTS:
            raise ValueError(f"noul_readout must be one of {domain.NOUL_READOUTS}")
        if layout not in prompt.LAYOUTS:
            raise ValueError(f"layout must be one of {prompt.LAYOUTS}")
        self.tokenizer = tokenizer
        self.format = prompt.PromptFormat(tokenizer, prompt_style)
        self.prompt_style, self.layout = prompt_style, layout
        self.noul_readout, self.option_averaging = noul_readout, option_averaging
        self.vision = vision  # lev_jax.vision.Vision of a vision checkpoint: how an image stands in a prompt
        self.codes = labels.LabelCodes(tokenizer, self.format.answer_context, self.format.sep)
        self.group_size = min(self.codes.capacity(), buckets.CODES[-1])
        if self.group_size < 2:
            raise ValueError("the tokenizer offers fewer than two single-token label codes")
        self.yes_no_lead, self.yes_no = self.codes.fixed(domain.YES_NO)
        self.rating_lead, self.rating = self.codes.fixed(domain.RATING_CODES)
        # Mode B (a scorer head is loaded): large choices in one row, each option followed by the marker
        self.marker = modeb.marker_token(tokenizer) if mode_b else None
        if mode_b and self.marker is None:
            raise ValueError("Mode B needs a reserved marker token; this tokenizer has none of readout.modeb.MARKERS")
        if not domain.CHOICE_OPTIONS[0] <= mode_b_min_options:
            raise ValueError(f"mode_b_min_options must be at least {domain.CHOICE_OPTIONS[0]}")
        self.mode_b_min_options = mode_b_min_options

    # -- text and tokens ---------------------------------------------------------------------------
    @staticmethod
    def state_text(state) -> str:
        if not isinstance(state, (str, dict, list)):
            raise RequestError("state must be a string, an object or an array")
        return prompt.render_state(state)

    def prefix_ids(self, state_text: str, images: dict | None = None) -> list[int]:
        """The state prefix's tokens; with `images` (placeholder -> PreparedImage) an ImagePrefix in
        which each placeholder occurrence in the state stands as the image's vision tokens."""
        text = self.format.build(state_text, "", self.layout).prefix
        if not images:
            return self.format.encode_prefix(text)
        if self.layout != "state_first":
            raise RequestError("images are read in the state_first layout only (the state is then the shared prefix)")
        pattern = re.compile("|".join(re.escape(a) for a in sorted(images, key=len, reverse=True)))
        ids, order, start = list(self.format.bos), [], 0
        for m in pattern.finditer(text):
            img = images[m.group(0)]
            ids += self.tokenizer.encode(text[start : m.start()]) + self.vision.placeholder_ids(img)
            order.append(img)
            start = m.end()
        ids += self.tokenizer.encode(text[start:])
        unused = sorted(set(images) - {img.alias for img in order})
        if unused:
            raise RequestError(f"image asset(s) {', '.join(map(repr, unused))} are not referenced in the state")
        if len(order) > domain.MAX_IMAGES_PER_REQUEST:
            raise RequestError(
                f"the state references images {len(order)} times; the limit is {domain.MAX_IMAGES_PER_REQUEST}"
            )
        if ids.count(self.vision.image_token_id) != sum(img.n_tokens for img in order):
            raise RequestError("the state's text contains the model's image placeholder token; remove it")
        return ImagePrefix(ids, order)

    def _row(self, state_text: str, question_text: str, label_ids, lead: str = "") -> Row:
        p = self.format.build(state_text, question_text, self.layout)
        row = Row(self.tokenizer.encode(p.suffix + lead), list(label_ids))
        if self.layout == "schema_first":
            # the tokens the row shares with the question alone: the same for every state (a
            # boundary token the state's first characters could change is left out)
            alone = self.tokenizer.encode(question_text)
            row.stateless = min(len(os.path.commonprefix([row.tokens, alone])), len(row.tokens) - 1)
        return row

    # -- readouts ----------------------------------------------------------------------------------
    def choice_readout(self, state_text: str, q: dict, idx: list[int]) -> Readout:
        """A readout over the options `idx` of choice `q` (in both orders with option averaging)."""
        options = list(q["criteria"].items())
        codes = self.codes.letters(len(idx))
        pos = {opt: j for j, opt in enumerate(idx)}
        rows, maps = [], []
        for order in (idx, idx[::-1]):
            text = prompt.choice_text(q["instructions"], [options[i] for i in order], [c for c, _ in codes])
            rows.append(self._row(state_text, text, [t for _, t in codes]))
            maps.append([pos[i] for i in order])
            averaged = self.option_averaging and len(idx) > 1 and len(rows[0].tokens) <= AVERAGING_MAX_ROW_TOKENS
            if not averaged:
                break
        return Readout(domain.CHOICE, domain.LETTER, len(idx), share_header(rows), maps)

    def marked_readout(self, state_text: str, q: dict, order: list[int]) -> Readout:
        """Mode B: one row listing the options in `order`, each followed by the marker the head
        scores (training passes a shuffled order; serving the request's)."""
        options = list(q["criteria"].items())
        block = self.format.state_block(state_text) if self.layout == "schema_first" else None
        ids, markers = modeb.marked_row(
            self.format, self.marker[1], q["instructions"], [options[i] for i in order], block
        )
        row = Row(ids, [], markers=markers)
        if block is not None:
            # schema first the options block, markers and all, does not depend on the state: the
            # executor keeps it (and its markers' keys) with the prefix in its cross-request cache, so
            # a stream of states asked one large choice computes its options once
            row.stateless = markers[-1] + 1
        return Readout(domain.CHOICE, domain.MARKER, len(order), [row], [list(order)])

    def route(self, n_options: int, allow_b: bool = True) -> str:
        head = allow_b and self.marker is not None
        return route(n_options, self.group_size, head=head, min_options=self.mode_b_min_options)

    def check_marker(self, qid: str, q: dict) -> None:
        """A Mode B question's text must not hold the marker (ReservedTextError, 422)."""
        text = self.marker[0]
        modeb.check_text(
            q["instructions"], text, f"question {qid!r}'s instructions", ("questions", qid, "instructions")
        )
        for key, desc in q["criteria"].items():
            where = f"question {qid!r}'s option {key!r}"
            modeb.check_text(key, text, where, ("questions", qid, "criteria"))
            modeb.check_text(prompt.render_value(desc), text, where, ("questions", qid, "criteria", key))

    def question(self, state_text: str, qid: str, q: dict, *, allow_b: bool = True) -> QuestionPlan:
        """The round-1 readouts of a question (validated and normalised here); `allow_b=False`
        reads it with Mode A even where the router would use the head (training both; A vs B)."""
        q = normalize_question(qid, q)
        qtype, criteria = q["type"], q["criteria"]
        if qtype == domain.CHOICE:
            k = len(criteria)
            how = self.route(k, allow_b)
            if how == MODE_B:
                self.check_marker(qid, q)
                return QuestionPlan(qid, q, [self.marked_readout(state_text, q, list(range(k)))], route=MODE_B)
            if how == MODE_A:
                return QuestionPlan(qid, q, [self.choice_readout(state_text, q, list(range(k)))])
            n_groups = math.ceil(k / self.group_size)
            if n_groups > self.group_size:
                raise RequestError(f"{k} options exceed what this tokenizer's {self.group_size} label codes can read")
            groups = [list(map(int, g)) for g in np.array_split(np.arange(k), n_groups)]
            return QuestionPlan(
                qid, q, [self.choice_readout(state_text, q, g) for g in groups], groups, route=MODE_A_GROUPED
            )
        if qtype == domain.SCORE:
            codes = self.codes.letters(len(criteria))
            text = prompt.score_text(q["instructions"], criteria, [c for c, _ in codes])
            row = self._row(state_text, text, [t for _, t in codes])
            return QuestionPlan(
                qid, q, [Readout(domain.SCORE, domain.LETTER, len(criteria), [row], [list(range(len(criteria)))])]
            )
        if self.noul_readout == domain.RATING:
            text = prompt.noul_rating_text(q["instructions"], criteria)
            row = self._row(state_text, text, [t for _, t in self.rating], self.rating_lead)
            n = domain.RATING_LEVELS
            return QuestionPlan(qid, q, [Readout(domain.NOUL, domain.RATING, n, [row], [list(range(n))])])
        orders = [domain.YES_NO] + ([domain.YES_NO[::-1]] if self.option_averaging else [])
        rows = [
            self._row(
                state_text,
                prompt.noul_binary_text(q["instructions"], criteria, o),
                [t for _, t in self.yes_no],
                self.yes_no_lead,
            )
            for o in orders
        ]
        # code position j of a row is domain.YES_NO[j]; the candidates are [yes, no] in every order
        return QuestionPlan(qid, q, [Readout(domain.NOUL, domain.BINARY, 2, share_header(rows), [[0, 1]] * len(rows))])

    def winners_readout(self, state_text: str, qp: QuestionPlan, winners: list[int]) -> Readout:
        """Round 2 of a grouped choice: one readout over each group's winning option."""
        return self.choice_readout(state_text, qp.question, winners)

    def _check_state_budget(self, state_text: str, prefix: list[int] | None, n_questions: int) -> None:
        """Refuse (TokenLimitError) a request whose state alone is over the token budgets before any
        question row is built. State first, the prefix (tokenized once, and kept) must leave room for
        a question. Schema first, every row repeats the state: a state that, once per question, is over
        the budget is refused here, so building the rows (each tokenizing the state again) costs at
        most what the budget allows: a 262k-character state asked 512 questions would otherwise
        tokenize it 1,000 times and hold every row's tokens."""
        if self.layout != "schema_first":
            if prefix is not None and len(prefix) + 1 > domain.MAX_STATE_PLUS_QUESTION_TOKENS:
                raise TokenLimitError(
                    f"state + longest question is at least {len(prefix) + 1} tokens; the limit is "
                    f"{domain.MAX_STATE_PLUS_QUESTION_TOKENS}"
                )
            return
        n = len(self.tokenizer.encode(self.format.state_block(state_text))) - _BOUNDARY_TOKENS
        if n + 1 > domain.MAX_STATE_PLUS_QUESTION_TOKENS:
            raise TokenLimitError(
                f"the state alone is at least {n} tokens; the state and any question must fit in "
                f"{domain.MAX_STATE_PLUS_QUESTION_TOKENS}"
            )
        if n * n_questions > domain.MAX_REQUEST_TOKENS:
            raise TokenLimitError(
                f"the request is at least {n * n_questions} tokens ({n_questions} questions each reading the "
                f"{n}-token state); the limit is {domain.MAX_REQUEST_TOKENS}"
            )

    def plan(self, state, questions, images: dict | None = None) -> RequestPlan:
        """Validate, lay out and tokenize a request, checking the token limits (RequestError /
        TokenLimitError) before any device work. `images`: placeholder -> PreparedImage, each
        placeholder referenced from the state (a vision checkpoint only)."""
        if not isinstance(questions, dict) or not questions:
            raise RequestError("questions must be a non-empty object mapping question ids to questions")
        if images and self.vision is None:
            raise RequestError("this model is text-only and cannot read images")
        text = self.state_text(state)
        # a text state's prefix first (an image state's is built once its questions are checked)
        prefix = None if images else self.prefix_ids(text)
        self._check_state_budget(text, prefix, len(questions))
        qplans = [self.question(text, qid, q) for qid, q in questions.items()]
        if any(qp.route == MODE_B for qp in qplans):
            modeb.check_text(text, self.marker[0], "the state", ("state",))
        for qp in qplans:
            named = [a for a in images or () if any(a in s for s in _strings(qp.question))]
            if named:
                raise RequestError(
                    f"question {qp.qid!r} references image {named[0]!r}: images are read in the state only"
                )
        plan = RequestPlan(text, self.prefix_ids(text, images) if prefix is None else prefix, qplans)
        check_limits(plan)
        return plan


# tokens a row's copy of the state block may lose to its neighbours' merges (the first and the last)
_BOUNDARY_TOKENS = 2


def _strings(value):
    """Every string in a JSON-like value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def check_limits(plan: RequestPlan) -> None:
    rows = plan.rows
    p = len(plan.prefix_ids)
    longest = max(len(r.tokens) for r in rows)
    if p + longest > domain.MAX_STATE_PLUS_QUESTION_TOKENS:
        raise TokenLimitError(
            f"state + longest question is {p + longest} tokens; the limit is {domain.MAX_STATE_PLUS_QUESTION_TOKENS}"
        )
    total = p + sum(len(r.tokens) for r in rows)
    if total > domain.MAX_REQUEST_TOKENS:
        raise TokenLimitError(
            f"the request is {total} tokens (state once + every question row); the limit is {domain.MAX_REQUEST_TOKENS}"
        )
