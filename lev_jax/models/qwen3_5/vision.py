"""Qwen3.5 vision tower as pure functions over a plain parameter tree: one image (or clip) in, the
merged patch features the language model reads out.

patches [N, C*T*P*P] -> patch embed (Conv3d with kernel = stride, i.e. one linear map per patch)
-> + learned position table resampled bilinearly to the image's grid -> `depth` pre-LayerNorm blocks
(full non-causal attention within each frame, axial 2-D rope on (row, col)) -> merger (LayerNorm,
each merge x merge block of patches concatenated, fc1, exact GELU, fc2) -> [N / merge^2, out_hidden].

Rows are in the processor's order: frame-major, then merge blocks in raster order, then the patches
inside a block in raster order. Positions, the pos-embed resampling and the merger all assume it.
Shape suffixes: N patches of the image, E tower width, H heads, D head dim, F rope frequencies per
token (D / 2), M merged tokens, O output width.
Mixed precision as in layers.py: matmul inputs in the weights' dtype with fp32 accumulation; the
residual stream, LayerNorm statistics, rope, softmax and the position table's resampling are fp32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lev_jax import programs
from lev_jax.models.layers import apply_rope, einsum, matmul

LN_EPS = 1e-6  # every LayerNorm of the tower (fixed in the reference, not in the config)

# hidden_act of the blocks' MLP -> activation (the merger always uses the exact, erf GELU)
ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),  # the same tanh formula
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, d: dict) -> VisionConfig | None:
        """From a whole checkpoint config.json; None when it has no vision tower. Missing keys take
        transformers' Qwen3_5VisionConfig defaults."""
        v = d.get("vision_config")
        if v is None:
            return None
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope['rope_type']!r}: only 'axial' rope is supported")
        cfg = cls(
            depth=int(v.get("depth", 27)),
            hidden_size=int(v.get("hidden_size", 1152)),
            intermediate_size=int(v.get("intermediate_size", 4304)),
            num_heads=int(v.get("num_heads", 16)),
            patch_size=_one_size(v.get("patch_size", 16), "patch_size"),
            temporal_patch_size=_one_size(v.get("temporal_patch_size", 2), "temporal_patch_size"),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            in_channels=int(v.get("in_channels", 3)),
            out_hidden_size=int(v.get("out_hidden_size", 3584)),
            num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
            hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {cfg.hidden_act!r} is not supported (known: {', '.join(ACTIVATIONS)})")
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            # the axial rope gives D/4 frequencies to rows and D/4 to columns, each used twice
            raise ValueError(
                f"vision hidden_size {cfg.hidden_size} over {cfg.num_heads} heads: the head dim must be a multiple of 4"
            )
        if v.get("head_dim") not in (None, cfg.head_dim):
            raise ValueError(f"vision head_dim {v['head_dim']} != hidden_size / num_heads = {cfg.head_dim}")
        if v.get("deepstack_visual_indexes"):
            raise ValueError("deepstack vision features (Qwen3-VL) are not supported")
        if cfg.grid_side < 1:
            raise ValueError(f"vision num_position_embeddings {cfg.num_position_embeddings} is not a square table")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        # the learned table is side x side; like the reference, a non-square count uses its first side^2 rows
        return math.isqrt(self.num_position_embeddings)


def _one_size(x, name: str) -> int:
    """patch sizes may be written per axis ([p, p]); this tower runs square, equal ones only."""
    sizes = {int(s) for s in x} if isinstance(x, list | tuple) else {int(x)}
    if len(sizes) != 1:
        raise ValueError(f"vision {name} {x}: only one size for every axis is supported")
    return sizes.pop()


# ------------------------------------------------------------------------------ parameters


def _shapes(cfg: VisionConfig) -> dict:
    E, F, O = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size
    ME = E * cfg.merge_unit
    linear = lambda i, o: {"kernel": (i, o), "bias": (o,)}
    norm = lambda n: {"scale": (n,), "bias": (n,)}
    block = lambda: {
        "norm1": norm(E),
        "attn": {"qkv": linear(E, 3 * E), "proj": linear(E, E)},
        "norm2": norm(E),
        "mlp": {"linear_fc1": linear(E, F), "linear_fc2": linear(F, E)},
    }
    return {
        "patch_embed": {"proj": linear(cfg.patch_dim, E)},
        "pos_embed": {"embedding": (cfg.num_position_embeddings, E)},
        "blocks": [block() for _ in range(cfg.depth)],
        "merger": {"norm": norm(E), "linear_fc1": linear(ME, ME), "linear_fc2": linear(ME, O)},
    }


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def abstract_params(cfg: VisionConfig, dtype="float32") -> dict:
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dt), _shapes(cfg), is_leaf=_is_shape)


