"""Prefill throughput of a backbone next to the matmul ceiling measured on this machine, same run.

    python -m scripts.bench_forward [--model PATH] [--dtype float32|bfloat16] [--tokens 512] [--repeats 10]

Prints tokens/s and achieved GFLOP/s (matmul FLOPs of the forward, counted from the config) for a
prefill of --tokens tokens, and the best GFLOP/s of plain jitted matmuls of the same dtype (the model's
own shapes and a large square one) measured in the same process, so the ratio survives a noisy machine.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import lev_jax
from lev_jax import models


def timed(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile + warm up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - t0)
    return min(samples)  # best of N: the least disturbed run, for the model and the ceiling alike


def matmul_ceiling(shapes, repeats: int, dtype: str = "float32") -> dict:
    """GFLOP/s of plain jitted matmuls: `dtype` inputs, fp32 accumulation and output (the model's form)."""
    out = {}
    for m, k, n in shapes:
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dtype)
        b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
        f = jax.jit(functools.partial(jnp.dot, preferred_element_type=jnp.float32))
        t = timed(lambda: f(a, b), repeats)
        out[f"{m}x{k}x{n}"] = 2.0 * m * k * n / t / 1e9
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)

    bb = lev_jax.load_backbone(args.model, dtype=args.dtype)
    cfg = bb.config
    T = args.tokens
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, T)), jnp.int32)
    valid = jnp.ones((1, T), bool)

    @jax.jit
    def prefill(params, ids):
        hidden, cache = models.forward(params, ids, None, cfg, valid_BT=valid)
        return hidden, cache

    t = timed(lambda: prefill(bb.params, ids), args.repeats)
    # causal attention sees on average (T + 1) / 2 keys per query
    flops = cfg.flops_per_token((T + 1) / 2) * T
    gflops = flops / t / 1e9
    E, F = cfg.hidden_size, cfg.intermediate_size
    ceiling = matmul_ceiling([(T, E, F), (T, F, E), (2048, 2048, 2048)], args.repeats, dtype=args.dtype)
    best = max(ceiling.values())
    print(f"backend: {jax.default_backend()}  devices: {jax.devices()}")
    print(f"model: {bb.name}  layers={cfg.num_hidden_layers} hidden={E} dtype={bb.dtype}")
    print(f"prefill {T} tokens: {t * 1e3:.1f} ms  -> {T / t:.0f} tokens/s, {gflops:.1f} GFLOP/s")
    for name, g in ceiling.items():
        print(f"  matmul {name}: {g:.1f} GFLOP/s")
    print(f"ratio to the matmul ceiling ({best:.1f} GFLOP/s): {gflops / best:.2f}")


if __name__ == "__main__":
    main()
