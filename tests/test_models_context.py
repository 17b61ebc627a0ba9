"""models.forward's call contract: CacheWrite modes, per-layer rematerialisation, and gradients
through a prefix cache (what training relies on), on tiny random Llama and Qwen3.5 (DeltaNet +
attention) models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lev_jax import models, testing
from lev_jax.models import cache as cache_lib

CW = models.CacheWrite
VOCAB = 101
FAMILIES = {"llama": testing.TINY_LLAMA, "qwen3_5": testing.TINY_QWEN3_5}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request):
    cfg = models.config_from_hf({**FAMILIES[request.param], "vocab_size": VOCAB})
    if request.param == "qwen3_5":
        assert {"linear_attention", "full_attention"} <= set(cfg.layer_types)  # both layer kinds
    return cfg, models.random_params(cfg, seed=3, init_std=0.3)


def _rows(rng, lengths, width=None):
    """Right-padded token rows: (tokens [B, T], valid [B, T])."""
    T = width or max(lengths)
    tokens = np.zeros((len(lengths), T), np.int32)
    valid = np.zeros((len(lengths), T), bool)
    for i, n in enumerate(lengths):
        tokens[i, :n], valid[i, :n] = rng.integers(0, VOCAB, n), True
    return jnp.asarray(tokens), jnp.asarray(valid)


def _nll(p, hidden_BRE, targets_BR, cfg):
    """Mean next-token loss of readout positions (the scalar a training step differentiates)."""
    logp = jax.nn.log_softmax(models.head_logits(p, hidden_BRE, cfg), axis=-1)
    return -jnp.take_along_axis(logp, targets_BR[..., None], axis=-1).mean()


def _max_diff(a, b):
    return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _assert_close(got, want):
    """Equal up to fp32 noise, which grows with the values (hidden states here reach a few units)."""
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * max(1.0, float(np.abs(want).max())), rtol=0)


def _assert_grads_close(got, want, atol, what):
    """Every leaf within `atol` + 1e-4 of that leaf's largest gradient: fp32 gradients through the
    DeltaNet's triangular solve move by ~3e-5 of their scale between two compilations of the very
    same program (jitted vs op by op), so a fixed bound alone would test XLA's fusion choices; a real
    error (a layer's gradient lost or doubled) is of the order of the scale itself."""
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        err, scale = float(jnp.abs(g - w).max()), float(jnp.abs(w).max())
        assert err <= atol + 1e-4 * scale, f"{what}{jax.tree_util.keystr(path)}: {err:.2e} (scale {scale:.2e})"


# -- rematerialisation ----------------------------------------------------------------------------

REMAT_PRIMITIVE = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).jaxpr.eqns[0].primitive


