"""Shape buckets: every device call is padded up to one of these sizes, so a serving process compiles
a bounded set of programs and never recompiles in steady state.

Sizes grow geometrically with a few steps per octave, which bounds padding waste (at most 1/steps of
the size: ~6 % on average for 8 steps, ~12 % for 4) while keeping the number of distinct programs small.

How much work goes into one call is a device property: a CPU runs fastest when a call's activations
stay in its last-level cache (bf16 SmolLM2 on the 2-core machine: 0.42 ms per row token at 16 rows x
48 tokens, 0.55 at 64 x 48; a 2048-token prefill in 256-token chunks takes half the time of one
2048-token call), an accelerator when calls are large. `python -m scripts.bench_predict` measures it.
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


PREFILL_CHUNK = 512  # longer prefixes prefill chunk by chunk (memory and cache footprint ~ chunk x prefix)
# beyond one chunk, prefixes come in whole chunks
PREFIX = (0,) + geometric(32, PREFILL_CHUNK, 8) + tuple(range(2 * PREFILL_CHUNK, 32768 + 1, PREFILL_CHUNK))
# a row after its prefix (a question after the state, or with the schema first the state after the
# question's cached lead): 4 sizes per octave, not 8. Each size is a program per question shape, and
# with the schema first a state length not seen yet costs one per question a request asks; 8 fresh
# requests right after ready needed 15 new programs at 8 sizes per octave (one of them waited past the
# server's deadline, BENCHMARKS.md "Serving"), 9 at 4 -- for at most a quarter of a short row padded
SUFFIX = geometric(8, 32768, 4)
# the last tokens of a row longer than a chunk (read after its chunks): few sizes, because every one is
# a program per cache size and a long row's tail depends on where its text happens to end; the padding
# falls on a fraction of the row
TAIL = geometric(32, PREFILL_CHUNK, 2)
# a long row's chunks grow the cache they extend to a multiple of this many slots: coarse enough that
# every question shorter than it shares the chunk and tail programs, fine enough that a chunk does not
# score hundreds of empty slots (a whole chunk's multiple cost a 512-token chunk after a short
# question 1,024 slots, about twice a prefill of its tokens)
LONG_ROW_SLOTS = 128
ROWS = geometric(1, 512, 2)
# a call of several rows (a micro-batch's requests asking one question, a request's questions) has
# a shape that depends on which rows happen to meet: every (rows, longest row) pair is a program, so
# such calls take coarser sizes (at most half padding) and a few programs serve the combinations
STACKED_ROWS = geometric(1, 512, 1)
STACKED_SUFFIX = geometric(8, 32768, 2)
# the verification path (one independent full forward per row, `reference=True`) pads each sequence on
# the right to a power of two: causal, so the padding cannot reach the row's tokens, and verifying a
# request's many rows of different lengths then compiles a handful of programs, not one per length
REFERENCE = geometric(32, 1 << 20, 1)
CODES = (2, 9, 32, 128, 704)
# rows x suffix bucket per call; more rows are split across calls of near-equal size
ROW_TOKENS_PER_CALL = {"cpu": 1024}
ROW_TOKENS_PER_CALL_DEFAULT = 1 << 16


def row_tokens_per_call(platform: str) -> int:
    return ROW_TOKENS_PER_CALL.get(platform, ROW_TOKENS_PER_CALL_DEFAULT)


def fit(n: int, sizes: tuple[int, ...], what: str) -> int:
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{what} of {n} exceeds the largest bucket ({sizes[-1]})")
