"""Llama-family decoder (SmolLM2, Llama 2/3 without rope scaling, Qwen2 with qkv bias, Qwen3 with q/k norm)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from lev_jax.models.base import CausalLM
from lev_jax.models.context import Context
from lev_jax.models.layers import MLP, Attention, RMSNorm, kv_cache

FAMILY = {  # model_type -> (qkv_bias, qk_norm)
    "llama": (False, None),
    "mistral": (False, None),
    "qwen2": (True, None),
    "qwen3": (False, "rms"),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: str | None = None
    max_position_embeddings: int = 8192
    exit_rank: int = 0  # > 0: truncated at an elastic-depth exit (models.exit_view)
    depth_of: int = 0  # > 0: that exit view's full model depth (models.full_config)
    # scan steps (models.scan) unrolled per loop iteration: 1 keeps a program's size independent of
    # depth; the layer count unrolls the whole stack (the program a layer loop in Python would give)
    scan_unroll: int = 1
    # the scan inputs (models.scan.FROZEN) never differentiated through this config's programs: on
    # XLA:CPU they pass the scan as raw 16-bit patterns (a trainer marks what it trains)
    scan_frozen: tuple[str, ...] = ("weights", "adapters", "caches")

    @classmethod
    def from_hf(cls, d: dict) -> LlamaConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in FAMILY:
            raise ValueError(f"model_type {model_type!r} is not a Llama-family model ({sorted(FAMILY)})")
        rope = d.get("rope_scaling") or {}
        rope_params = d.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type")) or rope_params.get("rope_type") or "default"
        if rope_type != "default":
            raise ValueError(f"rope scaling type {rope_type!r} is not supported yet")
        qkv_bias, qk_norm = FAMILY[model_type]
        heads = d["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=bool(d.get("attention_bias", qkv_bias)),
            qk_norm=qk_norm,
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        )

    @property
    def layer_types(self) -> tuple[str, ...]:
        return ("full_attention",) * self.num_hidden_layers

    def model(self, dtype=jnp.float32, rngs=None):
        return LlamaLM(self, dtype=dtype, rngs=rngs or nnx.Rngs(0))

    def layer_module(self, kind: str, dtype=jnp.float32):
        return LlamaLayer(self, dtype=dtype, rngs=nnx.Rngs(0))

    def layer_cache(self, batch: int, slots: int, dtype):
        return tuple(
            kv_cache(batch, self.num_key_value_heads, slots, self.head_dim, dtype)
            for _ in range(self.num_hidden_layers)
        )

    def flops_per_token(self, context: int) -> float:
        """Forward FLOPs per token (matmuls only) at a given attended context length."""
        E, F, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        qkvo = E * self.head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        attn = 2 * self.num_attention_heads * self.head_dim * context
        return 2.0 * L * (qkvo + 3 * E * F + attn)


class LlamaLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            eps=cfg.rms_norm_eps,
            qkv_bias=cfg.qkv_bias,
            qk_norm=cfg.qk_norm,
            dtype=dtype,
            rngs=rngs,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, ctx: Context, layer_cache):
        h, new_cache = self.self_attn(self.input_layernorm(x), ctx, layer_cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), new_cache


class LlamaLM(CausalLM):
    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.rot_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        self._init_shell(cfg, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype), dtype=dtype, rngs=rngs)
