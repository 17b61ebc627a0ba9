"""Smoke tests of training commands the README gives users, in real processes: `python -m train --preset
smollm2` (the embedded SmolLM2 on the banking77 + CLINC150 train parts) with its own batching --
question-grouped (`group_by_question`: `batches.keyed_iterator`), bf16, schema first -- for 2 steps
and an exact resume; and bf16 training (`--set dtype=bfloat16`) on the tiny model. Shrunk only by
--set (examples per step, data per source) and --steps; everything else is the preset's."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lev_jax.data.guard import default_eval_data_dir
from tests.test_train_run import FAST, REPO, _env, _progress, _restore, _same_checkpoint

pytestmark = pytest.mark.slow
EVAL = default_eval_data_dir()
# 4 examples a step (the preset: 32) from 200 train rows per source (the preset: 20,000)
SMALL = ["--set", "batch_size=4", "--set", "data_limit_per_source=200"]


def _train(preset: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [sys.executable, "-m", "train", "--preset", preset, "--out", str(out), *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if p.returncode != 0:
        raise AssertionError(f"train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


class _Records:
    """A renderer that hands the data iterator's records back unrendered (loop.data_iterator calls
    `batch` only): what a step's batch holds, before the planner."""

    def batch(self, grain_batch):
        return list(grain_batch["rows"]), 0


@pytest.mark.needs_shared(EVAL / "banking77-train.csv")
@pytest.mark.needs_shared(EVAL / "clinc150-small.json")
def test_smollm2_preset_trains_question_grouped_batches_and_resumes_exactly(tmp_path):
    from lev_jax.training import config, loop

    run = tmp_path / "smollm2"
    args = ["--steps", "2", "--checkpoint-every", "1", *SMALL, *FAST]
    p = _train("smollm2", run, *args)
    assert "training smollm2" in p.stdout and "bfloat16" in p.stdout and "done:" in p.stdout
    cfg = config.TrainConfig.from_json(json.loads((run / "config.json").read_text()))
    assert (cfg.preset, cfg.group_by_question, cfg.layout, cfg.dtype) == ("smollm2", True, "schema_first", "bfloat16")
    progress = _progress(run)
    assert [e["step"] for e in progress] == [1, 2] and all(math.isfinite(e["loss"]) for e in progress)

    # its batches, read as the trainer reads them: 4 records of one question each (its options the
    # step's one shared prefix), not records of mixed questions batched by readout
    it = loop.data_iterator(cfg, run / "data", _Records())
    for _ in range(4):
        records = next(it)["examples"]
        assert len(records) == cfg.batch_size
        assert len({json.dumps(r["question"], sort_keys=True) for r in records}) == 1
        assert all(r["readout"] == "choice" and len(r["question"]["criteria"]) >= 77 for r in records)

    # a rerun after losing the last checkpoint resumes from step 1 and writes the same step 2: the
    # adapter, optimiser and the question-keyed iterator's position restored exactly
    first = tmp_path / "step2"
    shutil.move(run / "checkpoints" / "2", first)
    again = _train("smollm2", run, *args)
    assert "resumed from" in again.stdout and "at step 1" in again.stdout
    _same_checkpoint(first, run / "checkpoints" / "2")
    assert (first / "data" / "process_0-of-1.json").read_text() == (
        run / "checkpoints" / "2" / "data" / "process_0-of-1.json"
    ).read_text()


def test_bf16_training_on_the_tiny_model(tmp_path):
    """`--set dtype=bfloat16`: the frozen base in bf16, the adapter and optimiser in fp32; the loss
    is bf16's (close to fp32's on the same first batch, not equal to it) and the run serves."""
    import jax
    import numpy as np

    import lev_jax

    losses = {}
    for dtype in ("float32", "bfloat16"):
        run = tmp_path / dtype
        p = _train("tiny", run, "--steps", "2", "--checkpoint-every", "2", "--set", f"dtype={dtype}", *FAST)
        assert f", {dtype}, mesh" in p.stdout, p.stdout[:2000]
        losses[dtype] = [e["loss"] for e in _progress(run)]
        assert len(losses[dtype]) == 2 and all(math.isfinite(x) for x in losses[dtype])
    a, b = losses["float32"][0], losses["bfloat16"][0]
    assert a != b and abs(a - b) <= 0.05 * abs(a), losses
    leaves = jax.tree.leaves(_restore(tmp_path / "bfloat16" / "checkpoints" / "2", "trainable"))
    assert leaves and all(np.asarray(x).dtype == np.float32 for x in leaves)  # the adapter trains in fp32
    engine = lev_jax.load(str(tmp_path / "bfloat16"))
    answer = engine.predict(
        "The parcel came late.", {"q": {"type": "choice", "criteria": {"late": None, "on_time": None}}}
    )["q"]
    assert sum(answer["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
