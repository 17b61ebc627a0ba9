"""Elastic depth exits (lev_jax.elastic.exits) on tiny random 4-layer models: an exit at d is a
d-layer model plus the exit adapter and the shared head; a cascade from d1 to d2 equals reading at d2
directly; at d = L it is the full model's readout."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lev_jax import models, readout, testing
from lev_jax.elastic import cascade as ex
from lev_jax.readout import exits as exits_lib


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def model(request):
    if request.param == "llama":
        hf = {**testing.TINY_LLAMA, "num_hidden_layers": 4, "vocab_size": 512}
    else:
        hf = {**testing.TINY_QWEN3_5, "vocab_size": 512}
    cfg = models.config_from_hf(hf)
    params = models.random_params(cfg, "float32", seed=1, init_std=0.3)
    # trained-looking adapters: `b` nonzero so every exit's map matters
    adapters = exits_lib.init_exits(cfg, (1, 2, 3, 4), rank=4, seed=2)
    adapters = {
        d: {
            **a,
            "b": 0.2 * jax.random.normal(jax.random.key(int(d)), a["b"].shape),
            "scale": a["scale"] * 1.5,
            "gain": 1.0 + jax.random.uniform(jax.random.key(10 + int(d)), a["gain"].shape),
        }
        for d, a in adapters.items()
    }
    return hf, cfg, params, adapters


def batch(seed=0):
    rng = np.random.default_rng(seed)
    prefix = jnp.asarray(rng.integers(1, 512, (1, 11)), jnp.int32)
    rows = rng.integers(1, 512, (2, 6))
    valid = np.ones((2, 6), bool)
    valid[1, 4:] = False  # the second row is shorter (right-padded)
    answer = jnp.asarray([5, 3], jnp.int32)
    labels = jnp.asarray(rng.integers(1, 512, (2, 3)), jnp.int32)
    return prefix, jnp.ones_like(prefix, bool), jnp.asarray(rows, jnp.int32), jnp.asarray(valid), answer, labels


def truncated(hf, params, d):
    """A d-layer model built from the config with d layers and the first d layers' weights."""
    small = {**hf, "num_hidden_layers": d}
    if "layer_types" in hf:
        small["layer_types"] = hf["layer_types"][:d]
    cfg = models.config_from_hf(small)
    view = models.layer_view(params)
    view["layers"] = {i: view["layers"][i] for i in range(d)}
    return cfg, models.stacked_view(view, cfg)


def reference(hf, params, adapters, d, prefix, rows, valid, answer, labels):
    """Each row run whole (prefix + row) through the d-layer model, adapter, final norm, label rows."""
    cfg, p = truncated(hf, params, d)
    out = []
    for b in range(rows.shape[0]):
        n = int(valid[b].sum())
        seq = jnp.concatenate([prefix[0], rows[b, :n]])[None]
        x, _ = models.forward(p, seq, None, cfg, final_norm=False)
        x = x[0, prefix.shape[1] + int(answer[b])]
        h = models.final_norm(p, exits_lib.apply_exit(adapters[str(d)], x) if d < 4 else x, cfg)
        if d < 4:  # the full model has no exit adapter; an exit's gain scales its final-normed state
            h = h * adapters[str(d)]["gain"]
        out.append(models.label_logits(p, h[None], labels[b : b + 1], cfg)[0])
    return np.stack(out)


@pytest.mark.parametrize("d", [1, 3])
def test_exit_is_a_truncated_model_plus_adapter_and_head(model, d):
    hf, cfg, params, adapters = model
    prefix, pvalid, rows, valid, answer, labels = batch()
    pre = ex.prefill(params, prefix, pvalid, cfg, d)
    assert models.cache_depth(pre.cache) == d  # nothing deeper is computed or cached
    got = ex.read(params, adapters, pre, rows, valid, answer, labels, cfg, d)
    want = reference(hf, params, adapters, d, prefix, rows, valid, answer, labels)
    np.testing.assert_allclose(np.asarray(got.logits_BC), want, atol=1e-5, rtol=1e-5)


