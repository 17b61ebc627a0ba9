"""``python -m scripts.loadtest [--url URL] [--burst N] [--max-pending N] [--warmup-budget S] ...``: the
bounded loopback load test of the server (throughput right after ready, overload, warm throughput); the
code and its options are in lev_jax/bench/loadtest.py, results in BENCHMARKS.md."""

import sys

from lev_jax.bench.loadtest import main

if __name__ == "__main__":
    sys.exit(main())
