"""Safetensors loader: sharded checkpoints, dtype casting and errors that name what is wrong."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_reference as R
import lev_jax
from lev_jax import CheckpointError, models


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    R.save_qwen3_5("mixed-gqa", d, seed=4)
    return d


def _copy(saved, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(saved, out)
    return out


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_sharded_checkpoint_equals_single_file(saved, tmp_path):
    tensors = load_file(str(saved / "model.safetensors"))
    names = sorted(tensors)
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(saved / "config.json", out / "config.json")
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = np.arange(30)[None] % R.VOCAB
    a, b = lev_jax.load_backbone(str(saved)), lev_jax.load_backbone(str(out))
    np.testing.assert_array_equal(np.asarray(a.logits(ids)), np.asarray(b.logits(ids)))


def test_bfloat16_cast_keeps_decay_parameters_in_fp32(saved):
    bb = lev_jax.load_backbone(str(saved), dtype="bfloat16")
    layer0 = models.layer_view(bb.params)["layers"][0]["linear_attn"]
    assert layer0["in_proj_qkv"]["kernel"].dtype == jnp.bfloat16
    assert layer0["A_log"].dtype == jnp.float32 and layer0["dt_bias"].dtype == jnp.float32
    ids = np.arange(20)[None]
    full = np.asarray(lev_jax.load_backbone(str(saved)).logits(ids))
    assert np.abs(np.asarray(bb.logits(ids)) - full).max() < 0.1 * np.abs(full).max()


def test_missing_unexpected_and_misshaped_tensors_are_named(saved, tmp_path):
    path = _copy(saved, tmp_path)

    def edit(t):
        del t["model.layers.1.self_attn.k_proj.weight"]
        t["model.layers.0.mlp.extra_proj.weight"] = np.zeros((2, 2), np.float32)
        t["model.norm.weight"] = np.zeros((3,), np.float32)

    _rewrite(path, edit)
    with pytest.raises(CheckpointError) as err:
        lev_jax.load_backbone(str(path))
    msg = str(err.value)
    assert "missing tensors: layers.1.self_attn.k_proj.kernel" in msg
    assert "unexpected tensors: model.layers.0.mlp.extra_proj.weight" in msg
    assert "mis-shaped tensors: model.norm.weight: got (3,), expected (64,)" in msg


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_corrupt_file_is_a_clear_error(saved, tmp_path, how):
    path = _copy(saved, tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\x00garbage" * 100)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        lev_jax.load_backbone(str(path))


def test_missing_config_missing_shard_and_bad_json(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        lev_jax.load_backbone(str(path))
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        lev_jax.load_backbone(str(path))
    path2 = _copy(saved, tmp_path / "b")
    (path2 / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-9.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-9.safetensors"):
        lev_jax.load_backbone(str(path2))


def test_unsupported_model_type_is_a_clear_error(saved, tmp_path):
    path = _copy(saved, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'mamba'"):
        lev_jax.load_backbone(str(path))


def test_hub_id_without_network_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="could not fetch 'Qwen/Qwen3.5-0.8B'"):
        lev_jax.load_backbone("Qwen/Qwen3.5-0.8B")
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        lev_jax.load_backbone("./definitely/not/here")
