"""Build the training mixture: guard -> load -> split -> limit -> mix -> abstain -> check -> write.

Order matters and is fixed:

1. the contamination guard runs on every requested source (and every local file) before anything
   loads;
2. each source's records become base examples (a record that cannot be used is dropped and counted
   by reason in the manifest), exact duplicates are dropped and rows that match an evaluation row of
   the eval-data folder are removed (a source where that is more than 5 % of rows is refused as
   evaluation data);
3. every base example gets its split from blake2b(dataset, position, text) of its split unit, before
   any mixing, so no underlying row can be in two splits whatever the layouts or option sets;
4. ``limit_per_source`` cuts each source after a seeded hash shuffle (a head slice is not a sample),
   keeping one train row of every label first;
5. the train split is mixed: banking77 + clinc_oos take 25 %, the rest splits evenly across the
   primitives present (and evenly across sources inside each), then ``abstain_fraction`` of the
   mixture is abstain rows (a question paired with a state from an unrelated source, uniform target);
6. coverage checks raise (see ``CoverageError``); token lengths are measured; the three splits are
   written as ArrayRecord files (one JSON row per record) with an index, the length statistics and a
   manifest. The same inputs give byte-identical files.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lev_jax.data.guard import ContaminationError, Guard, Violation, sha256_file
from lev_jax.data.lengths import Encode, dumps, encoder, length_stats, length_text
from lev_jax.data.questions import QuestionConfig, make_question, uniform_dist
from lev_jax.data.registry import REGISTRY, SourceSpec, SpecError, get_spec
from lev_jax.data.sources import LocalSource, Resolved, SourceUnavailable, resolve
from lev_jax.data.splits import SPLITS, HashRng, assign_split, blake2b_hex, hash_order, normalize_text, reachable_bands
from lev_jax.domain import BANDS, NOUL, RATING_YES

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ARRAY_RECORD_OPTIONS = "group_size:1,zstd:3"  # grain wants group size 1 for random access
INTENT_BUCKET = "intent"


class CoverageError(ValueError):
    """A label or option-count band the mixture needs is missing."""


@dataclass(frozen=True)
class BuildConfig:
    seed: int = 0
    limit_per_source: int = 20_000
    n_examples: int | None = None  # train rows incl. abstain; None: the largest exact mixture without repeats
    schema_first_fraction: float = 0.5
    abstain_fraction: float = 0.1
    intent_share: float = 0.25
    decontamination_max_fraction: float = 0.05
    question: QuestionConfig = field(default_factory=QuestionConfig)
    tokenizer: str = "qwen3.5-27b"


@dataclass
class SourceReport:
    origin: str
    raw: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> records (or completions) not usable
    examples: int = 0
    duplicates: int = 0
    decontaminated: int = 0
    limited: int = 0
    split: dict[str, int] = field(default_factory=dict)
    train_selected: int = 0
    train_repeats: int = 0


@dataclass
class BuildResult:
    rows: dict[str, list[dict[str, Any]]]
    sources: dict[str, SourceReport]
    skipped: dict[str, str]
    mixture: dict[str, Any]
    config: BuildConfig


# ---------------------------------------------------------------------------------------------


def _ex_texts(ex: Mapping[str, Any]) -> list[str]:
    st = ex["state"]
    if isinstance(st, dict):
        return [str(v) for v in st.values()]
    return [str(st)]


def _label_key(label: Any) -> str:
    return json.dumps(label)


def prepare_source(
    spec: SourceSpec,
    records: Iterable[Mapping[str, Any]],
    *,
    eval_texts: set[str],
    cfg: BuildConfig,
    label_map: Mapping[Any, Any] | None = None,
    origin: str = "",
) -> tuple[list[dict[str, Any]], SourceReport]:
    """Base examples of one source with split, item key and uid; deduped, decontaminated, limited."""
    from lev_jax.data.registry import build_examples

    rep = SourceReport(origin=origin)
    counted = _Counted(records)
    dropped: Counter[str] = Counter()
    seen: set[str] = set()
    examples: list[dict[str, Any]] = []
    for ex in build_examples(spec, counted, label_map, dropped):
        key = normalize_text(ex["key_text"]) + "\x1f" + ex["variant"]
        if key in seen:
            rep.duplicates += 1
            continue
        seen.add(key)
        if eval_texts and any(normalize_text(t) in eval_texts for t in _ex_texts(ex)):
            rep.decontaminated += 1
            continue
        unit_pos, unit_text = ex["unit"]
        ex["split"] = assign_split(spec.dataset, unit_pos, unit_text)
        ex["item"] = blake2b_hex(spec.dataset, unit_pos, unit_text)
        ex["uid"] = blake2b_hex(spec.name, ex["position"], ex["variant"], ex["key_text"])
        examples.append(ex)
    rep.raw = counted.n
    rep.dropped = dict(sorted(dropped.items()))
    if dropped:
        log.warning("%s: dropped %s", spec.name, drops_text(rep.dropped))
    total = len(examples) + rep.decontaminated
    if total >= 20 and rep.decontaminated > cfg.decontamination_max_fraction * total:
        raise ContaminationError(
            [Violation(spec.name, origin, f"{rep.decontaminated} of {total} rows are rows of the evaluation sets")]
        )
    if rep.decontaminated:
        log.warning("%s: dropped %d rows that are also evaluation rows", spec.name, rep.decontaminated)
    if len(examples) > cfg.limit_per_source:
        order = hash_order([e["uid"] for e in examples], cfg.seed, "limit", spec.name)
        chosen = _cover_first([examples[i] for i in order], cfg.limit_per_source, lambda e: e["split"] == "train")
        keep = {id(e) for e in chosen}
        rep.limited = len(examples) - len(chosen)
        examples = [e for e in examples if id(e) in keep]
    rep.examples = len(examples)
    for s in SPLITS:
        rep.split[s] = sum(1 for e in examples if e["split"] == s)
    return examples, rep


def drops_text(dropped: Mapping[str, int]) -> str:
    """``"3 (missing field 'text' 2, no gold label 1)"``: the total, then each reason, most first."""
    detail = ", ".join(f"{why} {n}" for why, n in sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{sum(dropped.values())} ({detail})"


class _Counted:
    def __init__(self, it: Iterable[Any]):
        self._it, self.n = it, 0

    def __iter__(self):
        for x in self._it:
            self.n += 1
            yield x


def _cover_first(
    ordered: list[dict[str, Any]], k: int, eligible: Callable[[dict[str, Any]], bool]
) -> list[dict[str, Any]]:
    """The first ``k`` of ``ordered``, after first taking one eligible example of every label."""
    first, seen = [], set()
    for e in ordered:
        lk = _label_key(e["label"])
        if lk not in seen and eligible(e):
            seen.add(lk)
            first.append(e)
    picked = first[:k]
    ids = {id(e) for e in picked}
    for e in ordered:
        if len(picked) >= k:
            break
        if id(e) not in ids:
            picked.append(e)
            ids.add(id(e))
    return picked


def _largest_remainder(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    wsum = sum(weights.values())
    raw = {k: total * w / wsum for k, w in weights.items()}
    out = {k: int(math.floor(v)) for k, v in raw.items()}
    rest = total - sum(out.values())
    for k in sorted(raw, key=lambda k: (-(raw[k] - out[k]), k))[:rest]:
        out[k] += 1
    return out


def _water_fill(total: int, caps: Mapping[str, int]) -> dict[str, int]:
    """Split ``total`` evenly over sources, capped by what each has (sum(caps) >= total)."""
    out = {k: 0 for k in caps}
    left, open_ = total, sorted(k for k, c in caps.items() if c > 0)
    while left > 0 and open_:
        share = _largest_remainder(left, {k: 1.0 for k in open_})
        nxt = []
        for k in open_:
            take = min(share[k], caps[k] - out[k])
            out[k] += take
            left -= take
            if out[k] < caps[k]:
                nxt.append(k)
        if nxt == open_ and all(share[k] == 0 for k in open_):
            break
        open_ = nxt
    return out


def plan_mixture(avail: Mapping[str, int], buckets: Mapping[str, str], cfg: BuildConfig) -> dict[str, Any]:
    """Per-source train quotas. ``avail``: train examples per source; ``buckets``: source -> bucket."""
    present: dict[str, list[str]] = {}
    for s, n in avail.items():
        if n > 0:
            present.setdefault(buckets[s], []).append(s)
    if not present:
        return {"weights": {}, "n_regular": 0, "n_abstain": 0, "quota": {}, "repeat": False}
    others = sorted(b for b in present if b != INTENT_BUCKET)
    weights: dict[str, float] = {}
    if INTENT_BUCKET in present:
        weights[INTENT_BUCKET] = cfg.intent_share if others else 1.0
    for b in others:
        weights[b] = (1.0 - weights.get(INTENT_BUCKET, 0.0)) / len(others)
    bucket_avail = {b: sum(avail[s] for s in present[b]) for b in present}
    if cfg.n_examples is not None:
        n_abstain = int(round(cfg.n_examples * cfg.abstain_fraction))
        n_regular = cfg.n_examples - n_abstain
    else:
        n_regular = int(min(bucket_avail[b] / weights[b] for b in weights if weights[b] > 0))
        af = cfg.abstain_fraction
        n_abstain = int(round(n_regular * af / (1.0 - af))) if af < 1 else 0
    bq = _largest_remainder(n_regular, weights)
    quota: dict[str, int] = {}
    repeat = False
    for b, q in bq.items():
        caps = {s: avail[s] for s in present[b]}
        if q <= bucket_avail[b]:
            quota.update(_water_fill(q, caps))
        else:
            repeat = True
            quota.update(_largest_remainder(q, {s: float(c) for s, c in caps.items()}))
    return {
        "weights": weights,
        "n_regular": n_regular,
        "n_abstain": n_abstain,
        "quota": quota,
        "bucket_quota": bq,
        "repeat": repeat,
    }


def _row(spec: SourceSpec, ex: Mapping[str, Any], split: str, cfg: BuildConfig, rep: int = 0) -> dict[str, Any]:
    uid = ex["uid"] if rep == 0 else blake2b_hex(ex["uid"], "repeat", rep)
    q = make_question(spec, dict(ex), split, HashRng(cfg.seed, "question", uid), cfg.question)
    layout = "schema_first" if HashRng(cfg.seed, "layout", uid).random() < cfg.schema_first_fraction else "state_first"
    return {
        "uid": uid,
        "item": ex["item"],
        "source": spec.name,
        "dataset": spec.dataset,
        "primitive": spec.primitive,
        "readout": spec.readout,
        "split": split,
        "state": ex["state"],
        "question": q["question"],
        "layout": layout,
        "target": q["target"],
        "target_dist": q["target_dist"],
        "label": ex["label"],
        "abstain": False,
        "negated": q["negated"],
        "canonical": q["canonical"],
        "full_options": q["full_options"],
        "n_options": q["n_options"],
        "band": q["band"],
        "aspect": ex.get("aspect"),
        "state_source": spec.name,
        "repeat": rep,
        "length": 0,
    }


def _abstain_rows(train: list[dict[str, Any]], n: int, cfg: BuildConfig) -> tuple[list[dict[str, Any]], str]:
    if n <= 0 or not train:
        return [], ""
    topic = {r["source"]: REGISTRY[r["source"]].topic for r in train}
    by_topic: dict[str, list[dict[str, Any]]] = {}
    for r in train:
        by_topic.setdefault(topic[r["source"]], []).append(r)
    if len(by_topic) < 2:
        return [], "abstain rows need sources from at least two unrelated topics"
    topics = sorted(by_topic)
    qorder = hash_order([r["uid"] for r in train], cfg.seed, "abstain-question")
    out = []
    for i in range(n):
        qrow = train[qorder[i % len(qorder)]]
        rng = HashRng(cfg.seed, "abstain", i, qrow["uid"])
        others = [t for t in topics if t != topic[qrow["source"]]]
        sizes = [len(by_topic[t]) for t in others]
        pick = rng.randbelow(sum(sizes))
        for t, sz in zip(others, sizes):
            if pick < sz:
                srow = by_topic[t][pick]
                break
            pick -= sz
        uid = blake2b_hex("abstain", qrow["uid"], srow["uid"], i)
        question = qrow["question"]
        layout = (
            "schema_first" if HashRng(cfg.seed, "layout", uid).random() < cfg.schema_first_fraction else "state_first"
        )
        out.append(
            {
                "uid": uid,
                "item": srow["item"],
                "source": qrow["source"],
                "dataset": qrow["dataset"],
                "primitive": qrow["primitive"],
                "readout": qrow["readout"],
                "split": "train",
                "state": srow["state"],
                "question": question,
                "layout": layout,
                "target": None,
                "target_dist": uniform_dist(question),
                "label": None,
                "abstain": True,
                "negated": qrow["negated"],
                "canonical": False,
                "full_options": qrow["full_options"],
                "n_options": qrow["n_options"],
                "band": qrow["band"],
                "aspect": qrow["aspect"],
                "state_source": srow["source"],
                "repeat": 0,
                "length": 0,
                "question_item": qrow["item"],
            }
        )
    return out, ""


def check_coverage(rows: Mapping[str, list[dict[str, Any]]], sources: Iterable[str]) -> None:
    """Raise CoverageError when
    * a label observed in any split is absent from train (taxonomies, scores, Noul);
    * a label the canonical question offers is never observed (taxonomies and scores; Noul exempt);
    * the calibration split lacks an option-count band that its choice sources can reach.
    Multiple-choice answer letters are positions, not labels, and are exempt."""
    problems: list[str] = []
    for name in sources:
        spec = REGISTRY[name]
        if spec.kind in ("mcq",):
            continue
        observed: dict[str, set[str]] = {}
        train: set[str] = set()
        for split, rs in rows.items():
            for r in rs:
                if r["source"] == name and not r["abstain"]:
                    lk = _label_key(r["label"])
                    observed.setdefault(lk, set()).add(split)
                    if split == "train":
                        train.add(lk)
        if not observed:
            continue
        missing_train = sorted(set(observed) - train)
        if missing_train:
            shown = ", ".join(f"{json.loads(k)!r} (in {'/'.join(sorted(observed[k]))})" for k in missing_train[:10])
            problems.append(f"{name}: {len(missing_train)} label(s) observed but not in train: {shown}")
        offered = spec.offered_labels()
        if offered is not None:
            unseen = [lab for lab in offered if _label_key(lab) not in observed]
            if unseen:
                problems.append(
                    f"{name}: {len(unseen)} of {len(offered)} offered label(s) never observed "
                    f"(undersampled taxonomy?): {', '.join(map(repr, unseen[:10]))}"
                    + (" ..." if len(unseen) > 10 else "")
                )
    cal = [r for r in rows.get("calibration", []) if not r["abstain"]]
    reach: set[str] = set()
    for name in {r["source"] for r in cal}:
        spec = REGISTRY[name]
        if spec.primitive == "choice":
            n_full = (
                len(spec.options)
                if spec.kind == "classify"
                else max(r["n_options"] for r in cal if r["source"] == name)
            )
            reach.update(reachable_bands(n_full))
    have = {r["band"] for r in cal}
    lacking = [b for b in BANDS if b in reach and b not in have]
    if lacking:
        problems.append(f"calibration split has no rows in option-count band(s) {', '.join(lacking)}")
    if problems:
        raise CoverageError("coverage check failed:\n  " + "\n  ".join(problems))


def assemble(
    sources: Sequence[str] | None = None,
    *,
    cfg: BuildConfig = BuildConfig(),
    local: Mapping[str, LocalSource] | None = None,
    use_hub: bool = True,
    require: Iterable[str] = (),
    eval_data_dir: str | os.PathLike | None = None,
    encode: Encode | None = None,
    length_fn: Callable[[Mapping[str, Any]], int] | None = None,
    guard: Guard | None = None,
) -> BuildResult:
    """Everything but writing. ``require``: sources whose absence is an error instead of a skip."""
    names = list(sources) if sources is not None else list(REGISTRY)
    local = dict(local or {})
    require = set(require)
    unknown = [n for n in [*names, *local, *require] if n not in REGISTRY]
    if unknown:
        raise SpecError(f"unknown source(s) {', '.join(sorted(set(unknown)))}; known: {', '.join(REGISTRY)}")
    for n in require | set(local):
        if n not in names:
            names.append(n)
    guard = guard or Guard(eval_data_dir)
    edir = Path(eval_data_dir) if eval_data_dir is not None else guard.eval_data_dir

    # 1. resolve (no data read), then guard everything before any load.
    resolved: dict[str, Resolved] = {}
    skipped: dict[str, str] = {}
    violations: list[Violation] = []
    for n in names:
        spec = get_spec(n)
        try:
            r = resolve(spec, local=local.get(n), use_hub=use_hub, eval_data_dir=edir)
            resolved[n] = r
            violations += guard.check_spec(spec, r.local.path if r.local else None, r.local.parts if r.local else None)
        except SourceUnavailable as e:
            violations += guard.check_spec(spec)
            if n in require:
                guard.enforce(violations)
                raise
            skipped[n] = str(e)
    guard.enforce(violations)
    for why in skipped.values():
        log.info("skipping %s", why)  # listed in the manifest and by `python -m data build`

    # 2-4. load, dedupe, decontaminate, split, limit.
    eval_texts = guard.eval_texts()
    examples: dict[str, list[dict[str, Any]]] = {}
    reports: dict[str, SourceReport] = {}
    for n, r in resolved.items():
        spec = REGISTRY[n]
        try:
            exs, rep = prepare_source(
                spec,
                r.records(),
                eval_texts=eval_texts,
                cfg=cfg,
                label_map=r.local.label_map if r.local else None,
                origin=r.display,
            )
        except SourceUnavailable as e:
            if n in require:
                raise
            skipped[n] = str(e)
            log.warning("skipping %s", e)
            continue
        if not exs:
            msg = f"{n}: no usable rows in {r.display}"
            if rep.dropped:
                msg += f"; dropped {drops_text(rep.dropped)}"
            if n in require:
                raise SourceUnavailable(msg)
            skipped[n] = msg
            continue
        examples[n], reports[n] = exs, rep
        log.info(
            "%s: %d examples from %s (%s)", n, len(exs), r.display, ", ".join(f"{k} {v}" for k, v in rep.split.items())
        )

    if not examples:
        raise SourceUnavailable("no source could be loaded:\n  " + "\n  ".join(skipped.values()))

    # 5. rows per split; train is mixed.
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    for n, exs in examples.items():
        spec = REGISTRY[n]
        for ex in exs:
            if ex["split"] != "train":
                rows[ex["split"]].append(_row(spec, ex, ex["split"], cfg))
    avail = {n: sum(1 for e in exs if e["split"] == "train") for n, exs in examples.items()}
    mix = plan_mixture(avail, {n: REGISTRY[n].bucket for n in examples}, cfg)
    for n, q in sorted(mix["quota"].items()):
        spec = REGISTRY[n]
        tr = [e for e in examples[n] if e["split"] == "train"]
        order = [tr[i] for i in hash_order([e["uid"] for e in tr], cfg.seed, "mix", n)]
        base = _cover_first(order, min(q, len(order)), lambda e: True)
        ids = {id(e) for e in base}
        ordered = base + [e for e in order if id(e) not in ids]
        for i in range(q):
            rep_i, j = divmod(i, len(ordered))
            rows["train"].append(_row(spec, ordered[j], "train", cfg, rep_i))
        reports[n].train_selected = q
        reports[n].train_repeats = max(0, (q - 1) // len(ordered)) if ordered else 0
    abstain, why = _abstain_rows(rows["train"], mix["n_abstain"], cfg)
    if why:
        log.warning("no abstain rows: %s", why)
        mix["abstain_note"] = why
    rows["train"] += abstain
    mix["n_abstain"] = len(abstain)

    # 6. checks, lengths, order.
    check_coverage(rows, examples.keys())
    if length_fn is None:
        enc = encode or encoder(cfg.tokenizer)
        cache: dict[str, int] = {}

        def length_fn(row: Mapping[str, Any]) -> int:
            text = length_text(row)
            if text not in cache:
                cache[text] = len(enc(text))
            return cache[text]

    for s in SPLITS:
        for r in rows[s]:
            r["length"] = int(length_fn(r))
    src_rank = {n: i for i, n in enumerate(REGISTRY)}
    tr = rows["train"]
    rows["train"] = [tr[i] for i in hash_order([r["uid"] for r in tr], cfg.seed, "train-order")]
    for s in ("calibration", "test"):
        rows[s].sort(key=lambda r: (src_rank[r["source"]], r["uid"]))
    return BuildResult(rows=rows, sources=reports, skipped=skipped, mixture=mix, config=cfg)


# ---------------------------------------------------------------------------------------------
# Writing and reading
# ---------------------------------------------------------------------------------------------


def encode_row(row: Mapping[str, Any]) -> bytes:
    return json.dumps(row, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def decode_row(data: bytes) -> dict[str, Any]:
    return json.loads(data.decode("utf-8"))


def write_split(path: Path, rows: list[dict[str, Any]]) -> None:
    """One split's rows as an ArrayRecord file, written beside it and renamed into place."""
    from array_record.python.array_record_module import ArrayRecordWriter

    tmp = path.with_suffix(path.suffix + ".tmp")
    w = ArrayRecordWriter(str(tmp), ARRAY_RECORD_OPTIONS)
    try:
        for r in rows:
            w.write(encode_row(r))
    finally:
        w.close()
    os.replace(tmp, path)


