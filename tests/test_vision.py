"""Images in a state, end to end: the multimodal prefix against transformers' own
Qwen3_5ForConditionalGeneration (tiny random VL configs saved offline), predict() with images against
one independent full forward per row, the feature cache, and the clear errors around images."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import hf_reference as R
import lev_jax
from lev_jax.errors import ImageError, RequestError
from lev_jax.images import PreparedImage
from lev_jax.readout import ImagePrefix
from lev_jax.testing import tiny_backbone
from lev_jax.vision import rope_index

TOL = 1e-4  # transformers parity, fp32
IMG = R.VL_TOKEN_IDS["image_token_id"]
START, END = R.VL_TOKEN_IDS["vision_start_token_id"], R.VL_TOKEN_IDS["vision_end_token_id"]


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    """'interval' has head_dim 32: four rotary frequencies, so temporal, height and width all turn."""
    d = tmp_path_factory.mktemp("vl-interval")
    ref = R.save_qwen3_5_vl("interval", d, seed=5)
    return ref, lev_jax.load_backbone(str(d))


def _image(rng, grid, cfg, alias):
    t, h, w = grid
    px = rng.standard_normal((t * h * w, cfg.patch_dim)).astype(np.float32)
    return PreparedImage(
        alias=alias, key=f"{alias}{grid}", pixel_values=px, grid_thw=grid, n_tokens=t * h * w // cfg.merge_unit
    )


def _sequence(rng, layout, images):
    """Token ids: text runs of the given lengths with each image's vision tokens between them."""
    ids = []
    for i, n_text in enumerate(layout):
        ids += rng.integers(0, 140, n_text).tolist()
        if i < len(images):
            ids += [START] + [IMG] * images[i].n_tokens + [END]
    return ids


def _hf_logits(model, ids, images):
    with torch.no_grad():
        ids_t = torch.tensor([ids])
        out = model(
            input_ids=ids_t,
            pixel_values=torch.tensor(np.concatenate([img.pixel_values for img in images])),
            image_grid_thw=torch.tensor([img.grid_thw for img in images]),
            mm_token_type_ids=(ids_t == IMG).int(),
        )
    return out.logits.float().numpy()


CASES = {
    "one image mid-text": ([5, 7], [(1, 4, 6)]),
    "two images of different sizes": ([3, 4, 6], [(1, 4, 4), (1, 6, 8)]),
    "image first": ([0, 9], [(1, 8, 4)]),
}


@pytest.mark.parametrize("case", CASES)
def test_multimodal_logits_match_transformers(tiny_vl, case):
    ref, bb = tiny_vl
    layout, grids = CASES[case]
    rng = np.random.default_rng(len(case))
    images = [_image(rng, g, bb.vision.config, f"<image:{k}>") for k, g in enumerate(grids)]
    ids = _sequence(rng, layout, images)
    embeds, mask, positions, _ = bb.vision.prefix_inputs(ids, images, len(ids))
    ours = np.asarray(bb.logits([ids], embeds=embeds, embeds_mask=mask, positions=positions))
    np.testing.assert_allclose(ours, _hf_logits(ref, ids, images), atol=TOL, rtol=0)


def test_rope_index_matches_transformers(tiny_vl):
    ref, bb = tiny_vl
    rng = np.random.default_rng(1)
    images = [_image(rng, g, bb.vision.config, str(k)) for k, g in enumerate([(1, 4, 6), (1, 8, 2)])]
    ids = _sequence(rng, [2, 3, 4], images)
    ids_t = torch.tensor([ids])
    theirs, delta = ref.model.get_rope_index(
        ids_t, (ids_t == IMG).int(), image_grid_thw=torch.tensor([img.grid_thw for img in images])
    )
    ours, next_pos = rope_index(ids, [img.grid_thw for img in images], IMG, 2)
    np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
    assert next_pos == len(ids) + int(delta[0, 0])  # the rows after the prefix continue here


