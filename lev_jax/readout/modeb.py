"""Mode B: a choice read in one row whatever its option count, by a trained scorer head.

Mode A reads a question from the next-token distribution over single-token label codes, so its
option count is bounded by the tokenizer's codes (larger choices are read in groups and a second
round). Mode B writes every candidate followed by one reserved marker token (`marker_token`: a
special token of the tokenizer that encodes as one id, inserted as that id, never parsed from the
request's text: text containing it is refused), then (schema first) the state, then the answer
context, and scores the candidates with a small pointer head (`head_scores`): a query from the
final-normed hidden state at the answer position against a key from each marker's. The answer
position is where Mode A finds the matching option among those listed (to copy its code), so the
pointer reads what the model already does there; a head over the marker states alone has to make
each marker judge the state by itself, which a small model does poorly (EVAL.md). The softmax over
a question's candidates (padding masked) is its distribution. 2-255 candidates in one row
continuing the shared state prefix. The scores have the shape of Mode A's label logits ([rows,
candidates]), so presentation-order maps, calibration, composition and the training loss read them
unchanged.

This module holds the pieces: the marker, the row layout (`marked_row`), the head (`init_head`,
`head_scores`, split as `marker_keys` / `answer_query` for a long row whose markers are read chunk
by chunk before its answer position) and its safetensors form. Rows are read by
`readout.logits.rows_scores`, the readout Mode A rows go through too (`Row.markers` marks a Mode B
row).
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
HEAD_WIDTH = 256  # the pointer's query/key width
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
    followed by the marker, the closing line, then (schema first: `state_block`, the state as the
    layout writes it) the state, and the answer context. After a state prefix (state first)
    `state_block` is None. The options come before the state as in Mode A's rows, so the answer
    position reads the state against options it has already seen."""
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
    """A fresh fp32 pointer head: score(answer h_a, marker h_m) = (h_a wq) . (h_m wk) / sqrt(width)
    + h_m . wp (wp: each option's prior from its marker alone, zero at the start); fan-in scaled
    normal wq, wk."""
    kq, kk = jax.random.split(jax.random.key(seed))
    return {
        "wq": jax.random.normal(kq, (hidden_size, width), jnp.float32) / np.sqrt(hidden_size),
        "wk": jax.random.normal(kk, (hidden_size, width), jnp.float32) / np.sqrt(hidden_size),
        "wp": jnp.zeros((hidden_size,), jnp.float32),
    }


def head_parameters(hidden_size: int, width: int = HEAD_WIDTH) -> int:
    """The head's parameter count (a training plan's trainable size)."""
    return 2 * hidden_size * width + hidden_size


def marker_keys(head: dict, markers_BRE) -> jax.Array:
    """[B, R, width + 1] fp32 keys of marker hidden states: the scaled key and the prior, so a
    question's scores are its keys against one query (`answer_query`) whichever call read them."""
    x = markers_BRE.astype(jnp.float32)
    k = jnp.matmul(x, head["wk"], precision=HIGHEST) / np.sqrt(head["wk"].shape[1])
    prior = jnp.matmul(x, head["wp"], precision=HIGHEST)
    return jnp.concatenate([k, prior[..., None]], axis=-1)


def answer_query(head: dict, answer_BE) -> jax.Array:
    """[B, width + 1] fp32 query of answer-position hidden states (its last entry weighs the prior)."""
    q = jnp.matmul(answer_BE.astype(jnp.float32), head["wq"], precision=HIGHEST)
    return jnp.concatenate([q, jnp.ones(q.shape[:-1] + (1,), jnp.float32)], axis=-1)


def keyed_scores(keys_BRK, query_BK) -> jax.Array:
    """[B, R] scores of keys against their row's query."""
    return jnp.einsum("brk,bk->br", keys_BRK, query_BK, precision=HIGHEST)


def head_scores(head: dict, answer_BE, markers_BRE) -> jax.Array:
    """[B, R] fp32 scores of R marker hidden states [B, R, E] against the answer position's [B, E]
    (the head is small: fp32 throughout)."""
    return keyed_scores(marker_keys(head, markers_BRE), answer_query(head, answer_BE))


def head_tensors(head: dict, prefix: str = "mode_b_head.") -> dict[str, np.ndarray]:
    """The head as named fp32 arrays (safetensors)."""
    return {prefix + k: np.array(v, np.float32) for k, v in head.items()}


def head_from_tensors(tensors: dict, prefix: str = "mode_b_head.") -> dict:
    """The head back from `head_tensors`' names; ValueError naming what is missing or mis-shaped."""
    need = ("wq", "wk", "wp")
    missing = [prefix + k for k in need if prefix + k not in tensors]
    if missing:
        raise ValueError(f"the Mode B head lacks {', '.join(missing)} (a pointer head: query, key and prior weights)")
    head = {k: jnp.asarray(np.asarray(tensors[prefix + k], np.float32)) for k in need}
    E, d = head["wq"].shape
    if head["wk"].shape != (E, d) or head["wp"].shape != (E,):
        raise ValueError(f"the Mode B head's shapes do not fit a width-{d} pointer over {E}-wide hidden states")
    return head
