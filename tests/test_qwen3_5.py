"""Qwen3.5 parity with transformers' own implementation on tiny random configs, and cache parity."""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_reference as R
import lev_jax
from lev_jax import models
from lev_jax.models import cache as cache_lib
from lev_jax.models.qwen3_5.modeling import chunk_gated_delta_rule, solve_unit_lower

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(R.QWEN3_5_TINY))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    ref = R.save_qwen3_5(request.param, d, seed=1)
    return ref, lev_jax.load_backbone(str(d))


@pytest.mark.parametrize("length", [77, 130])
def test_logits_match_transformers(pair, length):
    ref, bb = pair
    ids = np.random.default_rng(length).integers(0, R.VOCAB, (2, length))
    np.testing.assert_allclose(np.asarray(bb.logits(ids)), R.hf_logits(ref, ids), atol=TOL, rtol=0)


def test_padded_batch_matches_unpadded_rows(pair):
    ref, bb = pair
    rng = np.random.default_rng(5)
    lengths = [70, 33, 9]
    ids = np.zeros((3, 70), np.int64)
    mask = np.zeros((3, 70), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(0, R.VOCAB, n)
        mask[i, :n] = 1
    out = np.asarray(bb.logits(ids, mask))
    for i, n in enumerate(lengths):
        alone = R.hf_logits(ref, ids[i : i + 1, :n])[0]
        np.testing.assert_allclose(out[i, :n], alone, atol=TOL, rtol=0)


def test_config_and_head(pair):
    ref, bb = pair
    assert bb.config.layer_types == tuple(ref.config.layer_types)
    assert bb.tokenizer is None  # tiny checkpoints ship no tokenizer
    assert bb.config.tie_word_embeddings == ("lm_head" not in bb.params)


def test_bfloat16_weights_keep_the_delicate_parts_fp32(pair):
    """bf16 weights and matmul inputs; residual stream, norms, DeltaNet state and readout stay fp32."""
    ref, bb = pair
    bb16 = lev_jax.Backbone(bb.config, models.cast_params(bb.params, bb.config, "bfloat16"))
    assert bb16.dtype == "bfloat16"
    assert {
        str(leaf.dtype)
        for path, leaf in jax.tree_util.tree_leaves_with_path(bb16.params)
        if getattr(path[-1], "key", "") in ("A_log", "dt_bias")
    } <= {"float32"}
    ids = np.random.default_rng(7).integers(0, R.VOCAB, (2, 77))
    got = np.asarray(bb16.logits(ids))
    want = R.hf_logits(ref, ids)
    theirs16 = R.hf_logits(copy.deepcopy(ref).to(torch.bfloat16), ids)  # transformers with the model cast to bf16
    assert got.dtype == np.float32
    err, err_theirs = np.abs(got - want), np.abs(theirs16 - want)
    assert err.max() > 1e-6  # it really ran with bf16 weights
    # fp32 accumulation and residual stream: on average at least as close to fp32 as transformers' own
    # bf16 run, and no outlier beyond twice its worst
    assert err.mean() <= err_theirs.mean() and err.max() <= 2 * err_theirs.max()
    cache = bb16.prefill(ids[:1, :40])
    for layer in cache["blocks"].values():  # the layer stacks (models.stack)
        if "state" in layer:
            assert layer["state"].dtype == jnp.float32 and layer["conv"].dtype == jnp.float32
        else:
            assert layer["k"].dtype == jnp.bfloat16 and layer["v"].dtype == jnp.bfloat16
    hidden, _ = bb16.extend(cache, ids[:1, 40:50])
    assert hidden.dtype == jnp.float32


def test_vl_checkpoint_loads_its_language_model(tmp_path):
    ref = R.save_qwen3_5_vl("mixed-gqa", tmp_path, seed=3)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "qwen3_5" and "text_config" in saved
    bb = lev_jax.load_backbone(str(tmp_path))
    ids = np.random.default_rng(0).integers(0, R.VOCAB, (1, 40))
    np.testing.assert_allclose(np.asarray(bb.logits(ids)), R.hf_logits(ref, ids), atol=TOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# Cache parity: our own full forward is the reference (it matches transformers above).


def _cfg(layer_types):
    return models.Qwen3_5Config.from_hf(
        dict(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=len(layer_types),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_key_head_dim=32,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=layer_types,
        )
    )


LAYOUTS = {
    "deltanet-only": ["linear_attention"] * 2,
    "attention-only": ["full_attention"] * 2,
    "mixed": ["linear_attention", "full_attention", "linear_attention"],
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def tiny(request):
    cfg = _cfg(LAYOUTS[request.param])
    # HF-style init at a scale that gives O(1) logits; fp32 chunking noise stays ~1e-6 here, a real
    # cache bug shows up as O(0.1) errors
    params = models.random_params(cfg, seed=7, init_std=0.06)
    return lev_jax.Backbone(cfg, params)


def test_prefill_then_extend_equals_full_forward(tiny):
    ids = np.random.default_rng(1).integers(0, 97, 150)
    full = np.asarray(tiny.logits(ids[None]))[0]
    cache = tiny.prefill(ids[:100], chunk=32)  # several chunks, the last one padded
    hidden, cache = tiny.extend(cache, ids[None, 100:130])
    np.testing.assert_allclose(np.asarray(tiny.head(hidden))[0], full[100:130], atol=1e-5, rtol=0)
    hidden, _ = tiny.extend(cache, ids[None, 130:])  # and once more from the extended cache
    np.testing.assert_allclose(np.asarray(tiny.head(hidden))[0], full[130:], atol=1e-5, rtol=0)


def test_fork_to_rows_of_different_lengths_equals_independent_runs(tiny):
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, 97, 45)
    suffixes = [rng.integers(0, 97, n) for n in (7, 1, 12, 4)]
    T = max(len(s) for s in suffixes)
    tokens = np.zeros((len(suffixes), T), np.int32)
    valid = np.zeros((len(suffixes), T), bool)
    for i, s in enumerate(suffixes):
        tokens[i, : len(s)], valid[i, : len(s)] = s, True
    readout = np.array([[0, len(s) - 1] for s in suffixes])
    cache = tiny.prefill(prefix, slots=64)  # bucket-style spare slots must stay invisible
    hidden, forked = tiny.extend(cache, tokens, valid, readout)
    got = np.asarray(tiny.head(hidden))
    for i, s in enumerate(suffixes):
        alone = np.asarray(tiny.logits(np.concatenate([prefix, s])[None]))[0]
        np.testing.assert_allclose(got[i, 0], alone[len(prefix)], atol=1e-5, rtol=0)
        np.testing.assert_allclose(got[i, 1], alone[len(prefix) + len(s) - 1], atol=1e-5, rtol=0)
    # an explicitly materialised fork reads the same as the shared 1-row cache
    hidden_f, _ = tiny.extend(cache_lib.fork(cache, len(suffixes)), tokens, valid, readout)
    np.testing.assert_allclose(np.asarray(tiny.head(hidden_f)), got, atol=1e-6, rtol=0)
    # the forked cache carries each row's own state: extend every row by the same next token
    nxt = np.full((len(suffixes), 1), 3, np.int32)
    hidden2, _ = tiny.extend(forked, nxt)
    for i, s in enumerate(suffixes):
        alone = np.asarray(tiny.logits(np.concatenate([prefix, s, [3]])[None]))[0, -1]
        np.testing.assert_allclose(np.asarray(tiny.head(hidden2))[i, 0], alone, atol=1e-5, rtol=0)


def _recurrent_reference(q, k, v, g, beta, state):
    """Token-by-token gated delta rule in float64 numpy (the definition)."""
    q, k, v, g, beta, S = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(q.shape[-1])
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        S = S * np.exp(g[:, t])[..., None, None]
        kv = np.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + np.einsum("bhk,bhv->bhkv", k[:, t], (v[:, t] - kv) * beta[:, t][..., None])
        out[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return out, S


def test_chunked_delta_rule_continues_from_state_and_matches_recurrence():
    rng = np.random.default_rng(3)
    B, T, H, K, V = 2, 150, 3, 8, 6
    q, k = rng.normal(size=(B, T, H, K)), rng.normal(size=(B, T, H, K))
    v = rng.normal(size=(B, T, H, V))
    g = -np.abs(rng.normal(size=(B, T, H))) * 0.3
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
    s0 = rng.normal(size=(B, H, K, V)) * 0.1
    want_out, want_state = _recurrent_reference(q, k, v, g, beta, s0)
    f = lambda *a: [jnp.asarray(x, jnp.float32) for x in a]
    out, state = chunk_gated_delta_rule(*f(q, k, v, g, beta, s0))
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-4)
    np.testing.assert_allclose(np.asarray(state), want_state, atol=1e-4)
    # split at a point that is not a chunk boundary: the second call continues from the first's state
    o1, s1 = chunk_gated_delta_rule(*f(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], s0))
    o2, s2 = chunk_gated_delta_rule(*f(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:]), s1)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), want_out, atol=1e-4)
    np.testing.assert_allclose(np.asarray(s2), want_state, atol=1e-4)


