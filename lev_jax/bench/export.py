"""``levbench export``: eval-set files from the shared eval data and from the data pipeline.

From the eval-data folder (``$LEV_EVAL_DATA`` or ``<repo>/../shared/eval-data``):

============================  ===========  ==================================================
file written                  role         content
============================  ===========  ==================================================
``banking77-test.json``       test         BANKING77 test, one 77-way choice
``clinc150-test.json``        test         CLINC150 test (in-scope), one 150-way choice
``boolq-dev.json``            test         BoolQ dev, a noul question per item over its passage
``banking77-train.json``      calibration  BANKING77 train, the same 77-way choice
``clinc150-val.json``         calibration  CLINC150 val (in-scope), the same 150-way choice
============================  ===========  ==================================================

Choice questions use the data registry's canonical instructions and the option keys in the
registry's order, without descriptions (``null``): the same question for the test and the
calibration file of a dataset, and about half the prompt of the described options (the embedded
model reads every option once per presentation order). Calibration files drop rows whose text
is also an evaluation row (:meth:`lev_jax.data.guard.Guard.eval_texts`).

Every file carries ``meta`` (``source``, ``split``, ``role``); ``levbench fit`` refuses files
whose role is ``test``.

From the data pipeline (``python -m data build --out DATA``): ``export --pipeline DATA --split
calibration`` writes that split as ``mixture-calibration.<source>.json`` (role ``calibration``);
``--split test`` writes ``mixture-test.<source>.json`` (role ``test``). This is the pipeline's
own ``python -m data eval`` export, renamed and given ``meta``.
"""

from __future__ import annotations

import csv
import json
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from lev_jax.bench.evalset import EvalSet
from lev_jax.data.guard import EVAL_DATA_ENV, default_eval_data_dir

TEST, CALIBRATION = "test", "calibration"


def _spec(name: str):
    from lev_jax.data.registry import get_spec

    return get_spec(name)


def _choice_question(spec_name: str, drop: Sequence[str] = ()) -> dict[str, Any]:
    spec = _spec(spec_name)
    return {
        "type": "choice",
        "instructions": spec.instructions[0],
        "criteria": {o.key: None for o in spec.options if o.key not in drop},
    }


def _eval_texts(eval_data: Path) -> set[str]:
    from lev_jax.data.guard import Guard

    return Guard(eval_data).eval_texts()


def _norm(text: str) -> str:
    from lev_jax.data.splits import normalize_text

    return normalize_text(text)


def _choice_set(
    task: str, question: dict, rows: Iterable[tuple[str, str]], meta: dict, exclude: set[str] | None = None
) -> EvalSet:
    name = task.split("-")[0]
    items, dropped, unknown = [], 0, 0
    for text, label in rows:
        if label not in question["criteria"]:
            unknown += 1
            continue
        if exclude is not None and _norm(text) in exclude:
            dropped += 1
            continue
        items.append({"state": text, "labels": {name: label}})
    meta = {
        **meta,
        "task": task,
        "n_items": len(items),
        "options": len(question["criteria"]),
        "option_descriptions": False,
    }
    if exclude is not None:
        meta["dropped_as_evaluation_rows"] = dropped
    if unknown:
        meta["dropped_unknown_labels"] = unknown
    return EvalSet(task, {name: question}, items, meta)


def banking77(eval_data: Path, split: str, exclude: set[str] | None = None) -> EvalSet:
    fname = f"banking77-{split}.csv"
    with open(eval_data / fname, newline="", encoding="utf-8") as f:
        rows = [(r["text"], r["category"]) for r in csv.DictReader(f)]
    role = TEST if split == "test" else CALIBRATION
    return _choice_set(
        f"banking77-{split}",
        _choice_question("banking77"),
        rows,
        {"source": f"eval-data/{fname}", "split": f"banking77-{split}", "role": role},
        exclude if role == CALIBRATION else None,
    )


