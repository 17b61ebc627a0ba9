"""Deterministic hashing, split assignment and the option-count bands a question can be cut into.

Everything that decides *which* rows go where is a pure function of the data and a seed, computed
with ``hashlib.blake2b``: never Python's ``hash()`` (salted per process) and never an RNG draw
whose stream could change with a library version. ``HashRng`` is a tiny counter-mode generator on
top of blake2b, so augmentation choices are byte-stable across machines and Python versions too.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import MutableSequence, Sequence
from typing import Any, TypeVar

from lev_jax.domain import BAND_RANGES, BANDS

T = TypeVar("T")

SPLITS: tuple[str, ...] = ("train", "calibration", "test")
# Cumulative thresholds on [0, 1): train 80 %, calibration 10 %, test 10 %.
SPLIT_THRESHOLDS: tuple[float, ...] = (0.8, 0.9, 1.0)

_SEP = "\x1f"  # unit separator: cannot occur in a label name and rarely in text


def blake2b_digest(*parts: Any, size: int = 16) -> bytes:
    joined = _SEP.join(str(p) for p in parts)
    return hashlib.blake2b(joined.encode("utf-8"), digest_size=size).digest()


def blake2b_hex(*parts: Any, size: int = 16) -> str:
    return blake2b_digest(*parts, size=size).hex()


def blake2b_u64(*parts: Any) -> int:
    return int.from_bytes(blake2b_digest(*parts, size=8), "big")


def unit_float(*parts: Any) -> float:
    """A float in [0, 1) with 53 random bits, from blake2b of ``parts``."""
    return (blake2b_u64(*parts) >> 11) / float(1 << 53)


def assign_split(group: str, position: int, text: str) -> str:
    """train / calibration / test by blake2b of (source group, position, text)."""
    u = unit_float("split", group, position, text)
    for name, threshold in zip(SPLITS, SPLIT_THRESHOLDS):
        if u < threshold:
            return name
    return SPLITS[-1]


def reachable_bands(n_full: int) -> list[str]:
    """Bands (domain.BANDS) a question with ``n_full`` options can be cut into (subsets keep >= 2
    options). Calibration must cover each band the mixture can reach."""
    out = []
    for band in BANDS:
        lo, _ = BAND_RANGES[band]
        if n_full >= lo:
            out.append(band)
    return out


def normalize_text(text: str) -> str:
    """Case-, width- and whitespace-insensitive form used for dedupe and decontamination."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"\s+", " ", text).strip()
    return text.strip(" .?!,;:'\"")


class HashRng:
    """Counter-mode generator on blake2b: the same key gives the same stream everywhere."""

    __slots__ = ("_key", "_counter")

    def __init__(self, *key: Any):
        self._key = _SEP.join(str(k) for k in key)
        self._counter = 0

    def u64(self) -> int:
        d = hashlib.blake2b(f"{self._key}{_SEP}{self._counter}".encode(), digest_size=8).digest()
        self._counter += 1
        return int.from_bytes(d, "big")

    def random(self) -> float:
        return (self.u64() >> 11) / float(1 << 53)

    def randbelow(self, n: int) -> int:
        if n <= 0:
            raise ValueError("randbelow needs n > 0")
        limit = (1 << 64) - ((1 << 64) % n)
        while True:
            v = self.u64()
            if v < limit:
                return v % n

    def randint(self, lo: int, hi: int) -> int:
        """Uniform integer in [lo, hi] (both inclusive)."""
        if hi < lo:
            raise ValueError(f"empty range [{lo}, {hi}]")
        return lo + self.randbelow(hi - lo + 1)

    def choice(self, seq: Sequence[T]) -> T:
        return seq[self.randbelow(len(seq))]

    def shuffle(self, seq: MutableSequence[T]) -> None:
        for i in range(len(seq) - 1, 0, -1):
            j = self.randbelow(i + 1)
            seq[i], seq[j] = seq[j], seq[i]

    def sample(self, seq: Sequence[T], k: int) -> list[T]:
        pool = list(seq)
        if not 0 <= k <= len(pool):
            raise ValueError(f"sample size {k} out of range for {len(pool)} items")
        for i in range(k):
            j = i + self.randbelow(len(pool) - i)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]


def hash_order(keys: Sequence[str], *salt: Any) -> list[int]:
    """Indices of ``keys`` in a seeded pseudo-random order (a sort by blake2b, stable forever)."""
    return sorted(range(len(keys)), key=lambda i: (blake2b_digest("order", *salt, keys[i], size=8), i))
