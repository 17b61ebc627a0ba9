"""``levbench eval`` and ``levbench fit``: run eval sets through a client, score, report, fit.

Per task ``eval`` writes, into ``--out``:

* ``<task>.json`` - metrics (and the uncalibrated baseline's, when there is one), latency and
  token statistics, the client's description, the sample, and one record per answered row;
* ``<task>.md`` - the same as a short report;
* ``<task>.reliability.png`` (and ``<task>.uncalibrated.reliability.png``) - reliability diagrams;

and ``summary.json`` / ``summary.md`` across tasks.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as _dt
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lev_jax import calibrate, metrics
from lev_jax.bench.evalset import EvalSet, answer_row, gold_index, n_options, task_metrics

BOOTSTRAP = 1000


# --------------------------------------------------------------------------- set specs


@dataclass
class SetSpec:
    """An eval-set path with its own options: ``PATH[:limit=N][:max_options=K][:split=NAME]``."""

    path: Path
    limit: int | None = None
    max_options: int | None = None
    split: str | None = None

    @classmethod
    def parse(cls, text: str, default_limit: int | None = None) -> SetSpec:
        path, *opts = str(text).split(":")
        spec = cls(Path(path), default_limit)
        for opt in opts:
            key, eq, val = opt.partition("=")
            if not eq:
                raise ValueError(f"set option {opt!r} is not KEY=VALUE (in {text!r})")
            if key == "limit":
                spec.limit = None if val in ("all", "") else int(val)
            elif key == "max_options":
                spec.max_options = int(val)
            elif key == "split":
                spec.split = val
            else:
                raise ValueError(f"unknown set option {key!r} (limit, max_options, split)")
        return spec

    def load(self, seed: int) -> EvalSet:
        es = EvalSet.load(self.path)
        if self.max_options is not None:
            keep = [it for it in es.items if all(n_options(es.questions[q]) <= self.max_options for q in it["labels"])]
            es = EvalSet(
                es.task,
                es.questions,
                keep,
                {**es.meta, "max_options": self.max_options, "items_within_max_options": len(keep)},
                es.path,
            )
        if self.split:
            es.meta = {**es.meta, "split": self.split}
        return es.sample(self.limit, seed)


# --------------------------------------------------------------------------- running


class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="item", file=sys.stderr, dynamic_ncols=True)
            except ImportError:  # pragma: no cover - tqdm ships with the datasets dependency
                self.bar = None

    def update(self, n: int = 1, errors: int = 0) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if errors:
                self.bar.set_postfix(errors=errors)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_items(
    client, es: EvalSet, *, concurrency: int = 1, progress: bool = True, on_result: Callable | None = None
) -> list[dict]:
    """Ask every item its labelled questions; returns one result per item, in item order:
    ``{"i", "asked": Asked | None, "error": str | None}``. At most ``concurrency`` requests are
    in flight (the client may allow fewer)."""
    workers = max(1, min(int(concurrency), getattr(client, "max_concurrency", 1)))
    bar = _Progress(len(es.items), progress, es.task)
    results: list[dict | None] = [None] * len(es.items)
    errors = 0

    def one(i: int) -> dict:
        it = es.items[i]
        try:
            return {"i": i, "asked": client.ask(it["state"], es.questions_for(it)), "error": None}
        except Exception as e:  # noqa: BLE001 - an item's failure is recorded, not fatal
            return {"i": i, "asked": None, "error": f"{type(e).__name__}: {e}"}

    try:
        if workers == 1:
            for i in range(len(es.items)):
                results[i] = r = one(i)
                errors += r["error"] is not None
                bar.update(1, errors)
                if on_result:
                    on_result(r)
        else:
            with cf.ThreadPoolExecutor(workers) as pool:
                for r in pool.map(one, range(len(es.items))):
                    results[r["i"]] = r
                    errors += r["error"] is not None
                    bar.update(1, errors)
                    if on_result:
                        on_result(r)
    finally:
        bar.close()
    return results  # type: ignore[return-value]


def _stats(xs: Sequence[float]) -> dict[str, float] | None:
    if not xs:
        return None
    a = np.asarray(xs, dtype=np.float64)
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p95": float(np.percentile(a, 95)),
        "max": float(a.max()),
        "total": float(a.sum()),
    }


def _bootstrap_ece_delta(base: list, cal: list, gold: list, n_bins: int, seed: int = 0) -> dict[str, float]:
    """Paired bootstrap (rows resampled with replacement) of ECE(baseline) - ECE(calibrated)."""
    rng = np.random.default_rng(seed)
    n = len(gold)
    g = np.asarray(gold)
    deltas = []
    for _ in range(BOOTSTRAP):
        idx = rng.integers(0, n, n)
        deltas.append(
            metrics.ece([base[i] for i in idx], g[idx], n_bins) - metrics.ece([cal[i] for i in idx], g[idx], n_bins)
        )
    d = np.asarray(deltas)
    return {
        "mean": float(d.mean()),
        "ci95": [float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))],
        "p_not_lower": float((d <= 0).mean()),
        "resamples": BOOTSTRAP,
    }


def _sig(row) -> list[float]:
    """Probabilities to 6 significant digits: small ones keep their size, so NLL (and any metric)
    recomputed from the records matches the run's (6 decimal places would round them to 0)."""
    return [float(f"{x:.6g}") for x in row]


