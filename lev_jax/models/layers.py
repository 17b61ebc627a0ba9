"""Building blocks shared by every backbone: norms, rotary embeddings, cached attention, SwiGLU.

Shape suffixes: B batch rows, T new tokens in this call, S cached slots (the cache stores K/V as
[B, K, S, D]), H query heads,
K key/value heads, G = H // K query heads per KV head, D head dim, E model width.
Numerically delicate parts (norm statistics, softmax) run in fp32 whatever the matmul dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# A large negative instead of -inf: a fully masked row (a padding query with nothing to see) then
# gives a uniform softmax instead of NaN, and NaN can never leak into valid rows through a matmul.
_MASKED = -1e30


class RMSNorm(nnx.Module):
    """RMSNorm with fp32 statistics. `zero_centered`: the scale is (1 + w) (Qwen3.5), else w (Llama)."""

    def __init__(self, dim: int, eps: float, *, zero_centered: bool = False, dtype=jnp.float32):
        self.eps = eps
        self.zero_centered = zero_centered
        init = jnp.zeros if zero_centered else jnp.ones
        self.weight = nnx.Param(init((dim,), dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...].astype(jnp.float32)
        if self.zero_centered:
            return (y * (1.0 + w)).astype(x.dtype)
        # Llama casts the normalised activations back before the scale (HF parity).
        return w.astype(x.dtype) * y.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.gate_proj = lin(dim, hidden)
        self.up_proj = lin(dim, hidden)
        self.down_proj = lin(hidden, dim)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions_BT, rot_dim: int, theta: float):
    """cos/sin [B, T, rot_dim] in fp32 for the rotate-half convention (frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim))
    freqs_BTF = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs_BTF, freqs_BTF], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTHD, cos_BTR, sin_BTR):
    """Rotary embedding on the first R dims of each head (R = D for full rotary, D/4 for Qwen3.5)."""
    rot = cos_BTR.shape[-1]
    x32 = x_BTHD.astype(jnp.float32)
    x_rot, x_pass = x32[..., :rot], x32[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_BTR[:, :, None, :], sin_BTR[:, :, None, :]
    out = jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
    return out.astype(x_BTHD.dtype)


def attend(q_BTHD, k_BTKD, v_BTKD, valid_BT, cache_k_BKSD, cache_v_BKSD, cache_valid_BS, scale: float):
    """Causal GQA attention of T new queries over (cached slots, then the T new keys).

    The cache may hold 1 row shared by all B query rows (a forked prefix is then read in place,
    never copied: matmul broadcasts the batch axis) or B rows. Cached slots are visible where
    `cache_valid_BS`; new keys where causal and valid. Queries are laid out [B, K, G*T, D] so both
    products are plain batched matmuls (XLA:CPU runs 5-D einsums with group axes ~2x slower).
    """
    B, T, H, D = q_BTHD.shape
    K = k_BTKD.shape[2]
    G = H // K
    q_BKRD = q_BTHD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, D)  # R = (g, t)
    k_BKTD, v_BKTD = k_BTKD.transpose(0, 2, 1, 3), v_BTKD.transpose(0, 2, 1, 3)
    f32 = jnp.float32
    scores_new = jnp.matmul(q_BKRD, k_BKTD.swapaxes(-1, -2), preferred_element_type=f32).reshape(B, K, G, T, T)
    causal_TS = jnp.tril(jnp.ones((T, T), dtype=bool))
    mask_new = causal_TS[None] & valid_BT[:, None, :]  # [B, T, S=T]
    blocks = [jnp.where(mask_new[:, None, None], scores_new * scale, _MASKED)]
    if cache_k_BKSD is not None:
        S = cache_k_BKSD.shape[2]
        scores_cache = jnp.matmul(q_BKRD, cache_k_BKSD.swapaxes(-1, -2), preferred_element_type=f32)
        scores_cache = scores_cache.reshape(B, K, G, T, S)
        blocks.insert(0, jnp.where(cache_valid_BS[:, None, None, None, :], scores_cache * scale, _MASKED))
    scores = jnp.concatenate(blocks, axis=-1) if len(blocks) > 1 else blocks[0]
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BTKD.dtype)
    out_BKRD = jnp.matmul(probs[..., -T:].reshape(B, K, G * T, T), v_BKTD)
    if cache_k_BKSD is not None:
        out_BKRD = out_BKRD + jnp.matmul(probs[..., :S].reshape(B, K, G * T, S), cache_v_BKSD)
    return out_BKRD.reshape(B, K, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def write_slots(buf, new, offset, batch: int, axis: int = 1):
    """Write new entries at slot `offset` along `axis` of a [Bc, ...] buffer, broadcasting Bc=1 to
    `batch` (that is where a forked row gets its own copy)."""
    if buf.shape[0] != batch:
        buf = jnp.broadcast_to(buf, (batch,) + buf.shape[1:])
    start = [0] * buf.ndim
    start[axis] = offset
    return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), tuple(start))


