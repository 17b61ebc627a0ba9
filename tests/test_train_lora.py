"""LoRA as parameter trees: targets (attention, MLP, Gated DeltaNet), the merge against transformers +
peft computing base + adapter on the activations, and the training path (apply inside jit)."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_reference as R
import lev_jax
from lev_jax import models
from lev_jax.models import stack
from lev_jax.training import lora

peft = pytest.importorskip("peft")
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5-lora")
    ref = R.save_qwen3_5("mixed-gqa", d, seed=3)
    return ref, lev_jax.load_backbone(str(d))


@pytest.fixture(scope="module")
def adapter(pair):
    _, bb = pair
    ad = lora.init(bb.params, RANK, seed=1)
    # b starts at zero (the identity adapter); a trained one is not: give b values
    keys = jax.random.split(jax.random.key(2), len(ad))
    return {p: {"a": ab["a"], "b": 0.2 * jax.random.normal(k, ab["b"].shape)} for (p, ab), k in zip(ad.items(), keys)}


def test_targets_cover_attention_mlp_and_deltanet(pair, adapter):
    _, bb = pair
    names = {p.split(".")[-2] for p in adapter}
    assert names == set(lora.DEFAULT_TARGETS)
    fresh = lora.init(bb.params, RANK)
    assert all(float(jnp.abs(ab["b"]).max()) == 0.0 for ab in fresh.values())  # B zero-initialised
    for p, ab in adapter.items():
        w = lora.flatten(bb.params)[p]
        assert ab["a"].shape == (w.shape[0], RANK) and ab["b"].shape == (RANK, w.shape[1])
    # a target pattern picks kernels by path
    only = lora.target_paths(bb.params, [r"layers\.1\.self_attn\.(q|v)_proj\.kernel"])
    assert only == ["layers.1.self_attn.q_proj.kernel", "layers.1.self_attn.v_proj.kernel"]
    # lora_layers: only the last K decoder layers, every target in them
    n_layers = 1 + max(lora.layer_of(p) for p in adapter)
    top = lora.init(bb.params, RANK, top_layers=1)
    assert {lora.layer_of(p) for p in top} == {n_layers - 1}
    assert sorted(top) == sorted(p for p in adapter if lora.layer_of(p) == n_layers - 1)


def test_merged_weights_give_the_logits_of_base_plus_adapter(pair, adapter):
    ref, bb = pair
    scale = ALPHA / RANK
    merged = lora.merge(bb.params, adapter, scale)
    flat_m, flat_b = lora.flatten(merged), lora.flatten(bb.params)
    for p, ab in adapter.items():  # W + scale * a @ b, summed in fp32
        want = np.asarray(flat_b[p], np.float64) + scale * np.asarray(ab["a"], np.float64) @ np.asarray(ab["b"])
        np.testing.assert_allclose(np.asarray(flat_m[p]), want, atol=1e-6, rtol=0)
    ids = np.random.default_rng(0).integers(0, R.VOCAB, (2, 40))

    # transformers + peft: the frozen base plus the adapter applied to the activations, x W + s (x A) B;
    # in float64, so the only fp32 rounding left in the comparison is our merged kernels'
    cfg = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(lora.DEFAULT_TARGETS), init_lora_weights=False
    )
    with_adapter = peft.get_peft_model(copy.deepcopy(ref).double(), cfg).eval()
    modules = dict(with_adapter.named_modules())
    with torch.no_grad():
        for p, ab in adapter.items():
            m = modules["base_model.model.model." + p.removesuffix(".kernel")]
            m.lora_A["default"].weight.copy_(torch.from_numpy(np.asarray(ab["a"], np.float64).T.copy()))
            m.lora_B["default"].weight.copy_(torch.from_numpy(np.asarray(ab["b"], np.float64).T.copy()))
    peft_logits = R.hf_logits(with_adapter, ids)
    # the same transformers model with our merged kernels loaded as plain weights
    plain = with_adapter.merge_and_unload()
    plain_modules = dict(plain.named_modules())
    with torch.no_grad():
        for p in adapter:
            plain_modules["model." + p.removesuffix(".kernel")].weight.copy_(
                torch.from_numpy(np.asarray(flat_m[p], np.float64).T.copy())
            )
    np.testing.assert_allclose(R.hf_logits(plain, ids), peft_logits, atol=1e-5, rtol=0)

    ours = np.asarray(lev_jax.Backbone(bb.config, merged).logits(ids))
    np.testing.assert_allclose(ours, peft_logits, atol=1e-4, rtol=0)  # the model's own parity tolerance

    # the training path: the adapter applied to the activations inside jit (x W + (x A) sB, as peft
    # computes it) gives peft's logits, and the merged model's up to fp32 rounding
    @jax.jit
    def train_logits(params, ad):
        p = lora.apply(params, ad, scale)
        h, _ = models.forward(p, jnp.asarray(ids), None, bb.config)
        return models.head_logits(p, h, bb.config)

    trained = np.asarray(train_logits(bb.params, adapter))
    np.testing.assert_allclose(trained, peft_logits, atol=1e-4, rtol=0)
    np.testing.assert_allclose(trained, ours, atol=1e-4, rtol=0)
    # and it really is the unmerged path: the kernels are the base's, the adapter sits beside them
    # (in the layer stacks, models.stack: layer i is entry i // P of stack i % P)
    applied = lora.apply(bb.params, adapter, scale)
    p0 = next(iter(adapter))
    i, rest = stack.layer_path(p0)
    P = len(bb.params["blocks"])
    got, base = applied["blocks"][i % P], bb.params["blocks"][i % P]
    for key in rest.removesuffix(".kernel").split("."):
        got, base = got[key], base[key]
    assert got["kernel"] is base["kernel"]
    n, m = base["kernel"].shape[0], got["lora_b"].shape[0]
    np.testing.assert_array_equal(np.asarray(got["lora_b"][i // P - (n - m)]), scale * np.asarray(adapter[p0]["b"]))


def test_bfloat16_base_merges_in_fp32_then_casts(pair, adapter):
    _, bb = pair
    base16 = models.cast_params(bb.params, bb.config, "bfloat16")
    merged = lora.merge(base16, adapter, ALPHA / RANK)
    p = next(iter(adapter))
    got = lora.flatten(merged)[p]
    assert got.dtype == jnp.bfloat16
    want = (lora.flatten(base16)[p].astype(jnp.float32) + lora.delta(adapter[p], ALPHA / RANK)).astype(jnp.bfloat16)
    assert bool(jnp.all(got == want))
