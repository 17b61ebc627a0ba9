"""Building blocks shared by every backbone: norms, rotary embeddings, cached attention, SwiGLU.

Shape suffixes: B batch rows, T new tokens in this call, S cached slots (the cache stores keys as
[B, K, D, S] and values as [B, K, S, D]), H query heads, K key/value heads, G = H // K query heads
per KV head, D head dim, E model width.
Mixed precision: `dtype` is the weights' dtype and the matmuls' input dtype; every matmul accumulates
and returns fp32, and the residual stream, norm statistics, softmax and recurrent state stay fp32.
With bf16 weights the matmuls run at the bf16 rate (AMX / tensor cores), the rest keeps fp32 accuracy.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from lev_jax.models.context import CacheWrite, Context

# A large negative instead of -inf: a fully masked row (a padding query with nothing to see) then
# gives a uniform softmax instead of NaN, and NaN can never leak into valid rows through a matmul.
_MASKED = -1e30


def _dot(x, y, contract):
    return jax.lax.dot_general(x, y, (contract, ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def matmul(x, w):
    """x [..., I] @ w [I, O] -> fp32 [..., O]: `x` cast to w's dtype, products accumulated in fp32
    (XLA:CPU runs bf16 x bf16 -> fp32 at about twice the fp32 rate; bf16 -> bf16 is no faster).

    The backward keeps the weights' dtype too: the incoming fp32 cotangent is cast to w's dtype
    and both products (dx and dw) accumulate in fp32 - mixed-precision training as every framework
    does it. Plain autodiff would meet an fp32 cotangent and a bf16 weight, upcast the weight, and
    run the whole backward at the fp32 rate. dx is returned in x's own dtype (no bf16 rounding of
    the residual stream's gradient). With fp32 weights this is exactly the plain derivative."""
    return _matmul(x, w)


def _matmul(x, w):
    return _dot(x.astype(w.dtype), w, ((x.ndim - 1,), (0,)))


def _matmul_fwd(x, w):
    # the residual is x in w's dtype (what the product read: half the memory of an fp32 activation)
    # and a 0-d array of x's own dtype (a dtype is no residual)
    return _matmul(x, w), (x.astype(w.dtype), w, jnp.zeros((), x.dtype))


