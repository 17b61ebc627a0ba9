"""layers.attend: the anchored softmax (a shared cache's stabiliser taken from the row's own tokens)
is the exact softmax wherever it can serve, and fails loudly (NaN) where it cannot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lev_jax.models import layers

B, T, H, K, D, S = 5, 7, 4, 2, 16, 24


def _inputs(seed, cache_scale=1.0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, T, H, D))
    k = jax.random.normal(ks[1], (B, T, K, D))
    v = jax.random.normal(ks[2], (B, T, K, D))
    ck = cache_scale * jax.random.normal(ks[3], (1, K, D, S))
    cv = jax.random.normal(ks[4], (1, K, S, D))
    valid = jnp.arange(T)[None, :] < jnp.array([7, 7, 4, 1, 0])[:, None]  # ragged rows, one all padding
    cache_valid = (jnp.arange(S) < 19)[None]  # a bucket-padded prefix
    return q, k, v, valid, ck, cv, cache_valid


def _attend(args, anchored, scale=D**-0.5):
    fn = jax.jit(layers.attend, static_argnames=("scale", "anchored"))
    return np.asarray(fn(*args, scale=scale, anchored=anchored))


def _dense_reference(args, scale=D**-0.5):
    """Plain softmax attention over [cache slots, new tokens] per row, in float64."""
    q, k, v, valid, ck, cv, cache_valid = (
        np.asarray(a, np.float64) if a.dtype != bool else np.asarray(a) for a in args
    )
    G = H // K
    out = np.zeros((B, T, H, D))
    for b in range(B):
        for t in range(T):
            for h in range(H):
                kv = h // G
                keys = np.concatenate([ck[0, kv].T, k[b, :, kv]], 0)
                vals = np.concatenate([cv[0, kv], v[b, :, kv]], 0)
                seen = np.concatenate([cache_valid[0], (np.arange(T) <= t) & valid[b]])
                s = keys @ q[b, t, h] * scale
                w = np.exp(s - s[seen].max()) * seen
                out[b, t, h] = w @ vals / w.sum()
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_anchored_equals_exact_and_a_dense_softmax(seed):
    args = _inputs(seed)
    exact, anchored = _attend(args, False), _attend(args, True)
    valid = np.asarray(args[3])
    ref = _dense_reference(args)
    for b in range(B):
        for t in range(T):
            if valid[b, t]:
                np.testing.assert_allclose(exact[b, t], ref[b, t], atol=2e-5)
                np.testing.assert_allclose(anchored[b, t], ref[b, t], atol=2e-5)
    assert np.isfinite(exact).all() and np.isfinite(anchored).all()  # padding rows too


def test_anchored_fails_loudly_where_a_cached_score_dwarfs_the_own_ones():
    args = _inputs(2, cache_scale=60.0)  # cached scores ~60x the own ones: gaps far beyond the anchor's reach
    exact, anchored = _attend(args, False, scale=1.0), _attend(args, True, scale=1.0)
    valid = np.asarray(args[3])
    assert np.isfinite(exact).all()
    bad = ~np.isfinite(anchored).all(axis=(2, 3))
    assert (bad & valid).any()  # some real token overflowed, and it shows
    np.testing.assert_allclose(anchored[~bad & valid], exact[~bad & valid], atol=1e-4)  # the rest is exact


@pytest.mark.parametrize("form", ["shared", "per_row", "indexed"])
def test_a_long_cache_is_read_block_by_block_and_its_empty_blocks_are_never_read(form, monkeypatch):
    """A cache of several CACHE_BLOCKs (a chunk or a row in a capacity bucket up to twice its
    slots): blocks without a valid slot are skipped -- NaN planted in one changes nothing, where
    reading it at all would make every output NaN -- and the rest is the dense softmax."""
    monkeypatch.setattr(layers, "CACHE_BLOCK", 8)  # S = 24: three blocks (read eagerly: no stale trace)
    q, k, v, valid, ck, cv, _ = _inputs(3)
    cache_valid = (jnp.arange(S) < 11)[None]  # the second block part-filled, the third empty
    ref = _dense_reference((q, k, v, valid, ck, cv, cache_valid))
    ck, cv = ck.at[..., 16:].set(jnp.nan), cv.at[:, :, 16:].set(jnp.nan)
    rows = None
    if form == "per_row":
        ck, cv, cache_valid = (jnp.broadcast_to(x, (B,) + x.shape[1:]) for x in (ck, cv, cache_valid))
    elif form == "indexed":
        ck, cv, cache_valid = (jnp.concatenate([x, x]) for x in (ck, cv, cache_valid))
        rows = jnp.array([0, 1, 0, 1, 0], jnp.int32)
    for anchored in (False, True):
        out = np.asarray(
            layers.attend(q, k, v, valid, ck, cv, cache_valid, D**-0.5, anchored=anchored, cache_rows_B=rows)
        )
        assert np.isfinite(out).all()
        real = np.asarray(valid)
        np.testing.assert_allclose(out[real], ref[real], atol=2e-5)
