"""LoRA adapters as pure parameter trees.

An adapter is a plain dict ``{weight path: {"a": [in, r], "b": [r, out]}}`` keyed by the dotted path
of a base kernel (``"layers.3.self_attn.q_proj.kernel"``). It lives apart from the frozen base, so
only the adapter goes to ``jax.value_and_grad`` and to the optimiser (the base never enters optimiser
state), and it checkpoints and shards like any pytree.

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
    """{dotted path: leaf} of a nested parameter dict."""
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def layer_of(path: str) -> int | None:
    """The decoder layer index of a dotted path (``layers.7.mlp...`` -> 7), None outside the layers."""
    parts = path.split(SEP)
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def target_paths(params, targets: Iterable[str] = DEFAULT_TARGETS, top_layers: int = 0) -> list[str]:
    """Paths of the 2-D kernels LoRA adapts: a kernel whose module name is a target, or whose path
    matches a target given as a regular expression (``re.fullmatch`` on the dotted path).
    `top_layers` > 0 keeps only the last that many decoder layers: no gradient then flows below
    them, so the layers underneath run forward only (no backward, no saved activations)."""
    names = set(targets)
    patterns = [re.compile(t) for t in names if any(c in t for c in "\\.*+?[](|)^$")]
    out = []
    for path, x in flatten(params).items():
        parts = path.split(SEP)
        if parts[-1] != "kernel" or np.ndim(x) != 2:
            continue
        if parts[-2] in names or any(p.fullmatch(path) for p in patterns):
            out.append(path)
    if top_layers > 0:  # the model's last layers, whichever of their kernels the targets picked
        n_layers = 1 + max((i for p in flatten(params) if (i := layer_of(p)) is not None), default=-1)
        out = [p for p in out if (i := layer_of(p)) is not None and i >= n_layers - top_layers]
    return out


def init(
    params, rank: int, *, targets: Iterable[str] = DEFAULT_TARGETS, top_layers: int = 0, seed: int = 0, key=None
) -> dict:
    """A fresh fp32 adapter for `params`: a ~ U(-1/sqrt(in), 1/sqrt(in)), b = 0 (`top_layers`:
    see `target_paths`)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    flat = flatten(params)
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


def _set(tree, path: str, value):
    """A copy of nested dict `tree` with the leaf at `path` replaced (only the dicts on the path are
    copied; every other leaf is shared)."""
    keys = path.split(SEP)

    def go(node, i):
        k = keys[i]
        key = int(k) if k not in node and k.isdigit() else k
        new = dict(node)
        new[key] = value if i == len(keys) - 1 else go(node[key], i + 1)
        return new

    return go(tree, 0)


def _get(tree, path: str):
    node = tree
    for k in path.split(SEP):
        node = node[k] if k in node else node[int(k)]
    return node


def apply(params, adapter: Mapping, scale: float):
    """`params` with the adapter beside every adapted kernel, for training: the linear layer at
    ``X.kernel`` gets ``X.lora_a = a`` and ``X.lora_b = scale * b`` (fp32), and computes
    x W + (x a)(scale b) (`models.layers.Dense`). The kernel itself is untouched, so the backward
    never forms a gradient for it: per adapted kernel one product (dx) instead of two. Pure and
    differentiable in `adapter`; call it inside the jitted step. Same function as `merge` up to
    rounding (the sum happens on the activations instead of in the weights). A kernel outside the
    decoder layers (a pattern target such as ``lm_head.kernel``, which the head reads directly
    rather than through its layer) is merged instead."""
    out = params
    for path, ab in adapter.items():
        if layer_of(path) is None:
            out = _set(out, path, _merged_kernel(_get(params, path), ab, scale))
            continue
        module = path.removesuffix(SEP + "kernel")
        out = _set(out, module + SEP + "lora_a", ab["a"].astype(jnp.float32))
        out = _set(out, module + SEP + "lora_b", scale * ab["b"].astype(jnp.float32))
    return out


def merged(params, adapter: Mapping, scale: float):
    """`params` with every adapted kernel replaced by (W + scale * a @ b), summed in fp32 and cast
    to W's dtype."""
    out = params
    for path, ab in adapter.items():
        out = _set(out, path, _merged_kernel(_get(params, path), ab, scale))
    return out


def _merged_kernel(w, ab: Mapping, scale: float):
    return (w.astype(jnp.float32) + delta(ab, scale)).astype(w.dtype)


def merge(params, adapter: Mapping, scale: float):
    """Plain weights with the adapter folded in (fp32 sum, then the base dtype): what a run
    directory serves, jitted once over the whole tree."""
    return jax.jit(merged)(params, adapter, scale) if adapter else params


def n_params(tree) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(tree)))
