"""Backbones as pure functions over parameter pytrees.

`forward(params, tokens_BT, cache, cfg, ...)` merges the NNX graph for `cfg` with `params` (a plain
nested dict of arrays, the NNX-split state) inside the trace, so callers can jit it, shard params by
path, or merge a LoRA tree into `params` first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lev_jax.models import cache as cache_lib
from lev_jax.models import stack
from lev_jax.models.base import REMAT_POLICIES  # noqa: F401
from lev_jax.models.context import CacheWrite, Context  # noqa: F401
from lev_jax.models.layers import exit_params
from lev_jax.models.llama import LlamaConfig
from lev_jax.models.qwen3_5 import Qwen3_5Config

CONFIGS = {
    "llama": LlamaConfig,
    "mistral": LlamaConfig,
    "qwen2": LlamaConfig,
    "qwen3": LlamaConfig,
    "qwen3_5": Qwen3_5Config,
    "qwen3_5_text": Qwen3_5Config,
}


def config_from_hf(d: dict):
    """A frozen model config from an HF `config.json` dict."""
    model_type = d.get("model_type")
    if model_type not in CONFIGS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(CONFIGS)}")
    return CONFIGS[model_type].from_hf(d)


@functools.cache
def graph(cfg, dtype: str = "float32"):
    """(graphdef of the shell, abstract params) for a config, without allocating any weights. The
    shell is everything but the decoder layers (embeddings, final norm, head, exit map); the
    layers are stacks under params["blocks"] (models.stack), run by `CausalLM.__call__`."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cfg.model(dtype=jnp.dtype(dtype))))
    params = state.to_pure_dict()
    P = layer_period(cfg)
    layers = {}
    for kind in sorted(set(cfg.layer_types)):
        one = nnx.split(nnx.eval_shape(lambda kind=kind: cfg.layer_module(kind, jnp.dtype(dtype))))[1].to_pure_dict()
        layers[kind] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), one)
    params[stack.BLOCKS] = stack.stack_layers({i: layers[kind] for i, kind in enumerate(cfg.layer_types)}, P)
    return graphdef, dict(sorted(params.items()))  # the order every walk over the tree sees


def cache_row_axes(cache):
    """The row axis of every leaf of a cache (models.cache.row_axes)."""
    return cache_lib.row_axes(cache)


def layer_period(cfg) -> int:
    """How many layers one scan step runs (models.stack)."""
    return stack.period(cfg.layer_types)


def params_dtype(params) -> str:
    return str(params["embed_tokens"]["embedding"].dtype)


def bind(params, cfg):
    """The shell module (params without the layer stacks) of `cfg`."""
    graphdef, _ = graph(cfg, params_dtype(params))
    return nnx.merge(graphdef, {k: v for k, v in params.items() if k != stack.BLOCKS})


def forward(
    params,
    tokens_BT,
    cache,
    cfg,
    *,
    valid_BT=None,
    positions_BT=None,
    readout_BR=None,
    cache_write: CacheWrite = CacheWrite.APPEND,
    anchored_softmax: bool = False,
    remat: str = "none",
    embeds_BTE=None,
    embeds_mask_BT=None,
    hidden_BTE=None,
    layer_range: tuple[int, int] | None = None,
    final_norm: bool = True,
    mask_BTT=None,
):
    """(hidden, new_cache): the final-normed hidden state at `readout_BR` (or every new token), and the
    cache as `cache_write` asks (CausalLM.__call__). `remat`: a REMAT_POLICIES name, how each
    layer is rematerialised when this is differentiated. `embeds_BTE` / `embeds_mask_BT`: input
    embeddings (image features) replacing the token embeddings where the mask is set.
    `layer_range` / `hidden_BTE` / `final_norm`: run a slice of the layers (elastic depth,
    CausalLM.__call__). `mask_BTT`: packed rows' attention among the new tokens (CausalLM.__call__)."""
    return bind(params, cfg)(
        params[stack.BLOCKS],
        tokens_BT,
        cache,
        valid_BT,
        positions_BT,
        readout_BR,
        cache_write,
        anchored_softmax,
        remat,
        embeds_BTE,
        embeds_mask_BT,
        hidden_BTE=hidden_BTE,
        layer_range=layer_range,
        final_norm=final_norm,
        mask_BTT=mask_BTT,
    )


def final_norm(params, x, cfg):
    """The model's final norm over a raw residual stream (`forward(..., final_norm=False)`)."""
    return bind(params, cfg).final(x)


