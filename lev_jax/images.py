"""Image assets for vision checkpoints: decoding under limits, Qwen2-VL preprocessing, a feature cache.

    pre = ImagePreprocessor.from_checkpoint(ckpt_dir, config["vision_config"])
    image = pre.prepare("img_1", data)   # PreparedImage: pixel_values, grid_thw, n_tokens, key
    features = cache.get(image.key)       # FeatureCache: vision-tower outputs shared across requests

Qwen3.5 (like Qwen3-VL) checkpoints use transformers' Qwen2-VL image processor; `prepare` runs its
PIL/numpy backend (`Qwen2VLImageProcessorPil`, no torchvision needed), so pixel values are exactly
what the reference model is fed. What is done here is everything before it: bytes and declared
pixels checked before any decoding (a 20000 x 20000 PNG header is a few KB of bytes), PNG / JPEG only,
decoding bounded by the pixel budget (below), EXIF orientation, RGB conversion, and every failure
turned into an ImageError naming the asset.

Decoding costs memory by the pixels an image declares, not by its bytes (a 129 KB PNG of 40 MP
decoded to ~730 MB). So an image much larger than the budget is decoded smaller: a JPEG at a DCT
scale (PIL's `draft`: 1/2 to 1/8 while decoding, the full size never allocated), any other format
box-reduced by an integer factor right after decoding (`reduce`), before the copies that orientation
and RGB conversion make. Either way at least 2x the budget's side is kept for the processor's own
resize; an image within 16x the budget's pixels is decoded as it always was.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import math
import threading
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from lev_jax import domain
from lev_jax.errors import ImageError, ImageTooLargeError

# formats PIL may open an asset as: PNG and JPEG (MPO is how PIL names a multi-picture JPEG, as
# phone cameras write them; its first picture is read)
FORMATS = ("PNG", "JPEG")
_ACCEPTED = frozenset({*FORMATS, "MPO"})

# Qwen3.5 / Qwen3-VL processor settings (their preprocessor_config.json), used where a checkpoint
# does not say otherwise
QWEN_PATCH_SIZE, QWEN_TEMPORAL_PATCH_SIZE, QWEN_MERGE_SIZE = 16, 2, 2
QWEN_IMAGE_MEAN = QWEN_IMAGE_STD = (0.5, 0.5, 0.5)
# the fewest merged patches (image tokens) an image is resized up to when min_pixels is not given:
# Qwen2-VL's own default, 56 * 56 = (14 * 2) ** 2 * 4, stated per patch size so that tiny test models
# (patch 4) and Qwen3.5 (patch 16) both keep small images at 4 tokens
MIN_IMAGE_TOKENS = 4


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    """One asset, decoded and preprocessed, ready for the vision tower."""

    alias: str  # the asset's name in the request (for error messages)
    key: str  # sha256 of the decoded RGB pixels, their size and the preprocessing fingerprint
    pixel_values: np.ndarray  # float32 [t*h*w, patch_dim], as the transformers processor returns it
    grid_thw: tuple[int, int, int]  # patches along time, height, width
    n_tokens: int  # image tokens the language model sees: t*h*w // merge_size**2


class ImagePreprocessor:
    """Decodes image assets under the domain limits and preprocesses them as a Qwen2-VL-family
    checkpoint expects: resized (aspect kept) to a multiple of patch_size * merge_size within
    [min_pixels, pixel_budget] pixels, rescaled, normalized and cut into flattened patches."""

    def __init__(
        self,
        *,
        patch_size: int = QWEN_PATCH_SIZE,
        temporal_patch_size: int = QWEN_TEMPORAL_PATCH_SIZE,
        merge_size: int = QWEN_MERGE_SIZE,
        pixel_budget: int = domain.IMAGE_PIXEL_BUDGET,
        min_pixels: int | None = None,
        image_mean=None,
        image_std=None,
    ):
        # imported here, not at the top: transformers takes seconds to import (torch with it, where
        # installed), and only a server or tool that reads images should pay that
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        for name, v in (("patch_size", patch_size), ("temporal_patch_size", temporal_patch_size)):
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if int(merge_size) < 1:
            raise ValueError(f"merge_size must be >= 1, got {merge_size}")
        self.patch_size, self.temporal_patch_size, self.merge_size = (
            int(patch_size),
            int(temporal_patch_size),
            int(merge_size),
        )
        factor = self.patch_size * self.merge_size  # resized sides are multiples of this
        # smart_resize never goes below one factor x factor block, so a smaller budget could not hold
        if int(pixel_budget) < factor * factor:
            raise ValueError(f"pixel_budget must be >= (patch_size * merge_size) ** 2 = {factor * factor}")
        self.pixel_budget = int(pixel_budget)
        if min_pixels is None:
            min_pixels = factor * factor * MIN_IMAGE_TOKENS
        # the budget wins: a checkpoint's minimum above it would resize small images over the budget
        self.min_pixels = max(1, min(int(min_pixels), self.pixel_budget))
        self.image_mean = tuple(float(x) for x in (QWEN_IMAGE_MEAN if image_mean is None else image_mean))
        self.image_std = tuple(float(x) for x in (QWEN_IMAGE_STD if image_std is None else image_std))
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError(f"image_mean and image_std need 3 values (RGB), got {image_mean} / {image_std}")
        self.processor = Qwen2VLImageProcessorPil(
            size={"shortest_edge": self.min_pixels, "longest_edge": self.pixel_budget},
            patch_size=self.patch_size,
            temporal_patch_size=self.temporal_patch_size,
            merge_size=self.merge_size,
            image_mean=list(self.image_mean),
            image_std=list(self.image_std),
        )
        # every setting that changes pixel_values, the processor's fixed ones (resampling, rescale
        # factor) included, so that a key made under other settings never matches
        p = self.processor
        self.fingerprint = (
            f"{type(p).__name__}:patch={self.patch_size},temporal={self.temporal_patch_size},"
            f"merge={self.merge_size},min_pixels={self.min_pixels},max_pixels={self.pixel_budget},"
            f"mean={','.join(map(repr, self.image_mean))},std={','.join(map(repr, self.image_std))},"
            f"resample={int(p.resample)},rescale={p.rescale_factor!r},"
            f"resize={p.do_resize},do_rescale={p.do_rescale},normalize={p.do_normalize}"
        )

    @classmethod
    def from_checkpoint(
        cls, ckpt_dir, vision_config: dict, *, pixel_budget: int = domain.IMAGE_PIXEL_BUDGET
    ) -> ImagePreprocessor:
        """The preprocessing a checkpoint declares: its preprocessor_config.json where there is one
        (mean, std, patch sizes, min pixels; its max pixels only lower the budget), else the patch
        sizes of its vision config with the Qwen3.5 defaults. The pixel budget is always ours: it
        bounds the image tokens a request may cost."""
        vc = vision_config or {}
        kw = {
            "patch_size": _side(vc.get("patch_size", QWEN_PATCH_SIZE), "patch_size"),
            "temporal_patch_size": _side(
                vc.get("temporal_patch_size", QWEN_TEMPORAL_PATCH_SIZE), "temporal_patch_size"
            ),
            "merge_size": int(vc.get("spatial_merge_size", QWEN_MERGE_SIZE)),
        }
        path = Path(ckpt_dir) / "preprocessor_config.json"
        if path.is_file():
            try:
                pc = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"{path} is not readable JSON ({e})") from None
            for key in ("patch_size", "temporal_patch_size"):
                if pc.get(key) is not None:
                    kw[key] = _side(pc[key], key)
            if pc.get("merge_size") is not None:
                kw["merge_size"] = int(pc["merge_size"])
            for key in ("image_mean", "image_std"):
                if pc.get(key) is not None:
                    kw[key] = pc[key]
            # Qwen2-VL / 2.5-VL files name the bounds min_pixels / max_pixels; Qwen3-VL / 3.5 files
            # put them in size as shortest_edge / longest_edge (pixel counts, despite the names)
            size = pc.get("size") if isinstance(pc.get("size"), dict) else {}
            lo = pc.get("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
            hi = pc.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
            if lo is not None:
                kw["min_pixels"] = int(lo)
            if hi is not None:
                pixel_budget = min(int(pixel_budget), int(hi))
        return cls(pixel_budget=pixel_budget, **kw)

    def prepare(self, alias: str, data: bytes) -> PreparedImage:
        """Decode one asset and preprocess it. ImageTooLargeError for bytes or declared pixels over
        the domain limits (before decoding); ImageError for anything else that is not a readable PNG
        or JPEG. Both name the asset."""
        rgb = decode_rgb(alias, data, budget=self.pixel_budget)
        h, w = rgb.shape[:2]
        digest = hashlib.sha256()
        digest.update(f"{self.fingerprint}\n{w}x{h}\n".encode())
        digest.update(rgb.tobytes())
        try:
            out = self.processor(
                images=rgb,
                return_tensors="np",
                input_data_format="channels_last",  # said, not guessed: a 3-pixel-high image looks channels-first
                do_convert_rgb=False,  # decode_rgb did it
            )
        except ValueError as e:  # smart_resize refuses aspect ratios over 200
            raise ImageError(f"Asset {alias!r}: cannot preprocess a {w}x{h} image ({_one_line(e)})") from None
        pixel_values = np.asarray(out["pixel_values"], dtype=np.float32)
        t, gh, gw = (int(x) for x in np.asarray(out["image_grid_thw"])[0])
        return PreparedImage(
            alias=alias,
            key=digest.hexdigest(),
            pixel_values=pixel_values,
            grid_thw=(t, gh, gw),
            n_tokens=t * gh * gw // self.merge_size**2,
        )

    def info(self) -> dict:
        """What /health reports about image handling."""
        return {
            "pixel_budget": self.pixel_budget,
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "max_image_bytes": domain.MAX_IMAGE_BYTES,
            "max_image_pixels": domain.MAX_IMAGE_PIXELS,
            "max_images_per_request": domain.MAX_IMAGES_PER_REQUEST,
        }


def decode_rgb(alias: str, data: bytes, budget: int | None = None) -> np.ndarray:
    """An asset's pixels as uint8 RGB [height, width, 3], upright (EXIF orientation applied).

    Limits come first: bytes before opening, the header's width x height before any pixel is
    decoded. PIL's own decompression-bomb check (at twice its MAX_IMAGE_PIXELS, left as it is: it is
    process-wide) can fire inside open; it is reported as the same ImageTooLargeError. `budget`: the
    pixels the image will be resized to at most; an image over 16x that is decoded smaller (JPEG
    draft, else reduce), keeping at least 4x the budget's pixels."""
    data = bytes(data)
    if len(data) > domain.MAX_IMAGE_BYTES:
        raise ImageTooLargeError(
            f"Asset {alias!r}: {len(data):,} bytes is over the limit of {domain.MAX_IMAGE_BYTES:,} bytes per image"
        )
    if not data:
        raise ImageError(f"Asset {alias!r}: the image is empty")
    too_many = f"Asset {alias!r}: the image declares more than the limit of {domain.MAX_IMAGE_PIXELS:,} pixels"
    try:
        # formats= restricts the plugins PIL tries, so a PDF or GIF is unidentified, whatever its name
        im = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # the warning where warnings are errors
        raise ImageTooLargeError(too_many) from None
    except Image.UnidentifiedImageError:
        # PIL says the same of a PNG cut off inside its header as of a PDF
        fmt = _signature(data)
        if fmt is None:
            raise ImageError(f"Asset {alias!r}: not a PNG or JPEG image") from None
        raise ImageError(f"Asset {alias!r}: corrupt or truncated {fmt} image header") from None
    except Exception as e:  # a header PIL recognised but could not parse; PIL raises many types here
        fmt = _signature(data) or "image"
        raise ImageError(f"Asset {alias!r}: corrupt or truncated {fmt} header ({_one_line(e)})") from None
    with im:
        if im.format not in _ACCEPTED:
            raise ImageError(f"Asset {alias!r}: a {im.format} image, not PNG or JPEG")
        w, h = im.size
        if w * h > domain.MAX_IMAGE_PIXELS:
            raise ImageTooLargeError(
                f"Asset {alias!r}: a {w}x{h} image ({w * h:,} pixels) is over the limit of "
                f"{domain.MAX_IMAGE_PIXELS:,} pixels"
            )
        if w < 1 or h < 1:
            raise ImageError(f"Asset {alias!r}: a {w}x{h} image has no pixels")
        try:
            keep = None if budget is None else _decoded_size(w, h, budget)
            if keep is not None and im.format in ("JPEG", "MPO"):
                im.draft(im.mode, keep)  # DCT scaling: decoded at >= keep, never at full size
            im.load()
            if keep is not None:
                im = _reduced(im, keep)
            upright = ImageOps.exif_transpose(im)
            return _to_rgb(upright)
        except Exception as e:  # truncated or corrupt data: PIL's decoders raise OSError, SyntaxError,
            # ValueError, struct.error, EOFError, IndexError... depending on the format and the damage
            raise ImageError(f"Asset {alias!r}: corrupt or truncated {im.format} image ({_one_line(e)})") from None


