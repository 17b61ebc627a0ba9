"""`levbench compare A B`: two models' answers to the same items, metric by metric, with paired
bootstrap intervals on the differences (B - A).

A and B are `levbench eval --out` directories (or single task JSON files). Items are matched by
(item index, question) within each task present in both; only items both answered count. For every
readout both hold (the served, calibrated probabilities, and the uncalibrated ones when both runs
scored a baseline) it reports accuracy, ECE, Brier and NLL of A and of B and the 95 % interval of
B - A over `resamples` paired resamples of the items: the same resampled items score both models,
so what the two share (item difficulty) cancels. Resampling is by cluster (`clusters`: the item's
state) when several questions were asked about one state, so they move together.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lev_jax import metrics

RESAMPLES = 2000
METRICS = ("accuracy", "ece", "brier", "nll")
READOUTS = (("calibrated", "probs"), ("uncalibrated", "uncalibrated_probs"))


class CompareError(ValueError):
    """Inputs that cannot be compared (no shared task, no shared item)."""


def load_results(path: str | Path) -> dict[str, dict]:
    """{task: result JSON} of a `levbench eval --out` directory or one task JSON file."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.glob("*.json") if f.name != "summary.json")
    out = {}
    for f in files:
        d = json.loads(f.read_text(encoding="utf-8"))
        if isinstance(d, dict) and "records" in d and "task" in d:
            out[d["task"]] = d
    if not out:
        raise CompareError(f"{path}: no levbench task results (JSON with 'task' and 'records')")
    return out


def _metric(name: str, rows: np.ndarray, gold: np.ndarray, n_bins: int) -> float:
    if name == "accuracy":
        return metrics.accuracy(rows, gold)
    if name == "ece":
        return metrics.ece(rows, gold, n_bins)
    if name == "brier":
        return metrics.brier(rows, gold)
    return metrics.nll(rows, gold)


def _padded(rows: Sequence) -> np.ndarray:
    width = max(len(r) for r in rows)
    mat = np.zeros((len(rows), width), np.float64)
    for i, r in enumerate(rows):
        mat[i, : len(r)] = r
    return mat


def paired_bootstrap(
    rows_a: Sequence,
    rows_b: Sequence,
    gold: Sequence[int],
    clusters: Sequence | None = None,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
    n_bins: int = 10,
) -> dict[str, dict[str, Any]]:
    """Per metric: A, B, B - A, and the 2.5/97.5 percentiles of B - A over paired (cluster)
    resamples; `p_b_not_lower` is the share of resamples where B - A >= 0."""
    g = np.asarray(gold)
    rows_a, rows_b = _padded(rows_a), _padded(rows_b)  # zero padding changes no metric (lev_jax.metrics)
    cl = np.asarray(clusters if clusters is not None else np.arange(len(g)))
    groups = [np.flatnonzero(cl == c) for c in dict.fromkeys(cl.tolist())]
    rng = np.random.default_rng(seed)
    out = {}
    draws = {m: [] for m in METRICS}
    for _ in range(resamples):
        idx = np.concatenate([groups[j] for j in rng.integers(0, len(groups), len(groups))])
        ra, rb = rows_a[idx], rows_b[idx]
        for m in METRICS:
            draws[m].append(_metric(m, rb, g[idx], n_bins) - _metric(m, ra, g[idx], n_bins))
    for m in METRICS:
        a, b = _metric(m, rows_a, g, n_bins), _metric(m, rows_b, g, n_bins)
        d = np.asarray(draws[m])
        out[m] = {
            "a": a,
            "b": b,
            "delta": b - a,
            "ci95": [float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))],
            "p_b_not_lower": float((d >= 0).mean()),
        }
    return out


def compare(a: Mapping[str, dict], b: Mapping[str, dict], *, resamples: int = RESAMPLES, seed: int = 0) -> list[dict]:
    """One entry per shared task and readout (see the module docstring)."""
    shared = [t for t in a if t in b]
    if not shared:
        raise CompareError(f"no task in both (A: {', '.join(a)}; B: {', '.join(b)})")
    out = []
    for task in shared:
        ra = {(r["i"], r.get("question")): r for r in a[task]["records"] if "probs" in r}
        rb = {(r["i"], r.get("question")): r for r in b[task]["records"] if "probs" in r}
        keys = [k for k in ra if k in rb]
        if not keys:
            raise CompareError(f"{task}: no item answered by both")
        gold = [ra[k]["gold"] for k in keys]
        if gold != [rb[k]["gold"] for k in keys]:
            raise CompareError(f"{task}: the two results disagree on the gold answers (different eval sets?)")
        for readout, field in READOUTS:
            if not all(field in ra[k] and field in rb[k] for k in keys):
                continue
            stats = paired_bootstrap(
                [ra[k][field] for k in keys],
                [rb[k][field] for k in keys],
                gold,
                [k[0] for k in keys],  # one cluster per item (its state)
                resamples=resamples,
                seed=seed,
            )
            out.append(
                {
                    "task": task,
                    "readout": readout,
                    "items": len({k[0] for k in keys}),
                    "rows": len(keys),
                    "metrics": stats,
                }
            )
    return out


def markdown(results: Sequence[Mapping[str, Any]], name_a: str, name_b: str, resamples: int) -> str:
    lines = [
        f"# levbench compare: B = `{name_b}` vs A = `{name_a}`",
        "",
        f"B - A with 95 % paired bootstrap intervals ({resamples} resamples of the items both answered). "
        "Accuracy: higher is better; ECE, Brier, NLL: lower is better.",
        "",
        "| task | readout | rows | metric | A | B | B - A | 95 % interval |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for m in METRICS:
            s = r["metrics"][m]
            lines.append(
                f"| {r['task']} | {r['readout']} | {r['rows']} | {m} | {s['a']:.3f} | {s['b']:.3f} "
                f"| {s['delta']:+.3f} | [{s['ci95'][0]:+.3f}, {s['ci95'][1]:+.3f}] |"
            )
    return "\n".join(lines) + "\n"
