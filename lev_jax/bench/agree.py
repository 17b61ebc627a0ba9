"""Mode A vs Mode B agreement: the same choice questions read both ways by one model.

    levbench agree evalsets/banking77-test.json:limit=200 --model RELEASE_OR_RUN --out results/agree

Only questions both modes can read are compared: choices whose options all get a single-token label
code (Mode A reads them in one row) read again by the model's Mode B head (forced for every size
here; served, the router sends only large or split choices to it). Per task: how often the two
argmaxes agree, the mean total-variation distance between the two distributions, and each mode's
accuracy on the gold labels. A gate, not a benchmark: material disagreement means the router or a
head is wrong, so the command exits 1 when an agreement rate falls below `--min-agreement`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lev_jax import domain


def engines(engine):
    """(Mode A engine, Mode B engine) over `engine`'s backbone, prompt settings and calibration:
    Mode A with the head switched off, Mode B with its threshold at the smallest choice."""
    engine_type = type(engine)  # not imported: lev_jax.engine reads releases, whose cards use `markdown`
    if engine.backbone.mode_b_head is None:
        raise ValueError(f"{engine.model_name} has no Mode B head: nothing to compare Mode A with")
    kw = dict(
        prompt_style=engine.prompt_style,
        layout=engine.layout,
        noul_readout=engine.noul_readout,
        option_averaging=engine.option_averaging,
        calibration=engine.calibration,
        model_name=engine.model_name,
    )
    a = engine_type(engine.backbone, mode_b=False, **kw)
    b = engine_type(engine.backbone, mode_b_min_options=domain.CHOICE_OPTIONS[0], **kw)
    return a, b


def compare_set(engine_a, engine_b, es) -> dict:
    """One eval set's agreement record (choice questions within the label codes only)."""
    agree, tv, right_a, right_b, skipped = [], [], [], [], 0
    for item in es.items:
        qs = {
            name: q
            for name, q in es.questions_for(item).items()
            if q["type"] == domain.CHOICE and len(q["criteria"]) <= engine_a.planner.group_size
        }
        skipped += len(es.questions_for(item)) - len(qs)
        if not qs:
            continue
        pa, pb = engine_a.predict(item["state"], qs), engine_b.predict(item["state"], qs)
        for name in qs:
            va, vb = (np.asarray(list(p[name]["probabilities"].values())) for p in (pa, pb))
            agree.append(pa[name]["choice"] == pb[name]["choice"])
            tv.append(0.5 * float(np.abs(va - vb).sum()))
            gold = item["labels"].get(name)
            if gold is not None:
                right_a.append(pa[name]["choice"] == gold)
                right_b.append(pb[name]["choice"] == gold)
    n = len(agree)
    return {
        "task": es.task,
        "questions": n,
        "skipped": skipped,
        "agreement": float(np.mean(agree)) if n else None,
        "mean_tv": float(np.mean(tv)) if n else None,
        "accuracy_mode_a": float(np.mean(right_a)) if right_a else None,
        "accuracy_mode_b": float(np.mean(right_b)) if right_b else None,
    }


def markdown(records: Sequence[dict], min_agreement: float) -> str:
    lines = [
        "| task | questions | argmax agreement | mean TV distance | accuracy Mode A | accuracy Mode B | gate |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    for r in records:
        ok = r["agreement"] is None or r["agreement"] >= min_agreement
        lines.append(
            f"| {r['task']} | {r['questions']} | {f(r['agreement'])} | {f(r['mean_tv'])} | "
            f"{f(r['accuracy_mode_a'])} | {f(r['accuracy_mode_b'])} | {'pass' if ok else 'FAIL'} |"
        )
    return "\n".join(lines) + f"\n\nGate: argmax agreement >= {min_agreement:g} on every task.\n"


def run(engine, sets, out_dir, *, min_agreement: float = 0.8) -> tuple[list[dict], bool]:
    """Compare every set; write agreement.json and agreement.md to `out_dir`; (records, gate passed)."""
    a, b = engines(engine)
    records = [compare_set(a, b, es) for es in sets]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agreement.json").write_text(
        json.dumps({"min_agreement": min_agreement, "tasks": records}, indent=1) + "\n", encoding="utf-8"
    )
    (out / "agreement.md").write_text(markdown(records, min_agreement), encoding="utf-8")
    passed = all(r["agreement"] is None or r["agreement"] >= min_agreement for r in records)
    return records, passed
