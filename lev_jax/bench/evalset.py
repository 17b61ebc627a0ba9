"""Eval-set files: reading, checking, sampling, and turning answers into metric rows.

One file per task::

    {"questions": {name: question},
     "items": [{"state": ..., "labels": {name: label}}],
     "meta": {...}}                      # optional: source, split, sampling, ...

* ``questions`` are Jev questions. Noul criteria may be keyed ``yes``/``no`` (the engine's and
  the data pipeline's shape) or ``true``/``false`` (the wire shape); both are accepted and each
  client sends the shape it needs.
* ``labels`` maps question names to the gold answer: the option key (``choice``), the level
  index (``score``) or a bool (``noul``). An item is asked exactly the questions it has labels
  for, so a file can hold many questions (one per multiple-choice item, say) and each item asks
  its own; a file with one question asks it of every item.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lev_jax import metrics

QUESTION_TYPES = ("choice", "score", "noul")


class EvalSetError(ValueError):
    """An eval-set file that does not follow the format."""


@dataclass
class EvalSet:
    task: str
    questions: dict[str, dict]
    items: list[dict]
    meta: dict = field(default_factory=dict)
    path: Path | None = None

    # ---- IO

    @classmethod
    def load(cls, path: str | Path, task: str | None = None) -> EvalSet:
        p = Path(path)
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise EvalSetError(f"{p}: not JSON ({e})") from None
        es = cls.from_dict(doc, task or p.stem)
        es.path = p
        return es

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], task: str) -> EvalSet:
        if (
            not isinstance(doc, Mapping)
            or not isinstance(doc.get("questions"), Mapping)
            or not isinstance(doc.get("items"), list)
        ):
            raise EvalSetError(f"{task}: an eval set is an object with 'questions' (object) and 'items' (array)")
        es = cls(
            task,
            {str(k): dict(v) for k, v in doc["questions"].items()},
            list(doc["items"]),
            dict(doc.get("meta") or {}),
        )
        es.validate()
        return es

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"questions": self.questions, "items": self.items}
        if self.meta:
            out["meta"] = self.meta
        return out

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        return p

    # ---- checks

    def validate(self) -> None:
        if not self.questions:
            raise EvalSetError(f"{self.task}: no questions")
        for name, q in self.questions.items():
            if q.get("type") not in QUESTION_TYPES:
                raise EvalSetError(
                    f"{self.task}: question {name!r} has type {q.get('type')!r}; expected one of {QUESTION_TYPES}"
                )
        for i, it in enumerate(self.items):
            if not isinstance(it, Mapping) or "state" not in it or not isinstance(it.get("labels"), Mapping):
                raise EvalSetError(f"{self.task}: item {i} needs 'state' and a 'labels' object")
            if not it["labels"]:
                raise EvalSetError(f"{self.task}: item {i} has no labels")
            for name, label in it["labels"].items():
                if name not in self.questions:
                    raise EvalSetError(f"{self.task}: item {i} labels unknown question {name!r}")
                gold_index(self.questions[name], label)  # raises on a bad label

    # ---- sampling

    def sample(self, limit: int | None, seed: int = 0) -> EvalSet:
        """A fixed-seed shuffled sample of ``limit`` items (all of them, shuffled, if ``limit``
        is None or larger). The sample for a smaller limit is a prefix of a larger one's."""
        order = np.random.default_rng(seed).permutation(len(self.items))
        if limit is not None:
            order = order[: max(0, int(limit))]
        meta = {**self.meta, "sample": {"seed": seed, "limit": limit, "of": len(self.items), "n": int(len(order))}}
        return EvalSet(self.task, self.questions, [self.items[i] for i in order], meta, self.path)

    def questions_for(self, item: Mapping[str, Any]) -> dict[str, dict]:
        return {name: self.questions[name] for name in item["labels"]}


# --------------------------------------------------------------------------- question shapes


