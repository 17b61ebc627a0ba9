"""`levbench depth`: elastic depth on held-out sets -- every exit and every depth policy, with the
statistics that say which of them hold (issue 14's report).

    levbench depth evalsets/banking77-test.json:limit=200 --model RELEASE_WITH_EXITS --out results/depth

1. Every question of every item is read at every depth the model serves (`engine.predict(depth=d)`):
   per exit, one probability row per question (the same rows any policy picks from).
2. Policies map each question to a depth: every fixed exit; the confidence threshold (the serving
   `depth="auto"`, at several thresholds); the depth controller at several cost weights lambda; the
   best static mixture of two fixed exits at the controller's mean cost; the oracle (the cheapest
   exit that is right: an unattainable bound).
3. Controller protocol: its features are read at the first exit (top probability, margin, entropy,
   log options, log prompt tokens, and the state's hidden state there, mean-pooled over its tokens
   and projected on its top principal components); it is evaluated out of fold only -- items are
   dealt into `--folds` folds by state (all questions about one state in one fold), and each fold's
   depths come from a controller fitted on the other folds' outcomes, its projection fitted on their
   states too (`elastic.controller.cross_fit`).
4. Per policy: accuracy, ECE, mean depth (layers run by a vertical cascade that continues the first
   exit: no layer twice), and ms per decision on the serving path (`elastic.serving`'s cascade): the
   deepest exit's ms plus, per exit stopped at before it, the measured cost of a stop (each exit's ms
   and the whole cascade's measured on a warm engine with cold prefix caches, `--timing-items` items).
5. Verdicts on paired bootstraps clustered by state (2,000 resamples): each policy non-inferior to
   full depth (lower bound of the accuracy difference > -0.02 and cheaper in layers), and the
   controller beating the static mixture at its cost (lower bound > 0). "not shown" is a result too.

Writes depth.json and depth.md; prints the Markdown. Exits 2 for a model without exits.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lev_jax import buckets, metrics, programs
from lev_jax.bench.evalset import answer_row, gold_index
from lev_jax.elastic import controller as ctl
from lev_jax.elastic import policy

THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95)
LAMBDAS = (0.05, 0.1, 0.2, 0.4)
FOLDS = 5


def pooled_state(backbone, prefix_ids) -> np.ndarray | None:
    """[E] the mean over the state's tokens of `backbone`'s final-normed hidden state (an exit view:
    the state read at that exit); None for a state with images. Padded on the right to a prefix
    bucket (causal: the padding changes no earlier position), so lengths share programs."""
    if getattr(prefix_ids, "images", ()):
        return None
    ids = list(prefix_ids)
    n = buckets.fit(len(ids), buckets.PREFIX[1:], "state tokens")
    tokens = np.asarray([ids + [ids[-1]] * (n - len(ids))], np.int32)
    hidden = np.asarray(backbone.hidden_at(tokens, np.arange(n, dtype=np.int32)[None]), np.float64)
    return hidden[0, : len(ids)].mean(axis=0)


def read_every_depth(engine, sets, progress=None) -> dict:
    """Per question (flattened over sets and items): its row at every depth, gold, state cluster,
    option count, prompt tokens and the state's pooled hidden state at the first exit."""
    depths = engine.depths
    rows = {d: [] for d in depths}
    gold, clusters, options, tokens, tasks, pooled = [], [], [], [], [], []
    first = engine.backbone.at_depth(depths[0])
    for es in sets:
        for i, item in enumerate(es.items):
            qs = {n: q for n, q in es.questions_for(item).items() if item["labels"].get(n) is not None}
            if not qs:
                continue
            answers = {d: engine.predict(item["state"], qs, depth=d) for d in depths}
            plan = engine.plan(item["state"], qs)
            counts = plan.token_counts()
            state_vec = pooled_state(first, plan.prefix_ids)
            for name, q in qs.items():
                for d in depths:
                    rows[d].append(answer_row(q, answers[d][name]))
                gold.append(gold_index(q, item["labels"][name]))
                clusters.append(f"{es.task}:{i}")
                options.append(len(rows[depths[0]][-1]))
                tokens.append(counts["input_tokens"] / len(qs))
                tasks.append(es.task)
                pooled.append(state_vec)
            if progress:
                progress(es.task, i + 1, len(es.items))
    return {
        "depths": list(depths),
        "rows": rows,
        "gold": np.asarray(gold),
        "clusters": clusters,
        "options": np.asarray(options),
        "tokens": np.asarray(tokens),
        "tasks": tasks,
        "pooled": None if any(v is None for v in pooled) or not pooled else np.stack(pooled),
    }