def test_prefix_cache_with_images_continues_like_one_forward(tiny_vl):
    """The state prefix with its images computed once (in prefill chunks), rows extending it: the
    same logits as the whole sequence in one call, positions after the image included."""
    _, bb = tiny_vl
    rng = np.random.default_rng(2)
    images = [_image(rng, (1, 6, 4), bb.vision.config, "a"), _image(rng, (1, 4, 4), bb.vision.config, "b")]
    prefix = ImagePrefix(_sequence(rng, [4, 3, 2], images), images)
    rows = [rng.integers(0, 140, 5).tolist(), rng.integers(0, 140, 5).tolist()]
    embeds, mask, positions, _ = bb.vision.prefix_inputs(prefix, images, len(prefix))
    cache = bb.prefill(prefix, chunk=16, embeds=embeds, embeds_mask=mask, positions=positions)
    hidden, _ = bb.extend(cache, np.asarray(rows))
    got = np.asarray(bb.head(hidden))[:, -1]
    for r, row in enumerate(rows):
        ids = list(prefix) + row
        e, m, p, _ = bb.vision.prefix_inputs(ids, images, len(ids))
        want = np.asarray(bb.logits([ids], embeds=e, embeds_mask=m, positions=p))[0, -1]
        np.testing.assert_allclose(got[r], want, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ predict() with image states


def _png(rng, size, mode="RGB") -> bytes:
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl_engine(tmp_path_factory):
    """A tiny VL checkpoint over the real Qwen3.5 vocabulary (served with the Qwen3.5 tokenizer)."""
    d = tmp_path_factory.mktemp("vl-full")
    R.save_qwen3_5_vl("mixed-gqa", d, seed=7, vocab=248320)
    return lev_jax.load(str(d), dtype="float32", calibration=None), d


QUESTIONS = {
    "damaged": {"type": "noul", "instructions": "Is the parcel damaged?"},
    "kind": {
        "type": "choice",
        "instructions": "What is shown?",
        "criteria": {"parcel": "a box", "letter": None, "pallet": "goods on a pallet"},
    },
    "quality": {"type": "score", "instructions": "Photo quality?", "criteria": ["poor", "fair", "good"]},
}


def _probs(answers):
    out = {}
    for qid, a in answers.items():
        out[qid] = [a["noul"]] if a["type"] == "noul" else list(a["probabilities"].values())
    return out


def test_predict_with_images_equals_independent_full_forwards(vl_engine):
    engine, _ = vl_engine
    rng = np.random.default_rng(3)
    images = {"<image:front>": _png(rng, (40, 56)), "<image:label>": _png(rng, (32, 24))}
    state = {"photos": ["<image:front>", "<image:label>"], "note": "Delivered <image:front> at noon."}
    fast, usage = engine.predict_with_usage(state, QUESTIONS, images=images)
    ref = engine.predict(state, QUESTIONS, images=images, reference=True)
    for qid in QUESTIONS:
        np.testing.assert_allclose(_probs(fast)[qid], _probs(ref)[qid], atol=1e-5, rtol=0)
    # the front image is shown twice: each occurrence is its own run of image tokens
    pre = {a: engine.backbone.vision.prepare(a, b) for a, b in images.items()}
    assert usage["image_tokens"] == 2 * pre["<image:front>"].n_tokens + pre["<image:label>"].n_tokens
    # invariant to the other questions of the request
    alone = engine.predict(state, {"kind": QUESTIONS["kind"]}, images=images)
    np.testing.assert_allclose(_probs(alone)["kind"], _probs(fast)["kind"], atol=1e-6, rtol=0)
    # the pictures matter: another image in the same place changes the answer
    other = {**images, "<image:front>": _png(np.random.default_rng(99), (40, 56))}
    moved = engine.predict(state, QUESTIONS, images=other)
    assert max(abs(a - b) for a, b in zip(_probs(moved)["kind"], _probs(fast)["kind"])) > 1e-4


def test_a_repeated_image_runs_no_vision_tower(vl_engine):
    engine, _ = vl_engine
    vision = engine.backbone.vision
    rng = np.random.default_rng(4)
    png = _png(rng, (48, 48))
    images = {"<image:x>": png}
    first, u1 = engine.predict_with_usage("Look at <image:x> closely.", QUESTIONS, images=images)
    runs = vision.tower_runs
    # the same state: the whole prefix is cached
    again, u2 = engine.predict_with_usage("Look at <image:x> closely.", QUESTIONS, images=images)
    assert vision.tower_runs == runs and u2["cached_image_tokens"] == u2["image_tokens"] == u1["image_tokens"]
    assert _probs(again) == _probs(first)
    # another state, the same picture re-encoded with other compression: features come from the cache
    buf = io.BytesIO()
    Image.open(io.BytesIO(png)).save(buf, format="PNG", compress_level=1)
    assert buf.getvalue() != png
    _, u3 = engine.predict_with_usage("Another view: <image:y>", QUESTIONS, images={"<image:y>": buf.getvalue()})
    assert vision.tower_runs == runs and u3["cached_image_tokens"] == u3["image_tokens"] > 0
    hits = vision.cache.stats()["hits"]
    assert hits >= 1 and engine.info()["vision"]["feature_cache"]["hits"] == hits


def test_image_errors_are_clear(vl_engine):
    engine, _ = vl_engine
    rng = np.random.default_rng(5)
    png = _png(rng, (16, 16))
    q = {"damaged": QUESTIONS["damaged"]}
    with pytest.raises(ImageError, match="<image:bad>"):
        engine.predict("See <image:bad>", q, images={"<image:bad>": png[: len(png) // 2]})
    with pytest.raises(RequestError, match="not referenced in the state"):
        engine.predict("No picture here", q, images={"<image:a>": png})
    with pytest.raises(RequestError, match="images are read in the state only"):
        engine.predict(
            "See <image:a>",
            {"d": {"type": "noul", "instructions": "Is <image:a> damaged?"}},
            images={"<image:a>": png},
        )
    # the model's own placeholder typed into the text is text (tokenizer.plain_text), not an image slot:
    # the request reads its one image and the typed characters
    typed = engine.predict("See <image:a> and <|image_pad|>", q, images={"<image:a>": png})
    assert 0.0 <= typed["damaged"]["noul"] <= 1.0
    text_only = lev_jax.Engine(tiny_backbone("qwen3_5"))
    assert not text_only.supports_images
    with pytest.raises(RequestError, match="text-only"):
        text_only.predict("See <image:a>", q, images={"<image:a>": png})


# ------------------------------------------------------------------ the server with a vision checkpoint


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height pixels (valid chunks, no real pixel data)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_served_vision_checkpoint_reads_sdk_images_and_refuses_bad_ones(vl_engine, tmp_path):
    import base64

    import httpx
    from typesafe_sdk import Choice, Noul, TypeSafeClient
    from typesafe_sdk import Image as SdkImage

    from lev_jax.server.testing import ServerProcess

    _, ckpt = vl_engine
    png = _png(np.random.default_rng(6), (40, 32))
    with ServerProcess(["--checkpoint", str(ckpt)], log_path=tmp_path / "serve.log") as server:
        health = httpx.get(server.url + "/health").json()
        assert health["supports_images"] and health["vision"]["max_images_per_request"] >= 1
        assert health["vision"]["pixel_budget"] == 512 * 512 and health["vision"]["max_image_bytes"] > 0
        img = SdkImage(png)
        questions = {
            "damaged": Noul(instructions="Is the parcel damaged?"),
            "kind": Choice(instructions="What is shown?", criteria={"parcel": None, "letter": None}),
        }
        with TypeSafeClient(api_key="unused", base_url=server.url, timeout=120) as c:
            with c.attach_assets(img):  # multipart, as the SDK sends images
                r = c.system_one(state=f"Parcel photo: {img}", questions=questions)
        assert 0 <= r.nouls["damaged"].noul <= 1 and r.choices["kind"].choice in {"parcel", "letter"}
        assert abs(sum(r.choices["kind"].probabilities.values()) - 1) < 1e-6

        def post(data: bytes, alias="<image:p>", fmt="png"):
            body = {
                "model": "jev-latest",
                "state": f"See {alias}",
                "questions": {"q": {"type": "noul", "instructions": "Damaged?"}},
                "assets": {alias: {"type": "image", "format": fmt, "data_base64": base64.b64encode(data).decode()}},
            }
            return httpx.post(server.url + "/v1/systemone", json=body, timeout=120)

        ok = post(png)
        assert ok.status_code == 200, ok.text
        again = post(png).json()  # the same picture: no vision tower, cached image tokens
        assert again["x_cached_image_tokens"] == again["x_image_tokens"] > 0
        metrics = httpx.get(server.url + "/metrics").text
        assert "lev_image_feature_cache_hits_total" in metrics and "lev_vision_tower_runs_total" in metrics
        for data, status, words in (
            (png[: len(png) // 2], 400, "<image:p>"),  # truncated PNG
            (b"%PDF-1.4\n1 0 obj\n<<>>\nendobj\n", 400, "not a PNG or JPEG"),  # a PDF named .png
            (_png_header(20000, 20000), 413, "<image:p>"),  # 400 megapixels declared in a few bytes
        ):
            bad = post(data)
            assert bad.status_code == status and words in bad.json()["detail"]["message"], bad.text
        assert httpx.get(server.url + "/health").status_code == 200  # nothing crashed


def test_the_pixel_budget_is_configurable(vl_engine):
    engine, ckpt = vl_engine
    png = _png(np.random.default_rng(8), (96, 96))
    small = lev_jax.load(str(ckpt), dtype="float32", calibration=None, image_pixel_budget=32 * 32)
    assert small.info()["vision"]["pixel_budget"] == 32 * 32
    n_small = small.backbone.vision.prepare("a", png).n_tokens
    n_default = engine.backbone.vision.prepare("a", png).n_tokens
    assert n_small * 8 <= n_default  # 96 x 96 kept whole by default (144 tokens), 32 x 32 (16) on a budget
    with pytest.raises(ValueError, match="text-only"):
        lev_jax.load(tiny_backbone("llama"), image_pixel_budget=1024)


def test_micro_batches_mixing_image_and_text_states_equal_full_forwards(vl_engine):
    """A server's micro-batch: image and text prefixes stacked in one cache (each continuing from its
    own M-RoPE position), short rows read in slab calls over them, a long row read chunk by chunk."""
    engine, _ = vl_engine
    rng = np.random.default_rng(9)
    a, b = _png(rng, (40, 40)), _png(rng, (24, 48))
    why = "Given the photo, the courier's note and the customer's history, decide carefully. " * 8
    headed = {"type": "choice", "instructions": why, "criteria": {"refund": None, "resend": None, "wait": None}}
    many = {
        "type": "choice",
        "instructions": "Which department handles it?",
        "criteria": {f"Department {i}": f"handles delivery case type {i} with care" for i in range(40)},
    }
    requests = [
        ("Photo <image:a>", {"kind": QUESTIONS["kind"], "headed": headed}, {"<image:a>": a}),
        (
            "Two photos: <image:a> then <image:b>",
            {"many": many, "damaged": QUESTIONS["damaged"]},
            {"<image:a>": a, "<image:b>": b},
        ),
        ("A text-only state about a parcel.", {"headed": headed, "quality": QUESTIONS["quality"]}, None),
    ]
    plans = [engine.plan(s, q, i) for s, q, i in requests]
    # the 40-option rows are read chunk by chunk
    assert any(len(r.tokens) > lev_jax.buckets.PREFILL_CHUNK for r in plans[1].rows)
    keys = engine.executor.batch_programs([(p.prefix_ids, p.rows) for p in plans])
    assert {"prefill-image", "slab", "tail"} <= {k[0] for k in keys}  # short rows of several prefixes: slab calls
    batch = engine.predict_many([(p, None) for p in plans])
    for (state, questions, images), got in zip(requests, batch):
        want = engine.predict(state, questions, images=images, reference=True)
        for qid in questions:
            np.testing.assert_allclose(_probs(got)[qid], _probs(want)[qid], atol=1e-5, rtol=0)


def test_concurrent_requests_for_one_new_picture_run_the_tower_once(vl_engine):
    from concurrent.futures import ThreadPoolExecutor

    engine, _ = vl_engine
    vision = engine.backbone.vision
    image = vision.prepare("<image:z>", _png(np.random.default_rng(10), (56, 40)))
    runs = vision.tower_runs
    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(lambda _: vision.features(image), range(4)))
    assert vision.tower_runs == runs + 1 and sum(not cached for _, cached in out) == 1
    for feats, _ in out:
        np.testing.assert_array_equal(feats, out[0][0])
