"""Temperatures for a trained run, fitted on the data build's calibration split only.

The fine-tuned model (adapter merged) reads the calibration records through the serving engine (the
same planner, executor and presentation orders as predict()); each readout that holds the gold answer
becomes a `lev_jax.calibrate.CalibrationRow`, and `lev_jax.calibrate.fit` fits one temperature per
bucket. A large (grouped) choice gives two rows: its gold's group (round 1) and, when the gold won
its group, the winners (round 2) - the two readouts predict() applies a temperature to. The test
split is never read; `calibrate.fit` itself refuses split names that say test/eval/holdout.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lev_jax import calibrate, domain
from lev_jax.data.splits import HashRng, hash_order

SPLIT = "calibration"
SPLIT_NAME = "mixture-calibration"  # the name recorded in calibration.json


def _canonical(ro, logits_per_row) -> list[np.ndarray]:
    """Each presentation order's logits put back in candidate order."""
    out = []
    for logits, m in zip(logits_per_row, ro.maps):
        canon = np.empty(len(m))
        canon[np.asarray(m)] = np.asarray(logits[: len(m)], np.float64)
        out.append(canon)
    return out


def _gold(record) -> int | bool | None:
    """The gold answer of a record: option index (choice), level (score), bool (noul); None for
    abstain rows, which have none."""
    if record.get("abstain") or record.get("target") is None:
        return None
    q = record["question"]
    if q["type"] == domain.CHOICE:
        return list(q["criteria"]).index(record["target"])
    if q["type"] == domain.SCORE:
        return int(record["target"])
    return int(record["target"]) == domain.RATING_YES


def full_set(record: dict) -> dict:
    """`record` asked as its source's whole canonical taxonomy (every option, registry order, the
    record's own option descriptions), when it is a large choice of a fixed taxonomy; else as is.

    The build's calibration split asks large taxonomies over random option subsets in random order
    (one per band); a model trained on the canonical full set answers those differently from the
    full-set questions it serves, so temperatures fitted on them do not transfer."""
    from lev_jax.data.questions import LARGE_TAXONOMY
    from lev_jax.data.registry import REGISTRY

    q = record["question"]
    spec = REGISTRY.get(record.get("source", ""))
    if q["type"] != domain.CHOICE or spec is None or not spec.options or len(spec.options) <= LARGE_TAXONOMY:
        return record
    if len(q["criteria"]) <= LARGE_TAXONOMY or record.get("target") not in {o.key for o in spec.options}:
        return record
    own = q["criteria"]
    criteria = {o.key: own.get(o.key) for o in spec.options}
    question = {**q, "criteria": criteria}
    return {
        **record,
        "question": question,
        "target_dist": [float(k == record["target"]) for k in criteria],
        "band": domain.band_of(len(criteria)),
    }


def stripped(record: dict, fraction: float, seed: int = 0) -> dict:
    """`record` with its choice's option descriptions dropped, as a run's build drops them from that
    fraction of its train choices (`data_strip_fraction`; the build never strips calibration records):
    drawn per record (its uid, `seed`), so a run trained with every description dropped is calibrated
    on bare option names, as it trains and as the test parts ask. A source whose descriptions are part
    of the answer (`strip_descriptions` False: MCQ) is left as is."""
    from lev_jax.data.registry import REGISTRY

    q = record["question"]
    spec = REGISTRY.get(record.get("source", ""))
    if q["type"] != domain.CHOICE or spec is None or not spec.strip_descriptions:
        return record
    if (
        all(d is None for d in q["criteria"].values())
        or HashRng(seed, "calibration-strip", record["uid"]).random() >= fraction
    ):
        return record
    return {**record, "question": {**q, "criteria": dict.fromkeys(q["criteria"])}}


def build_strip_fraction(data_dir: Path) -> float:
    """The fraction of train choices the build at `data_dir` asked without option descriptions (its
    manifest's question config; 0 for a build that does not record one)."""
    import json

    path = Path(data_dir) / "manifest.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    return float(manifest.get("config", {}).get("question", {}).get("strip_fraction", 0.0))


def layout_of(record: dict, layout: str, layouts=(), large_layout: str = "", seed: int = 0) -> str:
    """The layout a calibration record is read in, as a run trains it: a large choice in
    `large_layout` (when set), anything else in one of `layouts` drawn per record (its uid), or the
    run's `layout` -- so a run trained in both layouts is calibrated on both."""
    q = record["question"]
    if large_layout and q["type"] == domain.CHOICE and domain.band_of(len(q["criteria"])) == "large":
        return large_layout
    if not layouts:
        return layout
    return layouts[HashRng(seed, "calibration-layout", record["uid"]).randbelow(len(layouts))]


