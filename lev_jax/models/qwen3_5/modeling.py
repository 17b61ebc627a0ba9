"""Qwen3.5 text decoder: Gated DeltaNet layers interleaved with gated full-attention layers.

Per `layer_types`: "linear_attention" = Gated DeltaNet (causal depthwise conv K=4 with carried state,
chunked gated delta rule with an fp32 state, gated RMSNorm); "full_attention" = GQA with a doubled
q_proj whose second half gates the output, per-head zero-centred q/k norm and partial rotary (0.25).
Rotary is M-RoPE: each rotary frequency turns with a temporal, height or width position
(`mrope_section` frequencies each, interleaved t, h, w, t, h, w, ...). Text tokens carry one position on
all three axes, so for text it is plain rotary; image tokens (the vision tower's features, scattered
in at their placeholders) carry their grid row and column.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from lev_jax.models.base import CausalLM
from lev_jax.models.context import Context
from lev_jax.models.layers import MLP, Attention, RMSNorm, dense, kv_cache

CHUNK = 64
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    model_type: str = "qwen3_5_text"
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    # the vision placeholders (a VL checkpoint's top-level config); None for a text-only checkpoint
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    exit_rank: int = 0  # > 0: truncated at an elastic-depth exit (models.exit_view)
    depth_of: int = 0  # > 0: that exit view's full model depth (models.full_config)
    # scan steps (models.scan) unrolled per loop iteration: 1 keeps a program's size independent of
    # depth; the layer count unrolls the whole stack (the program a layer loop in Python would give)
    scan_unroll: int = 1
    # the scan inputs (models.scan.FROZEN) never differentiated through this config's programs: on
    # XLA:CPU they pass the scan as raw 16-bit patterns (a trainer marks what it trains)
    scan_frozen: tuple[str, ...] = ("weights", "adapters", "caches")

    @classmethod
    def from_hf(cls, d: dict) -> Qwen3_5Config:
        vision_ids = {}
        if "text_config" in d:  # the VL checkpoint nests the language model's config
            if "vision_config" in d:
                vision_ids = {
                    k: int(d[k]) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id") if k in d
                }
            d = {
                **d["text_config"],
                "tie_word_embeddings": d.get("tie_word_embeddings", d["text_config"].get("tie_word_embeddings", False)),
            }
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        n_layers = d["num_hidden_layers"]
        layer_types = d.get("layer_types") or [
            "full_attention" if (i + 1) % d.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(n_layers)
        ]
        unknown = set(layer_types) - {"linear_attention", "full_attention"}
        if unknown or len(layer_types) != n_layers:
            raise ValueError(f"bad layer_types for {n_layers} layers: {layer_types}")
        heads = d["num_attention_heads"]
        if rope.get("mrope_interleaved") is False:
            raise ValueError("contiguous (non-interleaved) M-RoPE sections are not supported")
        section = tuple(int(x) for x in rope.get("mrope_section", (11, 11, 10)))
        if len(section) != 3:
            raise ValueError(f"mrope_section must have 3 entries (t, h, w), got {list(section)}")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
            layer_types=tuple(layer_types),
            linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4),
            linear_key_head_dim=d.get("linear_key_head_dim", 128),
            linear_value_head_dim=d.get("linear_value_head_dim", 128),
            linear_num_key_heads=d.get("linear_num_key_heads", 16),
            linear_num_value_heads=d.get("linear_num_value_heads", 32),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            mrope_section=section,
            **vision_ids,
        )

    def model(self, dtype=jnp.float32, rngs=None):
        return Qwen3_5LM(self, dtype=dtype, rngs=rngs or nnx.Rngs(0))

    def layer_module(self, kind: str, dtype=jnp.float32):
        return Qwen3_5Layer(self, kind, dtype=dtype, rngs=nnx.Rngs(0))

    @property
    def conv_dim(self) -> int:
        key_dims = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dims + self.linear_num_value_heads * self.linear_value_head_dim

    def layer_cache(self, batch: int, slots: int, dtype):
        out = []
        for kind in self.layer_types[: self.num_hidden_layers]:
            if kind == "full_attention":
                out.append(kv_cache(batch, self.num_key_value_heads, slots, self.head_dim, dtype))
            else:
                out.append(
                    {
                        "conv": jnp.zeros((batch, self.linear_conv_kernel_dim - 1, self.conv_dim), jnp.float32),
                        "state": jnp.zeros(
                            (batch, self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim),
                            jnp.float32,
                        ),
                    }
                )
        return tuple(out)

    def flops_per_token(self, context: int) -> float:
        E, F = self.hidden_size, self.intermediate_size
        total = 0.0
        for kind in self.layer_types[: self.num_hidden_layers]:
            if kind == "full_attention":
                proj = E * self.head_dim * (3 * self.num_attention_heads + 2 * self.num_key_value_heads)
                total += proj + 2 * self.num_attention_heads * self.head_dim * context
            else:
                vd = self.linear_num_value_heads * self.linear_value_head_dim
                proj = E * (self.conv_dim + vd + 2 * self.linear_num_value_heads) + vd * E
                # per token the delta rule costs ~ a few Dk x Dv products per value head
                total += proj + 4 * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
            total += 3 * E * F
        return 2.0 * total


def mrope_axes(section: tuple[int, int, int], n_freq: int) -> tuple[int, ...]:
    """The position axis (0 temporal, 1 height, 2 width) each rotary frequency turns with, in the
    interleaved layout: frequency f is height when f % 3 == 1 and f < 3 * section[1], width when
    f % 3 == 2 and f < 3 * section[2], temporal otherwise."""
    out = []
    for f in range(n_freq):
        if f % 3 == 1 and f < 3 * section[1]:
            out.append(1)
        elif f % 3 == 2 and f < 3 * section[2]:
            out.append(2)
        else:
            out.append(0)
    return tuple(out)


def _l2norm(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def unit_lower_inverse(a_CC):
    """(I + L)^-1 for L the strictly lower part of `a` ([..., C, C], C a power of two; its diagonal
    and upper part are never read), in plain XLA ops: no LAPACK call.

    Recursive 2x2 block inversion, every block of a level at once: from the inverses X11, X22 of the
    diagonal blocks of size s, the inverse of the block of size 2s is [[X11, 0], [X21, X22]] with
    X21 = -X22 A21 X11 -- log2(C) levels of batched matmuls from the 1x1 blocks (whose inverse is 1) up.
    Why no LAPACK: on CPU, jaxlib 0.10's LAPACK kernels (trsm) fan their batch out on XLA's intra-op
    thread pool and block until it is done, so two solves that XLA runs at the same time -- a training
    step's independent layers, or one program per host device when several run -- can hold every pool
    thread and wait on each other forever. Equal to substitution up to fp32 rounding (the triangular
    inverse by blocks is as stable as by columns: Du Croz & Higham, 1992)."""
    C = a_CC.shape[-1]
    if C & (C - 1):
        raise ValueError(f"unit_lower_inverse needs a power-of-two size, got {C}")
    lead = a_CC.shape[:-2]
    inv = jnp.ones((*lead, C, 1, 1), a_CC.dtype)  # [..., blocks, s, s] at s = 1
    s = 1
    while s < C:
        n = C // (2 * s)
        # the diagonal blocks of size 2s: [..., n, 2s, n, 2s] -> [..., n, 2s, 2s]
        blocks = a_CC.reshape(*lead, n, 2 * s, n, 2 * s)
        idx = jnp.arange(n)
        diag = blocks[..., idx, :, idx, :]  # advanced indices first: [n, ..., 2s, 2s]
        diag = jnp.moveaxis(diag, 0, -3)
        a21 = diag[..., s:, :s]
        pair = inv.reshape(*lead, n, 2, s, s)
        x11, x22 = pair[..., 0, :, :], pair[..., 1, :, :]
        x21 = -jnp.matmul(x22, jnp.matmul(a21, x11, precision=HIGHEST), precision=HIGHEST)
        top = jnp.concatenate([x11, jnp.zeros_like(x11)], axis=-1)
        bottom = jnp.concatenate([x21, x22], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)  # [..., n, 2s, 2s]
        s *= 2
    return inv.reshape(*lead, C, C)


@jax.custom_vjp
def solve_unit_lower(a_CC, b_CD):
    """x with a x = b for unit lower-triangular a ([..., C, C]; only its strictly lower part is read),
    as (a^-1) b with the inverse in plain XLA ops (`unit_lower_inverse`): inference and training run
    the same solve, and neither calls LAPACK (whose CPU kernels can deadlock XLA's thread pool)."""
    return jnp.matmul(unit_lower_inverse(a_CC), b_CD, precision=HIGHEST)


def _solve_unit_lower_fwd(a_CC, b_CD):
    inv_CC = unit_lower_inverse(a_CC)
    x_CD = jnp.matmul(inv_CC, b_CD, precision=HIGHEST)
    return x_CD, (inv_CC, x_CD)


def _solve_unit_lower_bwd(res, g_CD):
    """x = a^-1 b: the b cotangent solves a^T y = g (y = (a^-1)^T g), the a cotangent is -y x^T on
    the strictly lower part (the only part the solve reads)."""
    inv_CC, x_CD = res
    y_CD = jnp.matmul(jnp.swapaxes(inv_CC, -1, -2), g_CD, precision=HIGHEST)
    g_a = -jnp.tril(jnp.matmul(y_CD, jnp.swapaxes(x_CD, -1, -2), precision=HIGHEST), -1)
    return g_a.astype(inv_CC.dtype), y_CD


solve_unit_lower.defvjp(_solve_unit_lower_fwd, _solve_unit_lower_bwd)


def chunk_gated_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV, chunk: int = CHUNK):
    """Gated delta rule over a whole sequence, chunk by chunk, continuing from `state_BHKV`.

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)^T,  o_t = S_t^T q_t.
    Within a chunk the recurrence is solved with a unit lower-triangular system (the UT transform);
    across chunks a scan carries S. Everything here is fp32. Positions with beta = 0 and g = 0
    (padding) leave the state untouched. Returns (o [B, T, H, V], final state [B, H, K, V]).
    """
    B, T, H, Dk = q_BTHK.shape
    Dv = v_BTHV.shape[-1]
    f32 = lambda x: x.astype(jnp.float32)
    q, k, v, g, beta = map(f32, (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH))
    q = _l2norm(q) * (Dk**-0.5)
    k = _l2norm(k)
    pad = (-T) % chunk
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    N = (T + pad) // chunk
    # -> [B, H, N, C, D]
    split = lambda x: x.reshape(B, N, chunk, H, -1).transpose(0, 3, 1, 2, 4)
    q, k, v = split(q), split(k), split(v)
    g = g.reshape(B, N, chunk, H).transpose(0, 3, 1, 2)
    beta = beta.reshape(B, N, chunk, H).transpose(0, 3, 1, 2)

    cum = jnp.cumsum(g, axis=-1)  # log decay from the chunk start to each position
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    decay_CC = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    mm = lambda a, b: jnp.matmul(a, b, precision=HIGHEST)
    ut = mm(k_beta, jnp.swapaxes(k, -1, -2)) * decay_CC
    # both right-hand sides in one solve: one inverse, one matmul
    solved = solve_unit_lower(ut, jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1))
    new_v, k_cumdecay = solved[..., :Dv], solved[..., Dv:]
    intra = mm(q, jnp.swapaxes(k, -1, -2)) * decay_CC
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [B, H, N, 1, 1]

    def step(S_BHKV, xs):
        new_v_n, kcd_n, q_n, intra_n, k_n, dec_n = xs
        v_corr = new_v_n - mm(kcd_n, S_BHKV)
        out = mm(q_n, S_BHKV) + mm(intra_n, v_corr)
        S_BHKV = S_BHKV * dec_n + mm(jnp.swapaxes(k_n, -1, -2), v_corr)
        return S_BHKV, out

    by_chunk = lambda x: jnp.moveaxis(x, 2, 0)
    xs = tuple(map(by_chunk, (new_v, k_cumdecay, q_dec, intra, k_dec, chunk_decay)))
    state, out_N = jax.lax.scan(step, f32(state_BHKV), xs)
    out = jnp.moveaxis(out_N, 0, 2).transpose(0, 2, 3, 1, 4).reshape(B, N * chunk, H, Dv)
    return out[:, :T], state


