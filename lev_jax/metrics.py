"""Evaluation metrics: one definition each, used by the harness, calibration and tests.

Everything here is pure numpy and returns plain Python values (``float``, ``int``, ``dict``,
``list``) so results can go straight into JSON.

Inputs
------
``probs``
    One probability distribution per row, over the candidates offered in that row. Either a
    2-D array ``(n_rows, n_options)`` or a sequence of 1-D arrays/lists whose lengths may
    differ (ragged: rows with different option counts). Every row must be finite,
    non-negative and sum to 1 within ``1e-3``; nothing is renormalised silently.
``gold``
    The index of the correct candidate in each row (integers, ``0 <= gold < len(row)``).

Yes/no ("noul") answers are scored as the 2-class distribution ``{p, 1 - p}``: turn
``P(yes)`` and boolean gold labels into ordinary rows with :func:`binary_rows` (index 0 is
"yes", index 1 is "no"), then use any metric below.

Conventions (fixed here, so every caller agrees)
------------------------------------------------
* Prediction = ``argmax`` of the row; exact ties go to the **lowest index**.
* Confidence = the top probability of the row.
* Calibration bins: ``n_bins`` equal-width bins on the confidence, **right-closed** as in
  Guo et al. (2017): bin ``b`` holds ``b/n < conf <= (b+1)/n``; a confidence of exactly 0
  goes to bin 0. So 0.7 with 10 bins is in ``(0.6, 0.7]``.
* Selective accuracy keeps rows with ``confidence >= threshold`` (0.7 is kept at 0.7).
* Multiclass Brier = ``mean_rows( sum_k (p_k - onehot_k)^2 )``: the sum over classes, *not*
  divided by the number of classes, so it lies in ``[0, 2]`` for any option count. For a
  noul row ``{p, 1-p}`` this is ``2 * (p - y)^2``, twice the usual binary Brier score.
* NLL = ``mean_rows( -ln p_gold )`` (natural log) with ``p_gold`` floored at ``1e-12``
  (so one impossible-but-true row costs ~27.6 nats, not ``inf``).
* Empty inputs raise ``ValueError``; a statistic over an empty subset (an empty bin, a
  threshold nothing reaches) is ``None``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ProbRows",
    "SUM_ATOL",
    "NLL_FLOOR",
    "DEFAULT_THRESHOLDS",
    "binary_rows",
    "predictions",
    "confidences",
    "accuracy",
    "accuracy_by_family",
    "macro_accuracy",
    "reliability_bins",
    "ece",
    "ece_floor",
    "brier",
    "nll",
    "nll_terms",
    "selective_accuracy",
    "per_position_recall",
    "position_bias_rstd",
    "agreement",
    "summarize",
    "reliability_diagram_png",
]

ProbRows = np.ndarray | Sequence[Sequence[float]] | Sequence[np.ndarray]

SUM_ATOL = 1e-3
NLL_FLOOR = 1e-12
DEFAULT_THRESHOLDS = (0.5, 0.7, 0.9)


# --------------------------------------------------------------------------- input handling


def _as_matrix(probs: ProbRows) -> tuple[np.ndarray, np.ndarray]:
    """Validated ``(n, max_options)`` float64 matrix, zero-padded, plus each row's length.

    Zero padding changes none of the metrics: it never wins the argmax of a valid row, adds
    nothing to a sum of probabilities and adds ``(0 - 0)^2 = 0`` to the Brier sum.
    """
    if isinstance(probs, np.ndarray) and probs.dtype != object:
        if probs.ndim != 2:
            raise ValueError(f"probs must be 2-D (rows, options) or a list of 1-D rows, got shape {probs.shape}")
        mat = probs.astype(np.float64, copy=False)
        lengths = np.full(mat.shape[0], mat.shape[1], dtype=np.int64)
    else:
        rows = [np.asarray(r, dtype=np.float64) for r in probs]
        for i, r in enumerate(rows):
            if r.ndim != 1:
                raise ValueError(f"row {i} must be 1-D, got shape {r.shape}")
        lengths = np.array([r.shape[0] for r in rows], dtype=np.int64)
        width = int(lengths.max()) if len(rows) else 0
        mat = np.zeros((len(rows), width), dtype=np.float64)
        for i, r in enumerate(rows):
            mat[i, : r.shape[0]] = r
    if mat.shape[0] == 0:
        raise ValueError("no rows")
    if np.any(lengths < 1):
        raise ValueError("every row needs at least one option")
    if not np.all(np.isfinite(mat)):
        raise ValueError("probabilities must be finite")
    if np.any(mat < 0):
        raise ValueError("probabilities must be non-negative")
    sums = mat.sum(axis=1)
    bad = np.flatnonzero(np.abs(sums - 1.0) > SUM_ATOL)
    if bad.size:
        raise ValueError(f"row {int(bad[0])} sums to {sums[bad[0]]:.6g}, not 1 (within {SUM_ATOL})")
    return mat, lengths


def _as_gold(gold: Sequence[int] | np.ndarray, lengths: np.ndarray) -> np.ndarray:
    g = np.asarray(gold)
    if g.ndim != 1 or g.shape[0] != lengths.shape[0]:
        raise ValueError(f"gold must be 1-D with one entry per row ({lengths.shape[0]}), got shape {g.shape}")
    if g.dtype == bool or not np.issubdtype(g.dtype, np.integer):
        raise ValueError(f"gold must be integer option indices, got dtype {g.dtype} (use binary_rows for yes/no)")
    g = g.astype(np.int64)
    bad = np.flatnonzero((g < 0) | (g >= lengths))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"gold[{i}] = {g[i]} is outside row {i}'s {lengths[i]} options")
    return g


def _prepare(probs: ProbRows, gold) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mat, lengths = _as_matrix(probs)
    return mat, lengths, _as_gold(gold, lengths)


def _weights(weights, n: int) -> np.ndarray:
    if weights is None:
        return np.ones(n)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(f"weights must have shape ({n},), got {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError("weights must be finite, non-negative and not all zero")
    return w


def binary_rows(
    p_yes: Sequence[float] | np.ndarray, gold_yes: Sequence[bool] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Yes/no answers as 2-class rows: ``([[p, 1-p], ...], gold)``, gold 0 = yes, 1 = no."""
    p = np.asarray(p_yes, dtype=np.float64).reshape(-1)
    y = np.asarray(gold_yes)
    if y.shape != p.shape:
        raise ValueError(f"p_yes and gold_yes must have the same length, got {p.shape} and {y.shape}")
    if y.dtype != bool:
        raise ValueError(f"gold_yes must be booleans, got dtype {y.dtype}")
    if not np.all(np.isfinite(p)) or np.any((p < 0) | (p > 1)):
        raise ValueError("p_yes must lie in [0, 1]")
    return np.stack([p, 1.0 - p], axis=1), np.where(y, 0, 1).astype(np.int64)


