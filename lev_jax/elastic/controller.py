"""The depth controller: from cheap probe features read at the first exit it predicts, per exit,
the chance that exit answers right, and picks the exit maximising P(right at d) - lam * cost_d /
max cost. One L2-regularised logistic regression per exit (Newton's method: a few features, a few
thousand items; exact and deterministic).

Evaluated only out of fold (`cross_fit`): items are split into folds by cluster (the state they are
about), each fold's choices come from a controller fitted on the other folds, so no choice was made
by a controller that saw that item's (or its state's) outcomes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from lev_jax import metrics

RIDGE = 1.0  # L2 on the weights (not the bias), in units of the standardised features
NEWTON_STEPS = 25
POOLED_DIMS = 8  # principal components of the pooled hidden state the controller sees


def probe_features(first_rows: Sequence, option_counts=None, prompt_tokens=None, pooled=None) -> np.ndarray:
    """[N, F] features of each item at the first exit: top probability, margin to the runner-up,
    entropy / log(options), log(options), and log(prompt tokens) and a pooled hidden state [N, H]
    when given."""
    mat = np.zeros((len(first_rows), max(len(r) for r in first_rows)))
    for i, r in enumerate(first_rows):
        mat[i, : len(r)] = r
    n_opts = np.asarray(option_counts if option_counts is not None else [len(r) for r in first_rows], float)
    top2 = -np.sort(-mat, axis=1)[:, :2]
    p = np.clip(mat, 1e-12, 1.0)
    entropy = -(mat * np.log(p)).sum(axis=1) / np.log(np.maximum(n_opts, 2))
    cols = [top2[:, 0], top2[:, 0] - top2[:, 1], entropy, np.log(n_opts)]
    if prompt_tokens is not None:
        cols.append(np.log1p(np.asarray(prompt_tokens, float)))
    x = np.stack(cols, axis=1)
    if pooled is not None:
        x = np.concatenate([x, np.asarray(pooled, float)], axis=1)
    return x


def _logistic(x: np.ndarray, y: np.ndarray, ridge: float) -> np.ndarray:
    """Weights [F + 1] (last: bias) of an L2-regularised logistic regression, by Newton's method."""
    xb = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    w = np.zeros(xb.shape[1])
    reg = np.full(xb.shape[1], ridge)
    reg[-1] = 0.0
    for _ in range(NEWTON_STEPS):
        p = 1 / (1 + np.exp(-np.clip(xb @ w, -30, 30)))
        grad = xb.T @ (p - y) + reg * w
        hess = (xb * (p * (1 - p))[:, None]).T @ xb + np.diag(reg) + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


@dataclasses.dataclass(frozen=True)
class Controller:
    """Per exit, logistic weights over standardised features; `costs` per exit."""

    depths: tuple[int, ...]
    costs: tuple[float, ...]
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray  # [exits, F + 1]

    @classmethod
    def fit(
        cls, features, correct: Mapping[int, Sequence[bool]], costs: Mapping[int, float], ridge: float = RIDGE
    ) -> Controller:
        x = np.asarray(features, float)
        depths = tuple(sorted(correct))
        if not depths or any(len(correct[d]) != len(x) for d in depths):
            raise ValueError("correct needs, for every exit, one outcome per feature row")
        mean, scale = x.mean(axis=0), x.std(axis=0)
        scale = np.where(scale > 0, scale, 1.0)
        z = (x - mean) / scale
        w = np.stack([_logistic(z, np.asarray(correct[d], float), ridge) for d in depths])
        return cls(depths, tuple(float(costs[d]) for d in depths), mean, scale, w)

    def p_right(self, features) -> np.ndarray:
        """[N, exits] predicted chance each exit answers right."""
        z = (np.asarray(features, float) - self.mean) / self.scale
        logits = np.concatenate([z, np.ones((len(z), 1))], axis=1) @ self.weights.T
        return 1 / (1 + np.exp(-np.clip(logits, -30, 30)))

    def choose(self, features, lam: float) -> np.ndarray:
        """[N] the exit per item maximising P(right) - lam * cost / max cost (ties: the shallower)."""
        utility = self.p_right(features) - lam * np.asarray(self.costs) / max(self.costs)
        return np.asarray(self.depths)[np.argmax(utility, axis=1)]


def folds_by_cluster(clusters: Sequence, k: int, seed: int = 0) -> np.ndarray:
    """[N] fold index per item; every cluster's items in one fold (clusters shuffled, dealt round-robin)."""
    cl = np.asarray(clusters)
    uniq = np.array(list(dict.fromkeys(cl.tolist())), dtype=object)
    if len(uniq) < k:
        raise ValueError(f"{len(uniq)} clusters cannot fill {k} folds")
    order = np.random.default_rng(seed).permutation(len(uniq))
    fold_of = {uniq[j]: i % k for i, j in enumerate(order)}
    return np.array([fold_of[c] for c in cl.tolist()])


@dataclasses.dataclass(frozen=True)
class Projection:
    """The top principal components of pooled hidden states (fitted on training rows only): a
    576- or 4096-wide state is too many features for a few thousand outcomes."""

    mean: np.ndarray
    components: np.ndarray  # [dims, H]

    @classmethod
    def fit(cls, pooled, dims: int = POOLED_DIMS) -> Projection:
        h = np.asarray(pooled, float)
        mean = h.mean(axis=0)
        _, _, vt = np.linalg.svd(h - mean, full_matrices=False)
        return cls(mean, vt[: min(dims, len(vt))])

    def __call__(self, pooled) -> np.ndarray:
        return (np.asarray(pooled, float) - self.mean) @ self.components.T


def cross_fit(
    features,
    correct: Mapping[int, Sequence[bool]],
    costs: Mapping[int, float],
    clusters: Sequence,
    lams: Sequence[float],
    k: int = 5,
    seed: int = 0,
    ridge: float = RIDGE,
    pooled=None,
    pooled_dims: int = POOLED_DIMS,
) -> dict[float, np.ndarray]:
    """{lam: [N] out-of-fold choices}: each fold's items chosen by a controller fitted on the others.
    `pooled` [N, H]: a pooled hidden state per item, projected on principal components fitted on the
    training folds (never on the held-out fold) and joined to the features."""
    x = np.asarray(features, float)
    fold = folds_by_cluster(clusters, k, seed)
    out = {lam: np.zeros(len(x), int) for lam in lams}
    for f in range(k):
        held, train = fold == f, fold != f
        xf = x
        if pooled is not None:
            proj = Projection.fit(np.asarray(pooled)[train], pooled_dims)
            xf = np.concatenate([x, proj(pooled)], axis=1)
        ctl = Controller.fit(xf[train], {d: np.asarray(c)[train] for d, c in correct.items()}, costs, ridge)
        for lam in lams:
            out[lam][held] = ctl.choose(xf[held], lam)
    return out


def outcomes(exit_rows: Mapping[int, Sequence], gold) -> dict[int, np.ndarray]:
    """{depth: [N] bool} whether each exit's top answer is right."""
    return {d: metrics.predictions(rows) == np.asarray(gold) for d, rows in exit_rows.items()}
