"""Composition: label logits -> calibrated probabilities -> Jev answers.

The probability arithmetic is `lev_jax.calibrate.readout`, the same function calibration is fitted
and evaluated with. A grouped large choice is composed from two rounds:
P(option) = P(option | its group) * P(its group's winner | the winners).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lev_jax import domain
from lev_jax.calibrate import Calibration
from lev_jax.readout.execute import Usage
from lev_jax.readout.plan import Planner, QuestionPlan, Readout, RequestPlan

Reader = Callable[[list, list], list]  # [(prefix_ids, rows)], [Usage] -> per entry, per row: logits


def readout_probs(ro: Readout, logits_per_row: Sequence[np.ndarray], calibration: Calibration):
    """The calibrated distribution of one readout over its candidates (for noul: P(yes))."""
    arrs = [np.asarray(logits[: len(m)], np.float64) for logits, m in zip(logits_per_row, ro.maps)]
    n_options = ro.n if ro.qtype in domain.BANDED_QTYPES else None
    return calibration.readout(arrs, ro.qtype, ro.mode, n_options, maps=ro.maps)


def run(
    plans: list[RequestPlan], reader: Reader, usages: list[Usage], planner: Planner, calibration: Calibration
) -> list[dict]:
    """Answers of every plan: round 1 (every readout of every plan), round 2 (the group winners of
    large choices), then composition."""
    round1 = [[ro for qp in plan.questions for ro in qp.readouts] for plan in plans]
    logits = reader([(plan.prefix_ids, [r for ro in ros for r in ro.rows]) for plan, ros in zip(plans, round1)], usages)
    probs = []  # per plan, per question: the round-1 distribution of each readout
    for plan, per_plan in zip(plans, logits):
        it = iter(per_plan)
        probs.append(
            [
                [readout_probs(ro, [next(it) for _ in ro.rows], calibration) for ro in qp.readouts]
                for qp in plan.questions
            ]
        )
    finals = [
        {
            qi: planner.winners_readout(plan.state_text, qp, [g[int(np.argmax(p))] for g, p in zip(qp.groups, ps)])
            for qi, (qp, ps) in enumerate(zip(plan.questions, per_plan))
            if qp.groups is not None
        }
        for plan, per_plan in zip(plans, probs)
    ]
    final_p: list[dict] = [{} for _ in plans]
    todo = [k for k, f in enumerate(finals) if f]
    if todo:
        logits2 = reader(
            [(plans[k].prefix_ids, [r for ro in finals[k].values() for r in ro.rows]) for k in todo],
            [usages[k] for k in todo],
        )
        for k, per_plan in zip(todo, logits2):
            it = iter(per_plan)
            final_p[k] = {
                qi: readout_probs(ro, [next(it) for _ in ro.rows], calibration) for qi, ro in finals[k].items()
            }
    return [
        {
            qp.qid: answer(qp, question_probs(qp, ps, fp.get(qi)))
            for qi, (qp, ps) in enumerate(zip(plan.questions, per_plan))
        }
        for plan, per_plan, fp in zip(plans, probs, final_p)
    ]


def question_probs(qp: QuestionPlan, round1: list, round2=None):
    """A question's distribution over its candidates in canonical order (noul: P(yes))."""
    if qp.groups is None:
        return round1[0]
    p = np.zeros(len(qp.question["criteria"]))
    for gi, (g, pg) in enumerate(zip(qp.groups, round1)):
        p[g] = pg * round2[gi]
    return p


def choice_confidence(p: np.ndarray) -> float:
    k = len(p)
    return 1.0 if k <= 1 else float((k * p.max() - 1) / (k - 1))


def score_confidence(p: np.ndarray) -> float:
    k = len(p)
    if k <= 1:
        return 1.0
    idx = np.arange(k)
    mode = int(np.argmax(p))
    uniform_spread = np.abs(idx - (k - 1) / 2).mean()
    return float(max(0.0, 1.0 - float((p * np.abs(idx - mode)).sum()) / uniform_spread))


def answer(qp: QuestionPlan, p) -> dict:
    """One question's answer in the Jev shape."""
    q = qp.question
    if q["type"] == domain.CHOICE:
        keys = list(q["criteria"])
        p = p / p.sum()
        return {
            "type": "choice",
            "choice": keys[int(np.argmax(p))],
            "probabilities": {k: float(v) for k, v in zip(keys, p)},
            "confidence": choice_confidence(p),
        }
    if q["type"] == domain.SCORE:
        p = p / p.sum()
        return {
            "type": "score",
            "score": float((np.arange(len(p)) * p).sum()),
            "legend": {str(i): level for i, level in enumerate(q["criteria"])},
            "probabilities": {str(i): float(v) for i, v in enumerate(p)},
            "confidence": score_confidence(p),
        }
    return {"type": "noul", "noul": float(p)}
