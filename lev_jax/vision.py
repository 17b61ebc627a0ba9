"""Images in a state: the vision side of a backbone and the multimodal prefix.

A vision checkpoint (Qwen3.5's `Qwen3_5ForConditionalGeneration` layout) reads an image as image tokens:
the planner puts `<|vision_start|>`, one `<|image_pad|>` per image token and `<|vision_end|>` where the
state names the image (`readout.plan.ImagePrefix`); the prefix computation replaces the pad tokens' embeddings by
the vision tower's features and gives every token its 3-axis M-RoPE position (`rope_index`). The state
prefix with its images is computed once like any other, and every question continues from it.

Features are cached by content (`images.FeatureCache`, keyed by the decoded pixels and the
preprocessing): the same picture in a later request, even in another state, runs no vision tower.
"""

from __future__ import annotations

import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from lev_jax import domain, programs
from lev_jax.images import FeatureCache, ImagePreprocessor, PreparedImage
from lev_jax.models.qwen3_5 import vision as tower
from lev_jax.models.qwen3_5 import vision_params


def rope_index(ids, grids: list[tuple[int, int, int]], image_token_id: int, merge: int) -> tuple[np.ndarray, int]:
    """(positions int32 [3, T], next position) of a token sequence whose runs of `image_token_id` are
    the images of `grids` in order (as transformers' Qwen3.5 `get_rope_index`): text tokens count up on
    all three axes; an image's tokens sit at (start, start + row, start + column) of its merged grid,
    and the text after it continues at start + max(rows, columns)."""
    ids = np.asarray(ids)
    T = len(ids)
    out = np.zeros((3, T), np.int64)
    is_image = ids == image_token_id
    it = iter(grids)
    pos = i = 0
    while i < T:
        if not is_image[i]:
            out[:, i] = pos
            pos += 1
            i += 1
            continue
        t, h, w = next(it)
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if i + n > T or not is_image[i : i + n].all():
            raise ValueError(f"an image of grid {(t, h, w)} needs {n} consecutive image tokens at {i}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[0, i : i + n] = pos + tt.ravel()
        out[1, i : i + n] = pos + hh.ravel()
        out[2, i : i + n] = pos + ww.ravel()
        pos += max(gh, gw)
        i += n
    if next(it, None) is not None:
        raise ValueError("more image grids than image-token runs")
    return out.astype(np.int32), int(pos)


class Vision:
    """A vision checkpoint's tower, its preprocessing and its feature cache."""

    def __init__(
        self,
        cfg: tower.VisionConfig,
        params,
        preprocessor: ImagePreprocessor,
        *,
        image_token_id: int,
        vision_start_token_id: int,
        vision_end_token_id: int,
        feature_cache_bytes: int = 128 << 20,
    ):
        self.config = cfg
        self.params = params
        self.preprocessor = preprocessor
        self.image_token_id = image_token_id
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        self.cache = FeatureCache(feature_cache_bytes)
        self.tower_runs = 0  # images the vision tower encoded (a cached image does not count)
        self.tower_lock = threading.Lock()
        self.source = None  # (checkpoint directory, its vision_config) when loaded from a checkpoint

    @classmethod
    def from_checkpoint(cls, ckpt_dir: Path, hf_config: dict, lm_cfg, dtype: str, **kwargs) -> Vision | None:
        """The vision side of a checkpoint directory, or None for a text-only checkpoint."""
        cfg = tower.VisionConfig.from_hf(hf_config)
        if cfg is None:
            return None
        ids = (lm_cfg.image_token_id, lm_cfg.vision_start_token_id, lm_cfg.vision_end_token_id)
        if None in ids:
            raise ValueError("a vision checkpoint's config.json needs image_token_id, vision_start/end_token_id")
        params = vision_params.load(ckpt_dir, cfg, dtype)
        pixel_budget = kwargs.pop("pixel_budget", None) or domain.IMAGE_PIXEL_BUDGET
        pre = ImagePreprocessor.from_checkpoint(ckpt_dir, hf_config["vision_config"], pixel_budget=pixel_budget)
        vision = cls(
            cfg,
            params,
            pre,
            image_token_id=ids[0],
            vision_start_token_id=ids[1],
            vision_end_token_id=ids[2],
            **kwargs,
        )
        vision.source = (Path(ckpt_dir), hf_config["vision_config"])
        return vision

    def set_pixel_budget(self, pixels: int) -> None:
        """Resize images to at most `pixels` pixels from now on (cached features of the old budget
        stay valid for it: the budget is part of every image's key)."""
        if pixels < 1:
            raise ValueError(f"the image pixel budget must be positive, not {pixels}")
        ckpt_dir, vision_config = self.source
        self.preprocessor = ImagePreprocessor.from_checkpoint(ckpt_dir, vision_config, pixel_budget=pixels)

    def prepare(self, alias: str, data) -> PreparedImage:
        """Decode and preprocess one image (ImageError / ImageTooLargeError naming `alias`). A
        PreparedImage passes through."""
        if isinstance(data, PreparedImage):
            return data
        if isinstance(data, (str, Path)):
            data = Path(data).read_bytes()
        return self.preprocessor.prepare(alias, bytes(data))

    def placeholder_ids(self, image: PreparedImage) -> list[int]:
        """The tokens an image stands as in a prompt."""
        return [self.vision_start_token_id] + [self.image_token_id] * image.n_tokens + [self.vision_end_token_id]

    def features(self, image: PreparedImage) -> tuple[np.ndarray, bool]:
        """(fp32 [n_tokens, hidden] language-model inputs of an image, whether they came from the
        cache: this content was seen before)."""
        feats = self.cache.get(image.key)
        if feats is not None:
            return feats, True
        with self.tower_lock:
            # two requests with the same new picture: the second waited here while the first encoded it
            if image.key in self.cache:
                feats = self.cache.get(image.key)
                if feats is not None:
                    return feats, True
            out = tower.encode(self.params, jnp.asarray(image.pixel_values), image.grid_thw, self.config)
            feats = np.asarray(out, np.float32)
            if programs.computing():  # never a compile-only run's zeros
                self.tower_runs += 1
                self.cache.put(image.key, feats)
        return feats, False

    def prefix_inputs(self, ids, images, length: int):
        """(embeds [1, length, E], mask [1, length], positions [3, 1, length], image tokens whose
        features came from the cache) of a token sequence (a prefix, or a prefix and a row) padded to
        `length` slots: the features of `images` at its `<|image_pad|>` runs, M-RoPE positions for all."""
        ids = np.asarray(list(ids))
        merge = self.config.spatial_merge_size
        positions, _ = rope_index(ids, [img.grid_thw for img in images], self.image_token_id, merge)
        mask = ids == self.image_token_id
        parts, cached = [], 0
        for img in images:
            feats, hit = self.features(img)
            parts.append(feats)
            cached += img.n_tokens if hit else 0
        feats = np.concatenate(parts, axis=0)
        embeds = np.zeros((1, length, feats.shape[-1]), np.float32)
        embeds[0, np.flatnonzero(mask)] = feats
        mask_out = np.zeros((1, length), bool)
        mask_out[0, : len(ids)] = mask
        pos_out = np.zeros((3, 1, length), np.int32)
        pos_out[:, 0, : len(ids)] = positions
        return embeds, mask_out, pos_out, cached

    def info(self) -> dict:
        return {
            **self.preprocessor.info(),
            "tower_runs": self.tower_runs,
            "feature_cache": self.cache.stats(),
        }
