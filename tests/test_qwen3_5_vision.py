"""Qwen3.5 vision tower parity with transformers' own implementation on tiny random VL checkpoints,
and the tower's loader."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import hf_reference as R
from lev_jax.errors import CheckpointError
from lev_jax.models.qwen3_5 import vision as V
from lev_jax.models.qwen3_5 import vision_params as VP

TOL = 1e-4
TEXT = "mixed-gqa"


def save_deep_vl(out_dir, seed: int):
    """Two blocks, a 4 x 4 position table (so every grid here really resamples it, up or down), three
    heads, 2 x 2 patches and a non-default rope theta."""
    text = R.qwen3_5_text_config(TEXT)
    vision = transformers.Qwen3_5VisionConfig(
        depth=2,
        hidden_size=48,
        intermediate_size=80,
        num_heads=3,
        out_hidden_size=text.hidden_size,
        patch_size=2,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=16,
        hidden_act="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "axial", "rope_theta": 500.0},
    )
    cfg = transformers.Qwen3_5Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False, **R.VL_TOKEN_IDS
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    R._randomise(model, seed)
    _randomise_tower(model.model.visual, seed)
    model.save_pretrained(out_dir)
    return model


def _randomise_tower(visual, seed: int):
    """hf_reference's scales (weights * 0.08, norm scales ~ 0.2) leave the tiny tower nearly linear:
    a wrong rope theta or GELU moves its output by < 1e-5. Here activations keep unit scale and the
    attention is peaked, so every part shows well above the tolerance (test_deep_tower_is_sensitive)."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda shape: torch.randn(shape, generator=g)
    with torch.no_grad():
        for name, p in visual.named_parameters():
            if "norm" in name:
                p.copy_(randn(p.shape) * 0.2 + (1.0 if name.endswith("weight") else 0.0))
            elif name.endswith("bias"):
                p.copy_(randn(p.shape) * 0.1)
            elif name.startswith("pos_embed"):
                p.copy_(randn(p.shape))
            else:  # Linear / Conv3d: unit-variance outputs, qkv twice that (peaked attention)
                gain = 2.0 if "qkv" in name else 1.0
                p.copy_(randn(p.shape) * gain / p[0].numel() ** 0.5)


@pytest.fixture(scope="module", params=["tiny", "deep"])
def tower(request, tmp_path_factory):
    """(transformers' vision tower, our config, our fp32 params, checkpoint dir)."""
    d = tmp_path_factory.mktemp(f"vl-{request.param}")
    ref = R.save_qwen3_5_vl(TEXT, d, seed=3) if request.param == "tiny" else save_deep_vl(d, seed=4)
    cfg = V.VisionConfig.from_hf(json.loads((d / "config.json").read_text()))
    return ref.model.visual, cfg, VP.load(d, cfg), d


def pixels(grid, cfg, seed=0):
    t, h, w = grid
    return np.random.default_rng(seed).standard_normal((t * h * w, cfg.patch_dim)).astype(np.float32)


def hf_features(visual, px, grids):
    with torch.no_grad():
        return visual(torch.from_numpy(px), grid_thw=torch.tensor(grids)).pooler_output.numpy()


def test_config_from_hf(tower):
    visual, cfg, params, d = tower
    ref = visual.config
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.out_hidden_size) == (
        ref.depth,
        ref.hidden_size,
        ref.num_heads,
        ref.out_hidden_size,
    )
    assert (cfg.num_position_embeddings, cfg.hidden_act) == (ref.num_position_embeddings, ref.hidden_act)
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"]
    assert cfg.patch_dim == ref.in_channels * ref.temporal_patch_size * ref.patch_size**2
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(
        lambda x: (x.shape, x.dtype), V.abstract_params(cfg, "float32")
    )
    whole = json.loads((d / "config.json").read_text())
    assert V.VisionConfig.from_hf(whole["text_config"]) is None
    bad = {**whole, "vision_config": {**whole["vision_config"], "hidden_act": "xielu"}}
    with pytest.raises(ValueError, match="hidden_act 'xielu'"):
        V.VisionConfig.from_hf(bad)


