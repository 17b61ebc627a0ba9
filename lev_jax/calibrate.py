"""Temperature scaling for label-token readouts (step 2 of the method).

A temperature ``T`` divides the logits of a readout before the softmax. There is one ``T``
per **bucket** ``(question type, readout mode)``, and for ``choice`` questions one per
option-count **band** as well (small <= 8, mid 9-26, large > 26).

Rows
----
A :class:`CalibrationRow` is one answered calibration question:

* ``logits`` - the readout's logits over the offered candidates, in the candidates' canonical
  (offered) order. For an order-averaged readout, a list of such arrays (or a 2-D array,
  ``(n_orderings, n_options)``), one per presentation order, each already mapped back to the canonical
  order; the temperature is applied to each ordering, each is soft-maxed, and the probabilities are
  averaged (exactly what predict() does, see :func:`readout`).
* ``gold`` - the correct candidate's index (``choice`` and other categorical types), or a
  ``bool`` for ``noul`` (yes/no) questions.
* ``qtype``, ``mode`` - the question type and readout mode, e.g. ``("choice", "letter")``,
  ``("noul", "binary")``, ``("noul", "rating")``.
* ``family`` - the task family (dataset/task name) the row comes from.
* ``n_options`` - the number of offered candidates (defaults to the logits' length).
* ``split`` - optionally, the name of the split the row was drawn from (checked like ``splits``).

Noul (yes/no) readouts
----------------------
* ``mode="binary"``: logits over the two answer tokens in the order ``[yes, no]``;
  ``P(yes) = softmax(logits / T)[0]``.
* ``mode="rating"``: logits over 9 rating codes ``0..8``;
  ``P(yes) = sum_i (i / 8) * softmax(logits / T)_i``.

Binary and rating are separate buckets. Noul rows are fitted with the Bernoulli NLL of
``P(yes)`` against the boolean gold, ``-[y ln p + (1 - y) ln(1 - p)]``, which is the
categorical NLL of the 2-class row ``{p, 1 - p}`` - the same row :mod:`lev_jax.metrics`
scores, so fitting and evaluation agree.

Fitting (:func:`fit`)
---------------------
* Every row goes to its bucket; a ``choice`` row goes both to its band bucket and to the
  unbanded ``(choice, mode)`` bucket (the fallback for bands never seen in fitting).
* A bucket with fewer than ``min_rows`` (50) rows is **recorded** with ``T = 1`` and status
  ``too_few_rows``: it is never fitted on noise and never borrows another bucket's scalar.
* Otherwise ``log T`` is chosen in ``[-3, 3]`` (``T`` in ~[0.05, 20]) by minimising the mean
  NLL, twice: every row weighted equally (``row``), and every task family weighted equally
  (``family``: row weight ``1 / rows in its family``). The minimiser tabulates the NLL on a
  121-point grid over the whole interval (step 0.05 in log T) and refines the best grid point
  by golden-section search between its neighbours (to 1e-5 in log T), so it is robust to the
  non-convex objectives of order-averaged and rating readouts. The grid table is per family,
  so every leave-one-family-out fold reuses it (refined by parabolic interpolation) instead of
  re-scoring the data.
* The fit kept is the one with the lower **leave-one-family-out ECE**: for each family, ``T`` is
  fitted (same weighting) on the other families and applied to the held-out family; the
  held-out predictions of all folds are pooled and scored with :func:`lev_jax.metrics.ece`.
  Ties go to ``row``. With fewer than 3 families there is no meaningful held-out comparison,
  so the ``row`` fit is kept without one.
* :func:`fit` refuses split names that say test / eval / holdout (see
  :func:`forbidden_split_reason`).

Lookup (:meth:`Calibration.temperature`)
----------------------------------------
band bucket (if present in the profile, fitted or ``too_few_rows``) -> unbanded
``(qtype, mode)`` bucket (if present) -> identity ``T = 1``.

Files (:meth:`Calibration.save`)
--------------------------------
``<dir>/calibration.json`` (beside the weights) and ``<dir>/calibration_report.md``. If a
``calibration.json`` already exists it is **rotated**, not overwritten: renamed to
``calibration.<fit date of the old file, YYYYmmddTHHMMSSZ>.json`` (with ``-1``, ``-2``... if
that name is taken), and its report is renamed with the same stamp.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import re
import shutil
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lev_jax import durable, metrics
from lev_jax.domain import (
    BAND_RANGES,
    BANDED_QTYPES,
    BANDS,
    BINARY,
    NOUL,
    RATING,
    RATING_LEVELS,
    RATING_WEIGHTS,
    band_of,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CALIBRATION_FILE",
    "REPORT_FILE",
    "MIN_ROWS",
    "LOG_T_BOUNDS",
    "bucket_key",
    "forbidden_split_reason",
    "check_split_name",
    "softmax",
    "rating_p_yes",
    "readout",
    "CalibrationRow",
    "Calibration",
    "fit",
]

FORMAT = "lev-jax/calibration"
FORMAT_VERSION = 1
CALIBRATION_FILE = "calibration.json"
REPORT_FILE = "calibration_report.md"

MIN_ROWS = 50
LOG_T_BOUNDS = (-3.0, 3.0)
ECE_BINS = 10

_GRID_POINTS = 121  # log T step 0.05 over [-3, 3]
_GOLDEN_TOL = 1e-5
_AT_BOUND_TOL = 1e-3


# --------------------------------------------------------------------------- buckets


def bucket_key(qtype: str, mode: str, band: str | None = None) -> str:
    """Human-readable bucket name: ``"choice/letter/small"``, ``"noul/rating"``."""
    return f"{qtype}/{mode}" if band is None else f"{qtype}/{mode}/{band}"


def _check_type_mode(qtype: str, mode: str) -> None:
    if not qtype or not mode or "/" in qtype or "/" in mode:
        raise ValueError(f"qtype and mode must be non-empty strings without '/', got {qtype!r}, {mode!r}")
    if qtype == NOUL and mode not in (BINARY, RATING):
        raise ValueError(f"noul readout mode must be {BINARY!r} or {RATING!r}, got {mode!r}")


# --------------------------------------------------------------------------- split guard

# A split name is cut into word tokens (camelCase, '-', '_', '.', '/', spaces and digits all
# separate words) and refused if a token, or two adjacent tokens, name held-out data. Whole
# tokens only: "contest", "attestation", "retest" or "medieval" pass; "banking77-test",
# "clinc_eval", "holdout-2", "TestSet", "held out" do not. "val"/"validation"/"dev" are
# allowed: the issue's own calibration splits include CLINC150 val.
_FORBIDDEN_TOKENS = frozenset(
    {"test", "tests", "testing", "testset", "eval", "evals", "evaluation", "evalset", "holdout", "holdouts", "heldout"}
)
_FORBIDDEN_PAIRS = frozenset({("held", "out"), ("hold", "out")})


def _split_tokens(name: str) -> list[str]:
    spaced = re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", " ", name)
    return [t for t in re.split(r"[^a-z]+", spaced.lower()) if t]


def forbidden_split_reason(name: str) -> str | None:
    """Why ``name`` may not be used for fitting, or ``None`` if it may."""
    tokens = _split_tokens(str(name))
    for t in tokens:
        if t in _FORBIDDEN_TOKENS:
            return (
                f"split {name!r} looks like held-out data (word {t!r}); calibrate on calibration/train/val splits only"
            )
    for pair in zip(tokens, tokens[1:]):
        if pair in _FORBIDDEN_PAIRS:
            return (
                f"split {name!r} looks like held-out data (words {' '.join(pair)!r}); "
                "calibrate on calibration/train/val splits only"
            )
    return None


def check_split_name(name: str) -> None:
    """Raise ``ValueError`` (with the reason) if ``name`` says test / eval / holdout."""
    reason = forbidden_split_reason(name)
    if reason is not None:
        raise ValueError(reason)


# --------------------------------------------------------------------------- readout maths


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax (``-inf`` entries get probability 0)."""
    x = np.asarray(x, dtype=np.float64)
    z = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def rating_p_yes(probs: np.ndarray) -> np.ndarray | float:
    """``P(yes) = sum_i (i / 8) * p_i`` over the 9 rating codes (last axis)."""
    p = np.asarray(probs, dtype=np.float64)
    if p.shape[-1] != RATING_LEVELS:
        raise ValueError(f"a rating readout has {RATING_LEVELS} codes, got {p.shape[-1]}")
    out = (p * RATING_WEIGHTS).sum(axis=-1)
    return float(out) if np.ndim(out) == 0 else out


