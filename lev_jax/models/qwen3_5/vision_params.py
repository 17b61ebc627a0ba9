"""The Qwen3.5 vision tower's weights from a Qwen3_5ForConditionalGeneration safetensors checkpoint.

Our tree mirrors HF's module names (vision.abstract_params), so the name table is derived from it:
`X.kernel` <- `X.weight` transposed (Linear: [out, in] -> [in, out]; the patch embedding's Conv3d
[E, C, T, P, P] is flattened to [E, C*T*P*P] first, the order in which a patch row is laid out),
`X.scale` <- a LayerNorm's `X.weight`, `X.embedding` <- an Embedding's `X.weight`, biases as they are.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lev_jax.loaders import hf, name_map
from lev_jax.models.qwen3_5.vision import VisionConfig, abstract_params

# Where checkpoints put the tower: transformers 5 nests it under model., older exports did not.
PREFIXES = ("model.visual.", "visual.")
_HF_LEAF = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


def _key(k) -> str:
    return str(k.idx) if isinstance(k, jax.tree_util.SequenceKey) else str(k.key)


def hf_names(cfg: VisionConfig) -> dict[str, tuple]:
    """HF tensor name (without the prefix) -> our tree path, for every leaf of the tree."""
    out = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]:
        parts = [_key(k) for k in path]
        out[".".join(parts[:-1] + [_HF_LEAF[parts[-1]]])] = path
    return out


def _layout(arr, path):
    """An HF tensor in our layout (kernels [in, out])."""
    if _key(path[-1]) != "kernel":
        return arr
    return arr.reshape(arr.shape[0], -1).T  # Linear [out, in]; Conv3d [out, C, T, P, P] flattened first


def load(ckpt_dir, cfg: VisionConfig, dtype="float32") -> dict:
    """The tower's parameter tree, every leaf cast to `dtype`. Tensors outside the tower are ignored;
    every problem with the tower's own (missing, unexpected, mis-shaped) is reported in one
    CheckpointError."""
    ckpt_dir = Path(ckpt_dir)
    dt = jnp.dtype(dtype)
    abstract = abstract_params(cfg, dt)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shapes = {path: sds.shape for path, sds in leaves}
    expected = hf_names(cfg)
    filled, unexpected, misshaped = {}, [], []
    for name, arr in hf.iter_tensors(hf.shard_files(ckpt_dir)):
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue  # the language model, mtp heads, ...
        path = expected.get(name[len(prefix) :])
        if path is None:
            unexpected.append(name)
            continue
        value = _layout(np.asarray(arr), path)  # on the host: eager jnp ops would compile per shape
        if tuple(value.shape) != shapes[path]:
            misshaped.append(f"{name}: got {tuple(arr.shape)}, expected {shapes[path]} (after layout change)")
            continue
        filled[path] = jnp.asarray(value.astype(dt))
    missing = [PREFIXES[0] + hf_name for hf_name, path in expected.items() if path not in filled]
    name_map.check_complete(f"the vision tower of {ckpt_dir}", missing, unexpected, misshaped)
    return jax.tree_util.tree_unflatten(treedef, [filled[path] for path, _ in leaves])