def records(
    data_dir: Path,
    limit: int,
    seed: int = 0,
    readouts=(),
    full_sets: bool = False,
    strip_fraction: float = 0.0,
    layout: Callable[[dict], str] | None = None,
) -> list[dict]:
    """About `limit` labelled calibration-split records: a seeded shuffle (not a head slice), spread
    evenly over the temperature buckets (question type, readout, option band), each given at least
    `calibrate.MIN_ROWS` where the split has them, so no bucket is left at T = 1 for want of rows.
    `full_sets`: large taxonomies asked with every option (`full_set`), as such a run trains them;
    `strip_fraction`: choices without their option descriptions as often as the run trains them (`stripped`);
    `layout`: each record's layout (`layout_of`), kept in its "layout" field and spread over like a
    bucket, so every bucket has rows in every layout it is trained in."""
    from lev_jax.data.build import read_split

    rows = [
        stripped(full_set(r) if full_sets else r, strip_fraction, seed)
        for r in read_split(data_dir, SPLIT)
        if _gold(r) is not None and (not readouts or r["readout"] in readouts)
    ]
    if layout is not None:
        rows = [{**r, "layout": layout(r)} for r in rows]
    order = hash_order([r["uid"] for r in rows], seed, "calibration-sample")
    by_bucket: dict[tuple, list[dict]] = {}
    for i in order:
        r = rows[i]
        band = r["band"] if r["question"]["type"] in domain.BANDED_QTYPES else None
        by_bucket.setdefault((r["readout"], band, r.get("layout") if layout is not None else None), []).append(r)
    quota = max(calibrate.MIN_ROWS, limit // max(len(by_bucket), 1))
    return [r for key in sorted(by_bucket, key=str) for r in by_bucket[key][:quota]]


def collect(engine, recs: list[dict], *, chunk: int = 8) -> list[calibrate.CalibrationRow]:
    """Calibration rows of `recs`, read through `engine` with identity temperatures."""
    from lev_jax.readout import Usage

    cal = calibrate.Calibration.identity()
    out = []
    for start in range(0, len(recs), chunk):
        part = recs[start : start + chunk]
        plans = [engine.plan(r["state"], {"q": r["question"]}) for r in part]
        logits = engine.executor.read([(p.prefix_ids, p.rows) for p in plans], [Usage() for _ in plans])
        second = []
        for r, plan, per_plan in zip(part, plans, logits):
            qp, it, gold = plan.questions[0], iter(per_plan), _gold(r)
            per_readout = [[next(it) for _ in ro.rows] for ro in qp.readouts]
            if qp.groups is None:
                ro = qp.readouts[0]
                out.append(
                    calibrate.CalibrationRow(
                        _canonical(ro, per_readout[0]), gold, ro.qtype, ro.mode, r["source"], ro.n, SPLIT_NAME
                    )
                )
                continue
            winners = []
            for g, ro, lg in zip(qp.groups, qp.readouts, per_readout):
                p = cal.readout(_canonical(ro, lg), ro.qtype, ro.mode, ro.n)
                winners.append(g[int(np.argmax(p))])
                if gold in g:
                    out.append(
                        calibrate.CalibrationRow(
                            _canonical(ro, lg), g.index(gold), ro.qtype, ro.mode, r["source"], ro.n, SPLIT_NAME
                        )
                    )
            if gold in winners:
                second.append((r, plan, engine.planner.winners_readout(plan.state_text, qp, winners), winners))
        if second:
            logits2 = engine.executor.read(
                [(plan.prefix_ids, ro.rows) for _, plan, ro, _ in second], [Usage() for _ in second]
            )
            for (r, _, ro, winners), lg in zip(second, logits2):
                out.append(
                    calibrate.CalibrationRow(
                        _canonical(ro, lg), winners.index(_gold(r)), ro.qtype, ro.mode, r["source"], ro.n, SPLIT_NAME
                    )
                )
    return out


def routes_b(engine, record) -> bool:
    """Whether `engine`'s router reads `record`'s question with the Mode B head."""
    from lev_jax.readout import MODE_B

    return engine.plan(record["state"], {"q": record["question"]}).questions[0].route == MODE_B


def fit_run(cfg, run_dir: Path, backbone, data_dir: Path, *, out: Callable[[str], None] = print):
    """Fit and save `run_dir/calibration.json` for the merged `backbone`; returns the Calibration
    (None when the calibration split has no labelled record)."""
    from lev_jax.engine import Engine

    recs = records(
        data_dir,
        cfg.calibration_rows,
        cfg.seed,
        cfg.readouts,
        full_sets=cfg.data_full_set_fraction >= 1.0,
        strip_fraction=build_strip_fraction(data_dir),
        layout=lambda r: layout_of(r, cfg.layout, cfg.layouts, cfg.large_layout, cfg.seed),
    )
    if not recs:
        out("calibration: the calibration split has no labelled record; no temperatures fitted")
        return None
    rows = []
    # one temperature per bucket, fitted on the rows of every layout the run trains (each record in
    # its own): an engine per layout reads its records as it would serve them
    for layout in dict.fromkeys(r["layout"] for r in recs):
        mine = [r for r in recs if r["layout"] == layout]
        kw = dict(
            prompt_style=cfg.prompt_style,
            layout=layout,
            noul_readout=cfg.noul_readout,
            option_averaging=cfg.option_averaging,
            model_name=backbone.name,
        )
        # the run's head (if any) reads what it will serve
        engine = Engine(backbone, mode_b_min_options=cfg.mode_b_min_options, **kw)
        rows += collect(engine, mine)
        routed_b = [r for r in mine if routes_b(engine, r)]
        if routed_b:
            # ...and those choices read by label codes too: a caller can switch the head off
            # (`load(mode_b=False)`; levbench agree compares the two), and without temperatures of its
            # own a large letter readout would fall back to the small choices' bucket
            rows += collect(Engine(backbone, mode_b=False, **kw), routed_b)
    cal = calibrate.fit(rows, splits=[SPLIT_NAME], model_id=backbone.name)
    path = cal.save(run_dir)
    temps = ", ".join(f"{k} T={t:.2f}" for k, t in cal.describe()["temperatures"].items())
    layouts = ", ".join(f"{k} {v}" for k, v in Counter(r["layout"] for r in recs).items())
    out(f"calibration: {len(rows)} rows from {len(recs)} calibration-split records ({layouts}) -> {path} ({temps})")
    return cal
