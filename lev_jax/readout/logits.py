"""Label logits: pure functions from parameters and token rows to the logits of each row's label
tokens. Only the answer position goes through the vocabulary head, and only its label rows.

`rows_label_logits` continues an already computed prefix cache (serving: the state once, every
question row after it); `prefixed_label_logits` computes the prefixes too, differentiably (training:
several rows of one example continue one computed prefix, with gradients flowing through it).
The jitted variants below are the programs predict() runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from lev_jax import models, programs
from lev_jax.models import cache as cache_lib
from lev_jax.readout import exits as exits_lib
from lev_jax.readout import modeb


@dataclasses.dataclass
class RowBatch:
    """Rows padded to one shape: what one device call reads."""

    tokens_BT: np.ndarray  # int32
    valid_BT: np.ndarray  # bool
    answer_B: np.ndarray  # int32: the position whose next token is the answer
    label_ids_BC: np.ndarray  # int32: padded code slots hold id 0 (mask them)
    markers_BC: np.ndarray  # int32: Mode B rows' marker positions (padding points at the answer)
    marked_B: np.ndarray  # bool: the row is read by the Mode B head at its markers

    @property
    def marked(self) -> bool:
        return bool(self.marked_B.any())


def pack_rows(rows: Sequence, n_rows: int, length: int, n_codes: int) -> RowBatch:
    """`rows` (readout.Row) padded to [n_rows, length] tokens and [n_rows, n_codes] label ids (Mode
    A) or marker positions (Mode B rows, `Row.markers`)."""
    tokens = np.zeros((n_rows, length), np.int32)
    valid = np.zeros((n_rows, length), bool)
    answer = np.zeros((n_rows,), np.int32)
    ids = np.zeros((n_rows, n_codes), np.int32)
    markers = np.zeros((n_rows, n_codes), np.int32)
    marked = np.zeros((n_rows,), bool)
    for j, r in enumerate(rows):
        tokens[j, : len(r.tokens)], valid[j, : len(r.tokens)] = r.tokens, True
        answer[j] = len(r.tokens) - 1
        markers[j] = answer[j]
        ids[j, : len(r.label_ids)] = r.label_ids
        if r.markers is not None:
            markers[j, : len(r.markers)], marked[j] = r.markers, True
    return RowBatch(tokens, valid, answer, ids, markers, marked)


def pack_prefixes(prefixes: Sequence[Sequence[int]], n: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefix token lists right-padded to [n, length] (tokens, valid)."""
    tokens = np.zeros((n, length), np.int32)
    valid = np.zeros((n, length), bool)
    for j, p in enumerate(prefixes):
        tokens[j, : len(p)], valid[j, : len(p)] = p, True
    return tokens, valid


def rows_hidden(
    params, cache, prefix_B, tokens_BT, valid_BT, readout_BR, cfg, anchored, remat, *, layers=None, hidden_BTE=None
):
    """[B, R, E] final-normed hidden states at `readout_BR` of B rows continuing `cache` (one shared
    prefix, or row b reading prefix `prefix_B[b]` of a stacked cache in place); nothing is written.
    `layers` (start, stop): only that slice of the layers, continuing `hidden_BTE` when start > 0,
    returning the raw residual stream at every row token (readout_BR None; elastic depth)."""
    if prefix_B is not None:
        cache = cache_lib.index_rows(cache, prefix_B)
    hidden_BRE, _ = models.forward(
        params,
        tokens_BT,
        cache,
        cfg,
        valid_BT=valid_BT,
        readout_BR=readout_BR,
        cache_write=models.CacheWrite.NONE,
        anchored_softmax=anchored,
        remat=remat,
        hidden_BTE=hidden_BTE,
        layer_range=layers,
        final_norm=layers is None,
    )
    return hidden_BRE


def rows_label_logits(
    params,
    cache,
    prefix_B,
    tokens_BT,
    valid_BT,
    answer_B,
    label_ids_BC,
    cfg,
    *,
    anchored: bool = False,
    remat: str = "none",
):
    """[B, C] fp32 label logits of B rows continuing `cache`: one shared prefix (`prefix_B` None) or
    a cache stacking several prefixes, row b reading prefix `prefix_B[b]` in place
    (cache.index_rows). `anchored`: the anchored attention softmax (layers.attend); a row it cannot
    serve comes out NaN."""
    hidden_BRE = rows_hidden(params, cache, prefix_B, tokens_BT, valid_BT, answer_B[:, None], cfg, anchored, remat)
    return models.label_logits(params, hidden_BRE[:, 0], label_ids_BC, cfg)


