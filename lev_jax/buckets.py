"""Shape buckets: every device call is padded up to one of these sizes, so a serving process compiles
a bounded set of programs and never recompiles in steady state.

Sizes grow geometrically with a few steps per octave, which bounds padding waste (at most 1/steps of
the size, ~12 % on average for 4 steps) while keeping the number of distinct programs small.
"""
from __future__ import annotations


def geometric(lo: int, hi: int, steps_per_octave: int) -> tuple[int, ...]:
    """lo, ..., hi: within each octave [2^k, 2^(k+1)) sizes step by 2^k / steps_per_octave."""
    out, size = [], lo
    while size < hi:
        out.append(size)
        octave = 1 << (size.bit_length() - 1)
        size += max(1, octave // steps_per_octave)
    out.append(hi)
    return tuple(out)


PREFILL_CHUNK = 2048  # longer prefixes prefill chunk by chunk (memory ~ chunk x prefix)
# beyond one chunk, prefixes come in whole chunks
PREFIX = (0,) + geometric(32, PREFILL_CHUNK, 4) + tuple(range(2 * PREFILL_CHUNK, 32768 + 1, PREFILL_CHUNK))
SUFFIX = geometric(8, 32768, 4)
ROWS = geometric(1, 512, 2)
CODES = (2, 9, 32, 128, 704)
MAX_PADDED_ROW_TOKENS = 1 << 16  # rows x suffix bucket per call; more rows are split across calls


def fit(n: int, sizes: tuple[int, ...], what: str) -> int:
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{what} of {n} exceeds the largest bucket ({sizes[-1]})")