def _decoded_size(w: int, h: int, budget: int) -> tuple[int, int] | None:
    """The smallest size an image of w x h need be decoded at for a resize to `budget` pixels: 2x the
    resized sides (aspect kept), or None when the image is within 16x the budget (decoded whole)."""
    if w * h <= 16 * budget:
        return None
    scale = 2 * math.sqrt(budget / (w * h))
    return max(1, math.ceil(w * scale)), max(1, math.ceil(h * scale))


def _reduced(im: Image.Image, keep: tuple[int, int]) -> Image.Image:
    """`im` box-reduced by the largest integer factor that keeps both sides >= `keep` (a JPEG drafted
    already is left as its draft made it, or reduced further)."""
    factor = min(im.size[0] // keep[0], im.size[1] // keep[1])
    if factor < 2:
        return im
    if im.mode == "P":  # a palette has no averages: reduce its colours (the RGB conversion would anyway)
        im = im.convert("RGBA")
    elif im.mode.startswith("I;16"):  # 16-bit grey: reduce works on 32-bit integers
        im = im.convert("I")
    try:
        return im.reduce(factor)
    except ValueError:  # a mode reduce does not take (CMYK): convert first, then reduce
        return im.convert("RGB").reduce(factor)


def _to_rgb(im: Image.Image) -> np.ndarray:
    """uint8 RGB pixels, with transparency composited on white (transformers' convert_to_rgb, which
    the processor itself would apply). 16-bit grey is first scaled to 8 bits: PIL's conversion
    clips it (every value over 255 turns white) instead."""
    from transformers.image_transforms import convert_to_rgb

    if im.mode.startswith("I"):  # "I;16" (16-bit PNG grey) and its byte orders, or 32-bit "I"
        wide = np.asarray(im)  # uint16 for "I;16*", int32 for "I"
        if wide.dtype != np.uint16:
            wide = np.clip(wide, 0, 65535)
        grey = Image.fromarray((wide >> 8).astype(np.uint8), "L")  # the high byte, as libpng strips 16 bits
        transparent = im.info.get("transparency")
        if isinstance(transparent, int):  # a tRNS grey level: those pixels are transparent
            alpha = Image.fromarray(np.where(wide == transparent, 0, 255).astype(np.uint8), "L")
            grey = Image.merge("LA", (grey, alpha))
        im = grey
    return np.ascontiguousarray(convert_to_rgb(im, return_numpy=True), dtype=np.uint8)


def _signature(data: bytes) -> str | None:
    """The format whose signature `data` starts with, by PIL's own plugins' tests (the registry
    Image.open consults), or None."""
    for fmt in FORMATS:
        accept = Image.OPEN[fmt][1]
        if accept is not None and accept(data[:16]):
            return fmt
    return None


def _side(value, name: str) -> int:
    """A patch side from a config: an int, or a [h, w] pair of equal sides."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"{name} {value} is not square; the Qwen2-VL processor takes one side")
        value = value[0]
    return int(value)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class FeatureCache:
    """Vision-tower outputs by PreparedImage.key, LRU, bounded by bytes, thread-safe (a server's
    request threads share it). Entries are stored read-only: a caller cannot change a cached one."""

    def __init__(self, max_bytes: int = 128 << 20):
        if int(max_bytes) < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._bytes = 0
        self._hits = self._misses = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> np.ndarray | None:
        """The features stored under `key` (now the most recently used), or None; counts a hit or a miss."""
        with self._lock:
            features = self._entries.get(key)
            if features is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return features

    def __contains__(self, key: str) -> bool:
        """Whether `key` is held (counts nothing, changes no order)."""
        with self._lock:
            return key in self._entries

    def put(self, key: str, features: np.ndarray) -> None:
        """Store `features` under `key`, evicting the least recently used entries to stay within
        max_bytes. An entry larger than max_bytes is not kept (nor an older one under its key)."""
        view = np.asarray(features).view()
        view.setflags(write=False)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            if view.nbytes > self.max_bytes:
                return
            self._entries[key] = view
            self._bytes += view.nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes

    def stats(self) -> dict:
        """Counters for /health and /metrics."""
        with self._lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "entries": len(self._entries),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
            }