def _noul_sides(criteria) -> tuple[Any, Any]:
    if criteria is None:
        return None, None
    if not isinstance(criteria, Mapping):
        raise EvalSetError(f"noul criteria must be null or an object, got {criteria!r}")
    extra = set(criteria) - {"yes", "no", "true", "false"}
    if extra:
        raise EvalSetError(f"noul criteria keys must be yes/no (or true/false), got {sorted(extra)}")
    yes = criteria.get("yes", criteria.get("true"))
    no = criteria.get("no", criteria.get("false"))
    return yes, no


def to_wire(q: Mapping[str, Any]) -> dict[str, Any]:
    """A question in the wire shape of ``POST /v1/systemone`` (noul criteria ``true``/``false``), which
    is also the shape ``Engine.predict`` takes."""
    out = {"type": q["type"]}
    if q.get("instructions") is not None:
        out["instructions"] = q["instructions"]
    if q["type"] == "noul":
        yes, no = _noul_sides(q.get("criteria"))
        crit = {k: v for k, v in (("true", yes), ("false", no)) if v is not None}
        if crit:
            out["criteria"] = crit
    else:
        out["criteria"] = q["criteria"]
    return out


# --------------------------------------------------------------------------- labels and answers


def n_options(q: Mapping[str, Any]) -> int:
    return 2 if q["type"] == "noul" else len(q["criteria"])


def gold_index(q: Mapping[str, Any], label) -> int:
    """The gold row index for a label: the option's position (choice), the level (score), and
    0 for yes / 1 for no (noul, as :func:`lev_jax.metrics.binary_rows` orders them)."""
    qtype = q["type"]
    if qtype == "noul":
        if not isinstance(label, bool):
            raise EvalSetError(f"a noul label must be true or false, got {label!r}")
        return 0 if label else 1
    if qtype == "choice":
        keys = list(q["criteria"])
        if label not in q["criteria"]:
            raise EvalSetError(f"choice label {label!r} is not one of the options")
        return keys.index(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(q["criteria"]):
        raise EvalSetError(f"a score label must be a level index 0..{len(q['criteria']) - 1}, got {label!r}")
    return int(label)


def answer_row(q: Mapping[str, Any], answer: Mapping[str, Any]) -> list[float]:
    """An answer as a probability row over the question's candidates (metrics' row shape)."""
    qtype = q["type"]
    if answer.get("type") != qtype:
        raise ValueError(f"answer type {answer.get('type')!r} does not match the question's {qtype!r}")
    if qtype == "noul":
        p = float(answer["noul"])
        if not (0.0 <= p <= 1.0) or math.isnan(p):
            raise ValueError(f"noul probability {p} outside [0, 1]")
        return [p, 1.0 - p]
    probs = answer["probabilities"]
    keys = list(q["criteria"]) if qtype == "choice" else [str(i) for i in range(len(q["criteria"]))]
    row = np.array([float(probs[k]) for k in keys], dtype=np.float64)
    s = row.sum()
    if not s > 0:
        raise ValueError("answer probabilities sum to 0")
    return list(row / s)  # renormalise float round-off from JSON only


def task_metrics(
    rows: Sequence[Sequence[float]], gold: Sequence[int], families: Sequence[str] | None = None, n_bins: int = 10
) -> dict[str, Any]:
    """The per-task metric bundle: :func:`lev_jax.metrics.summarize` plus RStd and the sample's ECE
    floor (:func:`lev_jax.metrics.ece_floor`: what a calibrated model would show on this many rows)."""
    out = metrics.summarize(
        rows, gold, families if families is not None and len(set(families)) > 1 else None, n_bins=n_bins
    )
    out["rstd"] = metrics.position_bias_rstd(rows, gold)
    out["per_position_recall"] = {str(k): v for k, v in metrics.per_position_recall(rows, gold).items()}
    out["ece_floor"] = metrics.ece_floor(rows, n_bins)
    return out