def score_task(es: EvalSet, results: list[dict], n_bins: int = 10) -> dict[str, Any]:
    """Metrics and per-row records from :func:`run_items` results."""
    rows, base_rows, gold, fams, records = [], [], [], [], []
    lat, toks, state_toks, cached = [], [], [], []
    n_errors = 0
    for r in results:
        it = es.items[r["i"]]
        if r["error"] is not None:
            n_errors += 1
            records.append({"i": r["i"], "error": r["error"]})
            continue
        a = r["asked"]
        lat.append(a.latency_s)
        if a.input_tokens is not None:
            toks.append(a.input_tokens)
        if a.state_tokens is not None:
            state_toks.append(a.state_tokens)
        if a.cached_input_tokens is not None:
            cached.append(a.cached_input_tokens)
        for name, label in it["labels"].items():
            q = es.questions[name]
            g = gold_index(q, label)
            try:
                row = answer_row(q, a.answers[name])
            except (KeyError, ValueError) as e:
                n_errors += 1
                records.append({"i": r["i"], "question": name, "error": f"bad answer: {e}"})
                continue
            rec = {"i": r["i"], "question": name, "gold": g, "probs": _sig(row)}
            rows.append(row)
            gold.append(g)
            fams.append(name)
            if a.baseline is not None:
                b = answer_row(q, a.baseline[name])
                base_rows.append(b)
                rec["uncalibrated_probs"] = _sig(b)
            records.append(rec)
    out: dict[str, Any] = {
        "task": es.task,
        "meta": es.meta,
        "n_items": len(es.items),
        "n_rows": len(rows),
        "n_errors": n_errors,
        "latency_s": _stats(lat),
        "input_tokens": _stats(toks),
        "state_tokens": _stats(state_toks),
        "cached_input_tokens": _stats(cached),
    }
    if rows:
        multi = len(es.questions) > 1 and len(set(fams)) <= 20
        out["metrics"] = task_metrics(rows, gold, fams if multi else None, n_bins)
        if base_rows and len(base_rows) == len(rows):
            out["uncalibrated"] = task_metrics(base_rows, gold, fams if multi else None, n_bins)
            out["ece_delta_bootstrap"] = _bootstrap_ece_delta(base_rows, rows, gold, n_bins)
    out["records"] = records
    return out


# --------------------------------------------------------------------------- reports