def rows_exit_logits(
    params,
    exits,
    cache,
    prefix_B,
    tokens_BT,
    valid_BT,
    answer_B,
    label_ids_BC,
    cfg,
    depths,
    *,
    start: int = 0,
    resid_BTE=None,
    remat: str = "none",
):
    """({depth: [B, C] fp32 label logits}, the rows' raw residual stream after the deepest exit) of B
    rows continuing `cache` (as `rows_label_logits`), read at each exit in `depths` (ascending) in
    one pass: the layers run in slices between consecutive exits, each continuing the last one's
    residual stream, and each exit reads its adapter, the final norm and the label rows
    (readout.exits). `start` > 0 continues rows already run to that depth (`resid_BTE`); the cache
    must hold at least the deepest exit's layers. At depth L this is `rows_label_logits`."""
    if prefix_B is not None:
        cache = cache_lib.index_rows(cache, prefix_B)
    out, x = {}, resid_BTE
    for d in depths:
        if d <= start:
            raise ValueError(f"exit depths must be ascending and past start={start}, not {tuple(depths)}")
        x = rows_hidden(
            params, cache, None, tokens_BT, valid_BT, None, cfg, False, remat, layers=(start, d), hidden_BTE=x
        )
        at_BE = jnp.take_along_axis(x, answer_B[:, None, None].astype(jnp.int32), axis=1)[:, 0]
        out[d] = models.label_logits(params, exits_lib.exit_hidden(params, exits, at_BE, d, cfg), label_ids_BC, cfg)
        start = d
    return out, x


def rows_scores(
    params,
    head,
    cache,
    prefix_B,
    tokens_BT,
    valid_BT,
    answer_B,
    label_ids_BC,
    markers_BC,
    marked_B,
    cfg,
    *,
    anchored: bool = False,
    remat: str = "none",
    keys_BCK=None,
    keyed_B=None,
):
    """[B, C] fp32 scores of B rows continuing `cache` (as `rows_label_logits`), each row read its
    own way: Mode A rows as label logits at the answer position, Mode B rows (`marked_B`) as the
    pointer `head`'s scores (readout.modeb) of the final-normed hidden states at `markers_BC`
    against the answer position's. With `head` None every row is Mode A (the markers are not read):
    the one readout serving and training share. `keys_BCK` / `keyed_B`: the head's keys of Mode B
    rows whose markers were read before the row (`modeb.marker_keys`: in the prefix the row
    continues, or a long row's earlier chunks); a `keyed_B` row scores its answer against them."""
    if head is None:
        return rows_label_logits(
            params, cache, prefix_B, tokens_BT, valid_BT, answer_B, label_ids_BC, cfg, anchored=anchored, remat=remat
        )
    readout_BR = jnp.concatenate([answer_B[:, None], markers_BC], axis=1)
    hidden_BRE = rows_hidden(params, cache, prefix_B, tokens_BT, valid_BT, readout_BR, cfg, anchored, remat)
    letter_BC = models.label_logits(params, hidden_BRE[:, 0], label_ids_BC, cfg)
    keys = modeb.marker_keys(head, hidden_BRE[:, 1:])
    if keys_BCK is not None:
        keys = jnp.where(keyed_B[:, None, None], keys_BCK, keys)
    pointer_BC = modeb.keyed_scores(keys, modeb.answer_query(head, hidden_BRE[:, 0]))
    return jnp.where(marked_B[:, None], pointer_BC, letter_BC)


def prefixed_label_logits(
    params,
    prefix_EP,
    prefix_valid_EP,
    prefix_B,
    tokens_BT,
    valid_BT,
    answer_B,
    label_ids_BC,
    cfg,
    *,
    remat: str = "none",
):
    """[B, C] fp32 label logits of B rows after E prefixes computed here (row b continues prefix
    `prefix_B[b]`); differentiable end to end, so gradients reach the parameters through the shared
    prefix exactly as through independent full rows."""
    readout = jnp.zeros((prefix_EP.shape[0], 1), jnp.int32)  # the prefixes' hidden states are not needed
    _, cache = models.forward(params, prefix_EP, None, cfg, valid_BT=prefix_valid_EP, readout_BR=readout, remat=remat)
    return rows_label_logits(params, cache, prefix_B, tokens_BT, valid_BT, answer_B, label_ids_BC, cfg, remat=remat)


