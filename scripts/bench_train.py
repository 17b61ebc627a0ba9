"""Real tokens/s of one LoRA training step on the embedded model: lev-jax vs transformers + peft.

    python -m scripts.bench_train [--examples 8] [--rank 16] [--dtype bfloat16|float32] [--remat none] [--lora-layers K]

Same batch, same rows, same LoRA, same dtype, measured in the same run (best of --repeats after a
warm-up step); prints both rates and their ratio. The logic is lev_jax/training/bench.py.
"""

from __future__ import annotations

import argparse
import json


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--remat", default="none", choices=("none", "dots", "full"))
    ap.add_argument("--lora-layers", type=int, default=0, help="adapt only the last K layers (both sides)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="PyTorch intra-op threads")
    ap.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = ap.parse_args(argv)
    from lev_jax.training.cli import setup_runtime

    setup_runtime()
    from lev_jax.training import bench

    result = bench.run(
        examples=args.examples,
        rank=args.rank,
        alpha=args.alpha,
        dtype=args.dtype,
        remat=args.remat,
        repeats=args.repeats,
        threads=args.threads,
        layers=args.lora_layers,
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