def test_full_depth_is_the_models_own_readout(model):
    hf, cfg, params, adapters = model
    prefix, pvalid, rows, valid, answer, labels = batch(1)
    pre = ex.prefill(params, prefix, pvalid, cfg, 4)
    got = np.asarray(ex.read(params, adapters, pre, rows, valid, answer, labels, cfg, 4).logits_BC)
    for b in range(2):
        n = int(valid[b].sum())
        seq = jnp.concatenate([prefix[0], rows[b, :n]])[None]
        hidden, _ = models.forward(params, seq, None, cfg)  # today's forward: all layers, final norm
        want = models.head_logits(params, hidden[0, prefix.shape[1] + int(answer[b])], cfg, labels[b])
        np.testing.assert_allclose(got[b], np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d1,d2", [(1, 3), (2, 4)])
def test_cascade_equals_a_direct_deeper_readout(model, d1, d2):
    hf, cfg, params, adapters = model
    prefix, pvalid, rows, valid, answer, labels = batch(2)
    shallow = ex.prefill(params, prefix, pvalid, cfg, d1)
    first = ex.read(params, adapters, shallow, rows, valid, answer, labels, cfg, d1)
    deeper = ex.deepen(params, shallow, cfg, d2)
    assert models.cache_depth(deeper.cache) == d2
    cascaded = ex.read(params, adapters, deeper, rows, valid, answer, labels, cfg, d2, start=d1, rows=first)
    direct = ex.read(
        params, adapters, ex.prefill(params, prefix, pvalid, cfg, d2), rows, valid, answer, labels, cfg, d2
    )
    np.testing.assert_allclose(np.asarray(cascaded.logits_BC), np.asarray(direct.logits_BC), atol=1e-5, rtol=1e-5)
    # the cascade continues from the rows' saved residual (layers [d1, d2) only): change it and the
    # answer changes
    nudged = dataclasses.replace(first, resid_BTE=first.resid_BTE * 1.5)
    moved = ex.read(params, adapters, deeper, rows, valid, answer, labels, cfg, d2, start=d1, rows=nudged)
    assert np.abs(np.asarray(moved.logits_BC) - np.asarray(cascaded.logits_BC)).max() > 1e-3
    # the deepened prefix's cache is the direct one's, layer by layer
    direct_pre = ex.prefill(params, prefix, pvalid, cfg, d2)
    for a, b in zip(jax.tree.leaves(deeper.cache), jax.tree.leaves(direct_pre.cache)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)


def test_an_untrained_exit_is_the_logit_lens(model):
    hf, cfg, params, _ = model
    fresh = exits_lib.init_exits(cfg, exits_lib.default_depths(cfg), rank=4)
    assert sorted(map(int, fresh)) == [1, 2, 3]  # every exit below L, none at L
    x = jax.random.normal(jax.random.key(0), (3, cfg.hidden_size))
    np.testing.assert_array_equal(np.asarray(exits_lib.apply_exit(fresh["2"], x)), np.asarray(x))


def test_bad_depths_are_refused_before_any_work(model):
    hf, cfg, params, adapters = model
    prefix, pvalid, rows, valid, answer, labels = batch()
    with pytest.raises(ValueError, match="exit depths"):
        exits_lib.init_exits(cfg, (0, 2))
    with pytest.raises(ValueError, match="exit depths"):
        exits_lib.check_depths(cfg, (5,))
    shallow = ex.prefill(params, prefix, pvalid, cfg, 2)
    with pytest.raises(ValueError, match="deepen first"):
        ex.read(params, adapters, shallow, rows, valid, answer, labels, cfg, 3)
    with pytest.raises(ValueError, match="goes deeper"):
        ex.deepen(params, shallow, cfg, 2)
    with pytest.raises(KeyError, match="no exit adapter at depth 2"):
        ex.read(params, {}, shallow, rows, valid, answer, labels, cfg, 2)
    with pytest.raises(ValueError, match="layer_range"):
        models.forward(params, rows, None, cfg, layer_range=(2, 5))
    with pytest.raises(ValueError, match="hidden_BTE"):
        models.forward(params, rows, None, cfg, layer_range=(1, 2))


def test_every_exit_in_one_pass_is_the_shared_readout(model):
    """`readout.rows_exit_logits` (what training reads exits with) over a full cache: each exit equals
    reading that exit alone, and the last is `rows_label_logits`, the serving readout."""
    hf, cfg, params, adapters = model
    prefix, pvalid, rows, valid, answer, labels = batch(3)
    full = ex.prefill(params, prefix, pvalid, cfg, 4)
    every, _ = readout.rows_exit_logits(params, adapters, full.cache, None, rows, valid, answer, labels, cfg, (1, 2, 4))
    for d in (1, 2):
        alone = ex.read(
            params, adapters, ex.prefill(params, prefix, pvalid, cfg, d), rows, valid, answer, labels, cfg, d
        )
        np.testing.assert_allclose(np.asarray(every[d]), np.asarray(alone.logits_BC), atol=1e-5, rtol=1e-5)
    served = readout.rows_label_logits(params, full.cache, None, rows, valid, answer, labels, cfg)
    np.testing.assert_allclose(np.asarray(every[4]), np.asarray(served), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="ascending"):
        readout.rows_exit_logits(params, adapters, full.cache, None, rows, valid, answer, labels, cfg, (2, 1))
