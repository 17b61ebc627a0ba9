"""What one slab call costs, per shape, and the per-call cost the planner charges (buckets.CALL_TOKENS).

    python -m scripts.bench_slab [--model PATH] [--dtype bfloat16] [--repeats 5]

Times one call of every slab shape of this device (`buckets.slab_shapes`: L lanes x T tokens, read
after a real prefix's cache; several lanes read it stacked, one row per lane, as a micro-batch's do),
warm, best of `--repeats`. A call's time is close to a + b * L * T (a and b fitted by least squares
over the shapes); a / b is the per-call cost in
tokens' time that `readout.slab.calls` plans with (printed next to the value in buckets, which it is
meant to track: a call of many lanes pays it once where calls of one lane each pay it per lane).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model or release (default: the shipped default)")
    ap.add_argument("--dtype", default="bfloat16", help="the served dtype (the shipped default's: bfloat16)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np

    import lev_jax
    from lev_jax import buckets
    from lev_jax.models import cache as cache_lib
    from lev_jax.readout import logits, slab

    engine = lev_jax.load(args.model, dtype=args.dtype)
    ex, bb = engine.executor, engine.backbone
    prefix = engine.tokenizer.encode("A customer writes about a card payment charged twice at a cafe. " * 3)
    cache, _ = ex.prefix_cache(prefix[: buckets.FIRST_CHUNKS[0]])

    def call_ms(L: int, T: int) -> float:
        stacked = L > 1  # as readout.slab.calls plans them
        c = cache_lib.concat_rows([cache] * L) if stacked else cache
        args_ = (
            bb.params,
            c,
            jnp.zeros((L,), jnp.int32) if stacked else None,
            jnp.full((L, T), 100, jnp.int32),
            jnp.ones((L, T), bool),
            jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (L, T)),
            jnp.zeros((L, T), jnp.int32) if ex.packable else None,
            jnp.full((L, T), -1, jnp.int32) if ex.packable else None,
            jnp.zeros((L, slab.READS), jnp.int32),
            jnp.zeros((L, slab.READS, slab.CODES), jnp.int32),
            bb.config,
        )
        np.asarray(logits.read_slab(*args_))  # compile (or load) and warm
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            np.asarray(logits.read_slab(*args_))
            best = min(best, time.perf_counter() - t0)
        return best * 1e3

    shapes = buckets.slab_shapes(ex.platform)
    ms = {s: call_ms(*s) for s in shapes}
    print(f"model {engine.backbone.name}, {bb.dtype}, platform {ex.platform}, best of {args.repeats}")
    print("| lanes x tokens | ms | ms per token |")
    print("|---|---:|---:|")
    for (L, T), t in ms.items():
        print(f"| {L} x {T} | {t:.1f} | {t / (L * T):.3f} |")
    if len(shapes) > 1:
        n = np.array([L * T for L, T in shapes], float)
        (per_call, per_token), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), np.array(list(ms.values())))
        print(
            f"least-squares fit: {per_token:.3f} ms per token + {per_call:.1f} ms per call = "
            f"{per_call / per_token:.0f} tokens per call (buckets.call_tokens: {buckets.call_tokens(ex.platform)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
