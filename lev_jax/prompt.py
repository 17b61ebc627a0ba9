"""Prompt layout: the one place that turns (state, question) into text. Training and serving both
call this module, so a fine-tuned checkpoint sees at serving time exactly what it was trained on.

Two styles: `chat` (the checkpoint's chat template, thinking disabled, the answer position right
after the assistant turn opens) and `plain` (no template; the answer follows "Answer:").
Two layouts: `state_first` (the state, then the question: every question of a request shares the
state prefix, which is computed once) and `schema_first` (the question, then the state).

Everything a request supplies (the state, instructions, options, levels, criteria) reaches the
tokenizer marked as user text (`tokenizer.plain_text`): a special-token string written in it is
encoded as the characters it is, so a request cannot forge the template's turns.
"""

from __future__ import annotations

import dataclasses
import json

from lev_jax.tokenizer import plain_text

STYLES = ("chat", "plain")
LAYOUTS = ("state_first", "schema_first")
_SENTINEL = "\u2063LEV_CONTENT\u2063"


def render_state(state) -> str:
    """Deterministic text for a state: strings as they are, JSON values as sorted-key JSON."""
    if isinstance(state, str):
        return state
    return json.dumps(state, sort_keys=True, ensure_ascii=False, indent=1)


def render_value(desc) -> str:
    """Text for a description, instruction or level: strings as they are, structured values as
    compact sorted-key JSON, null as nothing."""
    if desc is None:
        return ""
    if isinstance(desc, str):
        return desc
    return json.dumps(desc, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))


def choice_text(instructions: str, options: list[tuple[str, object]], codes: list[str]) -> str:
    """`options` in presentation order as (key, description); `codes` the letters shown for them."""
    lines = []
    for code, (key, desc) in zip(codes, options):
        d = render_value(desc)
        lines.append(f"{code}) {key}: {d}" if d else f"{code}) {key}")
    return f"Question: {instructions}\nOptions:\n" + "\n".join(lines) + "\nAnswer with the letter of the best option."


def choice_pieces_marked(
    instructions: str, options: list[tuple[str, object]], state_block: str | None = None
) -> tuple[str, list[str], str]:
    """Mode B's layout of a choice: (the text before the first option, one line per option in
    presentation order, the text after the last). The reserved marker token follows each option line
    (inserted as a token id, never parsed from text). `state_block` (schema first) follows the
    closing line, as the state follows the options in Mode A's schema-first rows: the answer
    position, last, has read both (the scorer head's query)."""
    lines = []
    for key, desc in options:
        d = render_value(desc)
        lines.append(f"- {key}: {d}" if d else f"- {key}")
    state = f"\n\n{state_block}" if state_block else ""
    # each piece is encoded on its own (readout.modeb): each is marked as user text
    head, tail = f"Question: {instructions}\nOptions:\n", "\nWhich option fits best?" + state
    return plain_text(head), [plain_text(line) for line in lines], plain_text(tail)


def score_text(instructions: str, levels: list[str], codes: list[str]) -> str:
    lines = [f"{code}) {level}" for code, level in zip(codes, levels)]
    return (
        f"Question: {instructions}\nLevels, from lowest to highest:\n"
        + "\n".join(lines)
        + "\nAnswer with the letter of the level that fits best."
    )


def _noul_criteria(criteria) -> list[str]:
    criteria = criteria or {}  # {"true": ..., "false": ...} (the wire's shape; readout.plan normalises)
    out = []
    if criteria.get("true"):
        out.append(f"Yes means: {render_value(criteria['true'])}")
    if criteria.get("false"):
        out.append(f"No means: {render_value(criteria['false'])}")
    return out


def noul_binary_text(instructions: str, criteria, order: tuple[str, str]) -> str:
    lines = [f"Question: {instructions}", *_noul_criteria(criteria), f"Answer {order[0]} or {order[1]}."]
    return "\n".join(lines)


def noul_rating_text(instructions: str, criteria) -> str:
    lines = [
        f"Question: {instructions}",
        *_noul_criteria(criteria),
        "Rate how likely the answer is yes, from 0 (certainly no) to 8 (certainly yes). Answer with one digit.",
    ]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Prompt:
    prefix: str  # shared by every row of a request
    suffix: str  # the row's own text; the answer is the next token after it


class PromptFormat:
    """Chat-template pieces of one tokenizer and style, and the answer context label codes follow."""

    def __init__(self, tokenizer, style: str = "chat"):
        if style not in STYLES:
            raise ValueError(f"prompt_style must be one of {STYLES}, not {style!r}")
        self.style = style
        self.tokenizer = tokenizer
        if style == "chat":
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("prompt_style 'chat' needs a tokenizer with a chat template; use 'plain'")
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": _SENTINEL}], add_generation_prompt=True, enable_thinking=False
            )
            self.head, self.tail = text.split(_SENTINEL)
            self.sep = ""
        else:
            self.head, self.tail, self.sep = "", "\nAnswer:", " "
        self.bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None else []

    @property
    def answer_context(self) -> str:
        return self.tail

    @staticmethod
    def state_block(state_text: str) -> str:
        return f"State:\n{plain_text(state_text)}"

    def build(self, state_text: str, question_text: str, layout: str = "state_first") -> Prompt:
        """The prompt of a state and a question's text; both are the request's (user text, marked
        so), the template's head and tail the only special tokens."""
        state_block = self.state_block(state_text)
        question_text = plain_text(question_text)
        if layout == "state_first":
            return Prompt(self.head + state_block + "\n\n", question_text + self.tail)
        if layout == "schema_first":
            return Prompt(self.head, question_text + "\n\n" + state_block + self.tail)
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")

    def encode_prefix(self, text: str) -> list[int]:
        return self.bos + self.tokenizer.encode(text)