def _matmul_bwd(res, ct):
    xc, w, x_like = res
    ct = ct.astype(w.dtype)
    dx = _dot(ct, w, ((ct.ndim - 1,), (1,)))
    batch = tuple(range(xc.ndim - 1))
    dw = _dot(xc, ct, (batch, batch))
    return dx.astype(x_like.dtype), dw.astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(spec: str, a, b):
    """`jnp.einsum(spec, a, b)` accumulated and returned in fp32, with the backward in the inputs'
    dtype (as `matmul`): the fp32 cotangent is cast to the inputs' dtype and both gradients are
    einsums of the same kind. For matmul-like specs only (every index in exactly two of the three
    terms, e.g. "brd,bdt->brt"), whose gradients are the specs with the terms swapped."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _einsum_fwd(spec, a, b):
    return einsum(spec, a, b), (a, b)


def _einsum_bwd(spec, res, ct):
    a, b = res
    (x, y), z = spec.split("->")[0].split(","), spec.split("->")[1]
    da = jnp.einsum(f"{z},{y}->{x}", ct.astype(b.dtype), b, preferred_element_type=jnp.float32)
    db = jnp.einsum(f"{x},{z}->{y}", a, ct.astype(a.dtype), preferred_element_type=jnp.float32)
    return da.astype(a.dtype), db.astype(b.dtype)


einsum.defvjp(_einsum_fwd, _einsum_bwd)


@jax.custom_vjp
def lora_matmul(x, w, a, b):
    """x W + (x a) b -> fp32, as `matmul` (inputs cast to W's dtype, fp32 accumulation, the backward
    in W's dtype). One product [x | x a] @ [W ; b] instead of adding a rank-r product to the output
    (a full-size fp32 add per layer); the backward forms dx, da, db and never dW."""
    return _lora_fwd(x, w, a, b)[0]


def _lora_fwd(x, w, a, b):
    dt = w.dtype
    xc = x.astype(dt)
    h = _dot(xc, a.astype(dt), ((x.ndim - 1,), (0,))).astype(dt)
    y = _dot(jnp.concatenate([xc, h], axis=-1), _stacked(w, b), ((x.ndim - 1,), (0,)))
    # residuals: what the products read, not the stacked [W ; b] (a copy of W per layer: for a 4B
    # model ~10 GB held until the backward); x's dtype as a 0-d array (a dtype is no residual)
    return y, (xc, h, w, a, b, jnp.zeros((), x.dtype))


def _stacked(w, b):
    return jnp.concatenate([w, b.astype(w.dtype)], axis=0)


def _lora_bwd(res, ct):
    xc, h, w, a, b, x_like = res
    dt, n_in = w.dtype, xc.shape[-1]
    ct = ct.astype(dt)
    last, batch = ct.ndim - 1, tuple(range(ct.ndim - 1))
    g = _dot(ct, _stacked(w, b), ((last,), (1,)))  # [..., in + r]: dx through W and d(x a) at once
    dh = g[..., n_in:].astype(dt)
    dx = g[..., :n_in] + _dot(dh, a.astype(dt), ((last,), (1,)))
    da = _dot(xc, dh, (batch, batch))
    db = _dot(h, ct, (batch, batch))
    dw = _dot(xc, ct, (batch, batch))  # only for a trainable W; XLA drops it when W is frozen
    return dx.astype(x_like.dtype), dw.astype(dt), da.astype(a.dtype), db.astype(b.dtype)


lora_matmul.defvjp(_lora_fwd, _lora_bwd)


class Dense(nnx.Module):
    """A linear layer: `kernel` [in, out] (and `bias`) in the weights' dtype, applied with `matmul`
    (fp32 out). Optionally a low-rank adapter beside the kernel, applied to the activations as
    x W + (x A) B (`lora_a` [in, r], `lora_b` [r, out], scale folded into B; fp32 masters cast to the
    kernel's dtype): a training step then never forms or differentiates W + A B, so the frozen
    kernel costs the backward one product (dx) instead of two (dx and dW). Serving merges instead.
    The adapter slots are None unless a layer graph is built with them (`models.base` layer graphs, from
    the slots `lora.apply` puts into the layer stacks)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, dtype, rngs: nnx.Rngs):
        # Zeros, not a draw from `rngs`: every model's weights come from a checkpoint or from
        # models.random_params, which draws its own. A draw here is not free: models.graph builds
        # the model under nnx.eval_shape, where each draw's bookkeeping costs JAX a walk over the
        # whole trace so far (quadratic in the layer count: seconds per config of a 30-layer model).
        del rngs
        self.kernel = nnx.Param(jnp.zeros((in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        self.lora_a = nnx.data(None)  # data slots (not static): add_lora fills them with Params
        self.lora_b = nnx.data(None)

    def add_lora(self, rank: int) -> None:
        """Give this layer adapter slots of `rank` (fp32; their values come with the parameters)."""
        n_in, n_out = self.kernel.shape
        self.lora_a = nnx.Param(jnp.zeros((n_in, rank), jnp.float32))
        self.lora_b = nnx.Param(jnp.zeros((rank, n_out), jnp.float32))

    def __call__(self, x):
        w = self.kernel[...]
        if self.lora_a is None:
            y = matmul(x, w)
        else:
            y = lora_matmul(x, w, self.lora_a[...], self.lora_b[...])
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


def dense(in_features: int, out_features: int, *, bias: bool = False, dtype, rngs: nnx.Rngs) -> Dense:
    return Dense(in_features, out_features, bias=bias, dtype=dtype, rngs=rngs)


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


EXIT_NORM_EPS = 1e-6


def exit_map(x_raw, scale, a, b):
    """An exit adapter's map of a raw residual stream [..., E] (elastic depth, readout.exits): the
    stream plus a rank-r correction read off its fp32-statistics RMS norm, x + (rmsnorm(x) * scale)
    @ a @ b, in fp32 (the matmuls at the weights' dtype, accumulated in fp32)."""
    x = x_raw.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EXIT_NORM_EPS) * scale
    low = jnp.einsum("...e,er->...r", normed.astype(a.dtype), a, preferred_element_type=jnp.float32)
    return x + jnp.einsum("...r,re->...e", low.astype(b.dtype), b, preferred_element_type=jnp.float32)


EXIT_KEYS = ("scale", "a", "b", "gain")  # an exit adapter's arrays (readout.exits)


def exit_params(adapter) -> dict:
    """An exit adapter's arrays in `EXIT_KEYS` order; one trained before exits had a gain gets the
    identity gain (ones), which is what it read labels with."""
    out = {k: adapter[k] for k in EXIT_KEYS if k in adapter}
    if "gain" not in out:
        out["gain"] = jnp.ones(adapter["scale"].shape, jnp.float32)
    return out


def exit_gain(h_normed, gain):
    """An exit's own gain on the final-normed hidden state [..., E] (the shared final norm's weight
    times this, per exit). It sets the exit's logit scale: the final norm removes the magnitude of
    whatever the rank-r map adds, so without it an exit can only flatten an over-confident reading by
    rotating the stream, which its few parameters learn slowly if at all (measured: EVAL.md)."""
    return (h_normed.astype(jnp.float32) * gain).astype(h_normed.dtype)


class ExitMap(nnx.Module):
    """`exit_map` as a module: what a model truncated at an exit (`models.exit_view`) applies before
    its final norm, so every readout path of the full model reads labels at the exit unchanged."""

    def __init__(self, dim: int, rank: int, *, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.a = nnx.Param(jnp.zeros((dim, rank), dtype))
        self.b = nnx.Param(jnp.zeros((rank, dim), dtype))
        self.gain = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x):
        return exit_map(x, self.scale[...], self.a[...], self.b[...])

    def after_norm(self, h):
        return exit_gain(h, self.gain[...])


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs):
        lin = lambda i, o: dense(i, o, dtype=dtype, rngs=rngs)
        self.gate_proj = lin(dim, hidden)
        self.up_proj = lin(dim, hidden)
        self.down_proj = lin(hidden, dim)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions_BT, rot_dim: int, theta: float, mrope_axes: tuple[int, ...] | None = None):
    """cos/sin [B, T, rot_dim / 2] in fp32, one per frequency (rotate-half convention: the first and
    second halves of the rotated dims share the frequencies).

    Multimodal rotary (Qwen3.5's M-RoPE): `positions_BT` is then [3, B, T] (temporal, height, width
    position of each token) and frequency f turns with the position on axis `mrope_axes[f]`. Text
    tokens carry the same position on all three axes, which is plain rotary."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim))
    if positions_BT.ndim == 3:
        if mrope_axes is None or len(mrope_axes) != inv_freq.shape[0]:
            raise ValueError("3-axis positions need this model's M-RoPE sections (one axis per rotary frequency)")
        pos_BTF = jnp.moveaxis(positions_BT, 0, -1)[..., jnp.asarray(mrope_axes)]
        freqs_BTF = pos_BTF.astype(jnp.float32) * inv_freq
    else:
        freqs_BTF = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    return _materialize(jnp.cos(freqs_BTF)), _materialize(jnp.sin(freqs_BTF))


def _materialize(x):
    """`x`, computed once into a buffer. XLA:CPU otherwise fuses cheap-looking producers such as cos/sin
    into every consumer and re-evaluates them per element (for rotary: per head, in every layer, 10 % of
    a bf16 forward). A product with the identity is exact in fp32 and fusions never reach through a
    dot; `optimization_barrier` does not help, XLA:CPU strips it before fusion."""
    n = x.shape[-1]
    return jnp.dot(x, jnp.eye(n, dtype=x.dtype), precision=jax.lax.Precision.HIGHEST)


def apply_rope(x_BTHD, cos_BTF, sin_BTF):
    """Rotary embedding on the first 2F dims of each head (all D for full rotary, D/4 for Qwen3.5):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), one concatenate, no duplicated cos/sin."""
    half = cos_BTF.shape[-1]
    x32 = x_BTHD.astype(jnp.float32)
    x1, x2, x_pass = x32[..., :half], x32[..., half : 2 * half], x32[..., 2 * half :]
    cos, sin = cos_BTF[:, :, None, :], sin_BTF[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x_pass], axis=-1)
    return out.astype(x_BTHD.dtype)


# The anchored softmax's stabiliser sits this far above the row's own-token max: own-token weights
# are then <= 2^-87 and a cached score may exceed the own max by up to 60 + 77 before exp overflows
# fp32 (77: e^77 x 65536 slots still sums below fp32's max); the own max term stays a normal number,
# so nothing that matters underflows. A whole power of two (87 ln 2 = 60.3): the weights are the
# exact path's times 2^-87, with the same mantissas, so bf16 rounds them the same way.
ANCHOR_OFFSET = 87 * math.log(2)
# a cache of at least two blocks of this many slots is read block by block, its empty blocks skipped
CACHE_BLOCK = 1024


def attend(
    q_BTHD,
    k_BTKD,
    v_BTKD,
    valid_BT,
    cache_k_BKDS,
    cache_v_BKSD,
    cache_valid_BS,
    scale: float,
    dtype=None,
    anchored: bool = False,
    segment=None,
    cache_rows_B=None,
    mask_BTT=None,
):
    """Causal GQA attention of T new queries over (cached slots, then the T new keys).

    The cache may hold 1 row shared by all B query rows (a forked prefix, read in place and never
    copied), B rows, or (`cache_rows_B`, int32 [B]) any number of rows of which query row b reads
    row `cache_rows_B[b]` (several requests' prefixes stacked, each read by its own rows; a row's
    keys and values are taken per KV head as the layer runs). Cached slots are visible where
    `cache_valid_BS`; new keys where causal and valid. Per KV head, the G query heads of all T
    tokens form R = G*T query rows; against a shared cache every query row of every batch row meets
    the same keys, so the cache products are one plain [B*R, D] x [D, S] matmul per KV head
    (XLA:CPU runs large *batched* dots ~10x slower than the same work as 2-D dots, hence the loop
    over the few KV heads). Products take `dtype` inputs (the weights' dtype) and accumulate fp32;
    softmax statistics are fp32 and the normalisation comes after the value product, so the cache
    block and the new-token block are never concatenated.
    `mask_BTT` (bool [B, T, T]): which new tokens each new token sees, in place of causal-and-valid
    (several rows packed into one lane, readout.slab).
    `segment` (k [B, K, D, Sg], v [B, K, Sg, D], valid [B, Sg]): a second cache level between a shared
    cache and the new tokens, one per row (the question header both option orders continue), read as
    a third block.

    Softmax stabiliser. Exact (default): each block (cached slots, segment, new tokens) takes its own
    max and the blocks are rescaled to the common max after their value products (as in flash
    attention). `anchored` (with a cache, shared or per row): every block uses the row's own-token
    max + ANCHOR_OFFSET, so the cache blocks' scores are never reduced for a max and XLA:CPU streams
    them straight into exp (~10 % of a row readout against a shared cache). The result is the same
    softmax; it only fails where a cached score exceeds every own-token score by more than ~137, and
    then it fails loudly: exp overflows and the row's outputs become NaN. Callers check for
    non-finite results and rerun exact.
    """
    B, T, H, D = q_BTHD.shape
    K = k_BTKD.shape[2]
    G, R = H // K, (H // K) * T
    dt = dtype or q_BTHD.dtype
    f32 = jnp.float32
    q_BKRD = (q_BTHD * scale).reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4).reshape(B, K, R, D).astype(dt)  # r=(g,t)
    k_BKDT = k_BTKD.transpose(0, 2, 3, 1).astype(dt)
    v_BKTD = v_BTKD.transpose(0, 2, 1, 3).astype(dt)
    if mask_BTT is None:
        mask_new_BRT = jnp.tile(jnp.tril(jnp.ones((T, T), bool)), (G, 1))[None] & valid_BT[:, None, :]
    else:  # query rows r = (g, t): each head of a group sees what its token sees
        mask_new_BRT = jnp.tile(mask_BTT, (1, G, 1))
    has_cache = cache_k_BKDS is not None
    indexed = has_cache and cache_rows_B is not None
    shared = has_cache and not indexed and cache_k_BKDS.shape[0] == 1 and B > 1
    anchored = anchored and has_cache
    if indexed:
        # The index made to depend on this layer's queries (a NaN query row, whose output is NaN
        # whatever it reads, reads row 0): XLA then takes each layer's rows of the cache when that
        # layer runs. Otherwise it hoists every layer's copies ahead of the forward, and they all
        # live at once (memory ~ layers x rows x slots instead of rows x slots).
        cache_rows_B = jnp.where(jnp.isnan(q_BTHD[:, 0, 0, 0]), 0, cache_rows_B)
        cache_valid_BS = jnp.take(cache_valid_BS, cache_rows_B, axis=0)
    # Masks enter as additive biases (0 or _MASKED) on the scores: a select over the scores made
    # XLA:CPU materialise a masked copy of them. A row that sees anything gives masked slots exactly
    # zero weight; a padding row that sees nothing gets finite weights (it is never read).
    bias_new_BRT = jnp.where(mask_new_BRT, 0.0, _MASKED).astype(f32)
    # cached blocks: (keys, values, bias, shared by every row, rows to take per head, valid [B, S])
    blocks = []
    if has_cache:
        bias_cache_B1S = jnp.where(cache_valid_BS[:, None, :], 0.0, _MASKED).astype(f32)
        blocks.append(
            (
                cache_k_BKDS.astype(dt),
                cache_v_BKSD.astype(dt),
                _materialize(bias_cache_B1S[0, 0]) if shared else bias_cache_B1S,
                shared,
                cache_rows_B if indexed else None,
                cache_valid_BS,
            )
        )
    if segment is not None:
        seg_k, seg_v, seg_valid_BS = segment
        bias_seg = jnp.where(seg_valid_BS[:, None, :], 0.0, _MASKED).astype(f32)
        blocks.append((seg_k.astype(dt), seg_v.astype(dt), bias_seg, False, None, None))

    def weights(s, m):  # `dtype` weights for the value product, and their exact fp32 sum
        p = jnp.exp(s - m).astype(dt)
        return p, p.astype(f32).sum(axis=-1, keepdims=True)

    outs = []
    for h in range(K):
        q_BRD = q_BKRD[:, h]
        s_n = einsum("brd,bdt->brt", q_BRD, k_BKDT[:, h]) + bias_new_BRT
        m_n = s_n.max(axis=-1, keepdims=True)
        if anchored:  # (a padding row that sees none of its own tokens anchors at 0: finite, unread)
            m_n = jnp.where(m_n > _MASKED / 2, m_n, 0.0) + ANCHOR_OFFSET
        p_n, d_n = weights(s_n, m_n)
        parts = [(m_n, d_n, einsum("brt,btd->brd", p_n, v_BKTD[:, h]))]

        def part(ck, cv, bias, one_row, rows, lo, hi, q_BRD=q_BRD, m_n=m_n, h=h):
            """(max, weight sum, value product) of cached slots [lo, hi)."""
            if one_row:  # [B*R, D] x [D, S], kept 2-D through the value product
                s_c = einsum("rd,ds->rs", q_BRD.reshape(B * R, D), ck[0, h, :, lo:hi]) + bias[lo:hi]
                m_c = m_n.reshape(B * R, 1) if anchored else s_c.max(axis=-1, keepdims=True)
                p_c, d_c = weights(s_c, m_c)
                o_c = einsum("rs,sd->rd", p_c, cv[0, h, lo:hi]).reshape(B, R, D)
                return m_c.reshape(B, R, 1), d_c.reshape(B, R, 1), o_c
            ck_h, cv_h = (ck[:, h], cv[:, h]) if rows is None else (ck[rows, h], cv[rows, h])
            s_c = einsum("brd,bds->brs", q_BRD, ck_h[..., lo:hi]) + bias[..., lo:hi]
            m_c = m_n if anchored else s_c.max(axis=-1, keepdims=True)
            p_c, d_c = weights(s_c, m_c)
            return m_c, d_c, einsum("brs,bsd->brd", p_c, cv_h[:, lo:hi])

        for ck, cv, bias, one_row, rows, valid_BS in blocks:
            S = ck.shape[-1]
            if valid_BS is None or S < 2 * CACHE_BLOCK:
                parts.append(part(ck, cv, bias, one_row, rows, 0, S))
                continue
            # a long cache is read block by block, and a block without a valid slot is skipped: a
            # chunk or a row after a prefix sits in a cache of the capacity that holds it
            # (buckets.CAPACITY), up to twice the slots written, and attention over the empty half
            # cost a long prefix's chunks more than their dense work
            for lo in range(0, S, CACHE_BLOCK):
                hi = min(S, lo + CACHE_BLOCK)
                read = functools.partial(part, ck, cv, bias, one_row, rows, lo, hi)
                out = jax.eval_shape(read)

                def skip(out=out, m_n=m_n):
                    m = m_n if anchored else jnp.full(out[0].shape, _MASKED, out[0].dtype)
                    return m, jnp.zeros(out[1].shape, out[1].dtype), jnp.zeros(out[2].shape, out[2].dtype)

                parts.append(jax.lax.cond(valid_BS[:, lo:hi].any(), read, skip))
        if anchored:  # one stabiliser for every block: plain sums
            outs.append(sum(o for _, _, o in parts) / sum(d for _, d, _ in parts))
            continue
        m = parts[0][0]
        for m_i, _, _ in parts[1:]:
            m = jnp.maximum(m, m_i)
        scaled = [(jnp.exp(m_i - m), d_i, o_i) for m_i, d_i, o_i in parts]
        outs.append(sum(o * a for a, _, o in scaled) / sum(d * a for a, d, _ in scaled))
    out_BKRD = jnp.stack(outs, axis=1)
    return out_BKRD.reshape(B, K, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def kv_cache(batch: int, kv_heads: int, slots: int, head_dim: int, dtype) -> dict:
    """An empty attention cache entry: keys [B, K, D, S] (stored transposed, so scores are plain
    [R, D] x [D, S] matmuls; XLA:CPU runs the transposed-operand form ~3x slower), values [B, K, S, D]."""
    return {
        "k": jnp.zeros((batch, kv_heads, head_dim, slots), dtype),
        "v": jnp.zeros((batch, kv_heads, slots, head_dim), dtype),
    }


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

    def __init__(
        self,
        dim,
        num_heads,
        num_kv_heads,
        head_dim,
        *,
        eps,
        qkv_bias=False,
        qk_norm=None,
        output_gate=False,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        lin = lambda i, o, b: dense(i, o, bias=b, dtype=dtype, rngs=rngs)
        self.q_proj = lin(dim, num_heads * head_dim * (2 if output_gate else 1), qkv_bias)
        self.k_proj = lin(dim, num_kv_heads * head_dim, qkv_bias)
        self.v_proj = lin(dim, num_kv_heads * head_dim, qkv_bias)
        self.o_proj = lin(num_heads * head_dim, dim, False)
        if qk_norm is not None:
            zc = qk_norm == "zero_centered"
            self.q_norm = RMSNorm(head_dim, eps, zero_centered=zc, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, eps, zero_centered=zc, dtype=dtype)
        self.qk_norm = qk_norm

    def __call__(self, x_BTE, ctx: Context, layer_cache):
        """Attention of the new tokens over `layer_cache` (None: no context) and themselves; returns
        (output, new layer cache) with the new layer cache as `ctx.cache_write` asks: the cache with
        the new slots written (APPEND), None (NONE), or the cache as it is plus the new keys/values
        beside it, per row (SEGMENT: a second cache level that rows continuing these tokens read
        with `ctx.seg_valid`)."""
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
        q_BTHD, k_BTKD = apply_rope(q_BTHD, ctx.cos, ctx.sin), apply_rope(k_BTKD, ctx.cos, ctx.sin)
        ck = cv = segment = rows = None
        if layer_cache is not None:
            ck, cv, rows = layer_cache["k"], layer_cache["v"], layer_cache.get("rows")
            if "seg_k" in layer_cache:
                segment = (layer_cache["seg_k"], layer_cache["seg_v"], ctx.seg_valid)
        out = attend(
            q_BTHD,
            k_BTKD,
            v_BTKD,
            ctx.valid,
            ck,
            cv,
            ctx.cache_valid,
            D**-0.5,
            dtype=self.o_proj.kernel.dtype,
            anchored=ctx.anchored_softmax,
            segment=segment,
            cache_rows_B=rows,
            mask_BTT=ctx.mask,
        ).reshape(B, T, H * D)
        if gate_BTX is not None:
            out = out * jax.nn.sigmoid(gate_BTX)
        k_BKDT, v_BKTD = k_BTKD.transpose(0, 2, 3, 1), v_BTKD.transpose(0, 2, 1, 3)
        dt = self.o_proj.kernel.dtype
        if ctx.cache_write is CacheWrite.NONE:
            new_cache = None
        elif ctx.cache_write is CacheWrite.SEGMENT:
            if layer_cache is None or segment is not None:
                raise ValueError("a segment continues a cache that has none yet")
            new_cache = {"k": ck, "v": cv, "seg_k": k_BKDT.astype(dt), "seg_v": v_BKTD.astype(dt)}
            if rows is not None:  # each segment row keeps the stacked row it continues
                new_cache["rows"] = rows
        elif segment is not None:
            raise ValueError("a cache with a segment is read-only (cache_write=CacheWrite.NONE)")
        elif rows is not None:
            raise ValueError("a stacked cache read by row index is read-only (cache_write=CacheWrite.NONE)")
        elif layer_cache is None:  # a cache of exactly these T slots, in the cache dtype (the weights')
            new_cache = {"k": k_BKDT.astype(dt), "v": v_BKTD.astype(dt)}
        else:
            new_cache = {
                "k": write_slots(ck, k_BKDT, ctx.offset, B, axis=3),
                "v": write_slots(cv, v_BKTD, ctx.offset, B, axis=2),
            }
        return self.o_proj(out), new_cache
