"""LoRA adapters as pure parameter trees.

An adapter is a plain dict ``{weight path: {"a": [in, r], "b": [r, out]}}`` keyed by the dotted path
of a base kernel in the per-layer view (``"layers.3.self_attn.q_proj.kernel"``; the base itself holds
its layers as stacks, models.stack, and `apply` / `merge` put the adapter into them). It lives apart
from the frozen base, so only the adapter goes to ``jax.value_and_grad`` and to the optimiser (the base
never enters optimiser state), and it checkpoints and shards like any pytree.

* ``init``: ``a`` uniform(+-1/sqrt(in)) (as peft's kaiming init), ``b`` zero, so a fresh adapter is
  the identity and training starts at the base model exactly.
* ``apply``: inside jit, the adapter goes beside every targeted kernel and is applied to the
  activations, x W + scale (x a) b with ``scale = alpha / r`` (fp32 masters cast to the compute dtype).
* ``merge``: ``W + scale * a @ b`` summed in fp32 and cast to the kernel's dtype, giving plain weights a
  serving engine loads like any checkpoint.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from lev_jax.models import stack

SEP = "."
# Target names: the attention and MLP projections of every backbone and the Gated DeltaNet
# projections of Qwen3.5 (in_proj_qkv/z/a/b, out_proj).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
DEFAULT_TARGETS = ATTENTION + MLP + DELTANET


def path_str(path) -> str:
    """A tree path (from jax.tree_util) as a dotted string: ``layers.0.mlp.up_proj.kernel``."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return SEP.join(parts)


def flatten(tree) -> dict[str, jax.Array]:
    """{dotted path: leaf} of a nested parameter dict; model params in their per-layer view
    (``layers.7.mlp.up_proj.kernel``, models.stack.layer_view: one slice of a stack per layer)."""
    if isinstance(tree, Mapping) and stack.BLOCKS in tree:
        tree = stack.layer_view(tree)
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def shapes(params) -> dict[str, jax.ShapeDtypeStruct]:
    """`flatten` of shapes only: no stack is sliced."""
    return flatten(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params))


def layer_of(path: str) -> int | None:
    """The decoder layer index of a dotted path (``layers.7.mlp...`` -> 7), None outside the layers."""
    hit = stack.layer_path(path)
    return None if hit is None else hit[0]


def target_paths(params, targets: Iterable[str] = DEFAULT_TARGETS, top_layers: int = 0) -> list[str]:
    """Paths of the 2-D kernels LoRA adapts: a kernel whose module name is a target, or whose path
    matches a target given as a regular expression (``re.fullmatch`` on the dotted per-layer path).
    `top_layers` > 0 keeps only the last that many decoder layers: no gradient then flows below
    them, so the layers underneath run forward only (no backward, no saved activations)."""
    names = set(targets)
    patterns = [re.compile(t) for t in names if any(c in t for c in "\\.*+?[](|)^$")]
    flat = shapes(params)
    out = []
    for path, x in flat.items():
        parts = path.split(SEP)
        if parts[-1] != "kernel" or len(x.shape) != 2:
            continue
        if parts[-2] in names or any(p.fullmatch(path) for p in patterns):
            out.append(path)
    if top_layers > 0:  # the model's last layers, whichever of their kernels the targets picked
        n_layers = 1 + max((i for p in flat if (i := layer_of(p)) is not None), default=-1)
        out = [p for p in out if (i := layer_of(p)) is not None and i >= n_layers - top_layers]
    return out