class Attention(nnx.Module):
    """Self-attention with a KV cache. One class for the families we serve:
    Llama (plain), Qwen2 (`qkv_bias`), Qwen3 (`qk_norm="rms"`), Qwen3.5 gated attention
    (`output_gate`: q_proj is doubled and sigmoid(gate) scales the output; `qk_norm="zero_centered"`;
    partial rotary via the cos/sin width)."""

    def __init__(self, dim, num_heads, num_kv_heads, head_dim, *, eps, qkv_bias=False, qk_norm=None,
                 output_gate=False, dtype, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        lin = lambda i, o, b: nnx.Linear(i, o, use_bias=b, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.q_proj = lin(dim, num_heads * head_dim * (2 if output_gate else 1), qkv_bias)
        self.k_proj = lin(dim, num_kv_heads * head_dim, qkv_bias)
        self.v_proj = lin(dim, num_kv_heads * head_dim, qkv_bias)
        self.o_proj = lin(num_heads * head_dim, dim, False)
        if qk_norm is not None:
            zc = qk_norm == "zero_centered"
            self.q_norm = RMSNorm(head_dim, eps, zero_centered=zc, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, eps, zero_centered=zc, dtype=dtype)
        self.qk_norm = qk_norm

    def __call__(self, x_BTE, cos, sin, valid_BT, layer_cache, cache_valid_BS, offset, update_cache=True):
        B, T, _ = x_BTE.shape
        H, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x_BTE)
        gate_BTX = None
        if self.output_gate:  # per head: [query D | gate D]
            q_BTH2D = q.reshape(B, T, H, 2 * D)
            q, gate_BTX = q_BTH2D[..., :D], q_BTH2D[..., D:].reshape(B, T, H * D)
        q_BTHD = q.reshape(B, T, H, D)
        k_BTKD = self.k_proj(x_BTE).reshape(B, T, K, D)
        v_BTKD = self.v_proj(x_BTE).reshape(B, T, K, D)
        if self.qk_norm is not None:
            q_BTHD, k_BTKD = self.q_norm(q_BTHD), self.k_norm(k_BTKD)
        q_BTHD, k_BTKD = apply_rope(q_BTHD, cos, sin), apply_rope(k_BTKD, cos, sin)
        ck = cv = None
        if layer_cache is not None:
            ck, cv = layer_cache["k"], layer_cache["v"]
        out = attend(q_BTHD, k_BTKD, v_BTKD, valid_BT, ck, cv, cache_valid_BS, D**-0.5).reshape(B, T, H * D)
        if gate_BTX is not None:
            out = out * jax.nn.sigmoid(gate_BTX)
        k_BKTD, v_BKTD = k_BTKD.transpose(0, 2, 1, 3), v_BTKD.transpose(0, 2, 1, 3)
        if not update_cache:
            new_cache = None
        elif layer_cache is None:
            new_cache = {"k": k_BKTD, "v": v_BKTD}
        else:
            new_cache = {"k": write_slots(ck, k_BKTD, offset, B, axis=2),
                         "v": write_slots(cv, v_BKTD, offset, B, axis=2)}
        return self.o_proj(out), new_cache
