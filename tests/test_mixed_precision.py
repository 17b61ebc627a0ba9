"""The custom VJPs of the model's products (models.layers.matmul, lora_matmul, einsum): in fp32 they are
the plain derivative; with bf16 weights the backward stays bf16 x bf16 -> fp32 and the activations'
gradient keeps its own dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lev_jax.models import layers


@pytest.fixture(scope="module")
def operands():
    k = jax.random.split(jax.random.key(0), 5)
    return (
        jax.random.normal(k[0], (3, 5, 8)),  # x [B, T, in]
        jax.random.normal(k[1], (8, 6)),  # w [in, out]
        jax.random.normal(k[2], (8, 2)),  # a [in, r]
        jax.random.normal(k[3], (2, 6)),  # b [r, out]
    )


def _close(got, want, tol):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=tol)


def test_fp32_gradients_are_the_plain_derivative(operands):
    x, w, a, b = operands
    args = (0, 1, 2, 3)
    got = jax.grad(lambda *p: jnp.sum(jnp.sin(layers.lora_matmul(*p))), args)(x, w, a, b)
    want = jax.grad(lambda x, w, a, b: jnp.sum(jnp.sin(x @ w + (x @ a) @ b)), args)(x, w, a, b)
    _close(got, want, 1e-4)
    got = jax.grad(lambda x, w: jnp.sum(jnp.sin(layers.matmul(x, w))), (0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), (0, 1))(x, w)
    _close(got, want, 1e-5)
    q, k = x, jnp.swapaxes(x, 1, 2)  # [B, T, D] x [B, D, T]
    spec = "brd,bdt->brt"
    got = jax.grad(lambda q, k: jnp.sum(jnp.sin(layers.einsum(spec, q, k))), (0, 1))(q, k)
    want = jax.grad(lambda q, k: jnp.sum(jnp.sin(jnp.einsum(spec, q, k))), (0, 1))(q, k)
    _close(got, want, 1e-4)


def test_bf16_weights_keep_the_backward_in_bf16(operands):
    x, w, a, b = operands
    w16 = w.astype(jnp.bfloat16)
    loss = lambda x, w, a, b: jnp.sum(jnp.sin(layers.lora_matmul(x, w, a, b)))
    grads = jax.grad(loss, (0, 1, 2, 3))(x, w16, a, b)
    # fp32 activations and adapter masters keep fp32 gradients; the bf16 weight's is bf16
    assert [g.dtype for g in grads] == [jnp.float32, jnp.bfloat16, jnp.float32, jnp.float32]
    # the products of the backward read bf16 operands (no upcast weight, no fp32 dot)
    hlo = jax.jit(jax.grad(loss, (0, 2, 3))).lower(x, w16, a, b).as_text()
    operand_types = [line.rsplit(": (", 1)[1].split(") ->")[0] for line in hlo.splitlines() if "dot_general" in line]
    assert operand_types and all("f32" not in t for t in operand_types), operand_types
    # and agree with the fp32 derivative to bf16 precision
    want = jax.grad(loss, (0, 2, 3))(x, w16.astype(jnp.float32), a, b)
    for g, r in zip((grads[0], grads[2], grads[3]), want, strict=True):
        assert float(jnp.abs(g - r).max()) <= 0.05 * float(jnp.abs(r).max())