def _orderings(logits) -> list[np.ndarray]:
    """One 1-D float64 array per ordering."""
    if isinstance(logits, (list, tuple)) and logits and np.ndim(logits[0]) == 1:
        arrs = [np.asarray(a, dtype=np.float64) for a in logits]
    elif np.ndim(logits) == 2:  # stacked orderings, (n_orderings, n_options)
        arrs = list(np.asarray(logits, dtype=np.float64))
    else:
        arrs = [np.asarray(logits, dtype=np.float64)]
    for a in arrs:
        if a.ndim != 1 or a.shape[0] < 1:
            raise ValueError(f"logits must be 1-D and non-empty, got shape {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError("logits must be finite")
    if any(a.shape != arrs[0].shape for a in arrs):
        raise ValueError("every ordering must have the same number of logits")
    return arrs


def readout(logits, qtype: str, mode: str, temperature: float = 1.0, maps=None) -> np.ndarray | float:
    """The calibrated answer distribution of one readout: what predict() applies and what
    calibration is fitted and evaluated with.

    ``logits``: a 1-D array, or a list of per-ordering 1-D arrays, in canonical order, or, with
    ``maps`` (per ordering: code position -> candidate index), in each ordering's presentation
    order as read from the model. Each ordering is divided by ``temperature`` and soft-maxed (in
    the order it was read), mapped to canonical order, and the probabilities are averaged.
    Returns the probability vector over candidates, or for ``noul`` the float ``P(yes)``.
    """
    _check_type_mode(qtype, mode)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    arrs = _orderings(logits)
    ps = [softmax(a / temperature) for a in arrs]
    if maps is not None:
        if len(maps) != len(ps) or any(len(m) != len(p) for m, p in zip(maps, ps)):
            raise ValueError("maps must give one candidate index per logit of every ordering")
        canonical = []
        for m, p_read in zip(maps, ps):
            p_canon = np.zeros(len(m))
            p_canon[np.asarray(m)] = p_read
            canonical.append(p_canon)
        ps = canonical
    p = np.mean(ps, axis=0)
    if qtype != NOUL:
        return p
    if mode == BINARY:
        if p.shape[0] != 2:
            raise ValueError(f"a binary noul readout has 2 logits [yes, no], got {p.shape[0]}")
        return float(p[0])
    return rating_p_yes(p)


# --------------------------------------------------------------------------- rows


@dataclasses.dataclass(frozen=True)
class CalibrationRow:
    """One calibration question's readout; see the module docstring."""

    logits: Any
    gold: int | bool
    qtype: str
    mode: str
    family: str
    n_options: int | None = None
    split: str | None = None

    def __post_init__(self) -> None:
        _check_type_mode(self.qtype, self.mode)
        arrs = tuple(_orderings(self.logits))
        object.__setattr__(self, "logits", arrs)
        k = arrs[0].shape[0]
        if self.qtype == NOUL:
            if not isinstance(self.gold, (bool, np.bool_)):
                raise ValueError(f"noul gold must be a bool, got {self.gold!r}")
            need = 2 if self.mode == BINARY else RATING_LEVELS
            if k != need:
                raise ValueError(f"a noul {self.mode} readout has {need} logits, got {k}")
            object.__setattr__(self, "gold", bool(self.gold))
            if self.n_options is None:
                object.__setattr__(self, "n_options", 2)
        else:
            if isinstance(self.gold, (bool, np.bool_)) or not isinstance(self.gold, (int, np.integer)):
                raise ValueError(f"{self.qtype} gold must be an option index, got {self.gold!r}")
            n = k if self.n_options is None else int(self.n_options)
            if n != k:
                raise ValueError(f"n_options={n} but the logits cover {k} options")
            if not 0 <= int(self.gold) < k:
                raise ValueError(f"gold {self.gold} outside {k} options")
            object.__setattr__(self, "gold", int(self.gold))
            object.__setattr__(self, "n_options", n)
        if not self.family:
            raise ValueError("family must be a non-empty task/family name")

    @property
    def band(self) -> str | None:
        return band_of(self.n_options) if self.qtype in BANDED_QTYPES else None


class _Packed:
    """A bucket's rows grouped by option count, so one temperature is scored in a few numpy
    passes over the real logits (no padding to the widest row)."""

    def __init__(self, rows: Sequence[CalibrationRow]):
        self.n = len(rows)
        self.noul_mode = rows[0].mode if rows[0].qtype == NOUL else None
        if self.noul_mode is not None:
            self.gold = np.array([0 if r.gold else 1 for r in rows], dtype=np.int64)  # index in {p, 1-p}
        else:
            self.gold = np.array([r.gold for r in rows], dtype=np.int64)
        names, self.fam = np.unique(np.array([r.family for r in rows], dtype=object).astype(str), return_inverse=True)
        self.families = [str(x) for x in names]
        self.fam_sizes = np.bincount(self.fam, minlength=len(names)).astype(np.float64)
        self.width = max(r.logits[0].shape[0] for r in rows)
        by_width: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_width.setdefault(r.logits[0].shape[0], []).append(i)
        # one block per option count: row ids, stacked per-ordering logits, first line of each
        # row, orderings per row, and each line's gold column
        self.blocks = []
        for _, ids in sorted(by_width.items()):
            counts = np.array([len(rows[i].logits) for i in ids], dtype=np.int64)
            lines = np.stack([a for i in ids for a in rows[i].logits])
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
            ids = np.array(ids, dtype=np.int64)
            self.blocks.append((ids, lines, starts, counts, np.repeat(self.gold[ids], counts)))

    @staticmethod
    def _avg_softmax(lines, starts, counts, t):
        return np.add.reduceat(softmax(lines / t), starts, axis=0) / counts[:, None]

    def _p_yes(self, p: np.ndarray) -> np.ndarray:
        p_yes = p[:, 0] if self.noul_mode == BINARY else rating_p_yes(p)
        return np.clip(p_yes, 0.0, 1.0)

    def p_gold(self, t: float) -> np.ndarray:
        """Probability of the gold answer per row at temperature ``t``."""
        out = np.empty(self.n)
        for ids, lines, starts, counts, gline in self.blocks:
            if self.noul_mode is None:
                z = lines / t
                m = z.max(axis=1)
                lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
                p_line = np.exp(z[np.arange(z.shape[0]), gline] - lse)
                out[ids] = np.add.reduceat(p_line, starts) / counts
            else:
                p_yes = self._p_yes(self._avg_softmax(lines, starts, counts, t))
                out[ids] = np.where(self.gold[ids] == 0, p_yes, 1.0 - p_yes)
        return out

    def probs(self, t: float) -> np.ndarray:
        """Rows as the metrics score them: averaged probabilities (zero-padded to the widest
        row; padding changes no metric), or ``{p, 1-p}`` for noul."""
        out = np.zeros((self.n, 2 if self.noul_mode else self.width))
        for ids, lines, starts, counts, _ in self.blocks:
            p = self._avg_softmax(lines, starts, counts, t)
            if self.noul_mode is None:
                out[ids, : p.shape[1]] = p
            else:
                p_yes = self._p_yes(p)
                out[ids, 0], out[ids, 1] = p_yes, 1.0 - p_yes
        return out

    def row_weights(self, scheme: str) -> np.ndarray:
        return np.ones(self.n) if scheme == "row" else 1.0 / self.fam_sizes[self.fam]

    def nll(self, t: float, weights: np.ndarray | None = None) -> float:
        terms = metrics.nll_terms(self.p_gold(t))
        return float(terms.mean() if weights is None else np.sum(weights * terms) / weights.sum())

    def ece(self, t: float) -> float:
        return metrics.ece(self.probs(t), self.gold, ECE_BINS)


# --------------------------------------------------------------------------- fitting


def _golden(f, a: float, b: float, tol: float = _GOLDEN_TOL) -> tuple[float, float]:
    """Golden-section search for a minimum of ``f`` on ``[a, b]``: ``(x, f(x))``."""
    invphi = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - invphi * (b - a), a + invphi * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - invphi * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + invphi * (b - a)
            fd = f(d)
    return (c, fc) if fc <= fd else (d, fd)


def _parabolic_argmin(grid: np.ndarray, vals: np.ndarray) -> float:
    """Grid argmin refined by the vertex of the parabola through it and its two neighbours."""
    i = int(np.argmin(vals))
    if i == 0 or i == len(grid) - 1:
        return float(grid[i])
    y0, y1, y2 = vals[i - 1], vals[i], vals[i + 1]
    curv = y0 - 2.0 * y1 + y2
    if not curv > 0:
        return float(grid[i])
    h = grid[1] - grid[0]
    return float(np.clip(grid[i] + 0.5 * h * (y0 - y2) / curv, grid[i - 1], grid[i + 1]))


class _BucketFitter:
    """Temperature fits of one bucket under both weightings, and their LOFO-ECE comparison.

    The NLL of every family is tabulated once on a grid of log T (``_GRID_POINTS`` points over
    the bounds). Any weighting of any subset of families is then a cheap combination of the
    table: the full fits take its argmin and refine it by golden-section search on the exact
    objective; the leave-one-family-out folds refine it by parabolic interpolation.
    """

    def __init__(self, packed: _Packed, bounds: tuple[float, float]):
        self.packed = packed
        self.lo, self.hi = bounds
        self.grid = np.linspace(self.lo, self.hi, _GRID_POINTS)
        n_fam = len(packed.families)
        self.table = np.empty((_GRID_POINTS, n_fam))  # sum of row NLLs per (log T, family)
        for g, u in enumerate(self.grid):
            terms = metrics.nll_terms(packed.p_gold(math.exp(u)))
            self.table[g] = np.bincount(packed.fam, weights=terms, minlength=n_fam)

    def _grid_objective(self, scheme: str, keep: np.ndarray) -> np.ndarray:
        sizes = self.packed.fam_sizes[keep]
        if scheme == "row":
            return self.table[:, keep].sum(axis=1) / sizes.sum()
        return (self.table[:, keep] / sizes).sum(axis=1) / keep.sum()

    def fit(self, scheme: str) -> float:
        keep = np.ones(len(self.packed.families), dtype=bool)
        vals = self._grid_objective(scheme, keep)
        i = int(np.argmin(vals))
        w = self.packed.row_weights(scheme)
        a, b = self.grid[max(i - 1, 0)], self.grid[min(i + 1, len(self.grid) - 1)]
        u, fu = _golden(lambda x: self.packed.nll(math.exp(x), w), a, b)
        return math.exp(u if fu < vals[i] else float(self.grid[i]))

    def lofo_ece(self, scheme: str) -> float:
        """Pooled ECE of every family's rows under a temperature fitted without that family."""
        probs = np.empty((self.packed.n, 2 if self.packed.noul_mode else self.packed.width))
        for f in range(len(self.packed.families)):
            keep = np.arange(len(self.packed.families)) != f
            t = math.exp(_parabolic_argmin(self.grid, self._grid_objective(scheme, keep)))
            held = self.packed.fam == f
            probs[held] = self.packed.probs(t)[held]
        return metrics.ece(probs, self.packed.gold, ECE_BINS)


def _fit_bucket(qtype: str, mode: str, band: str | None, rows: Sequence[CalibrationRow], min_rows: int, bounds) -> dict:
    packed = _Packed(rows)
    families = Counter(r.family for r in rows)
    rec: dict[str, Any] = {
        "key": bucket_key(qtype, mode, band),
        "qtype": qtype,
        "mode": mode,
        "band": band,
        "n_rows": len(rows),
        "n_families": len(families),
        "families": dict(sorted(families.items())),
        "ece_before": packed.ece(1.0),
        "nll_before": packed.nll(1.0),
    }
    if len(rows) < min_rows:
        rec.update(
            temperature=1.0,
            status="too_few_rows",
            weighting=None,
            selection=None,
            temperature_row=None,
            temperature_family=None,
            lofo_ece=None,
            at_bound=False,
        )
    else:
        fitter = _BucketFitter(packed, bounds)
        t_row, t_fam = fitter.fit("row"), fitter.fit("family")
        if len(families) < 3:
            weighting, selection, lofo = "row", "fewer_than_3_families", None
        else:
            lofo = {"row": fitter.lofo_ece("row"), "family": fitter.lofo_ece("family")}
            weighting = "family" if lofo["family"] < lofo["row"] else "row"
            selection = "lofo_ece"
        t = t_row if weighting == "row" else t_fam
        u = math.log(t)
        rec.update(
            temperature=t,
            status="fitted",
            weighting=weighting,
            selection=selection,
            temperature_row=t_row,
            temperature_family=t_fam,
            lofo_ece=lofo,
            at_bound=bool(min(u - bounds[0], bounds[1] - u) < _AT_BOUND_TOL),
        )
    rec["ece_after"] = packed.ece(rec["temperature"])
    rec["nll_after"] = packed.nll(rec["temperature"])
    return rec


def fit(
    rows: Iterable[CalibrationRow],
    *,
    splits: Sequence[str],
    model_id: str,
    min_rows: int = MIN_ROWS,
    log_t_bounds: tuple[float, float] = LOG_T_BOUNDS,
    fit_date: _dt.datetime | None = None,
) -> Calibration:
    """Fit one temperature per bucket on calibration rows; see the module docstring.

    ``splits`` names the splits the rows were drawn from (e.g. ``["banking77-train",
    "clinc150-val"]``); any name (or any ``row.split``) that says test / eval / holdout raises
    ``ValueError`` before anything is fitted. ``model_id`` identifies the weights the profile
    belongs to and is recorded (and can be checked on load).
    """
    if isinstance(splits, str):
        splits = [splits]
    rows = list(rows)
    row_splits = Counter(r.split for r in rows if r.split is not None)
    names = list(dict.fromkeys([*splits, *row_splits]))
    if not names:
        raise ValueError("fit() needs the names of the splits the rows come from (splits=...)")
    for name in names:
        check_split_name(name)
    if not rows:
        raise ValueError("no calibration rows")
    if min_rows < 1:
        raise ValueError("min_rows must be >= 1")
    lo, hi = float(log_t_bounds[0]), float(log_t_bounds[1])
    if not lo < 0 < hi:
        raise ValueError(f"log_t_bounds must contain 0, got {log_t_bounds}")

    groups: dict[tuple[str, str, str | None], list[CalibrationRow]] = {}
    for r in rows:
        groups.setdefault((r.qtype, r.mode, None), []).append(r)
        if r.band is not None:
            groups.setdefault((r.qtype, r.mode, r.band), []).append(r)
    band_order = {None: 0, "small": 1, "mid": 2, "large": 3}
    keys = sorted(groups, key=lambda k: (k[0], k[1], band_order[k[2]]))
    buckets = [_fit_bucket(q, m, b, groups[(q, m, b)], min_rows, (lo, hi)) for q, m, b in keys]

    when = (fit_date or _dt.datetime.now(_dt.UTC)).astimezone(_dt.UTC)
    doc = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model_id": str(model_id),
        "fit_date": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "fitted_on": {
            "splits": names,
            "rows_per_split": dict(row_splits) if row_splits else None,
            "n_rows": len(rows),
            "families": dict(sorted(Counter(r.family for r in rows).items())),
        },
        "settings": {
            "min_rows": min_rows,
            "log_t_bounds": [lo, hi],
            "objective": "mean NLL (noul: Bernoulli NLL of P(yes)); row- and family-weighted",
            "selection": "lower leave-one-family-out ECE; row-weighted if fewer than 3 families",
            "ece_bins": ECE_BINS,
            "bands": {band: list(BAND_RANGES[band]) for band in BANDS},
            "banded_qtypes": sorted(BANDED_QTYPES),
            "rating_p_yes": "sum_i (i/8) p_i over 9 codes",
            "binary_logit_order": ["yes", "no"],
        },
        "buckets": buckets,
    }
    return Calibration(doc)


