"""Depth policies over per-exit answers, and the statistics that judge them (issue 14's report).

Inputs are what an evaluation of every exit produces on a held-out set: `exit_rows` {depth: [N]
probability rows} (one per question, in the same item order for every depth), `gold` [N], `clusters`
[N] (the state each question is about: several questions about one state move together when
resampled), and `costs` {depth: cost per decision} (layers run, or measured ms).

Policies map each item to a depth:
  fixed(d)            every item at d
  threshold(t)        the first exit whose top probability reaches t (the last exit otherwise): a
                      cascade, so its cost is the deepest exit it reached
  static mixture      each item at exit i with probability w, else at exit j (a fixed random
                      assignment, seeded), the best such pair at a target mean cost
  oracle              the cheapest exit that answers the item correctly (the unattainable bound)

Verdicts use `bench.compare.paired_bootstrap` (2,000 resamples, clustered by state):
  non-inferior        lower bound of (quality at the policy - quality at full depth) > -margin, and
                      the policy's mean cost is lower
  beats               the paired lower bound of (policy - other) > 0
Anything else is reported as "not shown", with the interval that says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lev_jax import metrics
from lev_jax.bench.compare import RESAMPLES, paired_bootstrap

NON_INFERIORITY_MARGIN = 0.02


def _depths(exit_rows: Mapping[int, Sequence]) -> list[int]:
    depths = sorted(exit_rows)
    n = {len(exit_rows[d]) for d in depths}
    if not depths or len(n) != 1:
        raise ValueError("exit_rows needs at least one depth, every depth answering the same items")
    return depths


def top_probability(answer: Mapping) -> float:
    """An answer's top probability (what `threshold` compares): a choice's or score's largest
    probability, a noul's max(P(yes), P(no))."""
    if answer.get("type") == "noul":
        p = float(answer["noul"])
        return max(p, 1.0 - p)
    return max(float(v) for v in answer["probabilities"].values())


def select(exit_rows: Mapping[int, Sequence], chosen: Sequence[int]) -> list:
    """The rows of each item at its chosen depth."""
    return [exit_rows[int(d)][i] for i, d in enumerate(chosen)]


def fixed(exit_rows, depth: int) -> np.ndarray:
    return np.full(len(exit_rows[depth]), depth)


def threshold(exit_rows: Mapping[int, Sequence], t: float) -> np.ndarray:
    """Per item, the first exit (shallowest) whose top probability is >= t; the deepest otherwise."""
    depths = _depths(exit_rows)
    n = len(exit_rows[depths[0]])
    chosen = np.full(n, depths[-1])
    done = np.zeros(n, bool)
    for d in depths:
        sure = metrics.confidences(exit_rows[d]) >= t
        chosen[sure & ~done] = d
        done |= sure
    return chosen


def cascade_cost(chosen: np.ndarray, costs: Mapping[int, float]) -> float:
    """Mean cost of a cascade that stops at `chosen`: an exit's cost includes every shallower one's
    layers (no layer recomputed), so it is the cost of the depth reached."""
    return float(np.mean([costs[int(d)] for d in chosen]))


def oracle(exit_rows: Mapping[int, Sequence], gold: Sequence[int]) -> np.ndarray:
    """Per item, the shallowest exit whose top answer is right (the deepest when none is)."""
    depths = _depths(exit_rows)
    g = np.asarray(gold)
    chosen = np.full(len(g), depths[-1])
    for d in reversed(depths):
        right = metrics.predictions(exit_rows[d]) == g
        chosen[right] = d
    return chosen


def static_mixture(exit_rows, costs: Mapping[int, float], gold, target_cost: float, seed: int = 0) -> dict:
    """The best mixture of two fixed exits i, j (cost_i <= target <= cost_j) whose expected mean cost
    is `target_cost`: w = (cost_j - target) / (cost_j - cost_i) of the items at i. Picked by expected
    accuracy w * acc_i + (1 - w) * acc_j; realised as a seeded random assignment (a policy one could
    run). Returns {"i", "j", "w", "chosen", "expected_accuracy"}."""
    depths = _depths(exit_rows)
    acc = {d: metrics.accuracy(exit_rows[d], gold) for d in depths}
    best = None
    for i in depths:
        for j in depths:
            if costs[i] > target_cost or costs[j] < target_cost or (i == j and costs[i] != target_cost):
                continue
            w = 1.0 if costs[j] == costs[i] else (costs[j] - target_cost) / (costs[j] - costs[i])
            expected = w * acc[i] + (1 - w) * acc[j]
            if best is None or expected > best["expected_accuracy"]:
                best = {"i": i, "j": j, "w": float(w), "expected_accuracy": float(expected)}
    if best is None:
        raise ValueError(f"target cost {target_cost} is outside the exits' costs {dict(costs)}")
    rng = np.random.default_rng(seed)
    n = len(exit_rows[depths[0]])
    best["chosen"] = np.where(rng.random(n) < best["w"], best["i"], best["j"])
    return best


def verdict(
    rows_policy: Sequence,
    rows_other: Sequence,
    gold: Sequence[int],
    clusters: Sequence | None,
    *,
    kind: str,
    cost_policy: float | None = None,
    cost_other: float | None = None,
    margin: float = NON_INFERIORITY_MARGIN,
    metric: str = "accuracy",
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> dict:
    """The paired comparison policy - other on `metric` (higher is better: accuracy) and its verdict.
    kind "non-inferior": lower bound > -margin and cost_policy < cost_other; kind "beats": lower
    bound > 0. Returns {"delta", "ci95", "holds", "why"}."""
    if kind not in ("non-inferior", "beats"):
        raise ValueError(f"kind is 'non-inferior' or 'beats', not {kind!r}")
    stats = paired_bootstrap(rows_other, rows_policy, gold, clusters, resamples=resamples, seed=seed)[metric]
    low, high = stats["ci95"]
    if kind == "beats":
        holds = low > 0
        why = f"lower bound {low:+.4f} {'>' if holds else '<='} 0"
    else:
        if cost_policy is None or cost_other is None:
            raise ValueError("a non-inferiority verdict needs both costs")
        cheaper = cost_policy < cost_other
        within = low > -margin
        holds = cheaper and within
        why = (
            f"lower bound {low:+.4f} {'>' if within else '<='} -{margin:g}"
            f"; cost {cost_policy:.3g} {'<' if cheaper else '>='} {cost_other:.3g}"
        )
    return {"delta": stats["delta"], "ci95": [low, high], "holds": bool(holds), "why": why}
