"""Mode B: a choice read in one row whatever its option count, by a trained scorer head.

Mode A reads a question from the next-token distribution over single-token label codes, so its
option count is bounded by the tokenizer's codes (larger choices are read in groups and a second
round). Mode B writes every candidate followed by one reserved marker token (`marker_token`: a
special token of the tokenizer that encodes as one id, inserted as that id, never parsed from the
request's text: text containing it is refused) and scores the final-normed hidden state at each
marker with a small head (`head_scores`); the softmax over a question's candidates (padding masked)
is its distribution. 2-255 candidates in one row continuing the shared state prefix. The scores have
the shape of Mode A's label logits ([rows, candidates]), so presentation-order maps, calibration,
composition and the training loss read them unchanged.

This module holds the pieces: the marker, the row layout (`marked_row`), the head (`init_head`,
`head_scores`) and its safetensors form. Rows are read by `readout.logits.rows_scores`, the readout
Mode A rows go through too (`Row.markers` marks a Mode B row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lev_jax import prompt
from lev_jax.errors import ReservedTextError

# special tokens a decision prompt never needs, in order of preference (Qwen3.5's grounding
# delimiters; SmolLM2's code-corpus metadata tokens)
MARKERS = ("<|object_ref_end|>", "<|box_end|>", "<|quad_end|>", "<empty_output>", "<gh_stars>", "<issue_closed>")
HEAD_WIDTH = 256  # the scorer's hidden width
HEAD_KEY = "mode_b_head"  # where a training state's trainable tree holds the head, beside the adapter
HIGHEST = jax.lax.Precision.HIGHEST


def marker_token(tokenizer) -> tuple[str, int] | None:
    """(text, id) of the first MARKERS token this tokenizer has as a special token that encodes as
    exactly that one id; None when it has none (Mode B is then unavailable: Mode A reads everything)."""
    specials = getattr(tokenizer, "special_ids", frozenset())
    for text in MARKERS:
        i = tokenizer.token_to_id(text)
        if i is not None and i in specials and tokenizer.encode(text) == [i]:
            return text, i
    return None


def check_text(text: str, marker: str, where: str, loc: tuple = ()) -> None:
    """ReservedTextError when request text contains the marker: it would be read as a candidate's end."""
    if marker in text:
        raise ReservedTextError(f"{where} contains {marker!r}, a token this model reserves for reading options", loc)


def marked_row(
    fmt: prompt.PromptFormat,
    marker_id: int,
    instructions: str,
    options: list[tuple[str, object]],
    state_block: str | None = None,
) -> tuple[list[int], list[int]]:
    """(row tokens, marker positions) of a Mode B choice row: the question, each option line
    followed by the marker, the answer context. After a state prefix (state first) `state_block` is
    None; with the schema first the row opens with the question and carries the state before the
    options (`state_block`: the state as the layout writes it), so every marker reads the state."""
    tok = fmt.tokenizer
    head, lines, tail = prompt.choice_pieces_marked(instructions, options, state_block)
    ids = tok.encode(head)
    markers = []
    for k, line in enumerate(lines):
        ids += tok.encode(("\n" if k else "") + line)
        markers.append(len(ids))
        ids.append(marker_id)
    ids += tok.encode(tail + fmt.tail)
    return ids, markers


def init_head(hidden_size: int, width: int = HEAD_WIDTH, seed: int = 0) -> dict:
    """A fresh fp32 scorer: score(h) = gelu(h w1 + b1) . w2 + b2, fan-in scaled normal weights."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (hidden_size, width), jnp.float32) / np.sqrt(hidden_size),
        "b1": jnp.zeros((width,), jnp.float32),
        "w2": jax.random.normal(k2, (width,), jnp.float32) / np.sqrt(width),
        "b2": jnp.zeros((), jnp.float32),
    }


def head_scores(head: dict, hidden_BRE) -> jax.Array:
    """[B, R] fp32 scores of hidden states [B, R, E] (the head is small: fp32 throughout)."""
    x = hidden_BRE.astype(jnp.float32)
    h = jax.nn.gelu(jnp.matmul(x, head["w1"], precision=HIGHEST) + head["b1"])
    return jnp.matmul(h, head["w2"], precision=HIGHEST) + head["b2"]


def head_tensors(head: dict, prefix: str = "mode_b_head.") -> dict[str, np.ndarray]:
    """The head as named fp32 arrays (safetensors)."""
    return {prefix + k: np.array(v, np.float32) for k, v in head.items()}  # (ascontiguousarray makes b2 1-d)


def head_from_tensors(tensors: dict, prefix: str = "mode_b_head.") -> dict:
    """The head back from `head_tensors`' names; ValueError naming what is missing or mis-shaped."""
    need = ("w1", "b1", "w2", "b2")
    missing = [prefix + k for k in need if prefix + k not in tensors]
    if missing:
        raise ValueError(f"the Mode B head lacks {', '.join(missing)}")
    head = {k: jnp.asarray(np.asarray(tensors[prefix + k], np.float32)) for k in need}
    E, d = head["w1"].shape
    if head["b1"].shape != (d,) or head["w2"].shape != (d,) or head["b2"].shape != ():
        raise ValueError(f"the Mode B head's shapes do not fit a width-{d} scorer")
    return head