# --------------------------------------------------------------------------- basic metrics


def predictions(probs: ProbRows) -> np.ndarray:
    """Argmax per row (ties: lowest index)."""
    mat, _ = _as_matrix(probs)
    return mat.argmax(axis=1)


def confidences(probs: ProbRows) -> np.ndarray:
    """Top probability per row."""
    mat, _ = _as_matrix(probs)
    return mat.max(axis=1)


def _correct(mat: np.ndarray, gold: np.ndarray) -> np.ndarray:
    return mat.argmax(axis=1) == gold


def accuracy(probs: ProbRows, gold) -> float:
    """Fraction of rows whose argmax (ties: lowest index) is the gold option."""
    mat, _, g = _prepare(probs, gold)
    return float(_correct(mat, g).mean())


def accuracy_by_family(probs: ProbRows, gold, families: Sequence[str]) -> dict[str, float]:
    """Accuracy within each task family, keyed by family name (sorted)."""
    mat, _, g = _prepare(probs, gold)
    fam = np.asarray([str(f) for f in families])
    if fam.shape[0] != mat.shape[0]:
        raise ValueError(f"families must have one entry per row ({mat.shape[0]}), got {fam.shape[0]}")
    correct = _correct(mat, g)
    return {str(f): float(correct[fam == f].mean()) for f in sorted(set(fam.tolist()))}


def macro_accuracy(probs: ProbRows, gold, families: Sequence[str]) -> float:
    """Unweighted mean of the per-family accuracies (each task family counts once)."""
    return float(np.mean(list(accuracy_by_family(probs, gold, families).values())))


def _bin_index(conf: np.ndarray, n_bins: int) -> np.ndarray:
    # Edges b / n_bins computed by exact division (0.3 is 3/10, not 0.30000000000000004).
    edges = np.arange(n_bins + 1, dtype=np.float64) / n_bins
    idx = np.searchsorted(edges, conf, side="left") - 1  # right-closed bins
    return np.clip(idx, 0, n_bins - 1)


def reliability_bins(probs: ProbRows, gold, n_bins: int = 10) -> list[dict[str, Any]]:
    """Per confidence bin: ``lower``, ``upper``, ``count``, mean ``confidence``, ``accuracy``.

    All ``n_bins`` bins are returned in order; empty bins have ``count`` 0 and ``None`` for
    the two means.
    """
    if n_bins < 1:
        raise ValueError("n_bins must be >= 1")
    mat, _, g = _prepare(probs, gold)
    conf = mat.max(axis=1)
    correct = _correct(mat, g)
    idx = _bin_index(conf, n_bins)
    out = []
    for b in range(n_bins):
        m = idx == b
        n = int(m.sum())
        out.append(
            {
                "lower": b / n_bins,
                "upper": (b + 1) / n_bins,
                "count": n,
                "confidence": float(conf[m].mean()) if n else None,
                "accuracy": float(correct[m].mean()) if n else None,
            }
        )
    return out