def time_depths(engine, sets, n_items: int) -> dict:
    """ms per decision at each depth, and decisions/s at depth "full" and "auto", on the first
    `n_items` items. Each is timed on a second pass right after an untimed one, every prefix cache
    emptied before each pass (each state computed as a new request's would be), after freeing every
    compiled program (so `lev_jax.programs.guard` has no reason to free them while a clock runs): the
    untimed pass compiles what the timed one runs; any compiled while a clock ran are counted. Also "auto"
    with every question read at every exit (the vertical cascade's whole way): its extra ms over the
    full depth, per exit passed, is what each stop at an exit adds (`serving_ms`)."""
    items = [(item["state"], es.questions_for(item)) for es in sets for item in es.items][:n_items]
    n_q = sum(len(q) for _, q in items)
    compiled = [0]

    def run(depth) -> float:
        # a clean slate first: with every exit's programs loaded the process nears its memory-map limit
        # and `programs.guard` frees them all at a moment of its choosing (measured: inside a timed pass)
        programs.free_compiled()
        engine.compiled_keys.clear()
        for _ in range(2):
            for ex in engine.executors.values():
                ex.prefixes.clear()
            engine.cascade.prefixes.clear()
            before = engine.compiled_programs
            t0 = time.perf_counter()
            for state, qs in items:
                engine.predict(state, qs, depth=depth)
            seconds = time.perf_counter() - t0
        compiled[0] += engine.compiled_programs - before
        return seconds

    ms = {d: 1000 * run(d) / n_q for d in engine.depths}
    threshold = engine.depth_threshold
    try:
        engine.depth_threshold = float("inf")
        every_s = run("auto")
    finally:
        engine.depth_threshold = threshold
    full_s, auto_s = run("full"), run("auto")
    passed = max(len(engine.depths) - 1, 1)
    return {
        "items": len(items),
        "questions": n_q,
        "ms_per_decision": ms,
        "ms_per_visit": max(0.0, (1000 * every_s / n_q - ms[engine.depths[-1]]) / passed),
        "decisions_per_s": {"full": n_q / full_s, "auto": n_q / auto_s, "auto_every_exit": n_q / every_s},
        "compiled_while_timed": compiled[0],
    }


def serving_ms(
    chosen: np.ndarray, ms: dict, visits: Sequence[Sequence[int]] | None = None, per_visit: float = 0.0
) -> float:
    """Mean ms per decision on the serving path (the vertical cascade: a question read at exits
    e1 < ... < ek runs ek layers once): the deepest exit's ms, plus `per_visit` for each exit it was
    read at before it (the readout and the call of each stop)."""
    if visits is None:
        return float(np.mean([ms[int(d)] for d in chosen]))
    return float(np.mean([ms[int(max(v))] + per_visit * (len(v) - 1) for v in visits]))


def evaluate(
    data: dict, ms: dict | None, *, thresholds=THRESHOLDS, lams=LAMBDAS, folds=FOLDS, seed=0, per_visit: float = 0.0
) -> dict:
    """Every policy's metrics and verdicts over `read_every_depth`'s data (`ms`: measured ms per
    decision per depth, or None; `per_visit`: what each earlier exit a question stops at adds)."""
    depths, rows, gold, clusters = data["depths"], data["rows"], data["gold"], data["clusters"]
    full, first = depths[-1], depths[0]
    layers = {d: float(d) for d in depths}
    records = []

    def add(name, chosen, visits=None, **extra):
        sel = policy.select(rows, chosen)
        records.append(
            {
                "policy": name,
                "chosen": np.asarray(chosen),
                "rows": sel,
                "accuracy": metrics.accuracy(sel, gold),
                "ece": metrics.ece(sel, gold),
                "mean_depth": policy.cascade_cost(np.asarray(chosen), layers),
                "ms_per_decision": None if ms is None else serving_ms(np.asarray(chosen), ms, visits, per_visit),
                **extra,
            }
        )

    for d in depths:
        add(f"fixed {d}", policy.fixed(rows, d))
    for t in thresholds:
        chosen = policy.threshold(rows, t)
        add(f"threshold {t:g}", chosen, visits=[[x for x in depths if x <= c] for c in chosen])
    feats = ctl.probe_features(rows[first], data["options"], data["tokens"])
    correct = ctl.outcomes(rows, gold)
    oof = ctl.cross_fit(feats, correct, layers, clusters, lams, k=folds, seed=seed, pooled=data.get("pooled"))
    for lam in lams:
        chosen = oof[lam]
        add(f"controller lambda={lam:g}", chosen, visits=[[first] + ([int(c)] if c != first else []) for c in chosen])
        target = policy.cascade_cost(chosen, layers)
        mix = policy.static_mixture(rows, layers, gold, target, seed=seed)
        add(f"static mixture at controller lambda={lam:g}", mix["chosen"], mixture=[mix["i"], mix["j"], mix["w"]])
    add("oracle (bound)", policy.oracle(rows, gold))

    by_name = {r["policy"]: r for r in records}
    full_rec = by_name[f"fixed {full}"]
    for r in records:
        if r is full_rec or r["policy"].startswith("oracle"):
            r["vs_full"] = None
            continue
        r["vs_full"] = policy.verdict(
            r["rows"],
            full_rec["rows"],
            gold,
            clusters,
            kind="non-inferior",
            cost_policy=r["mean_depth"],
            cost_other=full_rec["mean_depth"],
            seed=seed,
        )
    for lam in lams:
        c, m = by_name[f"controller lambda={lam:g}"], by_name[f"static mixture at controller lambda={lam:g}"]
        c["vs_mixture"] = policy.verdict(c["rows"], m["rows"], gold, clusters, kind="beats", seed=seed)
    return {
        "depths": depths,
        "questions": len(gold),
        "states": len(set(clusters)),
        "folds": folds,
        "controller_features": ["top probability", "margin", "entropy", "log options", "log prompt tokens"]
        + (
            [f"pooled state at the first exit (top {ctl.POOLED_DIMS} principal components)"]
            if data.get("pooled") is not None
            else []
        ),
        "policies": [{k: v for k, v in r.items() if k not in ("chosen", "rows")} for r in records],
    }