def _remat_policies_in(jaxpr, *, as_run: bool = True):
    """The policy of every jax.checkpoint in a jaxpr (nested jaxprs included), in order: as run (a
    scan's body counted once per step) or as written (once)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is REMAT_PRIMITIVE:
            found.append(eqn.params["policy"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            inner = _remat_policies_in(sub, as_run=as_run)
            found += inner * (eqn.params["length"] if as_run and eqn.primitive.name == "scan" else 1)
    return found


def test_remat_policies_give_the_same_gradients_and_checkpoint_each_layer(tiny):
    cfg, params = tiny
    tokens, _ = _rows(np.random.default_rng(0), [24, 24])

    def loss(p, remat):
        hidden, _ = models.forward(p, tokens[:, :-1], None, cfg, cache_write=CW.NONE, remat=remat)
        return _nll(p, hidden, tokens[:, 1:], cfg)

    grads = {name: jax.jit(jax.grad(loss), static_argnums=1)(params, name) for name in models.REMAT_POLICIES}
    assert float(jnp.abs(grads["none"]["embed_tokens"]["embedding"]).max()) > 1e-4  # a real gradient
    for name, policy in models.REMAT_POLICIES.items():
        _assert_grads_close(grads[name], grads["none"], 1e-6, f"remat={name}")
        # and the policy really is applied: one checkpoint per decoder layer run, none without remat;
        # written once per layer of the scanned period (models.scan), not once per layer
        jaxpr = jax.make_jaxpr(loss, static_argnums=1)(params, name).jaxpr
        assert _remat_policies_in(jaxpr) == ([] if policy is None else [policy] * cfg.num_hidden_layers), name
        written = _remat_policies_in(jaxpr, as_run=False)
        assert written == ([] if policy is None else [policy] * models.layer_period(cfg)), name
    assert set(models.REMAT_POLICIES) == {"none", "full", "dots"}
    assert models.REMAT_POLICIES["dots"] is jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def test_unknown_remat_or_cache_write_is_a_value_error(tiny):
    cfg, params = tiny
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"unknown remat 'selective'; known: none, full, dots"):
        models.forward(params, tokens, None, cfg, remat="selective")
    with pytest.raises(ValueError, match="cache_write must be a CacheWrite"):
        models.forward(params, tokens, None, cfg, cache_write=False)  # the old bool spelling


# -- gradients through a prefix cache ---------------------------------------------------------------


def test_gradient_through_a_prefix_cache_equals_independent_full_sequences(tiny):
    """Rows continuing a prefix computed in the same function (prefix APPENDed once into an empty
    cache, rows read it with NONE) give the gradient of running every row as its own sequence."""
    cfg, params = tiny
    rng = np.random.default_rng(1)
    P, lengths = 13, [9, 4, 7]
    prefix_1P = jnp.asarray(rng.integers(0, VOCAB, (1, P)), jnp.int32)
    rows_BT, valid_BT = _rows(rng, lengths)
    readout_BR = jnp.asarray([[0, n - 2] for n in lengths], jnp.int32)  # next-token losses inside each row
    targets_BR = jnp.take_along_axis(rows_BT, readout_BR + 1, axis=1)

    def loss_cached(p):
        _, cache = models.forward(p, prefix_1P, models.init_cache(cfg, 1, P), cfg, cache_write=CW.APPEND)
        hidden, none = models.forward(
            p, rows_BT, cache, cfg, valid_BT=valid_BT, readout_BR=readout_BR, cache_write=CW.NONE
        )
        assert none is None
        return _nll(p, hidden, targets_BR, cfg)

    def loss_independent(p):
        total = 0.0
        for i, n in enumerate(lengths):
            seq = jnp.concatenate([prefix_1P, rows_BT[i : i + 1, :n]], axis=1)
            hidden, _ = models.forward(p, seq, None, cfg, readout_BR=P + readout_BR[i : i + 1])
            total += _nll(p, hidden, targets_BR[i : i + 1], cfg)
        return total / len(lengths)

    (l_c, g_c), (l_i, g_i) = (jax.jit(jax.value_and_grad(f))(params) for f in (loss_cached, loss_independent))
    assert abs(float(l_c) - float(l_i)) <= 1e-5
    _assert_grads_close(g_c, g_i, 1e-5, "prefix cache")


# -- CacheWrite modes --------------------------------------------------------------------------------


def test_cache_write_modes_continue_a_prefix_like_the_full_sequence(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(2)
    fwd = jax.jit(models.forward, static_argnames=("cfg", "cache_write"))
    P, S = 11, 16
    prefix_1P = jnp.asarray(rng.integers(0, VOCAB, (1, P)), jnp.int32)
    _, cache = fwd(params, prefix_1P, models.init_cache(cfg, 1, P + S), cfg, cache_write=CW.APPEND)
    assert int(cache["offset"]) == P and int(cache["pos"][0]) == P

    def full(*parts):  # the reference: one sequence from scratch, hidden at its last token
        hidden, _ = fwd(params, jnp.concatenate(parts)[None], None, cfg)
        return hidden[0, -1]

    # APPEND: two rows of different lengths extend the shared prefix; the cache then continues each
    rows_BT, valid_BT = _rows(rng, [5, 3])
    hidden, appended = fwd(params, rows_BT, cache, cfg, valid_BT=valid_BT, cache_write=CW.APPEND)
    assert appended["valid"].shape == (2, P + S) and int(appended["offset"]) == P + 5
    nxt = jnp.asarray(rng.integers(0, VOCAB, (2, 1)), jnp.int32)
    hidden2, _ = fwd(params, nxt, appended, cfg, cache_write=CW.NONE)
    for i, n in enumerate([5, 3]):
        _assert_close(hidden[i, n - 1], full(prefix_1P[0], rows_BT[i, :n]))
        _assert_close(hidden2[i, 0], full(prefix_1P[0], rows_BT[i, :n], nxt[i]))

    # SEGMENT: two headers become per-row segments over the shared prefix (which stays as it was);
    # NONE: three rows read their header's segment and write nothing
    headers_BT, hvalid_BT = _rows(rng, [6, 2])
    _, seg = fwd(params, headers_BT, cache, cfg, valid_BT=hvalid_BT, cache_write=CW.SEGMENT)
    assert int(seg["offset"]) == P and seg["valid"].shape == (1, P + S)
    picks, lengths = [1, 0, 1], [4, 3, 1]
    tails_BT, tvalid_BT = _rows(rng, lengths)
    readout_BR = jnp.asarray([[n - 1] for n in lengths], jnp.int32)
    hidden, none = fwd(
        params,
        tails_BT,
        cache_lib.select_rows(seg, jnp.asarray(picks)),
        cfg,
        valid_BT=tvalid_BT,
        readout_BR=readout_BR,
        cache_write=CW.NONE,
    )
    assert none is None
    for i, (h, n) in enumerate(zip(picks, lengths)):
        want = full(prefix_1P[0], headers_BT[h, : int(hvalid_BT[h].sum())], tails_BT[i, :n])
        _assert_close(hidden[i, 0], want)


# -- bf16 stacks through the scan ---------------------------------------------------------------


def _f32_stacks_in(compiled_text: str, tree) -> list[str]:
    """The fp32 shapes of `tree`'s 16-bit stacked leaves that a compiled program materialises."""
    shapes = {f"f32[{','.join(map(str, a.shape))}]" for a in jax.tree.leaves(tree) if a.dtype == jnp.bfloat16}
    return sorted(s for s in shapes if s in compiled_text)


