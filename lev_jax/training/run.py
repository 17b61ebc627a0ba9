"""The run directory, and loading a trained run as a backbone a serving engine uses like any model.

    RUN_DIR/
      .lock                     held (flock) by the trainer writing the run; a second one refuses
      config.json               the resolved TrainConfig (a rerun resumes with it)
      checkpoints/<step>/       Orbax: trainable, opt_state, train (step, RNG), meta, data (grain state)
      history.json              progress and checkpoint events, rewritten at every checkpoint
      calibration.json          temperatures fitted on the calibration split (+ calibration_report.md)
      data/                     the preset's own data build (when no `data` directory was given)
      corrupt/<step>-<utc>/     unreadable checkpoints moved out of the way
      superseded-<utc>/         what `--fresh` moved aside (checkpoints, history, calibration)

`load_run(RUN_DIR, dtype)` -> (Backbone with the newest checkpoint's adapter merged, Calibration or
None, meta). `meta["engine"]` holds the prompt settings the run was trained with (pass them to
`Engine`: the served rows must be the trained rows).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import shutil
from pathlib import Path

from lev_jax.training.config import EMBEDDED, TINY_MODEL, ConfigError, TrainConfig

log = logging.getLogger(__name__)

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
DATA = "data"
ENGINE_KEYS = ("prompt_style", "layout", "noul_readout", "option_averaging", "mode_b_min_options")
SUPERSEDED = ("checkpoints", "history.json", "corrupt")  # plus every calibration* file
LOCK = ".lock"


class RunLocked(ConfigError):
    """Another trainer is writing the run directory."""


@contextlib.contextmanager
def lock(run_dir):
    """Hold `RUN_DIR/.lock` while a trainer writes the run: two trainers on one directory would race on
    its checkpoints, history and calibration. An exclusive flock, so the kernel releases it however
    the holder ends (no stale lock after kill -9); the file keeps the holder's pid for the message.
    RunLocked at once when another process holds it."""
    import fcntl  # POSIX; imported here so that loading a run for serving needs no lock support

    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise RunLocked(
                f"{path} is held by another trainer (pid {holder}) writing this run; wait for it to finish "
                "or use another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        if created and [p.name for p in run_dir.iterdir()] == [LOCK]:
            # a run that wrote nothing (refused at its start) leaves no directory behind; still held
            path.unlink()
            run_dir.rmdir()
        os.close(fd)  # releases the lock


def calibration_current(run_dir, name: str) -> bool:
    """Whether the run's calibration.json was fitted for the model `name` (its newest checkpoint)."""
    from lev_jax.calibrate import CALIBRATION_FILE

    try:
        return json.loads((Path(run_dir) / CALIBRATION_FILE).read_text(encoding="utf-8")).get("model_id") == name
    except (OSError, ValueError, AttributeError):
        return False


def is_run(path) -> bool:
    """A training run directory (its config.json is a TrainConfig, not a model's HF config)."""
    p = Path(path) / CONFIG
    if not p.is_file():
        return False
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and "preset" in d and "lora_rank" in d and "model_type" not in d