def clinc150(eval_data: Path, part: str, exclude: set[str] | None = None) -> EvalSet:
    data = json.loads((eval_data / "clinc150-small.json").read_text(encoding="utf-8"))
    rows = [(r[0], r[1]) for r in data[part]]
    role = TEST if part == "test" else CALIBRATION
    return _choice_set(
        f"clinc150-{part}",
        _choice_question("clinc_oos", drop=("oos",)),
        rows,
        {
            "source": f"eval-data/clinc150-small.json#{part}",
            "split": f"clinc150-{part}",
            "role": role,
            "note": "in-scope intents only (oos rows are not one of the 150 options)",
        },
        exclude if role == CALIBRATION else None,
    )


def boolq(eval_data: Path) -> EvalSet:
    questions, items = {}, []
    with open(eval_data / "boolq-dev.jsonl", encoding="utf-8") as f:
        for i, line in enumerate(ln for ln in f if ln.strip()):
            rec = json.loads(line)
            text = rec["question"].strip()
            name = f"boolq.{i}"
            questions[name] = {
                "type": "noul",
                "instructions": text[:1].upper() + text[1:].rstrip("?") + "?",
                "criteria": None,
            }
            items.append({"state": f"{rec['title']}\n\n{rec['passage']}", "labels": {name: bool(rec["answer"])}})
    return EvalSet(
        "boolq-dev",
        questions,
        items,
        {
            "source": "eval-data/boolq-dev.jsonl",
            "split": "boolq-dev",
            "role": TEST,
            "task": "boolq-dev",
            "n_items": len(items),
            "note": "state: title and passage; one noul question per item",
        },
    )


EXPORTS: dict[str, tuple[str, Callable[..., EvalSet]]] = {
    "banking77-test": (TEST, lambda d, ex: banking77(d, "test")),
    "clinc150-test": (TEST, lambda d, ex: clinc150(d, "test")),
    "boolq-dev": (TEST, lambda d, ex: boolq(d)),
    "banking77-train": (CALIBRATION, lambda d, ex: banking77(d, "train", ex)),
    "clinc150-val": (CALIBRATION, lambda d, ex: clinc150(d, "val", ex)),
}


def export_eval_data(
    out_dir: str | Path, eval_data: str | Path | None = None, which: str = "all", tasks: Sequence[str] | None = None
) -> dict[str, int]:
    """Write the eval-data exports (``which``: ``test``, ``calibration`` or ``all``; or the named
    ``tasks``) to ``out_dir``; returns items per task."""
    d = Path(eval_data) if eval_data is not None else default_eval_data_dir()
    if not d.is_dir():
        raise FileNotFoundError(f"no eval-data folder at {d} (set ${EVAL_DATA_ENV} or pass --eval-data)")
    names = list(tasks) if tasks else [n for n, (role, _) in EXPORTS.items() if which in ("all", role)]
    unknown = [n for n in names if n not in EXPORTS]
    if unknown:
        raise ValueError(f"unknown export task(s) {unknown}; known: {list(EXPORTS)}")
    exclude = _eval_texts(d) if any(EXPORTS[n][0] == CALIBRATION for n in names) else None
    out = Path(out_dir)
    counts = {}
    for n in names:
        es = EXPORTS[n][1](d, exclude)
        es.save(out / f"{n}.json")
        counts[n] = len(es.items)
    return counts


def export_pipeline(data_dir: str | Path, out_dir: str | Path, split: str = CALIBRATION) -> dict[str, int]:
    """The data pipeline's ``split`` as ``mixture-<split>.<source>.json`` files with ``meta``."""
    from lev_jax.data.build import export_eval

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    with tempfile.TemporaryDirectory(prefix="levbench-export-") as tmp:
        export_eval(data_dir, tmp, split)
        for f in sorted(Path(tmp).glob("*.json")):
            es = EvalSet.load(f)
            task = f"mixture-{split}.{f.stem}"
            es.task = task
            es.meta = {
                "source": f"data-pipeline:{Path(data_dir).name}/{split}/{f.stem}",
                "split": f"mixture-{split}/{f.stem}",
                "role": split,
                "task": task,
                "n_items": len(es.items),
            }
            es.save(out / f"{task}.json")
            counts[task] = len(es.items)
    return counts
