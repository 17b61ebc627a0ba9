"""Soft targets from a teacher: a build whose train choices carry a trained model's read of them.

    python -m data distill --data BUILD --teacher lev_jax/default --out BUILD_KD [--mix 0.5]

Every train record that asks a choice (abstain rows aside: their uniform target stays) is read by
the teacher as served (its own prompt settings and calibration, one request per record) and its
`target_dist` becomes ``mix * target + (1 - mix) * teacher``, over the record's options in its own
order. A Mode B run on such a build learns the teacher's confusions as well as the gold, and with
`mode_b_options` its sampled rows hold the gold plus the options the teacher finds most alike: hard
negatives where random ones are mostly easy.

Only the train split changes: calibration and test are copied byte for byte (a temperature is never
fitted on a teacher's view, and nothing is measured on one). The teacher's reads are appended to
``OUT/teacher.jsonl`` as they come, so an interrupted run resumes where it stopped; the manifest
records the teacher, the mix and how often the teacher's argmax is the gold.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lev_jax.data.build import read_split, write_split
from lev_jax.data.guard import sha256_file
from lev_jax.data.lengths import dumps

CACHE = "teacher.jsonl"
READ_BATCH = 8  # records per predict_many call: one micro-batch's worth of shared device calls


def _cached(path: Path) -> dict[str, list[float]]:
    """uid -> the teacher's probabilities; a torn last line (an interrupted write) is dropped."""
    done: dict[str, list[float]] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[d["uid"]] = d["p"]
    return done


def distillable(record: dict[str, Any]) -> bool:
    """A choice with a gold: abstain rows (a question over an unrelated state) keep their uniform
    target, which says the state holds no answer, whatever a teacher would guess."""
    return record["primitive"] == "choice" and not record.get("abstain")


def teacher_reads(engine, records: list[dict[str, Any]], cache: Path, log: Callable[[str], None] = print) -> dict:
    """uid -> the engine's probabilities over each choice record's options (in the record's order),
    read in micro-batches and appended to `cache`; records already there are not read again."""
    done = _cached(cache)
    todo = [r for r in records if distillable(r) and r["uid"] not in done]
    with cache.open("a", encoding="utf-8") as f:
        for k in range(0, len(todo), READ_BATCH):
            chunk = todo[k : k + READ_BATCH]
            answers = engine.predict_many([(r["state"], {"q": r["question"]}) for r in chunk])
            for r, a in zip(chunk, answers):
                if isinstance(a, Exception):
                    raise ValueError(f"the teacher refused train record {r['uid']}: {a}") from a
                probs = a["q"]["probabilities"]
                p = [float(probs[name]) for name in r["question"]["criteria"]]
                done[r["uid"]] = p
                f.write(json.dumps({"uid": r["uid"], "p": p}) + "\n")
            f.flush()
            if (k // READ_BATCH) % 50 == 0:
                log(f"teacher: {k + len(chunk)}/{len(todo)} records read")
    return done


def mixed_targets(records: list[dict[str, Any]], reads: dict, mix: float) -> tuple[list[dict[str, Any]], float]:
    """The records with `target_dist` := mix * target + (1 - mix) * teacher where the teacher read
    them, and the teacher's argmax == target argmax rate over those."""
    out, agree = [], []
    for r in records:
        p = reads.get(r["uid"])
        if p is None or not distillable(r):
            out.append(r)
            continue
        target = np.asarray(r["target_dist"], np.float64)
        p = np.asarray(p, np.float64)
        if p.shape != target.shape:
            raise ValueError(f"record {r['uid']}: the teacher read {p.size} options, the record has {target.size}")
        agree.append(int(np.argmax(p) == np.argmax(target)))
        out.append({**r, "target_dist": [float(x) for x in mix * target + (1 - mix) * p]})
    return out, float(np.mean(agree)) if agree else float("nan")


def distill(data_dir, out_dir, teacher: str, *, mix: float = 0.5, log: Callable[[str], None] = print) -> dict:
    """Write the distilled build to `out_dir`; returns its manifest."""
    import lev_jax

    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"--mix must be in [0, 1], got {mix}")
    src, out = Path(data_dir), Path(out_dir)
    if src.resolve() == out.resolve():
        raise ValueError("--out must differ from --data: the build is read, never rewritten in place")
    manifest = json.loads((src / "manifest.json").read_text(encoding="utf-8"))
    records = read_split(src, "train")
    source_sha = manifest["splits"]["train"]["sha256"]
    engine = lev_jax.load(teacher)  # a teacher that does not load is refused before anything is written
    out.mkdir(parents=True, exist_ok=True)
    reads = teacher_reads(engine, records, out / CACHE, log)
    rows, agreement = mixed_targets(records, reads, mix)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("train.array_record", "manifest.json", CACHE):
            shutil.copy2(f, out / f.name)
    write_split(out / "train.array_record", rows)
    manifest["splits"]["train"]["sha256"] = sha256_file(out / "train.array_record")
    manifest["distilled"] = {
        "teacher": engine.model_name,
        "mix": mix,
        "records": sum(1 for r in records if distillable(r)),
        "teacher_argmax_is_target": agreement,
        "source_train_sha256": source_sha,
    }
    (out / "manifest.json").write_text(dumps(manifest), encoding="utf-8")
    return manifest