def test_frozen_bf16_stacks_enter_the_scan_as_bits_and_gradients_refuse_them(tiny):
    """XLA:CPU converts a bf16 stack sliced per scan step to fp32 whole, before the loop (and an
    output stack once per step); frozen inputs go through as bits instead, bit-exact. A gradient
    that reaches a frozen input is an error naming the setting, never a silent zero."""
    import dataclasses

    cfg, params = tiny
    params = models.cast_params(params, cfg, jnp.bfloat16)
    rng = np.random.default_rng(5)
    # three rows of 7: no tensor inside a layer has the shape of a stack ([layers, rows, ...])
    tokens_BT, valid_BT = _rows(rng, [7, 6, 4])
    as_is = dataclasses.replace(cfg, scan_frozen=())

    def prefill(p, c):
        return models.forward(p, tokens_BT, None, c, valid_BT=valid_BT)

    hidden, cache = jax.jit(prefill, static_argnums=1)(params, cfg)
    want_hidden, want_cache = jax.jit(prefill, static_argnums=1)(params, as_is)
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(want_hidden))
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    stacks = (params[models.stack.BLOCKS], cache[models.stack.BLOCKS])
    for c, expect_none in ((cfg, True), (as_is, False)):
        text = jax.jit(prefill, static_argnums=1).lower(params, c).compile().as_text()
        found = _f32_stacks_in(text, stacks)
        assert not found if expect_none else found, (c.scan_frozen, found)

    def nll(p, c):
        h, _ = prefill(p, c)
        return jnp.sum(h.astype(jnp.float32) ** 2)

    with pytest.raises(TypeError, match="scan_frozen"):
        jax.grad(nll)(params, cfg)
    grads = jax.grad(nll)(params, as_is)
    blocks = jax.tree.leaves(grads[models.stack.BLOCKS])
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in blocks)
    assert all(float(jnp.abs(g.astype(jnp.float32)).max()) > 0 for g in blocks if g.dtype == jnp.bfloat16)
