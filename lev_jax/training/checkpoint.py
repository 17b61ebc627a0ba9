"""Checkpoints: one Orbax composite per saved step, the newest K kept, and `history.json`.

A checkpoint `<run>/checkpoints/<step>/` holds, saved together and atomically (Orbax writes a
temporary directory and renames it when every item is written):

* `trainable` - the adapter tree (or the fp32 master parameters of a full fine-tune);
* `opt_state` - the optimiser state (the learning-rate schedule lives in its step count);
* `train`     - step and RNG key data, as arrays;
* `meta`      - JSON: step, epoch, the base-model fingerprint, tokens and wall time so far;
* `data`      - the grain iterator state (grain's own Orbax handler), so a resumed run reads exactly
                the batch the interrupted one would have read next.

Restoring walks the steps newest first; a checkpoint that cannot be read (a corrupt file, a
missing item) is skipped with a warning that names it and moved to `<run>/corrupt/`, never silently
loaded. A temporary directory left by a save that was killed is reported the same way.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from lev_jax import durable
from lev_jax.training import hosts

log = logging.getLogger(__name__)

ITEMS = ("trainable", "opt_state", "train", "meta", "data")
HISTORY = "history.json"


def _handlers() -> dict:
    return {
        "trainable": ocp.StandardCheckpointHandler(),
        "opt_state": ocp.StandardCheckpointHandler(),
        "train": ocp.StandardCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
        "data": grain.checkpoint.CheckpointHandler(),
    }


def write_json_atomic(path: Path, obj: Any) -> None:
    durable.write_text(path, json.dumps(obj, indent=1) + "\n")  # fsynced before the rename


class Checkpoints:
    """The checkpoints of one run directory (`<run>/checkpoints`)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        keep: int = 3,
        *,
        read_only: bool = False,
        warn: Callable[[str], None] | None = None,
        local: bool = False,
    ):
        """`local` (read-only): this process reads alone, onto its own first device (a run loaded for
        serving or calibration while other processes of a multi-host job do not take part); Orbax's
        managers otherwise wait for every process at their start."""
        self.run_dir = Path(run_dir).absolute()
        self.dir = self.run_dir / "checkpoints"
        self.warn = warn or log.warning
        if read_only and not self.dir.is_dir():
            raise FileNotFoundError(f"{self.run_dir} has no checkpoints/ (not a training run directory)")
        self.local = local and read_only and jax.process_count() > 1
        solo = {}
        if self.local:
            me = jax.process_index()
            solo["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
                primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"lev_jax_local_{me}"
            )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            create=not read_only,
            read_only=read_only,
            enable_async_checkpointing=False,
            save_interval_steps=0 if read_only else 1,
            **solo,
        )
        absl_log = logging.getLogger("absl")
        level = absl_log.level
        if read_only:  # Orbax says at length that a read-only manager will not save; we know
            absl_log.setLevel(logging.ERROR)
        try:
            self.mngr = ocp.CheckpointManager(self.dir, options=options, item_handlers=_handlers())
        finally:
            absl_log.setLevel(level)
        self.read_only = read_only

    # -- listing ---------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        self.mngr.reload()
        return sorted(self.mngr.all_steps())

    def partial(self) -> list[Path]:
        """Directories a killed save left behind (not a finished step)."""
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.iterdir() if p.is_dir() and not re.fullmatch(r"\d+", p.name))

    def path(self, step: int) -> Path:
        return self.dir / str(step)

    # -- saving ----------------------------------------------------------------------------------
    def save(self, step: int, *, trainable, opt_state, train, meta: dict, iterator) -> Path:
        args = ocp.args.Composite(
            trainable=ocp.args.StandardSave(trainable),
            opt_state=ocp.args.StandardSave(opt_state),
            train=ocp.args.StandardSave(train),
            meta=ocp.args.JsonSave(meta),
            data=grain.checkpoint.CheckpointSave(iterator),
        )
        self.mngr.save(step, args=args, force=True)
        self.mngr.wait_until_finished()
        # Orbax renames the finished step into place without an fsync: persist its files and the
        # rename before history.json names the step
        if jax.process_index() == 0 and self.path(step).is_dir():
            durable.fsync_tree(self.path(step))
            durable.fsync_dir(self.dir)
        return self.path(step)

    # -- restoring -------------------------------------------------------------------------------
    def restore(self, *, trainable, opt_state, train, iterator, step: int | None = None):
        """(step, trainable, opt_state, train, meta) of the newest readable checkpoint (or of
        `step`), restored into the abstract trees given (shapes, dtypes, shardings) and `iterator`;
        None when there is none. Unreadable checkpoints are warned about and moved aside."""
        for p in self.partial():
            self.warn(f"skipping partial checkpoint {p} (a save that did not finish)")
        steps = [step] if step is not None else self.steps()[::-1]
        for s in steps:
            try:
                got = self.mngr.restore(
                    s,
                    args=ocp.args.Composite(
                        trainable=ocp.args.StandardRestore(trainable),
                        opt_state=ocp.args.StandardRestore(opt_state),
                        train=ocp.args.StandardRestore(train),
                        meta=ocp.args.JsonRestore(),
                        data=grain.checkpoint.CheckpointRestore(iterator),
                    ),
                )
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped, by name
                if step is not None:
                    raise
                self.quarantine(s, e)
                continue
            return s, got["trainable"], got["opt_state"], got["train"], got["meta"]
        return None

    def restore_trainable(self, step: int | None = None):
        """(step, trainable tree as saved, meta) of the newest readable checkpoint, without the
        optimiser state or the data iterator (loading a run for serving), on this process's first
        device."""
        steps = [step] if step is not None else self.steps()[::-1]
        for s in steps:
            try:
                # onto this process's first device, whatever mesh and processes saved it (Orbax
                # refuses a checkpoint of another topology without a target: a multi-host run's)
                dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
                saved = self.mngr.item_metadata(s)["trainable"]
                target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), saved)
                got = self.mngr.restore(
                    s,
                    args=ocp.args.Composite(trainable=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
                )
                return s, got["trainable"], got["meta"]
            except Exception as e:  # noqa: BLE001
                if step is not None:
                    raise
                self.warn(
                    f"skipping unreadable checkpoint {self.path(s)} ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''})"
                )
        return None

    def read_meta(self, step: int) -> dict:
        return self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def quarantine(self, step: int, error: BaseException) -> None:
        """Move an unreadable checkpoint out of the way (so a later save of that step can happen)."""
        src = self.path(step)
        if self.read_only:  # another run's directory: report it, leave it where it is
            self.warn(
                f"skipping corrupt checkpoint {src} ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''})"
            )
            return
        dest = self.run_dir / "corrupt" / f"{step}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
        self.warn(
            f"skipping corrupt checkpoint {src} ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); moved to {dest}"
        )
        with hosts.first("checkpoint quarantine") as mine:  # one mover; the others wait for it
            if mine:
                dest.parent.mkdir(parents=True, exist_ok=True)
                if src.exists():
                    shutil.move(str(src), str(dest))
        self.mngr.reload()

    def close(self) -> None:
        self.mngr.close()


def read_history(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / HISTORY
    if not p.is_file():
        return []
    try:
        return json.loads(p.read_text(encoding="utf-8"))["events"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return []


def write_history(run_dir: Path, events: list[dict]) -> None:
    write_json_atomic(Path(run_dir) / HISTORY, {"events": events})


def abstract(tree, shardings=None):
    """ShapeDtypeStructs of `tree` (with `shardings` when given): restore targets."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
