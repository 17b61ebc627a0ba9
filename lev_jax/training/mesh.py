"""The device mesh and the one table of sharding rules.

Axes (data, fsdp, tensor):
* data   - pure data parallelism: the batch is split, weights are replicated;
* fsdp   - data parallelism with sharded weights (ZeRO-3): the batch is split over it too, and every
           weight's "model width" dimension is sharded over it (gathered per layer by XLA);
* tensor - tensor parallelism: each weight's other dimension (heads, MLP width, vocabulary).

The axis types are given explicitly as `Auto`: the backbones are pure functions written for
compiler-propagated sharding (GSPMD), so jit's in/out shardings pin the parameters, the batch and
the results, and XLA places the rest. (`Explicit` axes would need a sharding annotation on every
contraction inside the model code.)

`RULES` is the one table: a parameter's dotted path (lora.path_str) -> how its dimensions shard (a
layer stack's leading layer axis, models.stack, is never sharded: the scan steps along it). A
dimension whose size the mesh axis does not divide stays replicated, so any model runs on any mesh
(a tiny test model on 2x2x2 included). A LoRA factor shards like its base kernel: `a` [in, r] takes
the kernel's input-dimension rule, `b` [r, out] its output-dimension rule.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lev_jax.models import stack
from lev_jax.training import lora
from lev_jax.training.config import ConfigError

AXES = ("data", "fsdp", "tensor")
AXIS_TYPES = (AxisType.Auto,) * len(AXES)
BATCH_AXES = ("data", "fsdp")  # the batch dimension of every input is split over these

# (pattern on the dotted path, per-dimension mesh axes). First match wins; no match = replicated.
RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens\.embedding", ("tensor", "fsdp")),  # [vocab, width]
    (r"lm_head\.kernel", ("fsdp", "tensor")),  # [width, vocab]
    # projections out of the model width: [width, heads x dim | mlp width]
    (
        r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj|in_proj_qkv|in_proj_z|in_proj_a|in_proj_b)\.kernel",
        ("fsdp", "tensor"),
    ),
    # projections back into the model width: [heads x dim | mlp width, width]
    (r".*\.(o_proj|down_proj|out_proj)\.kernel", ("tensor", "fsdp")),
    (r".*\.(q_proj|k_proj|v_proj)\.bias", ("tensor",)),
    # norms, conv taps, A_log, dt_bias: small, replicated
)
_COMPILED = tuple((re.compile(p), axes) for p, axes in RULES)


def parse(spec: str, n_devices: int) -> dict[str, int]:
    """ "data=2,fsdp=2,tensor=2" -> {axis: size}; axes not named are 1; "" puts every device on data.
    The sizes must multiply to the device count."""
    sizes = {a: 1 for a in AXES}
    if not spec.strip():
        sizes["data"] = n_devices
        return sizes
    for part in spec.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in AXES:
            raise ConfigError(f"--mesh takes {'=N,'.join(AXES)}=N, got {spec!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ConfigError(f"--mesh {name}={value}: not an integer") from None
        if sizes[name] < 1:
            raise ConfigError(f"--mesh {name}={value}: must be >= 1")
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(f"--mesh {spec} needs {math.prod(sizes.values())} devices; {n_devices} are visible")
    return sizes


def make(spec: str = "", devices: Sequence | None = None) -> Mesh:
    devices = list(devices) if devices is not None else jax.devices()
    sizes = parse(spec, len(devices))
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=AXIS_TYPES, devices=devices)


def rule(path: str) -> tuple[str | None, ...] | None:
    for pattern, axes in _COMPILED:
        if pattern.fullmatch(path):
            return axes
    return None


def spec_for(axes: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh) -> P:
    """A PartitionSpec for `shape` from per-dimension axes, dropping any axis that does not divide."""
    if axes is None:
        return P()
    dims = []
    for i, size in enumerate(shape):
        ax = axes[i] if i < len(axes) else None
        dims.append(ax if ax is not None and size % mesh.shape[ax] == 0 and mesh.shape[ax] > 1 else None)
    while dims and dims[-1] is None:
        dims.pop()
    return P(*dims)


def param_shardings(params, mesh: Mesh):
    """NamedShardings for a parameter tree, by `RULES`."""

    def one(path, x):
        name = lora.path_str(path)
        axes = rule(name)
        if axes is not None and name.startswith(stack.BLOCKS + "."):  # a layer stack: the layer axis unsharded
            axes = (None, *axes)
        return NamedSharding(mesh, spec_for(axes, np.shape(x), mesh))

    return jax.tree_util.tree_map_with_path(one, params)


def adapter_shardings(adapter: Mapping, mesh: Mesh):
    """NamedShardings for a LoRA tree: `a` like its kernel's input dim, `b` like its output dim."""
    out = {}
    for path, ab in adapter.items():
        axes = rule(path) or (None, None)
        out[path] = {
            "a": NamedSharding(mesh, spec_for((axes[0], None), ab["a"].shape, mesh)),
            "b": NamedSharding(mesh, spec_for((None, axes[1]), ab["b"].shape, mesh)),
        }
    return out


def like(tree, reference, reference_shardings, mesh: Mesh):
    """Shardings for `tree` (an optimiser state): a leaf whose path ends with a path of `reference`
    (the trainable tree; optax's moments mirror it) and has its shape takes that leaf's sharding;
    anything else (step counts, scalars) is replicated."""
    ref = {
        tuple(_keys(p)): (np.shape(x), s)
        for (p, x), s in zip(jax.tree_util.tree_flatten_with_path(reference)[0], jax.tree.leaves(reference_shardings))
    }
    depth = max((len(k) for k in ref), default=0)

    def one(path, x):
        keys = _keys(path)
        for n in range(depth, 0, -1):
            hit = ref.get(tuple(keys[-n:]))
            if hit is not None and hit[0] == np.shape(x):
                return hit[1]
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, tree)


def _keys(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """The leading (batch) dimension split over BATCH_AXES, the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))) if ndim else P())


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_multiple(mesh: Mesh) -> int:
    """Every batch dimension is padded to a multiple of this (the devices the batch is split over)."""
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