def markdown(report: dict) -> str:
    def f(x, nd=3):
        return "-" if x is None else f"{x:.{nd}f}"

    def v(x):
        return "-" if x is None else ("**yes**" if x["holds"] else "not shown") + f" ({x['why']})"

    lines = [
        f"Depths {report['depths']}; {report['questions']} questions about {report['states']} states; "
        f"controller out of fold ({report['folds']} folds by state; features: "
        f"{', '.join(report.get('controller_features', []))}).",
        "",
        "| policy | accuracy | ECE | mean depth | ms/decision (serving) | non-inferior to full "
        "| beats static mixture |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in report["policies"]:
        lines.append(
            f"| {r['policy']} | {f(r['accuracy'])} | {f(r['ece'])} | {f(r['mean_depth'], 1)} | "
            f"{f(r['ms_per_decision'], 1)} | {v(r.get('vs_full'))} | {v(r.get('vs_mixture'))} |"
        )
    t = report.get("timing")
    if t:
        lines += [
            "",
            f"Serving throughput on {t['items']} items ({t['questions']} decisions), cold prefix caches: "
            f"{t['decisions_per_s']['full']:.2f} decisions/s at depth full, "
            f"{t['decisions_per_s']['auto']:.2f} at auto (threshold {report['auto_threshold']:g}); "
            "ms per decision per exit: " + ", ".join(f"{d}: {m:.1f}" for d, m in t["ms_per_decision"].items()) + "; "
            f"every exit in turn (the whole cascade): {t['decisions_per_s']['auto_every_exit']:.2f} decisions/s, "
            f"{t['ms_per_visit']:.1f} ms per exit passed; programs compiled while timed: "
            f"{t.get('compiled_while_timed', '?')}.",
        ]
    return "\n".join(lines) + "\n"


def run(engine, sets, out_dir, *, timing_items: int = 30, folds=FOLDS, seed: int = 0, progress=None) -> dict:
    """Read, time, evaluate; write depth.json and depth.md to `out_dir`; the report. ValueError for a
    model without exits."""
    if len(engine.depths) < 2:
        raise ValueError(f"{engine.model_name} has no exits (depths {list(engine.depths)}): train them first")
    data = read_every_depth(engine, sets, progress)
    timing = time_depths(engine, sets, timing_items) if timing_items else None
    ms = None if timing is None else timing["ms_per_decision"]
    per_visit = 0.0 if timing is None else timing["ms_per_visit"]
    report = evaluate(data, ms, folds=folds, seed=seed, per_visit=per_visit)
    report |= {"model": engine.model_name, "auto_threshold": engine.depth_threshold, "timing": timing}
    report["tasks"] = sorted(set(data["tasks"]))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "depth.json").write_text(json.dumps(report, indent=1, default=_json) + "\n", encoding="utf-8")
    (out / "depth.md").write_text(markdown(report), encoding="utf-8")
    return report


def _json(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x).__name__)
