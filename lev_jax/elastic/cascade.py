"""Elastic depth's prefixes and its vertical cascade: compute really stops at an exit.

`prefill(..., depth=d)` runs and caches layers [0, d) only, and `read(..., depth=d)` reads rows
through them (`readout.logits.rows_exit_logits`). Both keep the residual stream after layer d (the
prefix's in its `Prefix`, the rows' in their `Rows`), so `deepen` continues a prefix from d1 to
d2 > d1 and `read(..., start=d1, rows=...)` continues rows: no layer runs twice.
"""

from __future__ import annotations

import dataclasses

import jax

from lev_jax import models, programs
from lev_jax.models import cache as cache_lib
from lev_jax.readout.logits import rows_exit_logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prefix computed to `depth` layers: its cache (layers [0, depth)) and the raw residual stream
    after layer `depth` at each of its slots [B, S, E] (what a deeper continuation starts from)."""

    cache: dict
    resid_BSE: jax.Array
    tokens_BS: jax.Array
    valid_BS: jax.Array
    depth: int = dataclasses.field(metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows read to `depth` over a prefix: label logits [B, C] at that exit and the rows' raw residual
    stream [B, T, E] after layer `depth` (what `read(..., start=depth)` continues)."""

    logits_BC: jax.Array
    resid_BTE: jax.Array
    depth: int = dataclasses.field(metadata={"static": True})


@programs.program(("cfg", "depth"))
def prefill(params, tokens_BS, valid_BS, cfg, depth: int) -> Prefix:
    """The cache of a prefix through its first `depth` layers, keeping the residual after them."""
    resid, cache = models.forward(
        params, tokens_BS, None, cfg, valid_BT=valid_BS, layer_range=(0, depth), final_norm=False
    )
    return Prefix(cache, resid, tokens_BS, valid_BS, depth)


@programs.program(("cfg", "depth"))
def deepen(params, prefix: Prefix, cfg, depth: int) -> Prefix:
    """`prefix` continued from its depth to `depth`: layers [prefix.depth, depth) run once over the
    saved residual stream (at the prefix's own positions), their caches stacked on the kept ones."""
    if depth <= prefix.depth:
        raise ValueError(f"deepen goes deeper: the prefix is at depth {prefix.depth}, asked {depth}")
    resid, upper = models.forward(
        params,
        prefix.tokens_BS,
        None,
        cfg,
        valid_BT=prefix.valid_BS,
        hidden_BTE=prefix.resid_BSE,
        layer_range=(prefix.depth, depth),
        final_norm=False,
    )
    cache = cache_lib.stack_on(prefix.cache, upper)
    return Prefix(cache, resid, prefix.tokens_BS, prefix.valid_BS, depth)


def truncated(prefix: Prefix, depth: int) -> Prefix:
    """`prefix` as a reading at exit `depth` needs it: its cache's first `depth` layers (a prefix
    computed deeper serves shallower readings; the program then depends on `depth` only). For
    reading only: its residual stream is still the deeper one's, so it must not be deepened."""
    if prefix.depth < depth:
        raise ValueError(f"the prefix is computed to depth {prefix.depth}; reading at {depth} needs deepen first")
    if prefix.depth == depth:
        return prefix
    cache = cache_lib.truncate(prefix.cache, depth)
    return Prefix(cache, prefix.resid_BSE, prefix.tokens_BS, prefix.valid_BS, depth)


@programs.program(("cfg", "depth", "start"))
def read(
    params, exits, prefix: Prefix, tokens_BT, valid_BT, answer_B, label_ids_BC, cfg, depth: int, start=0, rows=None
):
    """Label logits of rows continuing `prefix` (its depth >= `depth`), read at the exit `depth`.
    `start` > 0 continues `rows` (a `Rows` read at depth `start`) from their saved residual: layers
    [start, depth) only. `answer_B`: each row's answer position among its T tokens."""
    if prefix.depth < depth:
        raise ValueError(f"the prefix is computed to depth {prefix.depth}; reading at {depth} needs deepen first")
    if (start > 0) != (rows is not None) or (rows is not None and rows.depth != start):
        raise ValueError("start > 0 continues the Rows read at that depth")
    logits, resid = rows_exit_logits(
        params,
        exits,
        prefix.cache,
        None,
        tokens_BT,
        valid_BT,
        answer_B,
        label_ids_BC,
        cfg,
        (depth,),
        start=start,
        resid_BTE=None if rows is None else rows.resid_BTE,
    )
    return Rows(logits[depth], resid, depth)