def test_unit_lower_solve_is_plain_xla_with_lapacks_values_and_gradients():
    """The delta rule's triangular solve never calls LAPACK, plainly or under jax.grad (its CPU trsm
    kernels block on XLA's intra-op pool: one program per host device deadlocked a run on 8 host
    devices), and equals trsm up to fp32 rounding, with JAX's own gradients of trsm."""
    rng = np.random.default_rng(4)
    # shaped like the delta rule's: [B, H, N, C, C] with a unit diagonal the solve must ignore
    a = jnp.asarray(rng.normal(size=(2, 3, 2, 64, 64)) * 0.1 + 5 * np.eye(64), jnp.float32)
    b = jnp.asarray(rng.normal(size=(2, 3, 2, 64, 10)), jnp.float32)
    w = jnp.asarray(rng.normal(size=b.shape), jnp.float32)
    trsm = lambda a, b: jax.lax.linalg.triangular_solve(a, b, left_side=True, lower=True, unit_diagonal=True)
    want = jax.jit(trsm)(a, b)
    np.testing.assert_allclose(jax.jit(solve_unit_lower)(a, b), want, atol=1e-5 * float(jnp.abs(want).max()), rtol=0)
    lapack_loss = lambda a, b: (trsm(a, b) * w).sum()
    our_loss = lambda a, b: (solve_unit_lower(a, b) * w).sum()
    (v_ref, g_ref), (v_our, g_our) = (jax.jit(jax.value_and_grad(f, (0, 1)))(a, b) for f in (lapack_loss, our_loss))
    assert abs(float(v_our) - float(v_ref)) <= 1e-4 * abs(float(v_ref)) + 1e-5
    for got, want in zip(g_our, g_ref):
        np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()), rtol=0)
    assert float(jnp.abs(jnp.triu(g_our[0])).max()) == 0.0  # nothing flows to what the solve never reads
    # no LAPACK call in the plain or the differentiated program
    for fn in (solve_unit_lower, jax.grad(our_loss, (0, 1))):
        hlo = jax.jit(fn).lower(a, b).as_text()
        assert "trsm" not in hlo and "lapack" not in hlo.lower()
