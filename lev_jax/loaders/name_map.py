"""HF tensor names -> our parameter paths, driven by the model's own (abstract) parameter tree.

The table below is the only per-format knowledge: which prefixes a checkpoint may put in front of the
language model, which tensors to ignore, and how a few leaves change layout. Everything else follows
from the NNX module names, which mirror HF's (layers.N.self_attn.q_proj, ...):
`...X.weight` becomes `X.kernel` (transposed: HF stores [out, in]) when X is a Linear,
`X.embedding` when X is an Embed, and stays `X.weight` for norms.
"""

from __future__ import annotations

import re

import numpy as np

from lev_jax.errors import CheckpointError
from lev_jax.models import stack

# Longest first: the VL checkpoint nests the text model under model.language_model.
PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
# Tensors a text backbone does not use (vision tower, multi-token-prediction head, rotary caches).
IGNORED = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.)|rotary_emb\.inv_freq$")


def _leaf_paths(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaf_paths(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _to_path(parts):
    return tuple(int(p) if p.isdigit() else p for p in parts)


def resolve(hf_name: str, expected: dict):
    """(path, transform) for an HF tensor name, or None if it does not belong to this model."""
    for prefix in PREFIXES:
        if not hf_name.startswith(prefix):
            continue
        rest = hf_name[len(prefix) :]
        parts = rest.split(".")
        *module, leaf = parts
        base = _to_path(module)
        candidates = []
        if leaf == "weight":
            candidates = [(base + ("kernel",), "transpose"), (base + ("embedding",), None), (base + ("weight",), None)]
            if module and module[-1] == "conv1d":  # depthwise conv: [C, 1, K] -> [K, C]
                candidates = [(base, "conv")]
        elif leaf == "bias":
            candidates = [(base + ("bias",), None)]
        else:  # bare parameters: A_log, dt_bias
            candidates = [(base + (leaf,), None)]
        for path, transform in candidates:
            if path in expected:
                return path, transform
    return None


def apply_transform(arr: np.ndarray, transform):
    if transform == "transpose":
        return arr.T
    if transform == "conv":
        return arr.reshape(arr.shape[0], arr.shape[-1]).T
    return arr


def check_complete(source: str, missing, unexpected, misshaped) -> None:
    """The loader's one-error report: every missing, unexpected and mis-shaped tensor of a
    checkpoint in one CheckpointError (nothing raised when all three are empty)."""
    if missing or unexpected or misshaped:
        lines = [f"cannot load {source}:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if items:
                shown = ", ".join(items[:20]) + (f", ... ({len(items)} in all)" if len(items) > 20 else "")
                lines.append(f"  {title} tensors: {shown}")
        raise CheckpointError("\n".join(lines))


def assemble(named_tensors, abstract, cast, *, tied: bool, source: str):
    """Fill the abstract parameter tree from (hf_name, array) pairs.

    The checkpoint names one tensor per layer: the tree is filled in its per-layer view
    (models.stack.layer_view) and its layers stacked once at the end. `cast(path, array)` converts
    a host array to the stored dtype (`path` in the per-layer view). Collects every problem
    (missing, unexpected, mis-shaped) and raises one CheckpointError naming them all.
    """
    period = len(abstract[stack.BLOCKS])
    expected = dict(_leaf_paths(stack.layer_view(abstract)))
    filled, unexpected, misshaped = {}, [], []
    for name, arr in named_tensors:
        if IGNORED.search(name):
            continue
        hit = resolve(name, expected)
        if hit is None:
            if tied and name.endswith("lm_head.weight"):
                continue  # tied checkpoints may still carry a copy of the embedding
            unexpected.append(name)
            continue
        path, transform = hit
        value = apply_transform(arr, transform)
        want = tuple(expected[path].shape)
        if tuple(value.shape) != want:
            misshaped.append(f"{name}: got {tuple(arr.shape)}, expected {want} (after layout change)")
            continue
        filled[path] = cast(path, value)
    missing = [".".join(map(str, p)) for p in expected if p not in filled]
    check_complete(source, missing, unexpected, misshaped)
    params: dict = {}
    for path, value in filled.items():
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return stack.stacked_view(params, period)
