"""Tiny random reference models built with transformers (PyTorch CPU) and saved offline."""

from __future__ import annotations

import torch
import transformers

from lev_jax.bench.torch_reference import transformers_gguf_model  # noqa: F401  (re-exported for the tests)

QWEN3_5_TINY = {
    # mixed layer types, GQA (4 query heads over 2 KV heads), value heads > key heads in DeltaNet
    "mixed-gqa": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    ),
    # tied head, MHA attention, attention first
    "tied-mha": dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=3,
        linear_num_value_heads=3,
        tie_word_embeddings=True,
        layer_types=["full_attention", "linear_attention", "linear_attention"],
    ),
    # the default 3:1 interval, wider heads
    "interval": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        tie_word_embeddings=False,
    ),
}
VOCAB = 160


def qwen3_5_text_config(name: str) -> transformers.Qwen3_5TextConfig:
    kw = dict(QWEN3_5_TINY[name])
    return transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        **kw,
    )


def _randomise(model, seed: int):
    """HF inits norms at 0/1 and A_log/dt_bias at fixed values; randomise every tensor so parity
    checks every weight's role."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.5, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (0.0 if "linear_attn.norm" not in name else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
    return model


def save_qwen3_5(name: str, out_dir, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(qwen3_5_text_config(name)).eval()
    _randomise(model, seed)
    model.save_pretrained(out_dir)
    return model


# the vision special tokens of the tiny VL configs, inside their VOCAB-token vocabulary
VL_TOKEN_IDS = dict(image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)


def save_qwen3_5_vl(name: str, out_dir, seed: int = 0, *, vocab: int = VOCAB):
    """The VL layout: the text model nested under model.language_model.* beside a vision tower.
    `vocab`: the default tiny vocabulary (vision tokens VL_TOKEN_IDS), or the Qwen3.5 tokenizer's
    size (248,320: the checkpoint then serves with the real tokenizer and its own vision tokens)."""
    text = qwen3_5_text_config(name)
    text.vocab_size = vocab
    vision = transformers.Qwen3_5VisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text.hidden_size,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
    )
    cfg = transformers.Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        tie_word_embeddings=text.tie_word_embeddings,
        **(VL_TOKEN_IDS if vocab == VOCAB else {}),
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    _randomise(model, seed)
    model.save_pretrained(out_dir)
    return model


def hf_logits(model, ids, mask=None):
    with torch.no_grad():
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        kw = {} if mask is None else {"attention_mask": torch.as_tensor(mask, dtype=torch.long)}
        return model(input_ids=ids_t, **kw).logits.float().numpy()


def transformers_gguf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


LLAMA_TINY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def save_llama_family(kind: str, out_dir, seed: int = 0):
    cfg_cls, model_cls, extra = LLAMA_TINY[kind]
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=(kind == "qwen2"),
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    _randomise(model, seed)
    model.save_pretrained(out_dir)
    return model