def init(
    params, rank: int, *, targets: Iterable[str] = DEFAULT_TARGETS, top_layers: int = 0, seed: int = 0, key=None
) -> dict:
    """A fresh fp32 adapter for `params`: a ~ U(-1/sqrt(in), 1/sqrt(in)), b = 0 (`top_layers`:
    see `target_paths`)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    flat = shapes(params)
    paths = target_paths(params, targets, top_layers)
    if not paths:
        raise ValueError(f"no kernel matches the LoRA targets {sorted(targets)}")
    key = jax.random.key(seed) if key is None else key
    out = {}
    for path, k in zip(paths, jax.random.split(key, len(paths))):
        fan_in, fan_out = flat[path].shape
        bound = 1.0 / math.sqrt(fan_in)
        out[path] = {
            "a": jax.random.uniform(k, (fan_in, rank), jnp.float32, -bound, bound),
            "b": jnp.zeros((rank, fan_out), jnp.float32),
        }
    return out


def rank_of(adapter: Mapping) -> int:
    first = next(iter(adapter.values()))
    return int(first["a"].shape[1])


def delta(ab: Mapping, scale: float) -> jax.Array:
    """scale * a @ b in fp32 (HIGHEST precision: the update is small next to W and must not be
    rounded away before the sum)."""
    a = ab["a"].astype(jnp.float32)
    b = ab["b"].astype(jnp.float32)
    return scale * jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _set(tree, keys: tuple, value):
    """A copy of nested dict `tree` with the leaf at `keys` replaced (only the dicts on the path are
    copied; every other leaf is shared)."""

    def go(node, i):
        new = dict(node)
        new[keys[i]] = value if i == len(keys) - 1 else go(node[keys[i]], i + 1)
        return new

    return go(tree, 0)


def _get(tree, keys: tuple):
    for k in keys:
        tree = tree[k]
    return tree


def _keys(path: str) -> tuple:
    return tuple(path.split(SEP))


def by_stack(params, adapter: Mapping) -> tuple[dict, dict]:
    """(per stack and module: (entries, [a], [b]) in entry order; the adapter's paths outside the
    layers). Layer i is entry i // P of stack i % P (models.stack); a stack's adapted entries are
    checked to be its last ones, the same for each of its adapted modules (the scan runs adapted
    layers as one suffix of the model)."""
    P = len(params[stack.BLOCKS])
    grouped: dict[tuple[int, str], dict[int, Mapping]] = {}
    outside = {}
    for path, ab in adapter.items():
        hit = stack.layer_path(path)
        if hit is None:
            outside[path] = ab
            continue
        i, rest = hit
        p, j = stack.where(i, P)
        grouped.setdefault((p, rest), {})[j] = ab
    per_stack: dict[int, dict[str, tuple]] = {}
    for (p, rest), entries in sorted(grouped.items()):
        n = stack.entries(params[stack.BLOCKS][p])
        js = sorted(entries)
        if js != list(range(n - len(js), n)):
            layers = [stack.layer_at(p, j, P) for j in js]
            raise ValueError(
                f"an adapter adapts the last layers of a model (lora_layers), not layers {layers} of {rest}"
            )
        per_stack.setdefault(p, {})[rest] = (js, [entries[j]["a"] for j in js], [entries[j]["b"] for j in js])
    for modules in per_stack.values():
        counts = {len(v[0]) for v in modules.values()}
        if len(counts) > 1:
            raise ValueError(f"an adapter adapts the same modules in each of its layers, not {sorted(modules)}")
    return per_stack, outside


def apply(params, adapter: Mapping, scale: float):
    """`params` with the adapter beside every adapted kernel, for training: the linear layer at
    ``X.kernel`` gets ``X.lora_a = a`` and ``X.lora_b = scale * b`` (fp32; in the layer stacks, one
    slot per adapted entry, [m, in, r] / [m, r, out]), and computes x W + (x a)(scale b)
    (`models.layers.Dense`). The kernel itself is untouched, so the backward never forms a gradient
    for it: per adapted kernel one product (dx) instead of two. Pure and differentiable in
    `adapter`; call it inside the jitted step. Same function as `merge` up to rounding (the sum
    happens on the activations instead of in the weights). A kernel outside the decoder layers (a
    pattern target such as ``lm_head.kernel``, which the head reads directly rather than through
    its layer) is merged instead."""
    per_stack, outside = by_stack(params, adapter)
    out = params
    for path, ab in outside.items():
        out = _set(out, _keys(path), _merged_kernel(_get(params, _keys(path)), ab, scale))
    for p, modules in per_stack.items():
        for rest, (_, a_list, b_list) in modules.items():
            module = (stack.BLOCKS, p) + _keys(rest.removesuffix(SEP + "kernel"))
            a = jnp.stack([x.astype(jnp.float32) for x in a_list])
            b = scale * jnp.stack([x.astype(jnp.float32) for x in b_list])
            out = _set(out, module + ("lora_a",), a)
            out = _set(out, module + ("lora_b",), b)
    return out


def merged(params, adapter: Mapping, scale: float):
    """`params` with every adapted kernel replaced by (W + scale * a @ b), summed in fp32 and cast
    to W's dtype."""
    per_stack, outside = by_stack(params, adapter)
    out = params
    for path, ab in outside.items():
        out = _set(out, _keys(path), _merged_kernel(_get(params, _keys(path)), ab, scale))
    for p, modules in per_stack.items():
        for rest, (js, a_list, b_list) in modules.items():
            keys = (stack.BLOCKS, p) + _keys(rest)
            w = _get(params, keys)
            a = jnp.stack([x.astype(jnp.float32) for x in a_list])
            b = jnp.stack([x.astype(jnp.float32) for x in b_list])
            d = scale * jnp.einsum("mir,mro->mio", a, b, precision=jax.lax.Precision.HIGHEST)
            lo = js[0]
            new = (w[lo:].astype(jnp.float32) + d).astype(w.dtype)
            out = _set(out, keys, jnp.concatenate([w[:lo], new]) if lo else new)
    return out


def _merged_kernel(w, ab: Mapping, scale: float):
    return (w.astype(jnp.float32) + delta(ab, scale)).astype(w.dtype)


def merge(params, adapter: Mapping, scale: float):
    """Plain weights with the adapter folded in (fp32 sum, then the base dtype): what a run
    directory serves, jitted once over the whole tree."""
    return jax.jit(merged)(params, adapter, scale) if adapter else params


def n_params(tree) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(tree)))