# --------------------------------------------------------------------------- the profile


def _fmt(x: float | None, nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


class Calibration:
    """A calibration profile: per-bucket temperatures plus what they were fitted on.

    ``Calibration.identity()`` is the uncalibrated profile (every ``T = 1``).
    """

    def __init__(self, doc: Mapping[str, Any]):
        if doc.get("format") != FORMAT:
            raise ValueError(f"not a calibration profile (format {doc.get('format')!r}, expected {FORMAT!r})")
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"unsupported calibration profile version {doc.get('version')!r}")
        self._doc = json.loads(json.dumps(doc))  # deep, JSON-clean copy
        self._temps: dict[tuple[str, str, str | None], float] = {}
        for b in self._doc.get("buckets", []):
            t = float(b["temperature"])
            if not (t > 0 and math.isfinite(t)):
                raise ValueError(f"bucket {b.get('key')!r} has an invalid temperature {b['temperature']!r}")
            if b.get("band") not in (None, "small", "mid", "large"):
                raise ValueError(f"bucket {b.get('key')!r} has an unknown band {b.get('band')!r}")
            self._temps[(b["qtype"], b["mode"], b.get("band"))] = t
        self.path: Path | None = None

    # ---- construction / IO

    @classmethod
    def identity(cls, model_id: str | None = None) -> Calibration:
        return cls(
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "model_id": model_id,
                "fit_date": None,
                "fitted_on": None,
                "buckets": [],
            }
        )

    @classmethod
    def load(cls, path: str | Path, *, model_id: str | None = None) -> Calibration:
        """Load ``path`` (a ``calibration.json`` or the directory holding it). With
        ``model_id``, raise ``ValueError`` if the profile was fitted for a different model."""
        p = Path(path)
        if p.is_dir():
            p = p / CALIBRATION_FILE
        cal = cls(json.loads(p.read_text(encoding="utf-8")))
        if model_id is not None and cal.model_id != model_id:
            raise ValueError(f"{p} was fitted for model {cal.model_id!r}, not {model_id!r}")
        cal.path = p
        return cal

    @classmethod
    def load_or_identity(cls, path: str | Path | None, *, model_id: str | None = None) -> Calibration:
        """Like :meth:`load`, but the identity profile when there is no calibration file."""
        if path is None:
            return cls.identity(model_id)
        p = Path(path)
        if (p / CALIBRATION_FILE if p.is_dir() else p).exists():
            return cls.load(p, model_id=model_id)
        return cls.identity(model_id)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._doc))

    def to_json(self) -> str:
        return json.dumps(self._doc, indent=2) + "\n"

    def save(self, directory: str | Path) -> Path:
        """Write ``calibration.json`` and ``calibration_report.md`` into ``directory`` (beside
        the weights), rotating an existing profile/report pair instead of overwriting it.
        Returns the path of the new ``calibration.json``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        target, report = d / CALIBRATION_FILE, d / REPORT_FILE
        if target.exists():
            base = _stamp_of(target)
            stamp, i = base, 0
            while (d / f"calibration.{stamp}.json").exists() or (d / f"calibration_report.{stamp}.md").exists():
                i += 1
                stamp = f"{base}-{i}"
            # copied, not moved: the old profile stays in place until the new one replaces it whole,
            # so a save that fails (a full disk) leaves a calibration, never none
            shutil.copy2(target, d / f"calibration.{stamp}.json")
            if report.exists():
                shutil.copy2(report, d / f"calibration_report.{stamp}.md")
        _atomic_write(target, self.to_json())
        _atomic_write(report, self.report_markdown())
        self.path = target
        return target

    # ---- lookup / application

    @property
    def model_id(self) -> str | None:
        return self._doc.get("model_id")

    @property
    def fit_date(self) -> str | None:
        return self._doc.get("fit_date")

    @property
    def buckets(self) -> list[dict[str, Any]]:
        return json.loads(json.dumps(self._doc.get("buckets", [])))

    @property
    def is_identity(self) -> bool:
        """True when every lookup returns ``T = 1`` (no profile, or nothing was fitted)."""
        return all(t == 1.0 for t in self._temps.values())

    def resolve(self, qtype: str, mode: str, n_options: int | None = None) -> tuple[str | None, float]:
        """``(bucket key used, T)``: band bucket -> unbanded bucket -> ``(None, 1.0)``.

        ``n_options`` is required for banded question types (``choice``)."""
        _check_type_mode(qtype, mode)
        if qtype in BANDED_QTYPES:
            if n_options is None:
                raise ValueError(f"n_options is required to look up a {qtype!r} temperature")
            band = band_of(n_options)
            if (qtype, mode, band) in self._temps:
                return bucket_key(qtype, mode, band), self._temps[(qtype, mode, band)]
        if (qtype, mode, None) in self._temps:
            return bucket_key(qtype, mode), self._temps[(qtype, mode, None)]
        return None, 1.0

    def temperature(self, qtype: str, mode: str, n_options: int | None = None) -> float:
        return self.resolve(qtype, mode, n_options)[1]

    def apply(self, logits, qtype: str, mode: str, n_options: int | None = None):
        """``logits / T`` for one ordering's logits (numpy or jax array; the type is kept, the
        input returned unchanged when ``T = 1``). ``n_options`` defaults to the last axis."""
        if n_options is None and qtype in BANDED_QTYPES:
            n_options = np.shape(logits)[-1]
        t = self.temperature(qtype, mode, n_options)
        if t == 1.0:
            return logits
        if isinstance(logits, (list, tuple)):
            logits = np.asarray(logits, dtype=np.float64)
        return logits / t

    def readout(self, logits, qtype: str, mode: str, n_options: int | None = None, maps=None) -> np.ndarray | float:
        """Calibrated :func:`readout` (``logits`` one array or a list of per-ordering arrays;
        ``maps`` as there)."""
        arrs = _orderings(logits)
        if n_options is None and qtype in BANDED_QTYPES:
            n_options = arrs[0].shape[0]
        return readout(arrs, qtype, mode, self.temperature(qtype, mode, n_options), maps)

    def describe(self) -> dict[str, Any]:
        """Short JSON-ready status, e.g. for the server's ``/health``."""
        return {
            "calibrated": not self.is_identity,
            "model_id": self.model_id,
            "fit_date": self.fit_date,
            "path": str(self.path) if self.path else None,
            "temperatures": {bucket_key(*k): t for k, t in self._temps.items()},
        }

    def report_markdown(self) -> str:
        d = self._doc
        fo = d.get("fitted_on") or {}
        lines = [
            "# Calibration report",
            "",
            f"- model: `{d.get('model_id')}`",
            f"- fitted: {d.get('fit_date')}",
            f"- splits: {', '.join(fo.get('splits') or []) or '-'}",
            f"- rows: {fo.get('n_rows', 0)}",
            "",
            "ECE (10 equal-width bins) and NLL before (T = 1) and after, on the fitting rows; "
            "LOFO = leave-one-family-out ECE of each weighting (pooled held-out rows).",
            "",
            "| bucket | rows | families | status | weighting | T | ECE before | ECE after | NLL before | NLL after "
            "| LOFO row | LOFO family |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for b in d.get("buckets", []):
            lofo = b.get("lofo_ece") or {}
            lines.append(
                f"| {b['key']} | {b.get('n_rows', '-')} | {b.get('n_families', '-')} | {b.get('status', '-')}"
                f"{' (at bound)' if b.get('at_bound') else ''} | {b.get('weighting') or '-'} | {b['temperature']:.4f} "
                f"| {_fmt(b.get('ece_before'))} | {_fmt(b.get('ece_after'))} | {_fmt(b.get('nll_before'))} "
                f"| {_fmt(b.get('nll_after'))} | {_fmt(lofo.get('row'))} | {_fmt(lofo.get('family'))} |"
            )
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return f"Calibration(model_id={self.model_id!r}, fit_date={self.fit_date!r}, buckets={len(self._temps)})"


def _stamp_of(path: Path) -> str:
    try:
        when = _dt.datetime.strptime(json.loads(path.read_text(encoding="utf-8"))["fit_date"], "%Y-%m-%dT%H:%M:%SZ")
        return when.strftime("%Y%m%dT%H%M%SZ")
    except Exception:
        mtime = _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.UTC)
        return mtime.strftime("%Y%m%dT%H%M%SZ")


def _atomic_write(path: Path, text: str) -> None:
    durable.write_text(path, text)  # fsynced before the rename: a crash leaves the old file or the new