def _f(x, nd: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def task_markdown(res: Mapping[str, Any], client_info: Mapping[str, Any] | None = None) -> str:
    m = res.get("metrics") or {}
    u = res.get("uncalibrated")
    meta = res.get("meta") or {}
    s = meta.get("sample") or {}
    lines = [f"# {res['task']}", ""]
    if meta.get("source"):
        lines.append(f"- source: `{meta['source']}` (split `{meta.get('split')}`, role {meta.get('role', '-')})")
    lines.append(
        f"- items: {res['n_items']}"
        + (
            f" (fixed-seed sample, seed {s.get('seed')}, of {s.get('of')})"
            if s and s.get("of") != res["n_items"]
            else ""
        )
        + f"; rows scored: {res['n_rows']}; errors: {res['n_errors']}"
    )
    if client_info:
        lines.append(
            f"- answered by: {client_info.get('kind')} `{client_info.get('endpoint') or client_info.get('model')}`"
        )
    lat = res.get("latency_s")
    if lat:
        lines.append(f"- latency per item: mean {lat['mean']:.3f} s, p50 {lat['p50']:.3f} s, p95 {lat['p95']:.3f} s")
    tok = res.get("input_tokens")
    if tok:
        lines.append(f"- input tokens per item: mean {tok['mean']:.0f}")
    lines += ["", "| readout | accuracy | ECE | Brier | NLL | RStd |", "|---|---|---|---|---|---|"]
    if u:
        lines.append(
            f"| uncalibrated | {_f(u['accuracy'])} | {_f(u['ece'])} | {_f(u['brier'])} | {_f(u['nll'])} "
            f"| {_f(u['rstd'])} |"
        )
    if m:
        lines.append(
            f"| {'calibrated' if u else 'as served'} | {_f(m['accuracy'])} | {_f(m['ece'])} "
            f"| {_f(m['brier'])} | {_f(m['nll'])} | {_f(m['rstd'])} |"
        )
    floor = m.get("ece_floor")
    if floor:
        lines += [
            "",
            f"ECE floor of this sample: a perfectly calibrated model with these (calibrated) confidences "
            f"would show ECE {floor['mean']:.3f} on {m['n']} rows on average, above {floor['p95']:.3f} one "
            f"time in twenty ({floor['draws']} draws of the outcomes); ECE differences below that are noise.",
        ]
    bs = res.get("ece_delta_bootstrap")
    if bs:
        lines += [
            "",
            f"ECE reduction (uncalibrated - calibrated): {bs['mean']:.3f}, 95% paired bootstrap interval "
            f"[{bs['ci95'][0]:.3f}, {bs['ci95'][1]:.3f}] ({bs['resamples']} resamples).",
        ]
    if m:
        lines += [
            "",
            "Selective accuracy (rows with confidence >= threshold):",
            "",
            "| threshold | coverage | accuracy |",
            "|---|---|---|",
        ]
        for row in m["selective"]:
            lines.append(f"| {row['threshold']} | {_f(row['coverage'])} | {_f(row['accuracy'])} |")
        lines += [
            "",
            "Reliability (10 equal-width confidence bins):",
            "",
            "| bin | count | confidence | accuracy |",
            "|---|---|---|---|",
        ]
        for b in m["reliability"]:
            if b["count"]:
                lines.append(
                    f"| ({b['lower']:.1f}, {b['upper']:.1f}] | {b['count']} | {_f(b['confidence'])} "
                    f"| {_f(b['accuracy'])} |"
                )
    lines += [
        "",
        "RStd: population std of per-position recall over the gold positions (options are shown in "
        "canonical order, so it also reflects per-class difficulty).",
    ]
    return "\n".join(lines) + "\n"


def _floor(fl) -> str:
    return "-" if not fl else f"{fl['mean']:.3f} ({fl['p95']:.3f})"


def summary_markdown(results: Sequence[Mapping[str, Any]], client_info: Mapping[str, Any] | None = None) -> str:
    lines = ["# levbench eval", ""]
    if client_info:
        lines.append(
            f"Answered by: {client_info.get('kind')} `{client_info.get('endpoint') or client_info.get('model')}`"
        )
        lines.append("")
    lines += [
        "| task | items | accuracy | ECE uncal. | ECE | ECE floor (p95) | Brier | NLL | RStd | latency p50 (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r.get("metrics") or {}
        u = r.get("uncalibrated") or {}
        lat = r.get("latency_s") or {}
        lines.append(
            f"| {r['task']} | {r['n_items']} | {_f(m.get('accuracy'))} | {_f(u.get('ece'))} "
            f"| {_f(m.get('ece'))} | {_floor(m.get('ece_floor'))} | {_f(m.get('brier'))} | {_f(m.get('nll'))} "
            f"| {_f(m.get('rstd'))} | {_f(lat.get('p50'))} |"
        )
    return "\n".join(lines) + "\n"


def write_task(res: dict[str, Any], out_dir: Path, client_info: Mapping[str, Any] | None = None) -> dict[str, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    task = res["task"]
    files = {}
    doc = {**res, "client": client_info}
    p = out_dir / f"{task}.json"
    p.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    files["json"] = str(p)
    p = out_dir / f"{task}.md"
    p.write_text(task_markdown(res, client_info), encoding="utf-8")
    files["md"] = str(p)
    for key, suffix, label in (
        ("metrics", "", "calibrated" if res.get("uncalibrated") else ""),
        ("uncalibrated", ".uncalibrated", "uncalibrated"),
    ):
        m = res.get(key)
        if m:
            png = metrics.reliability_diagram_png(
                m["reliability"], out_dir / f"{task}{suffix}.reliability.png", title=f"{task} {label}".strip()
            )
            if png is not None:
                files[f"png{suffix}"] = str(png)
    return files


def evaluate(
    client,
    specs: Sequence[SetSpec],
    out_dir: str | Path,
    *,
    seed: int = 0,
    concurrency: int = 1,
    progress: bool = True,
    n_bins: int = 10,
) -> list[dict[str, Any]]:
    """Run every set, write the per-task files and the summary; returns the task results."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = client.describe()
    started = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    results = []
    for spec in specs:
        es = spec.load(seed)
        t0, c0 = time.perf_counter(), time.process_time()
        items = run_items(client, es, concurrency=concurrency, progress=progress)
        res = score_task(es, items, n_bins)
        res["run"] = {
            "wall_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0,
            "concurrency": max(1, min(int(concurrency), getattr(client, "max_concurrency", 1))),
            "seed": seed,
            "started": started,
        }
        res["files"] = write_task(res, out, info)
        results.append(res)
    summary = {
        "client": info,
        "started": started,
        "argv": ["python -m scripts.levbench", *sys.argv[1:]],
        "tasks": [{k: v for k, v in r.items() if k != "records"} for r in results],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(summary_markdown(results, info), encoding="utf-8")
    return results


# --------------------------------------------------------------------------- fitting


class FitRefused(ValueError):
    """A set that must not be used for fitting temperatures."""


def check_fit_set(es: EvalSet) -> str:
    """The split name to record for ``es``; raises :class:`FitRefused` for held-out data."""
    from lev_jax.data.guard import resolve_eval_subset

    split = str(es.meta.get("split") or es.task)
    if es.meta.get("role") == "test":
        raise FitRefused(f"{es.task}: role 'test' - measurement only, never fit on it")
    reason = calibrate.forbidden_split_reason(split) or calibrate.forbidden_split_reason(es.task)
    if reason:
        raise FitRefused(f"{es.task}: {reason}")
    for name in (split, es.task):
        subset = resolve_eval_subset(name)
        if subset:
            raise FitRefused(f"{es.task}: {name!r} is evaluation data ({subset})")
    return split


def check_fit_states(es: EvalSet, eval_texts: set[str]) -> None:
    """Refuse a set whose states are evaluation rows (by normalised text)."""
    from lev_jax.data.splits import normalize_text

    hits = 0
    for it in es.items:
        st = it["state"]
        texts = (
            [st]
            if isinstance(st, str)
            else [v for v in (st.values() if isinstance(st, dict) else st) if isinstance(v, str)]
        )
        hits += any(normalize_text(t) in eval_texts for t in texts)
    if hits:
        raise FitRefused(f"{es.task}: {hits} item state(s) are evaluation rows; decontaminate the set first")


def rows_from_results(es: EvalSet, results: list[dict], split: str) -> tuple[list[calibrate.CalibrationRow], int]:
    rows, skipped = [], 0
    for r in results:
        if r["error"] is not None:
            skipped += 1
            continue
        a = r["asked"]
        for name, label in es.items[r["i"]]["labels"].items():
            ro = a.readouts.get(name)
            if ro is None:  # grouped large choice: no single readout
                skipped += 1
                continue
            q = es.questions[name]
            gold = bool(label) if q["type"] == "noul" else gold_index(q, label)
            rows.append(
                calibrate.CalibrationRow(
                    [np.asarray(x) for x in ro.logits], gold, ro.qtype, ro.mode, es.task, ro.n, split
                )
            )
    return rows, skipped


def row_to_json(r: calibrate.CalibrationRow) -> dict[str, Any]:
    return {
        "logits": [[float(x) for x in a] for a in r.logits],
        "gold": r.gold,
        "qtype": r.qtype,
        "mode": r.mode,
        "family": r.family,
        "n_options": r.n_options,
        "split": r.split,
    }


def row_from_json(d: Mapping[str, Any]) -> calibrate.CalibrationRow:
    return calibrate.CalibrationRow(
        [np.asarray(a, dtype=np.float64) for a in d["logits"]],
        d["gold"],
        d["qtype"],
        d["mode"],
        d["family"],
        d.get("n_options"),
        d.get("split"),
    )


def save_rows(rows: Iterable[calibrate.CalibrationRow], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(row_to_json(r)) + "\n")
    return p


def load_rows(path: str | Path) -> list[calibrate.CalibrationRow]:
    with open(path, encoding="utf-8") as f:
        return [row_from_json(json.loads(line)) for line in f if line.strip()]


def collect_rows(
    engine, specs: Sequence[SetSpec], *, seed: int = 0, progress: bool = True, eval_data: str | Path | None = None
) -> tuple[list[calibrate.CalibrationRow], list[str], dict]:
    """Calibration rows (raw label logits) from calibration sets; refuses held-out sets."""
    from lev_jax.bench.clients import InProcessClient
    from lev_jax.data.guard import Guard

    client = InProcessClient(engine, readouts=True)
    texts = Guard(eval_data).eval_texts() if eval_data is not None else Guard().eval_texts()
    loaded = []
    for spec in specs:  # check everything before reading anything
        es = spec.load(seed)
        split = check_fit_set(es)
        check_fit_states(es, texts)
        loaded.append((es, split))
    rows, splits, report = [], [], {}
    for es, split in loaded:
        t0, c0 = time.perf_counter(), time.process_time()
        res = run_items(client, es, progress=progress)
        got, skipped = rows_from_results(es, res, split)
        rows += got
        splits.append(split)
        report[es.task] = {
            "split": split,
            "items": len(es.items),
            "rows": len(got),
            "skipped": skipped,
            "sample": es.meta.get("sample"),
            "max_options": es.meta.get("max_options"),
            "wall_s": round(time.perf_counter() - t0, 1),
            "cpu_s": round(time.process_time() - c0, 1),
        }
    return rows, splits, report


def fit_report_markdown(cal: calibrate.Calibration, report: Mapping[str, Any] | None, argv: Sequence[str]) -> str:
    lines = [cal.report_markdown().rstrip("\n"), "", "## Calibration sets", ""]
    if report:
        lines += ["| set | split | items | rows | max options | cpu s |", "|---|---|---|---|---|---|"]
        for task, r in report.items():
            lines.append(
                f"| {task} | {r['split']} | {r['items']} | {r['rows']} | {r.get('max_options') or '-'} "
                f"| {r.get('cpu_s', '-')} |"
            )
    lines += ["", "Reproduce:", "", "```", " ".join(argv), "```"]
    return "\n".join(lines) + "\n"