class GatedRMSNorm(nnx.Module):
    """norm(x) * w * silu(gate), statistics in fp32 (the weight is a plain scale, not 1 + w)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x, gate):
        x32 = x.astype(jnp.float32)
        y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)).astype(x.dtype)
        y = self.weight[...] * y
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: Qwen3_5Config, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        E = cfg.hidden_size
        Hv, Dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        lin = lambda i, o: dense(i, o, dtype=dtype, rngs=rngs)
        self.in_proj_qkv = lin(E, cfg.conv_dim)
        self.in_proj_z = lin(E, Hv * Dv)
        self.in_proj_b = lin(E, Hv)
        self.in_proj_a = lin(E, Hv)
        self.conv1d = nnx.Param(jnp.zeros((cfg.linear_conv_kernel_dim, cfg.conv_dim), dtype))  # [Kc, C] depthwise
        # kept fp32 whatever the model dtype: they set the decay, and exp(A) * softplus(.) is sensitive
        self.A_log = nnx.Param(jnp.zeros((Hv,), jnp.float32))
        self.dt_bias = nnx.Param(jnp.ones((Hv,), jnp.float32))
        self.norm = GatedRMSNorm(Dv, cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = lin(Hv * Dv, E)

    def __call__(self, x_BTE, valid_BT, layer_cache):
        cfg = self.cfg
        B, T, _ = x_BTE.shape
        Hk, Dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        Hv, Dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        Kc = cfg.linear_conv_kernel_dim
        x_BTE = x_BTE * valid_BT[..., None].astype(x_BTE.dtype)  # padding never feeds the conv or the state
        qkv_BTC = self.in_proj_qkv(x_BTE)
        if layer_cache is None:
            conv_prev = jnp.zeros((B, Kc - 1, qkv_BTC.shape[-1]), qkv_BTC.dtype)
            state = jnp.zeros((B, Hv, Dk, Dv), jnp.float32)
        else:
            prev = layer_cache["conv"]
            conv_prev = jnp.broadcast_to(prev, (B,) + prev.shape[1:]).astype(qkv_BTC.dtype)
            state = jnp.broadcast_to(layer_cache["state"], (B,) + layer_cache["state"].shape[1:])
        window = jnp.concatenate([conv_prev, qkv_BTC], axis=1)  # [B, Kc-1+T, C]
        w = self.conv1d[...]
        conv = sum(window[:, j : j + T] * w[j] for j in range(Kc))
        conv = jax.nn.silu(conv)
        # the carried conv state: the Kc-1 inputs before each row's next real token
        n_B = valid_BT.sum(axis=1).astype(jnp.int32)
        new_conv = jax.vmap(lambda win, n: jax.lax.dynamic_slice_in_dim(win, n, Kc - 1, axis=0))(window, n_B)

        kd = Hk * Dk
        q = conv[..., :kd].reshape(B, T, Hk, Dk)
        k = conv[..., kd : 2 * kd].reshape(B, T, Hk, Dk)
        v = conv[..., 2 * kd :].reshape(B, T, Hv, Dv)
        if Hv != Hk:  # each q/k head serves Hv/Hk consecutive value heads
            q, k = jnp.repeat(q, Hv // Hk, axis=2), jnp.repeat(k, Hv // Hk, axis=2)
        beta = jax.nn.sigmoid(self.in_proj_b(x_BTE).astype(jnp.float32))
        a = self.in_proj_a(x_BTE).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a + self.dt_bias[...])
        beta = jnp.where(valid_BT[..., None], beta, 0.0)
        g = jnp.where(valid_BT[..., None], g, 0.0)
        core_BTHV, state = chunk_gated_delta_rule(q, k, v, g, beta, state)
        z = self.in_proj_z(x_BTE).reshape(B, T, Hv, Dv)
        y = self.norm(core_BTHV.astype(x_BTE.dtype), z).reshape(B, T, Hv * Dv)
        return self.out_proj(y), {"conv": new_conv, "state": state}


class Qwen3_5Layer(nnx.Module):
    def __init__(self, cfg: Qwen3_5Config, kind: str, *, dtype, rngs: nnx.Rngs):
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True, dtype=dtype)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
        else:
            self.self_attn = Attention(
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                eps=cfg.rms_norm_eps,
                qkv_bias=cfg.attention_bias,
                qk_norm="zero_centered",
                output_gate=True,
                dtype=dtype,
                rngs=rngs,
            )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, ctx: Context, layer_cache):
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h, new_cache = self.linear_attn(h, ctx.valid, layer_cache)
        else:
            h, new_cache = self.self_attn(h, ctx, layer_cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), new_cache


class Qwen3_5LM(CausalLM):
    def __init__(self, cfg: Qwen3_5Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        rot = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rot_dim, self.rope_theta = rot - rot % 2, cfg.rope_theta
        self.mrope_axes = mrope_axes(cfg.mrope_section, self.rot_dim // 2)
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True, dtype=dtype)
        self._init_shell(cfg, norm, dtype=dtype, rngs=rngs)