def ece(probs: ProbRows, gold, n_bins: int = 10) -> float:
    """Expected calibration error: ``sum_b (count_b / N) * |accuracy_b - confidence_b|``
    over :func:`reliability_bins` (10 equal-width bins on the top probability by default)."""
    bins = reliability_bins(probs, gold, n_bins)
    total = sum(b["count"] for b in bins)
    return float(sum(b["count"] / total * abs(b["accuracy"] - b["confidence"]) for b in bins if b["count"]))


def ece_floor(probs: ProbRows, n_bins: int = 10, draws: int = 2000, seed: int = 0) -> dict[str, float]:
    """The ECE a *perfectly calibrated* model with these confidences would show on this many rows.

    ECE is biased upward on a finite sample: even when every row's top answer is right with
    probability exactly its confidence, each bin's accuracy scatters around its mean confidence by
    about ``sqrt(c (1 - c) / count)``. With mid-range confidences that floor is ~0.05 on 250 rows,
    so an ECE bar near it cannot be judged on such a sample. Each draw keeps the rows' confidences
    and draws "correct" as Bernoulli(confidence); returns the ``mean`` and the ``p95`` of the
    draws' ECE (the level a calibrated model exceeds one time in twenty). Gold is not needed.
    """
    mat, _ = _as_matrix(probs)
    conf = mat.max(axis=1)
    idx = _bin_index(conf, n_bins)
    counts = np.bincount(idx, minlength=n_bins).astype(np.float64)
    mean_conf = np.bincount(idx, weights=conf, minlength=n_bins) / np.maximum(counts, 1.0)
    rng = np.random.default_rng(seed)
    # one draw per row: (draws, n) Bernoulli outcomes, summed per bin
    hits = rng.random((draws, conf.size)) < conf
    per_bin = np.stack([hits[:, idx == b].sum(axis=1) for b in range(n_bins)], axis=1)
    gaps = np.abs(per_bin - counts * mean_conf) / conf.size  # count_b/N * |acc_b - conf_b|
    e = gaps.sum(axis=1)
    return {"mean": float(e.mean()), "p95": float(np.percentile(e, 95)), "draws": draws}


def brier(probs: ProbRows, gold) -> float:
    """Multiclass Brier: mean over rows of ``sum_k (p_k - onehot(gold)_k)^2`` (range [0, 2])."""
    mat, _, g = _prepare(probs, gold)
    onehot = np.zeros_like(mat)
    onehot[np.arange(mat.shape[0]), g] = 1.0
    return float(((mat - onehot) ** 2).sum(axis=1).mean())


def nll_terms(p_gold: Sequence[float] | np.ndarray) -> np.ndarray:
    """Per-row NLL from the probability given to the gold option: ``-ln max(p_gold, NLL_FLOOR)``.

    The single definition behind :func:`nll`; exposed for callers that already hold the gold
    probabilities (the temperature fit evaluates it many times)."""
    return -np.log(np.maximum(np.asarray(p_gold, dtype=np.float64), NLL_FLOOR))


def nll(probs: ProbRows, gold, weights: Sequence[float] | np.ndarray | None = None) -> float:
    """Mean negative log-likelihood of the gold option, natural log, ``p_gold`` floored at
    ``NLL_FLOOR``. With ``weights``, the weighted mean ``sum w_i nll_i / sum w_i``."""
    mat, _, g = _prepare(probs, gold)
    w = _weights(weights, mat.shape[0])
    terms = nll_terms(mat[np.arange(mat.shape[0]), g])
    return float(np.sum(w * terms) / w.sum())


def selective_accuracy(probs: ProbRows, gold, thresholds: Sequence[float] = DEFAULT_THRESHOLDS) -> list[dict[str, Any]]:
    """For each threshold: keep rows with ``confidence >= threshold`` and report
    ``{"threshold", "n", "coverage", "accuracy"}`` (accuracy ``None`` when nothing is kept)."""
    mat, _, g = _prepare(probs, gold)
    conf = mat.max(axis=1)
    correct = _correct(mat, g)
    out = []
    for t in thresholds:
        keep = conf >= t
        n = int(keep.sum())
        out.append(
            {
                "threshold": float(t),
                "n": n,
                "coverage": n / mat.shape[0],
                "accuracy": float(correct[keep].mean()) if n else None,
            }
        )
    return out