def write(result: BuildResult, out_dir: str | os.PathLike) -> dict[str, Any]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, Any] = {}
    for s in SPLITS:
        rows = result.rows[s]
        f = out / f"{s}.array_record"
        write_split(f, rows)
        index = {
            "readout": [r["readout"] for r in rows],
            "length": [r["length"] for r in rows],
            "source": [r["source"] for r in rows],
            "abstain": [r["abstain"] for r in rows],
        }
        (out / f"{s}.index.json").write_text(json.dumps(index, separators=(",", ":")) + "\n", encoding="utf-8")
        by_source: dict[str, int] = {}
        by_readout: dict[str, int] = {}
        by_band: dict[str, int] = {}
        for r in rows:
            key = "_abstain" if r["abstain"] else r["source"]
            by_source[key] = by_source.get(key, 0) + 1
            by_readout[r["readout"]] = by_readout.get(r["readout"], 0) + 1
            by_band[r["band"]] = by_band.get(r["band"], 0) + 1
        splits[s] = {
            "file": f.name,
            "index": f"{s}.index.json",
            "rows": len(rows),
            "sha256": sha256_file(f),
            "by_source": dict(sorted(by_source.items())),
            "by_readout": dict(sorted(by_readout.items())),
            "by_band": dict(sorted(by_band.items())),
        }
    stats = length_stats(result.rows)
    (out / "length_stats.json").write_text(dumps(stats), encoding="utf-8")
    cfg = asdict(result.config)
    manifest = {
        "format": FORMAT_VERSION,
        "record_format": "array_record",
        "record_options": ARRAY_RECORD_OPTIONS,
        "config": cfg,
        "splits": splits,
        "sources": {n: asdict(r) for n, r in sorted(result.sources.items())},
        "skipped": dict(sorted(result.skipped.items())),
        "mixture": result.mixture,
        "length_stats": "length_stats.json",
    }
    (out / "manifest.json").write_text(dumps(manifest), encoding="utf-8")
    return manifest


