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


PREFILL_CHUNK = 256  # prefixes (and rows longer than this) run through the model in chunks of this many tokens
# A prefix's first chunk runs without a cache at one of these sizes (a question lead of a few dozen
# tokens is not padded to a whole chunk); every later chunk is PREFILL_CHUNK tokens
FIRST_CHUNKS = (64, PREFILL_CHUNK)
# A computed prefix's cache has one of these slot counts, and so does a cache a long row's chunks
# extend: every chunk writing into it and every row reading it then runs one of a few programs per
# capacity, whatever the prefix's exact length (one program per prefix length bucket made a server
# compile ~35 prefill programs before it was ready). A cache grows through them chunk by chunk, so a
# chunk attends to at most twice the slots it needs; a row read after a prefix attends its capacity.
# (A short prefix's cache is a whole chunk's too: a read of its rows attends a few more empty slots,
# and the programs reading such caches are the ones reading any prefix of up to a chunk.)
CAPACITY = tuple(PREFILL_CHUNK << k for k in range(9))
# a prefix is computed into a cache of its capacity (0: no prefix)
PREFIX = (0,) + tuple(c for c in CAPACITY if c <= 32768)
# a row after its prefix (a question after the state, or with the schema first the state after the
# question's cached lead): 4 sizes per octave, not 8. Each size is a program per question shape, and
# with the schema first a state length not seen yet costs one per question a request asks; 8 fresh
# requests right after ready needed 15 new programs at 8 sizes per octave (one of them waited past the
# server's deadline, BENCHMARKS.md "Serving"), 9 at 4 -- for at most a quarter of a short row padded
SUFFIX = geometric(8, 32768, 4)
# the last tokens of a row read alone (readout.execute.tail_start): a row longer than a chunk ends in
# a tail of the first size after its chunks, wherever its text ends, so a tail is one program per
# cache capacity; a shorter row (Mode B, many label codes) is all tail
TAIL = (64, PREFILL_CHUNK)
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
# a row read alone after its chunks (a long row's tail, a Mode B row): its label codes (or markers) in
# the coarser buckets a slab's rows take, so a noul and a small choice share one program
READ_CODES = tuple(c for c in CODES if c >= 32)
# rows x suffix bucket per call; more rows are split across calls of near-equal size
ROW_TOKENS_PER_CALL = {"cpu": 1024}
ROW_TOKENS_PER_CALL_DEFAULT = 1 << 16


def row_tokens_per_call(platform: str) -> int:
    return ROW_TOKENS_PER_CALL.get(platform, ROW_TOKENS_PER_CALL_DEFAULT)


# Short rows are read packed into slabs of lanes (readout.slab): a lane is at most a chunk long, and a
# call holds a few lanes -- powers of 4 up to the device's per-call budget (on a CPU 1 or 4), of a
# chunk's tokens, or of SHORT_LANE tokens for the few small questions of a lone request (at most two
# lane counts: short lanes beyond that fill chunk-long calls). These few shapes are every short row's
# programs.
SHORT_LANE = 64
# What a slab call costs beyond its lanes' tokens, in tokens' time (the weights read once per call,
# dispatch): calls are planned at the least total cost (readout.slab.calls), so a lone request's three
# short lanes take one 4 x 64 call, not a 4 x 256 one nor three calls of their own, and lanes of one
# prefix take the lane counts they sum to where that computes less. `python -m scripts.bench_slab`
# measures it (it prints the fitted value for the device it runs on).
CALL_TOKENS = {"cpu": 112}
# an accelerator: a call is bound by its launch and its weight reads up to thousands of tokens (assumed,
# not measured here: no accelerator on the machines this was written on)
CALL_TOKENS_DEFAULT = 4096


def call_tokens(platform: str) -> int:
    return CALL_TOKENS.get(platform, CALL_TOKENS_DEFAULT)


def slab_shapes(platform: str) -> tuple[tuple[int, int], ...]:
    """(lanes, tokens per lane) of the slab calls, smallest first."""
    most = max(1, row_tokens_per_call(platform) // PREFILL_CHUNK)
    lanes = tuple(4**k for k in range(8) if 4**k <= most)
    return tuple(
        sorted(
            {(n, SHORT_LANE) for n in lanes[:2]} | {(n, PREFILL_CHUNK) for n in lanes},
            key=lambda s: (s[0] * s[1], s[1]),
        )
    )


def chunks(n: int, offset: int = 0, slots: int = 0, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int, int]]:
    """(start, tokens, cache slots) of the calls that run `n` tokens into a cache whose next slot is
    `offset` of `slots` (0: no cache yet, a prefix: its first call runs alone at a FIRST_CHUNKS size,
    and its cache slots are 0). Every later call is `chunk` tokens (the last one padded) written into
    the cache grown to a CAPACITY size that holds it: one program per capacity serves every prefix and
    every long row."""
    out, start = [], 0
    if not slots:
        first = fit(min(n, chunk), tuple(s for s in FIRST_CHUNKS if s < chunk) + (chunk,), "first chunk")
        out.append((0, first, 0))
        start = offset = slots = first
    while start < n:
        slots = max(slots, fit(offset + chunk, CAPACITY, "cache slots"))
        out.append((start, chunk, slots))
        start, offset = start + chunk, offset + chunk
    return out


def prefilled(n: int) -> tuple[int, int]:
    """(next slot, slots) of the cache of an n-token prefix (0 tokens: no cache, (0, 0)): its chunks
    end at the next slot, its capacity holds it."""
    if not n:
        return 0, 0
    start, size, _ = chunks(n)[-1]
    return start + size, fit(n, PREFIX[1:], "prefix length")


def fit(n: int, sizes: tuple[int, ...], what: str) -> int:
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{what} of {n} exceeds the largest bucket ({sizes[-1]})")
