"""Split assignment, deterministic hashing and option-count bands."""

import hashlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from lev_jax.data.splits import HashRng, assign_split, blake2b_hex, hash_order, normalize_text, reachable_bands
from lev_jax.domain import BANDS, band_of

REPO = Path(__file__).resolve().parents[1]


def test_split_is_blake2b_of_source_position_text():
    for pos, text in [(0, "I am still waiting on my card?"), (17, "héllo wörld"), (123456, "")]:
        digest = hashlib.blake2b(f"split\x1fbanking77\x1f{pos}\x1f{text}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") >> 11) / float(1 << 53)
        expected = "train" if u < 0.8 else "calibration" if u < 0.9 else "test"
        assert assign_split("banking77", pos, text) == expected


def test_split_fractions_are_80_10_10():
    counts = Counter(assign_split("src", i, f"text {i}") for i in range(20_000))
    assert abs(counts["train"] / 20_000 - 0.8) < 0.01
    assert abs(counts["calibration"] / 20_000 - 0.1) < 0.008
    assert abs(counts["test"] / 20_000 - 0.1) < 0.008


def test_split_depends_on_every_key_part():
    base = [assign_split("a", i, "t") for i in range(200)]
    assert base != [assign_split("b", i, "t") for i in range(200)]
    assert base != [assign_split("a", i, "u") for i in range(200)]


def test_split_and_rng_do_not_depend_on_the_process_hash_seed():
    expr = "([assign_split('s', i, 'x%d' % i) for i in range(50)], HashRng('k', 1).sample(list(range(30)), 5))"
    code = f"from lev_jax.data.splits import assign_split, HashRng; print(repr({expr}))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    here = ([assign_split("s", i, f"x{i}") for i in range(50)], HashRng("k", 1).sample(list(range(30)), 5))
    assert out.stdout.strip() == repr(here)


def test_hash_rng_is_deterministic_and_well_spread():
    a, b = HashRng("key", 3), HashRng("key", 3)
    xs = [a.random() for _ in range(2000)]
    assert xs == [b.random() for _ in range(2000)]
    assert 0.47 < sum(xs) / len(xs) < 0.53
    assert HashRng("other").random() != xs[0]
    counts = Counter(HashRng("die", i).randint(1, 6) for i in range(6000))
    assert set(counts) == {1, 2, 3, 4, 5, 6} and min(counts.values()) > 850
    seq = list(range(20))
    HashRng("s").shuffle(seq)
    assert sorted(seq) == list(range(20)) and seq != list(range(20))
    sample = HashRng("t").sample(range(100), 10)
    assert len(set(sample)) == 10
    with pytest.raises(ValueError):
        HashRng("t").sample(range(3), 4)


def test_hash_order_is_a_stable_permutation():
    keys = [blake2b_hex("k", i) for i in range(100)]
    order = hash_order(keys, 0, "x")
    assert sorted(order) == list(range(100)) and order != list(range(100))
    assert order == hash_order(keys, 0, "x")
    assert order != hash_order(keys, 1, "x")


def test_bands():
    assert [band_of(n) for n in (2, 8, 9, 26, 27, 151)] == ["small", "small", "mid", "mid", "large", "large"]
    assert reachable_bands(4) == ["small"]
    assert reachable_bands(14) == ["small", "mid"]
    assert reachable_bands(77) == list(BANDS)


def test_normalize_text():
    assert normalize_text("  Hello\tWORLD?! ") == normalize_text("hello world")
    assert normalize_text("ﬁne") == "fine"