def build(out_dir: str | os.PathLike, sources: Sequence[str] | None = None, **kw: Any) -> dict[str, Any]:
    """Assemble and write; returns the manifest."""
    return write(assemble(sources, **kw), out_dir)


def read_split(data_dir: str | os.PathLike, split: str) -> list[dict[str, Any]]:
    from array_record.python.array_record_module import ArrayRecordReader

    path = Path(data_dir) / f"{split}.array_record"
    if not path.is_file():
        raise FileNotFoundError(f"no {split} split at {path} (run `python -m data build --out {data_dir}`)")
    reader = ArrayRecordReader(str(path))
    try:
        n = reader.num_records()
        return [decode_row(b) for b in reader.read(list(range(n)))] if n else []
    finally:
        reader.close()


# ---------------------------------------------------------------------------------------------
# Eval export
# ---------------------------------------------------------------------------------------------


def eval_label(row: Mapping[str, Any]) -> Any:
    if row["primitive"] == NOUL:
        return row["target"] == RATING_YES
    return row["target"]


def export_eval(data_dir: str | os.PathLike, out_dir: str | os.PathLike, split: str = "test") -> dict[str, int]:
    """One file per task (source): {"questions": {name: question}, "items": [{"state", "labels"}]}.

    Labels: option key (choice), level index (score), bool (Noul). Abstain rows carry no label and
    are not exported. Sources with one canonical question name it after the source; those whose
    question varies per item (multiple choice, UltraFeedback aspects) get one name per question.
    """
    rows = [r for r in read_split(data_dir, split) if not r["abstain"]]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        tasks.setdefault(r["source"], []).append(r)
    counts: dict[str, int] = {}
    for task, trs in tasks.items():
        qkeys: dict[str, str] = {}
        questions: dict[str, Any] = {}
        items = []
        distinct = {json.dumps(r["question"], sort_keys=True) for r in trs}
        for r in trs:
            qk = json.dumps(r["question"], sort_keys=True)
            if qk not in qkeys:
                if len(distinct) == 1:
                    name = task
                elif r.get("aspect"):
                    name = f"{task}.{r['aspect']}"
                else:
                    name = f"{task}.{len(qkeys)}"
                qkeys[qk] = name
                questions[name] = r["question"]
            items.append({"state": r["state"], "labels": {qkeys[qk]: eval_label(r)}})
        doc = {"questions": questions, "items": items}
        (out / f"{task}.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        counts[task] = len(items)
    return counts


def describe(manifest: Mapping[str, Any], stats: Mapping[str, Any] | None = None) -> str:
    """A human summary: rows per split and source, train token lengths, dropped records, skipped sources."""
    lines = []
    for s in SPLITS:
        sp = manifest["splits"][s]
        lines.append(f"{s}: {sp['rows']} rows  " + ", ".join(f"{k} {v}" for k, v in sp["by_source"].items()))
    if stats:
        lines.append(f"train token lengths ({manifest['config']['tokenizer']}): source n mean p95 max")
        for name, st in stats["train"].items():
            lines.append(f"  {name:20s} {st['n']:7d} {st['mean']:8.1f} {st['p95']:8.1f} {st['max']:6d}")
    for name, rep in manifest["sources"].items():
        if rep.get("dropped"):
            lines.append(f"{name}: dropped {drops_text(rep['dropped'])}")
    for why in manifest["skipped"].values():
        lines.append(f"skipped {why}")
    return "\n".join(lines)


__all__ = [
    "BuildConfig",
    "BuildResult",
    "CoverageError",
    "assemble",
    "build",
    "write",
    "read_split",
    "export_eval",
    "plan_mixture",
    "check_coverage",
    "prepare_source",
    "describe",
]
