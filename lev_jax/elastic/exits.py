"""Exit readouts: the label readout applied to the residual stream after layer d.

An exit adapter maps the residual stream after layer d towards what the final layer would have
produced, so the model's own final norm and vocabulary/label head are shared by every exit:

    x_d  -> x_d + (rmsnorm(x_d) * scale) @ a @ b  -> final norm -> label rows of the head

`a` [E, r] and `b` [r, E] are low rank (`b` starts at zero: an untrained exit is the plain "logit
lens" of layer d); the norm's statistics are fp32. Adapters are a plain pytree {str(d): adapter},
trained like a LoRA tree; the exit at d = L (the full model) has none and is today's readout exactly.

Compute really stops at an exit: `prefill(..., depth=d)` runs and caches layers [0, d) only, and
`read(..., depth=d)` reads rows through them. Both keep the residual stream after layer d (the
prefix's in its `Prefix`, the rows' in their `Rows`), so `deepen` continues a prefix from d1 to
d2 > d1 and `read(..., start=d1)` continues rows: a vertical cascade in which no layer runs twice.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lev_jax import models
from lev_jax.models import CacheWrite

NORM_EPS = 1e-6


def init_exits(cfg, depths, rank: int = 8, seed: int = 0, dtype: str = "float32") -> dict:
    """Fresh adapters for every exit in `depths` below the model's depth (the last layer needs none).
    `a` ~ normal(0, 1/sqrt(E)), `b` = 0, `scale` = 1."""
    L, E = models.num_layers(cfg), int(cfg.hidden_size)
    depths = check_depths(cfg, depths)
    out = {}
    for d in (d for d in depths if d < L):
        key = jax.random.fold_in(jax.random.key(seed), d)
        out[str(d)] = {
            "scale": jnp.ones((E,), jnp.float32),
            "a": (jax.random.normal(key, (E, rank), jnp.float32) / jnp.sqrt(E)).astype(dtype),
            "b": jnp.zeros((rank, E), dtype),
        }
    return out


def check_depths(cfg, depths) -> tuple[int, ...]:
    """`depths` as a sorted tuple of distinct layer counts in [1, L]; ValueError otherwise."""
    L = models.num_layers(cfg)
    out = tuple(sorted({int(d) for d in depths}))
    if not out or out[0] < 1 or out[-1] > L:
        raise ValueError(f"exit depths must be layer counts in [1, {L}], not {list(depths)}")
    return out


def default_depths(cfg) -> tuple[int, ...]:
    """L/4, L/2, 3L/4 and L (rounded, distinct, at least 1)."""
    L = models.num_layers(cfg)
    return check_depths(cfg, [max(1, round(L * f)) for f in (0.25, 0.5, 0.75)] + [L])


def apply_exit(adapter, x_raw):
    """The adapter's residual map of a raw residual stream [..., E] (fp32 out)."""
    x = x_raw.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS) * adapter["scale"]
    w_a, w_b = adapter["a"], adapter["b"]
    low = jnp.einsum("...e,er->...r", normed.astype(w_a.dtype), w_a, preferred_element_type=jnp.float32)
    return x + jnp.einsum("...r,re->...e", low.astype(w_b.dtype), w_b, preferred_element_type=jnp.float32)


def exit_hidden(params, exits, x_raw, depth: int, cfg):
    """The final-normed hidden state an exit at `depth` reads labels from: the model's own final
    norm of the raw stream at d = L, of the adapted stream below. KeyError names a missing exit."""
    if depth < models.num_layers(cfg):
        if str(depth) not in exits:
            raise KeyError(f"no exit adapter at depth {depth}; trained exits: {sorted(map(int, exits))}")
        x_raw = apply_exit(exits[str(depth)], x_raw)
    return models.final_norm(params, x_raw, cfg)


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


@functools.partial(jax.jit, static_argnames=("cfg", "depth"))
def prefill(params, tokens_BS, valid_BS, cfg, depth: int) -> Prefix:
    """The cache of a prefix through its first `depth` layers, keeping the residual after them."""
    resid, cache = models.forward(
        params, tokens_BS, None, cfg, valid_BT=valid_BS, layer_range=(0, depth), final_norm=False
    )
    return Prefix(cache, resid, tokens_BS, valid_BS, depth)


@functools.partial(jax.jit, static_argnames=("cfg", "depth"))
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
    cache = {**prefix.cache, "layers": tuple(prefix.cache["layers"]) + tuple(upper["layers"])}
    return Prefix(cache, resid, prefix.tokens_BS, prefix.valid_BS, depth)


@functools.partial(jax.jit, static_argnames=("cfg", "depth", "start"))
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
    resid, _ = models.forward(
        params,
        tokens_BT,
        prefix.cache,
        cfg,
        valid_BT=valid_BT,
        cache_write=CacheWrite.NONE,
        hidden_BTE=None if rows is None else rows.resid_BTE,
        layer_range=(start, depth),
        final_norm=False,
    )
    at = jnp.take_along_axis(resid, answer_B[:, None, None].astype(jnp.int32), axis=1)[:, 0]
    hidden_BE = exit_hidden(params, exits, at, depth, cfg)
    return Rows(models.label_logits(params, hidden_BE, label_ids_BC, cfg), resid, depth)