# (8, 12): the deep table (side 4) resampled up on both axes; (2, 2) down; (2, 6) down and up;
# two frames: attention stays within each frame, positions repeat per frame
@pytest.mark.parametrize("grid", [(1, 8, 12), (1, 2, 2), (1, 2, 6), (2, 4, 6)])
def test_one_image_matches_transformers(tower, grid):
    visual, cfg, params, _ = tower
    px = pixels(grid, cfg)
    ours = np.asarray(V.encode(params, px, grid, cfg))
    ref = hf_features(visual, px, [grid])
    assert ours.shape == (np.prod(grid) // cfg.merge_unit, cfg.out_hidden_size) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_deep_tower_is_sensitive(tower):
    """The parity checks can fail: the default rope theta, the exact GELU in the blocks or the
    position table read with rows and columns swapped each move the deep tower's output far past
    the tolerance."""
    visual, cfg, params, _ = tower
    if cfg.depth == 1:
        pytest.skip("the tiny tower's scales hide these (see _randomise_tower)")
    grid = (1, 8, 12)
    px = pixels(grid, cfg)
    ref = hf_features(visual, px, [grid])
    side, table = cfg.grid_side, params["pos_embed"]["embedding"]
    swapped = {
        **params,
        "pos_embed": {"embedding": table.reshape(side, side, -1).transpose(1, 0, 2).reshape(table.shape)},
    }
    wrong = [  # (params, config, how far off at least): tanh vs erf GELU differ by < 5e-4 anywhere
        (params, dataclasses.replace(cfg, rope_theta=10000.0), 100 * TOL),
        (params, dataclasses.replace(cfg, hidden_act="gelu"), 2 * TOL),
        (swapped, cfg, 100 * TOL),
    ]
    for p, c, off in wrong:
        assert np.abs(np.asarray(V.encode(p, px, grid, c)) - ref).max() > off


def test_two_images_one_hf_call(tower):
    """transformers packs both images in one sequence (cu_seqlens keep them apart); ours encodes
    each on its own."""
    visual, cfg, params, _ = tower
    grids = [(1, 4, 4), (1, 6, 10)]
    px = [pixels(g, cfg, seed=i) for i, g in enumerate(grids)]
    ref = hf_features(visual, np.concatenate(px), grids)
    ours = np.concatenate([np.asarray(V.encode(params, p, g, cfg)) for p, g in zip(px, grids)])
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_bfloat16_params_stay_close(tower):
    _, cfg, params, d = tower
    params16 = VP.load(d, cfg, dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(params16)} == {np.dtype("bfloat16")}
    grid = (1, 8, 12)
    px = pixels(grid, cfg)
    ref = np.asarray(V.encode(params, px, grid, cfg))
    out = np.asarray(V.encode(params16, px, grid, cfg))
    assert out.dtype == np.float32 and np.isfinite(out).all()
    assert np.abs(out - ref).max() <= 5e-2 * np.abs(ref).max()


def test_loader_reports_every_problem_at_once(tower, tmp_path):
    _, cfg, _, d = tower
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.visual.blocks.0.norm2.bias"]
    tensors["model.visual.merger.fc1.weight"] = tensors.pop("model.visual.merger.linear_fc1.weight")
    tensors["model.visual.pos_embed.weight"] = tensors["model.visual.pos_embed.weight"][:-1]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(CheckpointError) as err:
        VP.load(tmp_path, cfg)
    msg = str(err.value)
    assert "missing tensors: " in msg and "unexpected tensors: model.visual.merger.fc1.weight" in msg
    for name in ("model.visual.blocks.0.norm2.bias", "model.visual.merger.linear_fc1.weight"):
        assert name in msg.split("missing tensors: ")[1].splitlines()[0]
    assert "mis-shaped tensors: model.visual.pos_embed.weight" in msg


def test_loader_accepts_the_bare_visual_prefix(tower, tmp_path):
    _, cfg, params, d = tower
    tensors = load_file(str(d / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    loaded = VP.load(tmp_path, cfg)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), loaded, params)))


def test_random_params_run(tower):
    _, cfg, _, _ = tower
    params = V.random_params(cfg, "bfloat16", seed=1)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(
        lambda x: (x.shape, x.dtype), V.abstract_params(cfg, "bfloat16")
    )
    out = V.encode(params, pixels((1, 4, 6), cfg), (1, 4, 6), cfg)
    assert out.shape == (6, cfg.out_hidden_size) and np.isfinite(np.asarray(out)).all()
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        V.encode(params, pixels((1, 3, 4), cfg), (1, 3, 4), cfg)
