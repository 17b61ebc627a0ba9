"""Regenerate tests/data/default_golden.json: the shipped default's (lev_jax/default) answers to a small
fixed request set, in fp32 and in bf16 (`dtype="auto"` where bf16 is native: what `make serve` and
`lev_jax.load()` run there), pinned by tests/test_default_golden.py.

    python -m scripts.golden_default [--out tests/data/default_golden.json]

Run it only when a change is meant to move the default's answers (a new release, a readout change),
say why in the commit, and read the diff first: the tests never call this script; they compare what
the engine answers now with what it answered when the file was written.

The requests: a small choice, a score and a noul (the README's example), a described noul, and two
BANKING77-style questions over all 77 intents (read by the release's Mode B head; the options as
`levbench export` asks them, without descriptions) on states written here, not taken from any data
set.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
from pathlib import Path

import jax

import lev_jax
from lev_jax import runtime
from lev_jax.engine import DEFAULT_RELEASE

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "default_golden.json"
DTYPES = ("float32", "bfloat16")

STATES = [
    {"customer": "Ann", "message": "My parcel never arrived and I was charged twice!"},
    "I was charged twice for the same card payment yesterday, please refund one of them.",
    "Hi, I moved abroad last month. How do I change the address on my account and order a new card?",
]


def _banking77_question() -> dict:
    """BANKING77's canonical question as `levbench export` writes it (lev_jax/bench/export.py)."""
    from lev_jax.bench import export

    return export._choice_question("banking77")


def requests() -> list[dict]:
    support = {
        "intent": {
            "type": "choice",
            "instructions": "What does the customer want?",
            "criteria": {"refund": "money back", "delivery": "a late parcel", "other": None},
        },
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high"]},
        "angry": {
            "type": "noul",
            "instructions": "Is the customer angry?",
            "criteria": {"true": "insults, threats, shouting", "false": "calm"},
        },
        "polite": {"type": "noul", "instructions": "Is the message polite?"},
    }
    return [
        {"state": STATES[0], "questions": support},
        {"state": STATES[1], "questions": {**support, "banking77": _banking77_question()}},
        {"state": STATES[2], "questions": {"banking77": _banking77_question()}},
    ]


def answers(dtype: str, reqs: list[dict]) -> list[dict]:
    engine = lev_jax.load(dtype=dtype)
    assert engine.backbone.dtype == dtype, (engine.backbone.dtype, dtype)
    out = engine.predict_many([(r["state"], r["questions"]) for r in reqs])
    for r in out:
        if isinstance(r, Exception):
            raise r
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    reqs = requests()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    release = json.loads((DEFAULT_RELEASE / "lev_release.json").read_text())
    doc = {
        "generated_by": "python -m scripts.golden_default",
        "commit": commit.stdout.strip(),
        "date": datetime.date.today().isoformat(),
        "release": release["name"],
        "jax": jax.__version__,
        "machine": platform.machine(),
        "bf16_native": runtime.resolve_dtype("auto") == "bfloat16",
        "requests": reqs,
        "answers": {dtype: answers(dtype, reqs) for dtype in DTYPES},
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}: {len(reqs)} requests x {len(DTYPES)} dtypes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