def exit_view(params, cfg, depth: int, adapter=None):
    """(params, cfg) of the model truncated after `depth` layers (elastic depth): its first `depth`
    layers (the same arrays, nothing copied), the exit adapter `adapter` ({scale, a, b}, required
    below the full depth) before the shared final norm, and the same embeddings and head. Every
    function of (params, cfg) -- forward, prefill, every readout -- then computes and caches those
    layers only and reads labels at the exit; the config differs, so its programs are its own."""
    L = num_layers(cfg)
    if not 1 <= depth <= L:
        raise ValueError(f"an exit depth is a layer count in [1, {L}], not {depth}")
    if depth == L:
        return params, cfg
    if adapter is None:
        raise ValueError(f"no exit adapter for depth {depth}")
    # the stacks stay whole (no copy): a call runs the config's first `depth` layers of them
    changes = {"num_hidden_layers": depth, "exit_rank": int(adapter["a"].shape[-1]), "depth_of": L}
    view = {**params, "exit": exit_params(adapter)}
    return view, dataclasses.replace(cfg, **changes)


def num_layers(cfg) -> int:
    return int(cfg.num_hidden_layers)


def head_logits(params, hidden, cfg, token_ids=None):
    """fp32 logits of the vocabulary head, restricted to `token_ids` when given."""
    return bind(params, cfg).head(hidden, token_ids)


def label_logits(params, hidden_BE, ids_BC, cfg):
    """fp32 logits of per-row label tokens: [B, E] hidden, [B, C] token ids -> [B, C]."""
    return bind(params, cfg).head_rows(hidden_BE, ids_BC)


def init_cache(cfg, batch: int, slots: int, dtype="float32"):
    per_layer = cfg.layer_cache(batch, slots, jnp.dtype(dtype))
    return cache_lib.empty_cache(batch, slots, stack.stack_layers(dict(enumerate(per_layer)), layer_period(cfg)))


layer_view = stack.layer_view  # params in the per-layer view of the on-disk formats


def stacked_view(params_per_layer, cfg):
    """Params in the per-layer view (`layer_view`) with their layers stacked for `cfg`."""
    return stack.stacked_view(params_per_layer, layer_period(cfg))


def cache_depth(cache) -> int:
    """How many layers a cache holds."""
    return stack.depth(cache[stack.BLOCKS])


def layer_tree(cfg, dtype="float32") -> dict:
    """The abstract params in the per-layer view of the on-disk formats (models.stack.layer_view)."""
    return stack.layer_view(abstract_params(cfg, dtype))


def random_params(cfg, dtype="float32", seed: int = 0, init_std: float = 0.02):
    """Random weights the way HF initialises a fresh model: normal(0, init_std) matrices and
    embeddings, the modules' own norm inits, A_log = log U(1, 16), a kaiming-sized depthwise conv.
    Tiny random models for tests and demos. Drawn layer by layer (the per-layer view), so a seed
    gives the same weights whatever the layout."""
    shell = nnx.split(cfg.model(dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed)))[1].to_pure_dict()
    kinds = {
        kind: nnx.split(cfg.layer_module(kind, jnp.dtype(dtype)))[1].to_pure_dict() for kind in set(cfg.layer_types)
    }
    params = {**shell, "layers": {i: kinds[kind] for i, kind in enumerate(cfg.layer_types)}}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for (path, leaf), key in zip(leaves, keys):
        name = getattr(path[-1], "key", "")
        if name in ("kernel", "embedding"):
            leaf = init_std * jax.random.normal(key, leaf.shape, jnp.float32)
        elif name == "conv1d":
            leaf = 0.5 * jax.random.normal(key, leaf.shape, jnp.float32)
        elif name == "A_log":
            leaf = jnp.log(jax.random.uniform(key, leaf.shape, jnp.float32, 1.0, 16.0))
        out.append(leaf.astype(jnp.float32 if name in ("A_log", "dt_bias") else dtype))
    return stack.stacked_view(jax.tree_util.tree_unflatten(treedef, out), layer_period(cfg))


def abstract_params(cfg, dtype="float32"):
    return graph(cfg, str(jnp.dtype(dtype)))[1]


def cast_params(params, cfg, dtype):
    """The same weights in another dtype, leaf by leaf as the model declares them (A_log and
    dt_bias stay fp32 in every dtype). `cfg` may be an exit view's: the stacks are the full model's."""
    return jax.tree.map(lambda x, a: jnp.asarray(x, a.dtype), params, abstract_params(full_config(cfg), dtype))


def full_config(cfg):
    """The config of the whole model an exit view (`exit_view`) was cut from."""
    if not getattr(cfg, "depth_of", 0):
        return cfg
    changes = {"num_hidden_layers": cfg.depth_of, "exit_rank": 0, "depth_of": 0}
    return dataclasses.replace(cfg, **changes)