def random_params(cfg: VisionConfig, dtype="float32", seed: int = 0) -> dict:
    """Random weights of the right shapes and sensible scales (norm scales near 1, nonzero biases so
    every parameter's role shows in a comparison)."""
    rng = np.random.default_rng(seed)

    def init(path, sds):
        leaf = path[-1].key
        if leaf == "kernel":
            x = rng.standard_normal(sds.shape) / np.sqrt(sds.shape[0])
        elif leaf == "scale":
            x = 1.0 + 0.1 * rng.standard_normal(sds.shape)
        else:  # biases, the position table
            x = 0.02 * rng.standard_normal(sds.shape)
        return jnp.asarray(x, sds.dtype)

    return jax.tree_util.tree_map_with_path(init, abstract_params(cfg, dtype))


# ------------------------------------------------------------------------------ per-grid tables


@functools.lru_cache(maxsize=64)
def grid_tables(h: int, w: int, merge: int, side: int, head_dim: int, theta: float):
    """Everything that depends on the grid only, for one frame's h*w patches in processor order
    (frames repeat it): the 4 bilinear taps into the side x side position table and their weights
    ([h*w, 4] int32 / fp32), and the axial rope's cos and sin ([h*w, D/2] fp32: D/4 row frequencies,
    then D/4 column frequencies). numpy, evaluated once per grid, baked into the program as constants."""
    # (row, col) of each patch: merge blocks in raster order, raster order inside a block
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    block = lambda a: a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)
    row_N, col_N = block(rows), block(cols)

    def axis(index, size):
        """bilinear, align_corners=True: target 0 and size-1 land on source 0 and side-1 exactly.
        fp32 arithmetic in the reference's order, so the weights match it to the last bit."""
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        lo = np.floor(src)
        offsets = np.arange(2)
        taps = np.clip(lo.astype(np.int64)[:, None] + offsets, 0, side - 1)
        # hat kernel 1 - |distance|: a tap clipped at the edge (src = side-1 exactly) gets weight 0
        dist = np.abs(src[:, None] - lo[:, None] - offsets.astype(np.float32))
        return taps, np.maximum(np.float32(1) - dist, np.float32(0))

    h_taps, h_w = axis(row_N, h)
    w_taps, w_w = axis(col_N, w)
    idx_N4 = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4).astype(np.int32)
    wts_N4 = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)

    half = head_dim // 2
    inv_freq = (1.0 / (theta ** (np.arange(0, half, 2, dtype=np.float32) / half))).astype(np.float32)
    ang_NF = np.concatenate([row_N[:, None] * inv_freq, col_N[:, None] * inv_freq], axis=1).astype(np.float32)
    return idx_N4, wts_N4, np.cos(ang_NF), np.sin(ang_NF)


# ------------------------------------------------------------------------------ the tower


def _linear(p, x):
    return matmul(x, p["kernel"]) + p["bias"].astype(jnp.float32)


def _layer_norm(p, x):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + LN_EPS)
    return y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)


