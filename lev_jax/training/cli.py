"""`python -m train`: fine-tune a backbone into a decision model; `python -m train plan`: size a run first.

    python -m train --preset NAME --out RUN_DIR [--steps N] [--checkpoint-every K]
                    [--mesh data=2,fsdp=2,tensor=2] [--loss plain|rlcd] [--set key=value ...]
                    [--fresh | --resume PATH]
    python -m train plan --preset NAME [--accelerator h100|v5p|cpu] [--set key=value ...] [--steps N]
    python -m train release --run RUN_DIR [--step N] [--out DIR] [--eval LEVBENCH_DIR] [--agree DIR] [--depth-eval DIR]

Rerunning the same command on an existing RUN_DIR resumes it from its newest checkpoint (to a larger
--steps when given). `--fresh` moves the old checkpoints, history and calibration into
RUN_DIR/superseded-<utc>/ first; `--resume PATH` starts from a given checkpoint (a run directory or
one of its checkpoints/<step>). Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_BAD_INPUT = 2
# XLA:CPU's concurrency-optimised scheduler keeps most of the backward pass's buffers alive at once
# (an embedded-SmolLM2 LoRA step: 29 GB of temporaries instead of 5.5 GB with it off) and made the
# Qwen3.5 gradient hang more often on this 2-core machine; it is a CPU flag, ignored elsewhere.
XLA_DEFAULTS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)
# "1": jax.distributed.initialize() first (multi-host), from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
# and JAX_PROCESS_ID when they are set (training.hosts)
DISTRIBUTED_ENV = "LEV_JAX_DISTRIBUTED"
# keys a resumed run may change (everything else changes what it trains: use --fresh)
RESUMABLE = frozenset(
    {
        "steps",
        "checkpoint_every",
        "log_every",
        "keep_checkpoints",
        "calibrate",
        "calibration_rows",
        "mesh",
        "accelerator",
        "rows_per_call",  # how rows are scheduled, not what is computed
        # a loss stage: the plain loss's run continued with RLCD (history.json records a "stage")
        "loss",
        "rlcd_samples",
        "rlcd_sigma",
        "rlcd_log_floor",
        "rlcd_spherical_weight",
        "rlcd_ce_weight",
    }
)


class DataError(ValueError):
    """A data directory that is not a usable build."""


class UsageError(ValueError):
    """A bad command line (argparse's complaint, as one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints the whole usage)
        raise UsageError(f"{message} (see {self.prog} --help)")


def setup_runtime() -> None:
    """XLA flags, the compilation cache and (optionally) jax.distributed, before JAX starts (a
    process-wide setting: called once a command is known to run)."""
    flags = os.environ.get("XLA_FLAGS", "")
    for f in XLA_DEFAULTS:
        if f.split("=")[0] not in flags:
            flags = f"{flags} {f}".strip()
    os.environ["XLA_FLAGS"] = flags
    import jax

    from lev_jax import runtime

    runtime.enable_compilation_cache(min_compile_s=1.0)  # $LEV_JAX_CACHE or the per-user directory
    if os.environ.get(DISTRIBUTED_ENV) == "1":
        from lev_jax.training import hosts

        try:
            kwargs = hosts.settings()
        except hosts.DistributedSetupError as e:
            raise UsageError(str(e)) from None
        jax.distributed.initialize(**kwargs)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def check_data(path: str | os.PathLike) -> Path:
    """A training data directory: a `python -m data build` output whose sources pass the guard.
    Refuses evaluation files (the contamination guard), a build's test split, and non-builds."""
    from lev_jax.data.guard import ContaminationError, Guard
    from lev_jax.data.registry import REGISTRY

    p = Path(path)
    guard = Guard()
    if not p.is_dir():
        violations = guard.check_path(p) if p.exists() else guard.check_identifier(str(p))
        if violations:
            raise ContaminationError(violations)
        if p.name.startswith("test."):
            raise DataError(f"{p} is a build's test split; training reads the train split of a build directory")
        if not p.exists():
            raise DataError(f"no such data directory: {p}")
        raise DataError(f"{p} is a file, not a data build directory (python -m data build --out DIR)")
    need = ["manifest.json", "train.array_record", "train.index.json", "calibration.array_record"]
    missing = [n for n in need if not (p / n).is_file()]
    if missing:
        raise DataError(
            f"{p} is not a data build (missing {', '.join(missing)}); build one with `python -m data build --out {p}`"
        )
    import json

    manifest = json.loads((p / "manifest.json").read_text(encoding="utf-8"))
    violations = []
    for name in manifest.get("sources", {}):
        if name in REGISTRY:
            violations += guard.check_spec(REGISTRY[name])
        else:
            violations += guard.check_identifier(name)
    if violations:
        raise ContaminationError(violations)
    return p


def resolve_data(cfg, run_dir: Path, out) -> Path:
    from lev_jax.training import recipes

    if cfg.data:
        return check_data(cfg.data)
    if not cfg.data_recipe:
        raise DataError(
            f"preset {cfg.preset!r} needs a data build: `python -m data build --out DIR`, then --set data=DIR"
        )
    data_dir = run_dir / "data"
    if not (data_dir / "manifest.json").is_file():
        out(f"building the {cfg.data_recipe!r} data recipe into {data_dir}")
        manifest = recipes.build(cfg, data_dir)
        out("data: " + ", ".join(f"{s} {v['rows']} rows" for s, v in manifest["splits"].items()))
    return check_data(data_dir)


def _train_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m train", description="Fine-tune a backbone into a decision model.")
    ap.add_argument("--preset", required=True)
    ap.add_argument("--out", required=True, help="the run directory")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--checkpoint-every", type=int)
    ap.add_argument("--mesh", help="device mesh, e.g. data=2,fsdp=2,tensor=2 (default: all devices on data)")
    ap.add_argument(
        "--loss",
        choices=("plain", "rlcd"),
        help="plain (CE + Brier + ordinal) or rlcd (its policy term + the plain loss); "
        "on an existing run or with --resume it starts a stage from that checkpoint",
    )
    ap.add_argument(
        "--mode-b",
        action="store_true",
        help="train a Mode B scorer head with the adapter (large choices read in one marked row)",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--fresh", action="store_true", help="move the old run aside and start from step 0")
    g.add_argument("--resume", help="start from this checkpoint (a run directory or its checkpoints/<step>)")
    g.add_argument(
        "--from-release",
        metavar="DIR",
        help="a new run starting from a release's adapter (e.g. an exits stage over a shipped release, with "
        "--set train_adapter=false); its base, LoRA shape and prompt settings must be this run's",
    )
    return ap


def _plan_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m train plan", description="Estimate tokens, FLOPs, time and memory of a run.")
    ap.add_argument("--preset", required=True)
    ap.add_argument("--accelerator", help="h100, v5p or cpu (default: the preset's)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--mesh")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", help="a run directory whose data build to measure (default: --set data=DIR)")
    return ap


def _overrides(args) -> dict:
    from lev_jax.training import config

    over = config.parse_sets(args.set)
    if args.steps is not None:
        over["steps"] = args.steps
    if getattr(args, "checkpoint_every", None) is not None:
        over["checkpoint_every"] = args.checkpoint_every
    if args.mesh is not None:
        over["mesh"] = args.mesh
    if getattr(args, "accelerator", None) is not None:
        over["accelerator"] = args.accelerator
    if getattr(args, "loss", None) is not None:
        over["loss"] = args.loss
    if getattr(args, "mode_b", False):
        over["mode_b"] = True
    return over


def resolve_config(args, run_dir: Path):
    """The preset with overrides, or (rerun on an existing run) the saved config with the few
    values a resumed run may change."""
    from lev_jax.training import config, run

    over = _overrides(args)
    if run.is_run(run_dir) and not args.fresh:
        saved = run.read_config(run_dir)
        if saved.preset != args.preset:
            raise config.ConfigError(
                f"{run_dir} holds a {saved.preset!r} run; use --fresh to replace it or another --out"
            )
        bad = sorted(k for k, v in over.items() if k not in RESUMABLE and getattr(saved, k) != v)
        if bad:
            was = ", ".join(f"{k}={getattr(saved, k)!r}" for k in bad)
            raise config.ConfigError(f"{run_dir} was trained with {was}; changing that needs --fresh or another --out")
        return dataclasses.replace(saved, **over).validate()
    return config.resolve(args.preset, over)


def settings_that_fit(cfg, data_dir: Path | None, devices: int | None = None) -> dict | None:
    """The smallest change of `cfg` (as --set values) whose `train plan` estimate fits its
    accelerator: a stronger remat at the preset's batch size, then the batch halved under full remat,
    then bfloat16 weights; None when none fits (or the plan cannot size it)."""
    from lev_jax.training import plan

    try:
        tokens = plan.data_tokens(cfg, data_dir)  # read once: none of the settings tried changes it
    except (ValueError, KeyError, OSError):
        return None
    order = ("none", "dots", "full")
    stronger = order[order.index(cfg.remat) + 1 :] if cfg.remat in order else ()
    tries = [{"remat": r} for r in stronger]
    remat = {"remat": "full"} if cfg.remat != "full" else {}
    b = cfg.batch_size // 2
    while b >= 1:
        tries.append({**remat, "batch_size": b})
        b //= 2
    if cfg.dtype != "bfloat16" and not cfg.full_finetune:
        tries.append({**remat, "dtype": "bfloat16"})
    for over in tries:
        try:
            c = dataclasses.replace(cfg, **over).validate()
            if plan.estimate(c, data_dir=data_dir, devices=devices, tokens=tokens).fits:
                return over
        except (ValueError, KeyError, OSError):
            continue
    return None


def refuse_if_too_big(cfg, data_dir: Path, devices: int | None = None) -> None:
    """Refuse (one line, exit 2) before the first step when `train plan`'s estimate of the run exceeds
    its accelerator's memory (`--set accelerator=...` names another), naming the settings that would
    fit: a process past the host's memory is killed by the kernel without a word in the run's log, and
    a device out of memory fails after minutes of compiling. A model or build the plan cannot size
    passes."""
    from lev_jax.training import config, plan

    try:
        estimate = plan.estimate(cfg, data_dir=data_dir, devices=devices)
    except (ValueError, KeyError, OSError):  # a model or build the plan cannot size: no refusal, no harm
        return
    if estimate.fits:
        return
    fit = settings_that_fit(cfg, data_dir, devices)
    fix = (
        "it fits with " + " ".join(f"--set {k}={v}" for k, v in fit.items())
        if fit is not None
        else "no remat, batch size or dtype alone fits it: shard it over more devices (--mesh fsdp=N)"
    )
    raise config.ConfigError(f"{estimate.refusal.split('; turn ')[0]}; {fix} (python -m train plan sizes it)")


def train_main(argv: Sequence[str], out=print) -> int:
    args = _train_parser().parse_args(argv)
    run_dir = Path(args.out)
    cfg = resolve_config(args, run_dir)
    from lev_jax.training import run

    # one trainer per run directory, taken before anything starts: a second one refuses at once, in
    # one line. Where several hosts train one run, its first process holds it (after jax.distributed
    # says which one that is)
    distributed = os.environ.get(DISTRIBUTED_ENV) == "1"
    with contextlib.ExitStack() as held:
        if not distributed:
            held.enter_context(run.lock(run_dir))
        # only now that the command line is good: a bad one (or an in-process caller's) leaves the
        # process's JAX configuration (its compilation cache above all) as it was
        setup_runtime()
        import jax

        if distributed and jax.process_index() == 0:
            held.enter_context(run.lock(run_dir))
        return _train(args, cfg, run_dir, out)


def _train(args, cfg, run_dir: Path, out) -> int:
    import jax

    from lev_jax.errors import CheckpointError
    from lev_jax.training import calibration, hosts, loop, run
    from lev_jax.training import mesh as mesh_lib

    resume = Path(args.resume) if args.resume else None
    if resume is not None and not resume.exists():
        raise DataError(f"--resume {resume}: no such checkpoint or run directory")
    from_release = Path(args.from_release) if args.from_release else None
    if from_release is not None:
        from lev_jax.training import release

        release.check_stage_source(from_release, cfg)  # before the base loads: a wrong release says so at once
    # the base model first: a hub id offline fails here, before any data is built
    base = run.load_base(cfg.model, "float32" if cfg.full_finetune else cfg.dtype)
    mesh = mesh_lib.make(cfg.mesh)
    run_dir.mkdir(parents=True, exist_ok=True)
    # what writes the shared run directory, process 0 does alone while the others wait (multi-host)
    with hosts.first("--fresh") as mine:
        moved = run.supersede(run_dir) if mine and args.fresh else None
    if moved is not None:
        out(f"--fresh: moved the previous run's checkpoints, history and calibration to {moved}")
    with hosts.first("the data build") as mine:
        if mine:
            resolve_data(cfg, run_dir, out)
    data_dir = resolve_data(cfg, run_dir, out)  # built: every process checks it
    refuse_if_too_big(cfg, data_dir, devices=len(jax.devices()))
    if jax.process_index() == 0:
        run.write_config(run_dir, cfg)
    stager = None
    if from_release is not None:
        stager = functools.partial(release.stage_adapter, from_release, cfg, base)
    summary = loop.train(cfg, run_dir, base, data_dir, mesh=mesh, resume=resume, start_adapter=stager, out=out)
    trained = summary.pop("state", None) is not None
    summary.pop("trainer", None)  # free the device copies before calibrating
    # a rerun fits what an earlier one did not save (or fitted for an older checkpoint); process 0
    # alone (on its own devices), the others waiting for it
    with hosts.first("the calibration") as mine:
        if (
            mine
            and cfg.calibrate
            and (trained or not run.calibration_current(run_dir, run.model_name(base.name, cfg, summary["step"])))
        ):
            bb, _, meta = run.load_run(run_dir, cfg.dtype, warn_uncalibrated=False)  # fitted now
            try:
                calibration.fit_run(cfg, run_dir, bb, data_dir, out=out)
            except OSError as e:  # a full disk, a read-only directory: the run must not pass for calibrated
                raise CheckpointError(
                    f"the calibration of {run_dir} could not be saved ({e}): the run is served uncalibrated "
                    f"until `python -m train --out {run_dir}` fits it again"
                ) from None
    out(
        f"done: {run_dir} at step {summary['step']} ({summary['tokens']:,} real tokens trained); "
        f"serve it with lev_jax.load({str(run_dir)!r})"
    )
    return 0


def plan_main(argv: Sequence[str], out=print) -> int:
    args = _plan_parser().parse_args(argv)
    from lev_jax.training import config, plan

    cfg = config.resolve(args.preset, _overrides(args))
    data = Path(cfg.data) if cfg.data else (Path(args.out) / "data" if args.out else None)
    estimate = plan.estimate(cfg, data_dir=data if data is not None and data.is_dir() else None)
    out(plan.report(estimate))
    if not estimate.fits:
        print(f"error: {estimate.refusal}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def release_main(argv: Sequence[str], out) -> int:
    """`python -m train release --run RUN_DIR [--step N] [--out DIR] [--eval DIR] [--agree DIR] [--depth-eval DIR]`."""
    p = _Parser(prog="python -m train release", description="Write a run's checkpoint as a release directory.")
    p.add_argument("--run", required=True, help="the training run directory")
    p.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the newest readable)")
    p.add_argument("--out", default=None, help="the release directory to create (default: RUN_DIR/release-<step>)")
    p.add_argument("--eval", default=None, help="a levbench eval output directory: its held-out table goes in the card")
    p.add_argument(
        "--agree",
        default=None,
        help="a `levbench agree` output directory of this checkpoint: Mode A vs Mode B in the card and manifest",
    )
    p.add_argument(
        "--depth-eval",
        default=None,
        help="a `levbench depth` output directory of this checkpoint: per-exit held-out quality (card, /health)",
    )
    args = p.parse_args(list(argv))
    setup_runtime()
    from lev_jax.training import release, run

    run_dir = Path(args.run)
    if not run.is_run(run_dir):
        raise UsageError(f"{run_dir} is not a training run directory (no TrainConfig config.json)")
    if args.out is None:
        step, _, _ = run.load_checkpoint(run_dir, args.step)
        args.out = run_dir / f"release-{step}"
    done = release.make(
        run_dir, args.out, step=args.step, eval_dir=args.eval, depth_dir=args.depth_eval, agree_dir=args.agree
    )
    manifest = release.read_manifest(done)
    out(f"released {manifest['name']} (step {manifest['step']}) to {done}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from lev_jax.data.guard import ContaminationError
    from lev_jax.errors import CheckpointError, TrainingError
    from lev_jax.training.config import ConfigError

    def out(line: str) -> None:
        print(line, flush=True)

    try:
        if argv and argv[0] == "plan":
            return plan_main(argv[1:], out)
        if argv and argv[0] == "release":
            return release_main(argv[1:], out)
        return train_main(argv, out)
    except ContaminationError as e:
        reasons = "; ".join(f"{v.source}: {v.reason}" for v in e.violations)
        print(f"error: refusing training input: {reasons}", file=sys.stderr)
    except (UsageError, ConfigError, DataError, TrainingError, CheckpointError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
    return EXIT_BAD_INPUT
