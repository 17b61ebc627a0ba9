"""First vs repeated image request: what the content-keyed feature cache and the prefix cache save.

    python -m scripts.bench_images [--model VL_CHECKPOINT] [--size 512] [--repeats 3] [--markdown]

Without --model the engine is a tiny random Qwen3.5 language model (the Qwen3.5 tokenizer) with a
random ViT-B-sized vision tower (depth 12, width 768, 12 heads, patch 16, merge 2: the shape class of
Qwen3.5's small checkpoints' towers) — random weights time like trained ones. Every request asks three
questions (noul, 3-option choice, 3-level score) about a state showing one --size x --size photo
(random pixels; the default pixel budget 512^2 keeps 512 x 512 at 256 image tokens). Programs are
compiled by a warm-up request first, so every row below is warm:

  new image        a picture never seen: vision tower + state prefix + question rows
  same image, new state    the picture seen before in another state: the features come from the
                   feature cache (no vision tower), the prefix is computed again
  same request     the same state and picture again: the whole prefix comes from the prefix cache

Each row is the median of --repeats requests (a new picture for each "new image" request), with its
ratio to "new image" measured in the same run (these machines are noisy; the ratio survives).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np

QUESTIONS = {
    "damaged": {"type": "noul", "instructions": "Is the parcel damaged?"},
    "kind": {
        "type": "choice",
        "instructions": "What is shown?",
        "criteria": {"parcel": None, "letter": None, "pallet": None},
    },
    "quality": {"type": "score", "instructions": "Photo quality?", "criteria": ["poor", "fair", "good"]},
}
TOWER = dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m scripts.bench_images", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a vision checkpoint directory (default: a random tiny one)")
    p.add_argument("--size", type=int, default=512, help="photo side in pixels (default 512)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--markdown", action="store_true", help="also print a BENCHMARKS.md table")
    args = p.parse_args(argv)
    if args.size < 16 or args.repeats < 1:
        p.error("--size must be at least 16 and --repeats at least 1")
    return args


def photo(seed: int, size: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def random_engine():
    """A tiny random Qwen3.5 LM with a random ViT-B-sized tower (lev_jax.testing's tiny backbone)."""
    import lev_jax
    from lev_jax.images import ImagePreprocessor
    from lev_jax.models.qwen3_5 import vision as tower
    from lev_jax.testing import tiny_backbone
    from lev_jax.vision import Vision

    bb = tiny_backbone("qwen3_5")
    cfg = tower.VisionConfig(
        **TOWER,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
        out_hidden_size=bb.config.hidden_size,
        num_position_embeddings=2304,
        hidden_act="gelu_pytorch_tanh",
    )
    tok = bb.tokenizer
    bb.vision = Vision(
        cfg,
        tower.random_params(cfg),
        ImagePreprocessor(),
        image_token_id=tok.token_to_id("<|image_pad|>"),
        vision_start_token_id=tok.token_to_id("<|vision_start|>"),
        vision_end_token_id=tok.token_to_id("<|vision_end|>"),
    )
    return lev_jax.Engine(bb)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def main(argv=None) -> int:
    args = parse_args(argv)
    import lev_jax

    engine = random_engine() if args.model is None else lev_jax.load(args.model)
    if not engine.supports_images:
        raise SystemExit(f"bench_images: {args.model} is not a vision checkpoint")
    vision = engine.backbone.vision
    ask = lambda state, img: engine.predict_with_usage(state, QUESTIONS, images={"<image:p>": img})  # noqa: E731
    ask("Warm-up: <image:p>", photo(0, args.size))  # compiles the tower, prefix and row programs
    image_tokens = ask("Warm-up: <image:p>", photo(0, args.size))[1]["image_tokens"]
    new, same_image, same_request = [], [], []
    for k in range(args.repeats):
        img = photo(k + 1, args.size)
        runs = vision.tower_runs
        new.append(timed(lambda: ask(f"Delivery {k}: <image:p>", img)))
        assert vision.tower_runs == runs + 1
        same_image.append(timed(lambda: ask(f"Returned parcel {k}, photo <image:p>", img)))
        same_request.append(timed(lambda: ask(f"Returned parcel {k}, photo <image:p>", img)))
        assert vision.tower_runs == runs + 1  # the repeats ran no vision tower
    rows = [
        ("new image", statistics.median(new)),
        ("same image, new state", statistics.median(same_image)),
        ("same request", statistics.median(same_request)),
    ]
    base = rows[0][1]
    print(f"{engine.model_name} ({engine.backbone.dtype}): {args.size}x{args.size} photo = {image_tokens} image tokens")
    for name, ms in rows:
        print(f"  {name:<24} {ms:9.1f} ms   x{base / ms:5.2f} faster than a new image")
    if args.markdown:
        print(f"\n| request | ms (median of {args.repeats}) | speed-up vs new image |\n|---|---:|---:|")
        for name, ms in rows:
            print(f"| {name} | {ms:.1f} | {base / ms:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
