"""A micro-batch of requests against the same requests one at a time, in one process, warm.

    python -m scripts.bench_microbatch [--sizes 2,4,8] [--dtypes auto] [--repeats 3] [--model DIR]

The shipped default (`lev_jax.load()`; `--model` for another) asked the load test's questions
(lev_jax/bench/loadtest.py: a yes/no, a 4-option choice, a 4-level score) about N of its tickets: each
request alone (`predict`, N calls), then all N as one micro-batch (`predict_many`, what the server's
scheduler runs for N concurrent requests). Both are warmed first (every program compiled), so the
ratio is the device work a micro-batch saves, without HTTP and without compiles; the server's
end-to-end numbers are `scripts/loadtest`'s. Prints ms per request, the ratio alone / batched (the
throughput gain) and the largest difference of any probability between the two readings.
"""

from __future__ import annotations

import argparse
import time

import lev_jax
from lev_jax.bench.loadtest import QUESTIONS, TICKETS, answer_difference


def best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,4,8", help="micro-batch sizes (requests)")
    ap.add_argument("--dtypes", default="auto", help="comma-separated: auto, float32, bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", help="a model directory, release or run (default: the shipped default)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    if max(sizes) > len(TICKETS) or min(sizes) < 1:
        ap.error(f"--sizes must be between 1 and {len(TICKETS)}")
    print("| dtype | requests | alone ms/request | micro-batch ms/request | alone / micro-batch | largest difference |")
    print("|---|---:|---:|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        engine = lev_jax.load(args.model, dtype=dtype)
        for n in sizes:
            # a reference number per size, so no request's state is in the cross-request cache twice
            reqs = [(f"{t} (ref {n:02d}-{i:03d})", QUESTIONS) for i, t in enumerate(TICKETS[:n])]
            alone = [engine.predict(*r) for r in reqs]  # compiles the single-request programs
            batched = engine.predict_many(reqs)  # ... and the micro-batch's
            gap = max(answer_difference(a, b) for a, b in zip(alone, batched, strict=True))
            t_alone = best_ms(lambda reqs=reqs: [engine.predict(*r) for r in reqs], args.repeats) / n
            t_batch = best_ms(lambda reqs=reqs: engine.predict_many(reqs), args.repeats) / n
            cells = [
                engine.backbone.dtype,
                n,
                f"{t_alone:.1f}",
                f"{t_batch:.1f}",
                f"{t_alone / t_batch:.2f}x",
                f"{gap:.1e}",
            ]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
