"""Shape buckets: every device call is padded up to one of these sizes, so a serving process compiles
a bounded set of programs and never recompiles in steady state."""
from __future__ import annotations

PREFIX = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SUFFIX = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CODES = (2, 9, 32, 128, 704)
PREFILL_CHUNK = 2048  # longer prefixes prefill chunk by chunk (memory ~ chunk x prefix)
MAX_PADDED_ROW_TOKENS = 1 << 16  # rows x suffix bucket per call; more rows are split across calls


def fit(n: int, sizes: tuple[int, ...], what: str) -> int:
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{what} of {n} exceeds the largest bucket ({sizes[-1]})")
