"""Tiny random models with real tokenizers: real (if untrained) models for tests, fuzzing and demos
that must run in seconds. Their weights follow HF's initialisation; nothing about them is mocked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from lev_jax import models
from lev_jax.backbone import Backbone

TINY_LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=65536,
    tie_word_embeddings=True,
)
TINY_QWEN3_5 = dict(
    model_type="qwen3_5_text",
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
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=65536,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)


def _smollm2_tokenizer():
    from lev_jax.loaders.gguf import embedded_default_path, read_gguf

    return read_gguf(embedded_default_path()).tokenizer


def tiny_backbone(
    family: str = "llama", seed: int = 0, init_std: float = 0.5, dtype: str = "float32", *, layers: int | None = None
) -> Backbone:
    """A tiny random backbone over a real vocabulary: `llama` with the SmolLM2 tokenizer, `qwen3_5`
    with the Qwen3.5 tokenizer. `init_std` is large enough that label distributions are not flat.
    The same seed gives the same weights in every dtype (bf16 ones are the fp32 ones rounded).
    `layers`: a deeper llama than the default 2 layers (elastic depth needs exits to choose from)."""
    if family == "llama":
        tok = _smollm2_tokenizer()
        hf = {
            **TINY_LLAMA,
            "vocab_size": tok.vocab_size,
            "num_hidden_layers": layers or TINY_LLAMA["num_hidden_layers"],
        }
    elif family == "qwen3_5":
        from lev_jax.tokenizer import Tokenizer

        tok = Tokenizer.qwen3_5()
        hf = {**TINY_QWEN3_5, "vocab_size": tok.vocab_size}
    else:
        raise ValueError(f"unknown tiny family {family!r}")
    if layers is not None and family != "llama":
        raise ValueError("layers= sizes the tiny llama (the tiny qwen3_5 has its 4 layer types)")
    cfg = models.config_from_hf(hf)
    return Backbone(
        cfg, models.random_params(cfg, dtype, seed=seed, init_std=init_std), tok, name=f"tiny-{family}", hf_config=hf
    )


def save_tiny_checkpoint(directory, seed: int = 0) -> Path:
    """Save a tiny random Llama with the SmolLM2 tokenizer as an HF checkpoint directory
    (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bb = tiny_backbone("llama", seed=seed)
    p = bb.params
    tensors = {"model.embed_tokens.weight": p["embed_tokens"]["embedding"], "model.norm.weight": p["norm"]["weight"]}
    for i, layer in models.layer_view(p)["layers"].items():
        pre = f"model.layers.{i}."
        tensors[pre + "input_layernorm.weight"] = layer["input_layernorm"]["weight"]
        tensors[pre + "post_attention_layernorm.weight"] = layer["post_attention_layernorm"]["weight"]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[pre + f"self_attn.{name}.weight"] = layer["self_attn"][name]["kernel"].T
        for name in ("gate_proj", "up_proj", "down_proj"):
            tensors[pre + f"mlp.{name}.weight"] = layer["mlp"][name]["kernel"].T
    save_file(
        {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()},
        str(directory / "model.safetensors"),
    )
    (directory / "config.json").write_text(json.dumps(bb.hf_config, indent=1))
    bb.tokenizer.save(directory)
    return directory