def _attention(p, x_tNE, cos_NF, sin_NF, cfg: VisionConfig):
    """Full (non-causal) attention among the patches of each frame; frames never see each other."""
    t, N, E = x_tNE.shape
    H, D = cfg.num_heads, cfg.head_dim
    qkv = _linear(p["qkv"], x_tNE).reshape(t, N, 3, H, D)  # fp32
    q_tNHD = apply_rope(qkv[:, :, 0], cos_NF[None], sin_NF[None])
    k_tNHD = apply_rope(qkv[:, :, 1], cos_NF[None], sin_NF[None])
    dt = p["qkv"]["kernel"].dtype
    scores = einsum("tqhd,tkhd->thqk", (q_tNHD * D**-0.5).astype(dt), k_tNHD.astype(dt))
    probs = jax.nn.softmax(scores, axis=-1)  # fp32
    out_tNHD = einsum("thqk,tkhd->tqhd", probs.astype(dt), qkv[:, :, 2].astype(dt))
    return _linear(p["proj"], out_tNHD.reshape(t, N, E))


def _block(p, x_tNE, cos_NF, sin_NF, cfg: VisionConfig):
    x_tNE = x_tNE + _attention(p["attn"], _layer_norm(p["norm1"], x_tNE), cos_NF, sin_NF, cfg)
    act = ACTIVATIONS[cfg.hidden_act]
    h = act(_linear(p["mlp"]["linear_fc1"], _layer_norm(p["norm2"], x_tNE)))
    return x_tNE + _linear(p["mlp"]["linear_fc2"], h)


@programs.program(("grid_thw", "cfg"))
def _encode(params, pixel_values_ND, grid_thw: tuple[int, int, int], cfg: VisionConfig):
    t, h, w = grid_thw
    E, N = cfg.hidden_size, h * w
    idx_N4, wts_N4, cos_NF, sin_NF = grid_tables(
        h, w, cfg.spatial_merge_size, cfg.grid_side, cfg.head_dim, cfg.rope_theta
    )
    x_tNE = _linear(params["patch_embed"]["proj"], pixel_values_ND).reshape(t, N, E)
    table = params["pos_embed"]["embedding"].astype(jnp.float32)
    pos_NE = jnp.sum(table[idx_N4] * wts_N4[..., None], axis=1)
    x_tNE = x_tNE + pos_NE[None]
    for p in params["blocks"]:
        x_tNE = _block(p, x_tNE, cos_NF, sin_NF, cfg)
    m = params["merger"]
    # LayerNorm per patch, then each block of merge_unit consecutive patches becomes one token
    x_ME = _layer_norm(m["norm"], x_tNE).reshape(t * N // cfg.merge_unit, cfg.merge_unit * E)
    x_ME = jax.nn.gelu(_linear(m["linear_fc1"], x_ME), approximate=False)
    return _linear(m["linear_fc2"], x_ME)


def encode(params, pixel_values_ND, grid_thw, cfg: VisionConfig):
    """Features [t*h*w / merge_unit, out_hidden_size] (fp32) of one image or clip.

    `pixel_values_ND`: the processor's flattened patches of this image, [t*h*w, patch_dim], in its
    order; `grid_thw`: its (t, h, w) in patches (the processor's image_grid_thw row; t = 1 for a
    still image). One compiled program per (grid, config)."""
    t, h, w = (int(n) for n in grid_thw)
    m = cfg.spatial_merge_size
    if min(t, h, w) < 1 or h % m or w % m:
        raise ValueError(f"grid {(t, h, w)}: h and w must be positive multiples of spatial_merge_size {m}")
    if tuple(pixel_values_ND.shape) != (t * h * w, cfg.patch_dim):
        raise ValueError(
            f"pixel values of shape {tuple(pixel_values_ND.shape)} for grid {(t, h, w)}: "
            f"expected {(t * h * w, cfg.patch_dim)}"
        )
    return _encode(params, pixel_values_ND, (t, h, w), cfg)