def read_config(run_dir) -> TrainConfig:
    p = Path(run_dir) / CONFIG
    if not p.is_file():
        raise ConfigError(f"{run_dir} is not a training run (no {CONFIG})")
    try:
        return TrainConfig.from_json(json.loads(p.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError) as e:
        raise ConfigError(f"{p}: not a training config ({e})") from None


def write_config(run_dir, cfg: TrainConfig) -> None:
    from lev_jax.training.checkpoint import write_json_atomic

    write_json_atomic(Path(run_dir) / CONFIG, cfg.to_json())


def supersede(run_dir) -> Path | None:
    """Move a run's checkpoints, history and calibration into superseded-<utc>/ (`--fresh`)."""
    run_dir = Path(run_dir)
    names = [n for n in SUPERSEDED if (run_dir / n).exists()]
    names += sorted(p.name for p in run_dir.glob("calibration*"))
    if not names:
        return None
    dest = run_dir / f"superseded-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S%fZ}"
    dest.mkdir()
    for n in names:
        shutil.move(str(run_dir / n), str(dest / n))
    if (run_dir / CONFIG).is_file():
        shutil.copy2(run_dir / CONFIG, dest / CONFIG)
    return dest


def load_base(model: str, dtype: str = "float32"):
    """The frozen base model of a config: the embedded SmolLM2, the tiny random Qwen3.5, or a
    checkpoint directory / .gguf file / hub id (lev_jax.load_backbone)."""
    from lev_jax.backbone import load_backbone

    if model == EMBEDDED:
        return load_backbone(None, dtype=dtype)
    if model == TINY_MODEL:
        from lev_jax import testing

        return testing.tiny_backbone("qwen3_5", seed=0, dtype=dtype)
    return load_backbone(model, dtype=dtype)


def model_name(base_name: str, cfg: TrainConfig, step: int) -> str:
    """The name a trained model serves (and its calibration is fitted) under."""
    return f"{base_name}+{cfg.preset}@{step}"


def merged(cfg: TrainConfig, base, trainable, step: int, dtype: str):
    """A Backbone serving `trainable` on `base` (an fp32 base): adapter folded in fp32, then cast."""
    import jax
    import jax.numpy as jnp

    from lev_jax import models
    from lev_jax.backbone import Backbone
    from lev_jax.training import lora
    from lev_jax.training.loop import parts

    adapter, head, exits = parts(trainable)
    if cfg.full_finetune:
        params = adapter
    else:
        params = lora.merge(base.params, adapter, cfg.lora_scale)
    params = models.cast_params(params, base.config, dtype)
    bb = Backbone(
        base.config,
        params,
        base.tokenizer,
        name=model_name(base.name, cfg, step),
        source=str(cfg.model),
        hf_config=base.hf_config,
        vision=base.vision,  # a VL base's tower is not trained: the served model still reads images
    )
    if head is not None:  # the head stays fp32 whatever the compute dtype
        bb.mode_b_head = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), head)
    if exits is not None:  # so do the exit adapters
        bb.exits = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), exits)
    return bb


def load_checkpoint(run_dir, step: int | None = None):
    """(step, trainable tree, checkpoint meta) of the newest readable checkpoint (or of `step`)."""
    from lev_jax.errors import CheckpointError
    from lev_jax.training.checkpoint import Checkpoints

    run_dir = Path(run_dir)
    # local: in a multi-host job, the process that calls this reads alone (training.hosts.first)
    got = (
        Checkpoints(run_dir, read_only=True, local=True).restore_trainable(step)
        if (run_dir / CHECKPOINTS).is_dir()
        else None
    )
    if got is None:
        raise CheckpointError(f"{run_dir} has no readable checkpoint")
    return got


def load_run(run_dir, dtype: str = "float32", *, warn_uncalibrated: bool = True):
    """(Backbone with the newest readable checkpoint merged, Calibration or None, meta). A run that
    was to be calibrated and has no calibration is served with a warning that says so."""
    from lev_jax.calibrate import CALIBRATION_FILE, Calibration
    from lev_jax.errors import CheckpointError
    from lev_jax.training.loop import fingerprint, same_base

    run_dir = Path(run_dir)
    cfg = read_config(run_dir)
    step, trainable, ck_meta = load_checkpoint(run_dir)
    base = load_base(cfg.model, "float32")
    if not same_base(ck_meta.get("base", {}), fingerprint(cfg, base)):
        raise CheckpointError(f"{run_dir}: its checkpoint belongs to another base model than {cfg.model!r}")
    bb = merged(cfg, base, trainable, step, dtype)
    cal = None
    cal_path = run_dir / CALIBRATION_FILE
    if not cal_path.is_file() and cfg.calibrate and warn_uncalibrated:
        # the run was to be calibrated: its fit has not run yet, or its save failed
        log.warning(
            "%s has no %s (its calibration was not fitted or not saved); serving uncalibrated until "
            "`python -m train --out %s` fits it",
            run_dir,
            CALIBRATION_FILE,
            run_dir,
        )
    if cal_path.is_file():
        cal = Calibration.load(cal_path)
        if cal.model_id != bb.name:
            log.warning(
                "%s was fitted for %s, not %s (a later checkpoint); serving uncalibrated",
                cal_path,
                cal.model_id,
                bb.name,
            )
            cal = None
    meta = {
        "step": step,
        "config": cfg.to_json(),
        "base": ck_meta.get("base"),
        "run_dir": str(run_dir),
        "engine": {k: getattr(cfg, k) for k in ENGINE_KEYS},
    }
    return bb, cal, meta
