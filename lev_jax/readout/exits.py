"""Exit readouts (elastic depth): the label readout applied to the residual stream after layer d.

An exit adapter maps the residual stream after layer d towards what the final layer would have
produced, so the model's own final norm and vocabulary/label head are shared by every exit:

    x_d  -> x_d + (rmsnorm(x_d) * scale) @ a @ b  -> final norm -> * gain -> label rows of the head

`a` [E, r] and `b` [r, E] are low rank (`b` starts at zero and `gain` at one: an untrained exit is
the plain "logit lens" of layer d); the norm's statistics are fp32. `gain` [E] is the exit's own
weight on the shared final norm: its logit scale (models.layers.exit_gain says why it is needed).
Adapters are a plain pytree {str(d): adapter}, trained like a LoRA tree; the exit at d = L (the
full model) has none and is today's readout exactly.

Rows are read at exits by `readout.logits.rows_exit_logits` (the readout every row goes through);
`elastic.cascade` computes prefixes to a depth and continues them deeper, `elastic.serving` serves
depth="auto" with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lev_jax import models
from lev_jax.models.layers import EXIT_KEYS, exit_gain, exit_map, exit_params

EXITS_KEY = "exits"  # where a training state's trainable tree holds the exit adapters, beside the adapter
DEFAULT = "default"  # the spec of L/4, L/2, 3L/4 (and L)


def parse_spec(spec: str) -> str:
    """A validated exits spec: "" (none), "default", or comma-separated layer counts ("4,8,12");
    ValueError otherwise (the model's depth is checked when it is known, `depths_of`)."""
    spec = spec.strip()
    if spec in ("", DEFAULT):
        return spec
    parts = [x.strip() for x in spec.split(",") if x.strip()]
    if not parts or not all(x.isdigit() for x in parts):
        raise ValueError(f"exits must be '', {DEFAULT!r} or comma-separated layer counts, not {spec!r}")
    return ",".join(parts)


def depths_of(spec: str, cfg) -> tuple[int, ...]:
    """The exit depths below the model's depth L that `spec` names (L itself needs no adapter)."""
    spec = parse_spec(spec)
    if not spec:
        return ()
    depths = default_depths(cfg) if spec == DEFAULT else check_depths(cfg, [int(x) for x in spec.split(",")])
    return tuple(d for d in depths if d < models.num_layers(cfg))


def init_exits(cfg, depths, rank: int = 8, seed: int = 0, dtype: str = "float32") -> dict:
    """Fresh adapters for every exit in `depths` below the model's depth (the last layer needs none).
    `a` ~ normal(0, 1/sqrt(E)), `b` = 0, `scale` = `gain` = 1."""
    L, E = models.num_layers(cfg), int(cfg.hidden_size)
    depths = check_depths(cfg, depths)
    out = {}
    for d in (d for d in depths if d < L):
        key = jax.random.fold_in(jax.random.key(seed), d)
        out[str(d)] = {
            "scale": jnp.ones((E,), jnp.float32),
            "a": (jax.random.normal(key, (E, rank), jnp.float32) / jnp.sqrt(E)).astype(dtype),
            "b": jnp.zeros((rank, E), dtype),
            "gain": jnp.ones((E,), jnp.float32),
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
    """The adapter's residual map of a raw residual stream [..., E] (fp32 out; models.layers.exit_map,
    the one a model truncated at the exit applies too)."""
    return exit_map(x_raw, adapter["scale"], adapter["a"], adapter["b"])


def exit_hidden(params, exits, x_raw, depth: int, cfg):
    """The final-normed hidden state an exit at `depth` reads labels from: the model's own final
    norm of the raw stream at d = L, of the adapted stream below (times the exit's gain). KeyError
    names a missing exit."""
    if depth >= models.num_layers(cfg):
        return models.final_norm(params, x_raw, cfg)
    if str(depth) not in exits:
        raise KeyError(f"no exit adapter at depth {depth}; trained exits: {sorted(map(int, exits))}")
    adapter = exit_params(exits[str(depth)])
    return exit_gain(models.final_norm(params, apply_exit(adapter, x_raw), cfg), adapter["gain"])


def exits_tensors(exits: dict, prefix: str = "exits.") -> dict[str, np.ndarray]:
    """The adapters as named fp32 arrays (safetensors): "exits.{d}.{scale,a,b,gain}"."""
    return {f"{prefix}{d}.{k}": np.array(v, np.float32) for d, a in exits.items() for k, v in exit_params(a).items()}


def exits_from_tensors(tensors: dict, cfg, prefix: str = "exits.") -> dict:
    """The adapters back from `exits_tensors`' names; ValueError naming what is missing, mis-shaped
    or deeper than the model. Adapters saved before exits had a gain get the identity gain."""
    E, L = int(cfg.hidden_size), models.num_layers(cfg)
    depths = sorted({int(k[len(prefix) :].split(".")[0]) for k in tensors if k.startswith(prefix)})
    if not depths:
        raise ValueError("no exit adapters in these tensors")
    out = {}
    for d in depths:
        if not 1 <= d < L:
            raise ValueError(f"an exit adapter at depth {d}: the model's exits are at 1..{L - 1}")
        need = [f"{prefix}{d}.{k}" for k in EXIT_KEYS if k != "gain"]
        missing = [n for n in need if n not in tensors]
        if missing:
            raise ValueError(f"the exit adapters lack {', '.join(missing)}")
        names = {k: f"{prefix}{d}.{k}" for k in EXIT_KEYS if f"{prefix}{d}.{k}" in tensors}
        a = exit_params({k: jnp.asarray(np.asarray(tensors[n], np.float32)) for k, n in names.items()})
        r = a["a"].shape[-1]
        shapes = (a["scale"].shape, a["a"].shape, a["b"].shape, a["gain"].shape)
        if shapes != ((E,), (E, r), (r, E), (E,)):
            raise ValueError(f"the exit adapter at depth {d} does not fit hidden size {E}")
        out[str(d)] = a
    return out
