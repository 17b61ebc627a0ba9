"""lev_jax.images: decoding under the domain limits, Qwen2-VL preprocessing against transformers' own
processor, cache keys, and the feature cache. No model is needed."""

from __future__ import annotations

import io
import struct
import threading
import time
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from lev_jax import domain
from lev_jax.errors import ImageError, ImageTooLargeError
from lev_jax.images import FeatureCache, ImagePreprocessor, PreparedImage, decode_rgb


@pytest.fixture(scope="module")
def pre():
    return ImagePreprocessor()  # Qwen3.5 settings: patch 16, merge 2, the domain's pixel budget


@pytest.fixture(scope="module")
def tiny():
    return ImagePreprocessor(patch_size=4)  # the tiny test models' patch size


def pixels(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def encode(im: Image.Image, fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def png_declaring(w, h) -> bytes:
    """A PNG with a valid signature and IHDR (CRC included) declaring w x h RGB, then a few bytes of data."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def reference(rgb: np.ndarray, p: ImagePreprocessor):
    """transformers' processor called directly, configured as the checkpoint would configure it."""
    proc = Qwen2VLImageProcessorPil(
        size={"shortest_edge": p.min_pixels, "longest_edge": p.pixel_budget},
        patch_size=p.patch_size,
        temporal_patch_size=p.temporal_patch_size,
        merge_size=p.merge_size,
        image_mean=list(p.image_mean),
        image_std=list(p.image_std),
    )
    return proc(images=Image.fromarray(rgb), return_tensors="np")


# -- preprocessing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(480, 640), (37, 53), (1, 1), (3, 5), (900, 300)])
@pytest.mark.parametrize("which", ["pre", "tiny"])
def test_pixel_values_are_the_transformers_processor_s(shape, which, request):
    p = request.getfixturevalue(which)
    rgb = pixels(*shape)
    img = p.prepare("img", encode(Image.fromarray(rgb)))
    ref = reference(rgb, p)
    assert isinstance(img, PreparedImage) and img.alias == "img"
    assert img.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(img.pixel_values, ref["pixel_values"])
    assert img.grid_thw == tuple(int(x) for x in ref["image_grid_thw"][0])
    t, h, w = img.grid_thw
    assert img.pixel_values.shape == (t * h * w, 3 * p.temporal_patch_size * p.patch_size**2)
    assert img.n_tokens == t * h * w // p.merge_size**2 >= 1


def test_the_budget_bounds_pixels_and_keeps_the_aspect(pre):
    img = pre.prepare("wide", encode(Image.fromarray(pixels(1000, 2000))))
    t, h, w = img.grid_thw
    budget = 512 * 512
    assert pre.pixel_budget == domain.IMAGE_PIXEL_BUDGET == budget
    assert t * h * w * pre.patch_size**2 <= budget
    assert t * h * w * pre.patch_size**2 > budget * 0.8  # the budget is used, not wasted
    factor = pre.patch_size * pre.merge_size
    height, width = h * pre.patch_size, w * pre.patch_size
    assert height % factor == 0 and width % factor == 0
    assert abs(width / height - 2.0) <= 2.0 * factor / height  # within one block of rounding
    assert img.n_tokens == t * h * w // 4


def test_small_images_are_resized_up_to_the_minimum(pre, tiny):
    for p in (pre, tiny):
        assert p.min_pixels == (p.patch_size * p.merge_size) ** 2 * 4
        assert p.prepare("dot", encode(Image.fromarray(pixels(1, 1)))).n_tokens == 4


def test_extreme_aspect_ratio_is_an_image_error(pre):
    with pytest.raises(ImageError, match=r"Asset 'thin': .*aspect ratio"):
        pre.prepare("thin", encode(Image.fromarray(pixels(1, 300))))


def test_settings_are_validated():
    with pytest.raises(ValueError, match="pixel_budget"):
        ImagePreprocessor(patch_size=16, pixel_budget=31 * 31)
    with pytest.raises(ValueError, match="3 values"):
        ImagePreprocessor(image_mean=[0.5])
    assert ImagePreprocessor(min_pixels=10**9).min_pixels == domain.IMAGE_PIXEL_BUDGET  # the budget wins


# -- keys ------------------------------------------------------------------------------------------


def test_key_follows_pixels_not_bytes(pre):
    rgb = pixels(64, 96)
    a = pre.prepare("a", encode(Image.fromarray(rgb), compress_level=0))
    b = pre.prepare("b", encode(Image.fromarray(rgb), compress_level=9, optimize=True))
    rgba = np.concatenate([rgb, np.full((64, 96, 1), 255, np.uint8)], axis=2)  # opaque: the same RGB
    c = pre.prepare("c", encode(Image.fromarray(rgba, "RGBA")))
    assert a.key == b.key == c.key and len(a.key) == 64
    changed = rgb.copy()
    changed[10, 20, 1] ^= 1
    assert pre.prepare("d", encode(Image.fromarray(changed))).key != a.key
    other_budget = ImagePreprocessor(pixel_budget=256 * 256)
    assert other_budget.fingerprint != pre.fingerprint
    assert other_budget.prepare("a", encode(Image.fromarray(rgb))).key != a.key
    # the size is part of the key: the same bytes of pixels in another shape are another image
    assert pre.prepare("e", encode(Image.fromarray(rgb.reshape(96, 64, 3)))).key != a.key


def test_fingerprint_is_stable_and_covers_settings(pre):
    assert ImagePreprocessor().fingerprint == pre.fingerprint
    fps = {
        ImagePreprocessor(**kw).fingerprint
        for kw in (
            {},
            {"patch_size": 14},
            {"temporal_patch_size": 1},
            {"merge_size": 1},
            {"min_pixels": 1024},
            {"image_mean": [0.48, 0.46, 0.41]},
            {"image_std": [0.27, 0.26, 0.28]},
        )
    }
    assert len(fps) == 7


# -- decoding --------------------------------------------------------------------------------------


def test_exif_orientation_is_applied(pre):
    # left half red, right half blue; orientation 6 means "rotate 90 degrees clockwise to display"
    raw = np.zeros((64, 128, 3), np.uint8)
    raw[:, :64] = (255, 0, 0)
    raw[:, 64:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(Image.fromarray(raw), "JPEG", quality=95, exif=exif)
    upright = decode_rgb("photo", data)
    assert upright.shape == (128, 64, 3)
    assert upright[:32, :, 0].mean() > 200 and upright[96:, :, 2].mean() > 200  # red on top, blue below
    plain = pre.prepare("plain", encode(Image.fromarray(raw), "JPEG", quality=95))
    rotated = pre.prepare("photo", data)
    assert plain.grid_thw == (1, 4, 8) and rotated.grid_thw == (1, 8, 4)


def test_modes_convert_to_rgb(pre, tiny):
    grey = np.arange(48 * 40, dtype=np.uint32).reshape(48, 40) % 256
    la = np.stack([grey, np.where(grey < 128, 0, 255)], axis=2).astype(np.uint8)
    rgba = np.zeros((48, 40, 4), np.uint8)
    rgba[..., 1] = 200
    rgba[:24, :, 3] = 255  # top half opaque green, bottom half fully transparent
    pal = Image.fromarray(grey.astype(np.uint8)).convert("P")
    pal.info["transparency"] = int(np.asarray(pal)[0, 0])
    wide = (grey * 257).astype(np.uint16)  # 16-bit grey spanning the full range
    cases = {
        "grey": Image.fromarray(grey.astype(np.uint8), "L"),
        "la": Image.fromarray(la, "LA"),
        "rgba": Image.fromarray(rgba, "RGBA"),
        "palette": pal,
        "grey16": Image.fromarray(wide),
        "cmyk": Image.fromarray(pixels(48, 40)).convert("CMYK"),
    }
    assert cases["grey16"].mode == "I;16"
    out = {}
    for name, im in cases.items():
        fmt = "JPEG" if im.mode == "CMYK" else "PNG"
        data = encode(im, fmt)
        out[name] = decode_rgb(name, data)
        assert out[name].shape == (48, 40, 3) and out[name].dtype == np.uint8, name
        for p in (pre, tiny):
            assert p.prepare(name, data).n_tokens >= 1
    np.testing.assert_array_equal(out["grey"][..., 0], grey)
    np.testing.assert_array_equal(out["grey16"][..., 1], grey)  # scaled to 8 bits, not clipped
    np.testing.assert_array_equal(out["la"][grey < 128], 255)  # transparent: composited on white
    np.testing.assert_array_equal(out["rgba"][:24], np.broadcast_to([0, 200, 0], (24, 40, 3)))
    np.testing.assert_array_equal(out["rgba"][24:], 255)
    assert (out["palette"][0, 0] == 255).all()  # the transparent palette entry


def test_sixteen_bit_grey_with_a_transparent_level():
    wide = np.full((8, 8), 1000, np.uint16)
    wide[0, 0] = 7
    im = Image.fromarray(wide)
    rgb = decode_rgb("g", encode(im, "PNG", transparency=7))
    assert (rgb[0, 0] == 255).all() and (rgb[1:, 1:] == 1000 >> 8).all()


def test_multi_picture_jpeg_reads_its_first_picture():
    first, second = Image.new("RGB", (32, 32), (255, 0, 0)), Image.new("RGB", (32, 32), (0, 0, 255))
    rgb = decode_rgb("mpo", encode(first, "MPO", save_all=True, append_images=[second]))
    assert rgb[..., 0].mean() > 200 and rgb[..., 2].mean() < 50


def _good_png() -> bytes:
    return encode(Image.fromarray(pixels(64, 64)), compress_level=0)


@pytest.mark.parametrize(
    "data, what",
    [
        (lambda: _good_png()[: len(_good_png()) // 2], "truncated"),
        (lambda: _good_png()[:40], "truncated"),
        (lambda: encode(Image.fromarray(pixels(64, 64)), "JPEG")[:300], "truncated"),
        (lambda: b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n", "not a PNG or JPEG"),
        (lambda: b"hello, I am text in a file named cat.png\n", "not a PNG or JPEG"),
        (lambda: np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes(), "not a PNG or JPEG"),
        (lambda: b"\x89PNG\r\n\x1a\n" + bytes(64), "corrupt or truncated PNG"),
        (lambda: encode(Image.fromarray(pixels(8, 8)), "GIF"), "not a PNG or JPEG"),
        (lambda: b"", "empty"),
    ],
    ids=["truncated-png", "png-header-only", "truncated-jpeg", "pdf", "text", "random", "bad-ihdr", "gif", "empty"],
)
def test_unreadable_images_are_image_errors_naming_the_asset(pre, data, what):
    with pytest.raises(ImageError) as e:
        pre.prepare("cat.png", data())
    assert not isinstance(e.value, ImageTooLargeError)
    msg = str(e.value)
    assert msg.startswith("Asset 'cat.png': ") and what in msg and "\n" not in msg
    assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__)  # no PIL trace


@pytest.mark.parametrize("side", [7000, 10_000, 20_000])  # ours only; PIL's warning zone; PIL's error zone
@pytest.mark.parametrize("warnings_are_errors", [False, True])
def test_declared_pixels_over_the_limit_are_refused_before_decoding(pre, side, warnings_are_errors):
    limit_before = Image.MAX_IMAGE_PIXELS
    data = png_declaring(side, side)
    assert len(data) < 200
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error" if warnings_are_errors else "ignore", Image.DecompressionBombWarning)
        with pytest.raises(ImageTooLargeError, match=r"^Asset 'bomb': .*limit of 24,000,000 pixels"):
            pre.prepare("bomb", data)
    assert time.perf_counter() - start < 0.5  # refused from the header, nothing allocated
    assert Image.MAX_IMAGE_PIXELS == limit_before  # PIL's process-wide limit is left alone


def test_declared_pixels_within_the_limit_are_decoded(pre):
    with pytest.raises(ImageError, match="corrupt or truncated PNG"):  # opened, then short of data
        pre.prepare("ok", png_declaring(64, 64))


def test_bytes_over_the_limit_are_refused_before_decoding(pre, monkeypatch):
    data = _good_png()
    monkeypatch.setattr(domain, "MAX_IMAGE_BYTES", len(data) - 1)
    with pytest.raises(ImageTooLargeError, match=rf"^Asset 'big': {len(data):,} bytes is over the limit"):
        pre.prepare("big", data)
    with pytest.raises(ImageTooLargeError):
        pre.prepare("big", b"x" * len(data))  # refused before anyone looks at what it is
    monkeypatch.setattr(domain, "MAX_IMAGE_BYTES", len(data))
    assert pre.prepare("big", data).n_tokens > 0


def test_info(pre):
    assert pre.info() == {
        "pixel_budget": 512 * 512,
        "patch_size": 16,
        "merge_size": 2,
        "max_image_bytes": domain.MAX_IMAGE_BYTES,
        "max_image_pixels": domain.MAX_IMAGE_PIXELS,
        "max_images_per_request": domain.MAX_IMAGES_PER_REQUEST,
    }


# -- from_checkpoint -------------------------------------------------------------------------------


def test_from_checkpoint_without_a_preprocessor_config(tmp_path):
    p = ImagePreprocessor.from_checkpoint(
        tmp_path, {"patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2}, pixel_budget=64 * 64
    )
    assert (p.patch_size, p.temporal_patch_size, p.merge_size) == (4, 2, 2)
    assert (p.pixel_budget, p.min_pixels) == (64 * 64, 8 * 8 * 4)
    assert p.image_mean == p.image_std == (0.5, 0.5, 0.5)
    q = ImagePreprocessor.from_checkpoint(tmp_path, {"patch_size": [16, 16]})
    assert (q.patch_size, q.temporal_patch_size, q.merge_size, q.pixel_budget) == (16, 2, 2, domain.IMAGE_PIXEL_BUDGET)


def test_from_checkpoint_reads_preprocessor_config(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,'
        ' "merge_size": 2, "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28],'
        ' "image_processor_type": "Qwen2VLImageProcessorFast"}'
    )
    p = ImagePreprocessor.from_checkpoint(tmp_path, {"patch_size": 14})
    assert p.patch_size == 16  # the processor's file wins over the vision config
    assert p.image_mean == (0.48, 0.46, 0.41) and p.image_std == (0.27, 0.26, 0.28)
    assert (p.min_pixels, p.pixel_budget) == (65536, domain.IMAGE_PIXEL_BUDGET)  # ours caps its max
    rgb = pixels(20, 30)
    np.testing.assert_array_equal(
        p.prepare("x", encode(Image.fromarray(rgb))).pixel_values, reference(rgb, p)["pixel_values"]
    )
    # Qwen2-VL style: top-level min/max pixels; a max below our budget lowers it
    (tmp_path / "preprocessor_config.json").write_text('{"min_pixels": 3136, "max_pixels": 50176, "patch_size": 14}')
    q = ImagePreprocessor.from_checkpoint(tmp_path, {})
    assert (q.patch_size, q.min_pixels, q.pixel_budget) == (14, 3136, 50176)


# -- feature cache ---------------------------------------------------------------------------------


def feats(n, fill=0.0):
    return np.full((n, 4), fill, np.float32)  # n * 16 bytes


def test_cache_counts_hits_and_misses():
    cache = FeatureCache(max_bytes=1024)
    assert cache.get("a") is None
    cache.put("a", feats(2, 1.0))
    np.testing.assert_array_equal(cache.get("a"), feats(2, 1.0))
    cache.get("a")
    assert cache.stats() == {"hits": 2, "misses": 1, "entries": 1, "bytes": 32, "max_bytes": 1024}
    with pytest.raises(ValueError):
        cache.get("a")[0, 0] = 5.0  # read-only: a caller cannot change what others will read


def test_cache_evicts_least_recently_used_within_bytes():
    cache = FeatureCache(max_bytes=100)
    for k in "abc":
        cache.put(k, feats(2))  # 32 bytes each: 96
    cache.get("a")  # a is now the most recent; b the least
    cache.put("d", feats(2))
    assert cache.get("b") is None and all(cache.get(k) is not None for k in "acd")
    cache.put("e", feats(4))  # 64 bytes: two more go, least recent first (c, then a)
    s = cache.stats()
    assert s["bytes"] <= 100 and s["entries"] == 2
    assert cache.get("c") is None and cache.get("a") is None and cache.get("e") is not None
    cache.put("e", feats(1))  # replacing an entry counts its bytes once
    assert cache.stats()["bytes"] == 32 + 16


def test_cache_does_not_keep_an_oversize_entry():
    cache = FeatureCache(max_bytes=64)
    cache.put("small", feats(1))
    cache.put("huge", feats(5))  # 80 bytes > 64
    assert cache.get("huge") is None and cache.get("small") is not None
    cache.put("small", feats(5))  # nor an older entry under the same key
    assert cache.get("small") is None and cache.stats()["bytes"] == 0


def test_cache_is_thread_safe():
    cache = FeatureCache(max_bytes=64 * 16 * 10)  # room for 10 of the 40 keys
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(2000):
                k = int(rng.integers(40))
                got = cache.get(str(k))
                if got is None:
                    cache.put(str(k), feats(16, float(k)))
                elif got[0, 0] != k:
                    errors.append((k, got[0, 0]))
        except Exception as e:  # noqa: BLE001 - reported below, from the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = cache.stats()
    assert not errors
    assert s["hits"] + s["misses"] == 8 * 2000
    assert s["bytes"] <= s["max_bytes"] and s["bytes"] == s["entries"] * 16 * 16


# -- decoding bounded by the pixel budget ----------------------------------------------------------


def _smooth(h, w):
    """A picture with no detail finer than a few hundred pixels: what a downscale keeps."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h)], axis=2).astype(np.uint8)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_large_image_is_decoded_no_larger_than_the_budget_needs(pre, fmt, monkeypatch):
    """A 6000 x 4000 image for a 512 x 512 budget is decoded at a quarter of each side (a JPEG by its
    DCT scale, never at full size; a PNG reduced as soon as it is decoded), keeping at least twice
    the budget's side; what the processor then makes of it is what it makes of the full decode."""
    from PIL import JpegImagePlugin

    drafts = []
    real_draft = JpegImagePlugin.JpegImageFile.draft
    monkeypatch.setattr(
        JpegImagePlugin.JpegImageFile, "draft", lambda im, *a: drafts.append(real_draft(im, *a)) or drafts[-1]
    )
    data = encode(Image.fromarray(_smooth(4000, 6000)), fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    rgb = decode_rgb("big", data, budget=pre.pixel_budget)
    assert rgb.shape == (1000, 1500, 3)  # 1/4 of each side: >= 2x the budget's (~418 x 627)
    if fmt == "JPEG":
        assert drafts and drafts[-1][1][2:] == (1500, 1000)  # decoded at 1/4 scale, not decoded whole
    full = decode_rgb("big", data)  # no budget: the whole picture
    assert full.shape == (4000, 6000, 3)
    img, ref = pre.prepare("big", data), reference(full, pre)
    assert img.grid_thw == tuple(int(x) for x in ref["image_grid_thw"][0])
    assert np.abs(img.pixel_values - ref["pixel_values"]).mean() < 0.02  # of a [-1, 1] range


def test_an_image_within_16x_the_budget_is_decoded_whole(pre):
    rgb = pixels(1500, 2000)  # 3 MP: under 16 x 512 x 512
    np.testing.assert_array_equal(decode_rgb("mid", encode(Image.fromarray(rgb)), budget=pre.pixel_budget), rgb)


@pytest.mark.parametrize("mode", ["P", "I;16", "LA", "CMYK"])
def test_reduced_decoding_keeps_every_mode(mode):
    big = Image.fromarray(_smooth(2400, 2400))
    im = {
        "P": big.convert("P"),
        "I;16": Image.fromarray(np.asarray(big.convert("L")).astype(np.uint16) * 257),
        "LA": big.convert("LA"),
        "CMYK": big.convert("CMYK"),
    }[mode]
    data = encode(im, "JPEG" if mode == "CMYK" else "PNG")
    rgb = decode_rgb("m", data, budget=64 * 64)
    assert rgb.dtype == np.uint8 and rgb.shape[2] == 3 and 128 <= rgb.shape[0] <= 2400 // 2
    whole = decode_rgb("m", data)
    small = np.asarray(Image.fromarray(whole).resize(rgb.shape[1::-1], Image.Resampling.BOX))
    assert np.abs(rgb.astype(int) - small.astype(int)).mean() < 6