# --------------------------------------------------------------------------- position bias


def per_position_recall(probs: ProbRows, gold) -> dict[int, float]:
    """Recall of each gold position: among rows whose gold option sits at position ``j``,
    the fraction predicted correctly. Only positions that hold the gold at least once appear.

    Input design (position-bias probe): one row per (item, placement), where the same item is
    presented with its gold option moved to each position in turn (e.g. all cyclic shifts of
    the options) and ``gold`` is the gold option's position in that presentation. Then every
    position has equal support and differences in recall are due to position alone.
    """
    mat, _, g = _prepare(probs, gold)
    correct = _correct(mat, g)
    return {int(j): float(correct[g == j].mean()) for j in np.unique(g)}


def position_bias_rstd(probs: ProbRows, gold) -> float:
    """RStd (Zheng et al., 2023): population standard deviation (ddof=0) of
    :func:`per_position_recall` across gold positions, as a fraction (x100 for percent).
    0 means no position bias. Needs at least one row; with one position it is 0."""
    rec = np.array(list(per_position_recall(probs, gold).values()))
    return float(rec.std())


# --------------------------------------------------------------------------- agreement


def agreement(probs_a: ProbRows, probs_b: ProbRows) -> dict[str, Any]:
    """Agreement between two readouts of the same rows (same option count row by row):
    ``argmax_agreement`` (fraction of rows with the same argmax, ties to lowest index) and
    ``mean_tv`` (mean total-variation distance ``0.5 * sum_k |a_k - b_k|``, in [0, 1])."""
    a, la = _as_matrix(probs_a)
    b, lb = _as_matrix(probs_b)
    if la.shape != lb.shape or np.any(la != lb):
        raise ValueError("the two readouts must have the same number of rows and options per row")
    width = max(a.shape[1], b.shape[1])
    a = np.pad(a, ((0, 0), (0, width - a.shape[1])))
    b = np.pad(b, ((0, 0), (0, width - b.shape[1])))
    return {
        "n": int(a.shape[0]),
        "argmax_agreement": float((a.argmax(axis=1) == b.argmax(axis=1)).mean()),
        "mean_tv": float((0.5 * np.abs(a - b).sum(axis=1)).mean()),
    }


# --------------------------------------------------------------------------- bundles / plots


def summarize(
    probs: ProbRows,
    gold,
    families: Sequence[str] | None = None,
    *,
    n_bins: int = 10,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
) -> dict[str, Any]:
    """All per-task metrics in one JSON-ready dict (what the harness writes per task)."""
    out: dict[str, Any] = {
        "n": len(probs),
        "accuracy": accuracy(probs, gold),
        "ece": ece(probs, gold, n_bins),
        "brier": brier(probs, gold),
        "nll": nll(probs, gold),
        "selective": selective_accuracy(probs, gold, thresholds),
        "reliability": reliability_bins(probs, gold, n_bins),
    }
    if families is not None:
        out["accuracy_by_family"] = accuracy_by_family(probs, gold, families)
        out["macro_accuracy"] = float(np.mean(list(out["accuracy_by_family"].values())))
    return out


def reliability_diagram_png(
    bins: Sequence[Mapping[str, Any]], path: str | Path, title: str | None = None
) -> Path | None:
    """Draw :func:`reliability_bins` output as a PNG at ``path``.

    matplotlib is optional: returns ``None`` (and writes nothing) when it is not installed,
    otherwise the written path. Uses the object-oriented API with the Agg canvas, so it never
    touches pyplot's global state and is safe in a server or a worker thread.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("PNG plot skipped: matplotlib is not installed (pip install 'lev-jax[plot]')", stacklevel=2)
        return None
    bins = list(bins)
    if not bins:
        raise ValueError("no bins")
    total = sum(int(b["count"]) for b in bins)
    fig = Figure(figsize=(4.5, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = bins[0]["upper"] - bins[0]["lower"]
    filled = [b for b in bins if b["count"]]
    ax.bar(
        [b["lower"] for b in filled],
        [b["accuracy"] for b in filled],
        width=width,
        align="edge",
        edgecolor="black",
        color="tab:blue",
        alpha=0.8,
        label="accuracy",
    )
    ax.plot(
        [b["confidence"] for b in filled],
        [b["confidence"] for b in filled],
        "o",
        color="tab:red",
        markersize=4,
        label="mean confidence",
    )
    ax.plot([0, 1], [0, 1], "--", color="gray", linewidth=1)
    gap = sum(b["count"] / total * abs(b["accuracy"] - b["confidence"]) for b in filled) if total else math.nan
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence (top probability)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{title + ' - ' if title else ''}ECE {gap:.3f}, n={total}", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
