"""The stacked layer layout: decoder layers as a few stacks with a leading layer axis, so the decoder
is a `jax.lax.scan` and a program's compile cost does not grow with depth.

A model whose layer kinds repeat with period P (Llama-family: P = 1; Qwen3.5: three Gated DeltaNet
layers and one gated attention layer, P = 4) keeps P stacks, `params["blocks"][p]` for p < P: stack p
holds layers p, p + P, p + 2P, ... along axis 0. Layer i is entry `i // P` of stack `i % P`, so one
scan step runs P consecutive layers, one from each stack, and the layout needs nothing but the
params to be read (P = len(blocks)). A model whose kinds do not repeat has P = L (one layer a stack:
correct, only not cheaper to compile). Caches mirror it: `cache["blocks"][p]` stacks the layer
caches of stack p.

LoRA slots (`lora_a` [m, in, r], `lora_b` [m, r, out]) in stack p adapt its last m entries: adapters
always sit on the model's last K layers (`training.lora`), which is a suffix of every stack.

On disk every format (HF safetensors, GGUF, peft adapters) is per layer; the loaders fill the
per-layer view (`layer_view`) and stack once (`stack_layers`); exports unstack.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

BLOCKS = "blocks"  # the params / cache key of the layer stacks
LORA_LEAVES = ("lora_a", "lora_b")


def period(layer_types: Sequence[str]) -> int:
    """The smallest P with layer_types[i] == layer_types[i + P] everywhere (len when none repeats)."""
    n = len(layer_types)
    for p in range(1, n + 1):
        if all(layer_types[i] == layer_types[i + p] for i in range(n - p)):
            return p
    return max(n, 1)


def where(i: int, P: int) -> tuple[int, int]:
    """(stack, entry) of layer i."""
    return i % P, i // P


def layer_at(p: int, j: int, P: int) -> int:
    return j * P + p


def _is_lora(path) -> bool:
    return any(getattr(k, "key", None) in LORA_LEAVES for k in path)


def entries(tree) -> int:
    """The leading (layer) size of a stack: of its base leaves, not its LoRA slots."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not _is_lora(path):
            return int(np.shape(leaf)[0])
    return 0


def depth(blocks: Mapping) -> int:
    """How many layers the stacks (of params or of a cache) hold."""
    return sum(entries(blocks[p]) for p in blocks)


def _stack_leaves(*xs):
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    if all(isinstance(x, np.ndarray) for x in xs):
        return np.stack(xs)
    import jax.numpy as jnp  # deferred only to keep this module's import light for loaders

    return jnp.stack(xs)


def _index(x, j: int):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[j]


def stack_layers(layers: Mapping[int, dict], P: int) -> dict:
    """{layer index: layer tree} -> {stack p: tree with a leading layer axis}."""
    n = len(layers)
    if sorted(layers) != list(range(n)):
        raise ValueError(f"layers must be numbered 0..{n - 1}, got {sorted(layers)}")
    return {p: jax.tree.map(_stack_leaves, *(layers[i] for i in range(p, n, P))) for p in range(min(P, n))}


def unstack_layers(blocks: Mapping[int, dict]) -> dict[int, dict]:
    """The inverse of `stack_layers` (of base weights: adapter slots cover only the last entries)."""
    P = len(blocks)
    out = {}
    for p, tree in blocks.items():
        if any(_is_lora(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]):
            raise ValueError("a stack with adapter slots has no per-layer view (unstack the base weights)")
        for j in range(entries(tree)):
            out[layer_at(p, j, P)] = jax.tree.map(lambda x, j=j: _index(x, j), tree)
    return dict(sorted(out.items()))


def layer_view(params: Mapping) -> dict:
    """`params` with the stacks as per-layer trees under "layers" (the on-disk formats' view)."""
    return {("layers" if k == BLOCKS else k): (unstack_layers(v) if k == BLOCKS else v) for k, v in params.items()}


def stacked_view(params: Mapping, P: int) -> dict:
    """The inverse of `layer_view`."""
    return {(BLOCKS if k == "layers" else k): (stack_layers(v, P) if k == "layers" else v) for k, v in params.items()}


def layer_path(path: str) -> tuple[int, str] | None:
    """A per-layer dotted path ``layers.7.mlp.up_proj.kernel`` -> (7, "mlp.up_proj.kernel"); None
    outside the layers."""
    parts = path.split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1]), ".".join(parts[2:])
    return None
