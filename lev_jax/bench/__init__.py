"""The benchmark harness behind ``python -m scripts.levbench``: eval sets (export, sampling),
clients (in-process engine or any Jev-compatible URL), eval / fit / sweep, and their reports."""

from lev_jax.bench.evalset import EvalSet, EvalSetError

__all__ = ["EvalSet", "EvalSetError"]
