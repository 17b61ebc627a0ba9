"""Llama-family backbones: the embedded SmolLM2 against transformers' GGUF load, and tiny random
Llama / Qwen2 / Qwen3 checkpoints against transformers."""

import numpy as np
import pytest

import hf_reference as R
import lev_jax
from lev_jax.loaders.gguf import embedded_default_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Question: Is the customer asking about a refund?\nAnswer (yes or no):",
    "Les élèves ont étudié 3 chapitres et 12 exercices — ensuite ils",
    '{"order_id": 1042, "status": "delayed", "items": ["lamp", "desk"]} The order is',
    "<|im_start|>user\nWhich option fits: A) sports B) politics?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smollm2(embedded):
    return embedded


@pytest.fixture(scope="module")
def reference():
    path = embedded_default_path()
    return R.transformers_gguf_model(path), R.transformers_gguf_tokenizer(path)


def test_embedded_default_is_smollm2(smollm2):
    cfg = smollm2.config
    assert (
        cfg.model_type,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.vocab_size,
    ) == ("llama", 30, 576, 9, 3, 49152)
    assert smollm2.tokenizer is not None and smollm2.tokenizer.chat_template


def test_token_ids_match_transformers_tokenizer(smollm2, reference):
    _, tok = reference
    for text in PROMPTS:
        assert smollm2.tokenizer.encode(text) == tok.encode(text, add_special_tokens=False), text


def test_next_token_logits_match_transformers(smollm2, reference):
    model, tok = reference
    for text in PROMPTS:
        ids = tok.encode(text, add_special_tokens=False)
        ref = R.hf_logits(model, [ids])[0, -1]
        ours = np.asarray(smollm2.logits([ids]))[0, -1]
        assert np.abs(ours - ref).max() <= 1e-3, text
        assert list(np.argsort(-ours)[:5]) == list(np.argsort(-ref)[:5]), text


def test_padded_batch_and_cache_on_the_real_model(smollm2):
    tok = smollm2.tokenizer
    rows = [tok.encode(t) for t in PROMPTS[:3]]
    T = max(map(len, rows))
    ids = np.zeros((3, T), np.int32)
    mask = np.zeros((3, T), bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, True
    batch = np.asarray(smollm2.logits(ids, mask))
    for i, r in enumerate(rows):
        alone = np.asarray(smollm2.logits([r]))[0]
        np.testing.assert_allclose(batch[i, : len(r)], alone, atol=1e-4, rtol=0)
    # the state prefix once, two different continuations forked from it
    prefix, cont = rows[2][:10], [rows[2][10:], rows[0]]
    cache = smollm2.prefill(prefix)
    T2 = max(map(len, cont))
    toks = np.zeros((2, T2), np.int32)
    val = np.zeros((2, T2), bool)
    for i, c in enumerate(cont):
        toks[i, : len(c)], val[i, : len(c)] = c, True
    hidden, _ = smollm2.extend(cache, toks, val, [[len(c) - 1] for c in cont])
    got = np.asarray(smollm2.head(hidden))
    for i, c in enumerate(cont):
        alone = np.asarray(smollm2.logits([prefix + c]))[0, -1]
        np.testing.assert_allclose(got[i, 0], alone, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", sorted(R.LLAMA_TINY))
def test_tiny_llama_family_matches_transformers(kind, tmp_path):
    ref = R.save_llama_family(kind, tmp_path, seed=2)
    bb = lev_jax.load_backbone(str(tmp_path))
    ids = np.random.default_rng(0).integers(0, R.VOCAB, (2, 50))
    np.testing.assert_allclose(np.asarray(bb.logits(ids)), R.hf_logits(ref, ids), atol=1e-4, rtol=0)