# -- the programs predict() runs -------------------------------------------------------------------
# `head` is None for calls without Mode B rows (one program per bucket, as before a head existed);
# `markers_BC` / `marked_B` are then ignored. `keys_BCK` / `keyed_B` (another program): Mode B rows
# after an options block whose markers' keys were read with the prefix (`rows_scores`).
@programs.program(("cfg", "anchored"))
def read_rows(
    params,
    head,
    cache,
    prefix_B,
    tokens_BT,
    valid_BT,
    answer_B,
    label_ids_BC,
    markers_BC,
    marked_B,
    cfg,
    anchored=True,
    keys_BCK=None,
    keyed_B=None,
):
    return rows_scores(
        params,
        head,
        cache,
        prefix_B,
        tokens_BT,
        valid_BT,
        answer_B,
        label_ids_BC,
        markers_BC,
        marked_B,
        cfg,
        anchored=anchored,
        keys_BCK=keys_BCK,
        keyed_B=keyed_B,
    )


@programs.program(("cfg", "anchored"))
def read_slab(
    params,
    cache,
    prefix_L,
    tokens_LT,
    valid_LT,
    positions_LT,
    segments_LT,
    parents_LT,
    answer_LR,
    label_ids_LRC,
    cfg,
    anchored=True,
):
    """[L, R, C] fp32 label logits of rows packed into L lanes (readout.slab): lane l continues
    `cache` (one shared prefix, `prefix_L` None) or row `prefix_L[l]` of a stacked cache, and each
    token sees the prefix, its own segment's earlier tokens and its header segment's (`parents_LT`),
    at its own position after the prefix. `segments_LT` None: one row per lane (a model with
    recurrent layers), read causally."""
    if prefix_L is not None:
        cache = cache_lib.index_rows(cache, prefix_L)
    L, T = tokens_LT.shape
    mask = None
    if segments_LT is not None:
        seen = (segments_LT[:, None, :] == segments_LT[:, :, None]) | (
            segments_LT[:, None, :] == parents_LT[:, :, None]
        )
        mask = seen & jnp.tril(jnp.ones((T, T), bool))[None] & valid_LT[:, None, :]
    start = jnp.zeros((L, 1), jnp.int32) if cache is None else jnp.broadcast_to(cache["pos"], (L,))[:, None]
    hidden_LRE, _ = models.forward(
        params,
        tokens_LT,
        cache,
        cfg,
        valid_BT=valid_LT,
        positions_BT=start + positions_LT,
        readout_BR=answer_LR,
        cache_write=models.CacheWrite.NONE,
        anchored_softmax=anchored,
        mask_BTT=mask,
    )
    R, C = label_ids_LRC.shape[1:]
    logits = models.label_logits(params, hidden_LRE.reshape(L * R, -1), label_ids_LRC.reshape(L * R, C), cfg)
    return logits.reshape(L, R, C)


@programs.program(("cfg",))
def extend_cache_marked(params, head, cache, tokens_BT, valid_BT, markers_BR, cfg):
    """(Mode B head keys at `markers_BR`, the continued cache): `Backbone.extend_chunk` for a chunk of a long
    Mode B row, whose markers inside the chunk are read on the way (their keys wait for the row's
    answer position, `read_tail`)."""
    hidden_BRE, cache = models.forward(params, tokens_BT, cache, cfg, valid_BT=valid_BT, readout_BR=markers_BR)
    return modeb.marker_keys(head, hidden_BRE), cache


@programs.program(("cfg",))
def read_tail(params, head, cache, tokens_BT, valid_BT, answer_B, label_ids_BC, markers_BC, cfg):
    """(label logits [B, C], Mode B keys at `markers_BC` [B, C, K], the answer's query [B, K]) of the
    last tokens of rows read alone after `cache` (a long row's chunks, or its prefix): a Mode A row
    reads the logits, a Mode B row its keys and query (with its earlier chunks' keys, its scores).
    One program for both (`head` None: a model without a Mode B head, logits only); exact softmax."""
    readout_BR = jnp.concatenate([answer_B[:, None], markers_BC], axis=1)
    hidden_BRE = rows_hidden(params, cache, None, tokens_BT, valid_BT, readout_BR, cfg, False, "none")
    logits = models.label_logits(params, hidden_BRE[:, 0], label_ids_BC, cfg)
    if head is None:
        return logits, None, None
    return logits, modeb.marker_keys(head, hidden_BRE[:, 1:]), modeb.answer_query(head, hidden_BRE[:, 0])


def compiled_programs() -> int:
    """Row, segment and long-row programs compiled so far in this process."""
    return read_slab.count() + read_rows.count() + extend_cache_marked.count() + read_tail.count()
