"""`python -m train --preset tiny` in real processes: it trains (loss falls), serves through the engine,
resumes exactly after kill -9 (adapter, optimiser moments and next batch bit-identical), skips a
corrupt checkpoint by name, reruns resume, and --fresh moves the old run aside; the rlcd loss from the
start and as a stage, resumed exactly."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

REPO = Path(__file__).resolve().parents[1]
FAST = ["--set", "calibrate=false", "--set", "log_every=1"]


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def train(out, *args, check=True):
    p = subprocess.run(
        [sys.executable, "-m", "train", "--preset", "tiny", "--out", str(out), *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if check and p.returncode != 0:
        raise AssertionError(f"train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def _restore(ckpt: Path, item: str):
    return ocp.StandardCheckpointer().restore((ckpt / item).absolute())


def _progress(run: Path) -> list[dict]:
    return [e for e in json.loads((run / "history.json").read_text())["events"] if e["event"] == "progress"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "tiny"
    p = train(run)
    return run, p.stdout


def test_tiny_trains_loss_falls_and_writes_the_run(trained):
    run, stdout = trained
    assert "step 24/24 100.0%" in stdout and "checkpoint step 24" in stdout
    progress = _progress(run)
    assert [e["step"] for e in progress] == [4, 8, 12, 16, 20, 24]
    assert np.mean([e["loss"] for e in progress[-2:]]) < progress[0]["loss"] - 0.3
    for e in progress:  # the progress line's content, kept in history.json
        assert {"loss_by_mode", "lr", "steps_per_s", "tokens_per_s", "elapsed_s"} <= set(e)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["16", "24", "8"]  # keep 3
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["preset"] == "tiny" and cfg["steps"] == 24
    assert (run / "calibration.json").is_file() and (run / "data" / "manifest.json").is_file()


def test_the_trained_run_answers_through_the_engine(trained):
    import jax

    from lev_jax.data.build import read_split
    from lev_jax.engine import Engine
    from lev_jax.readout import Planner, Usage
    from lev_jax.training import batches, config, loop
    from lev_jax.training import mesh as mesh_lib
    from lev_jax.training import run as run_lib

    run, _ = trained
    bb, cal, meta = run_lib.load_run(run)
    assert meta["step"] == 24 and bb.name.endswith("+tiny@24") and cal is not None
    engine = Engine(bb, calibration=cal, **meta["engine"])
    answers = engine.predict(
        {"review": "A tender, witty film."},
        {
            "stars": {"type": "score", "instructions": "How positive?", "criteria": ["bad", "so-so", "good"]},
            "liked": {"type": "noul", "instructions": "Is it positive?"},
        },
    )
    assert sum(answers["stars"]["probabilities"].values()) == pytest.approx(1.0)
    assert 0.0 <= answers["liked"]["noul"] <= 1.0

    # lev_jax.load(RUN_DIR) is that engine: the run's backbone, calibration and prompt settings
    import lev_jax

    loaded = lev_jax.load(str(run))
    assert loaded.backbone.name == bb.name and loaded.calibration.model_id == bb.name
    assert loaded.planner.layout == meta["engine"]["layout"] and "@step 24" in loaded.info()["checkpoint"]
    same = loaded.predict(
        {"review": "A tender, witty film."},
        {"stars": {"type": "score", "instructions": "How positive?", "criteria": ["bad", "so-so", "good"]}},
    )
    assert same["stars"]["probabilities"] == pytest.approx(answers["stars"]["probabilities"], abs=1e-4)  # other buckets
    leaves = jax.tree.leaves(lev_jax.load_backbone(str(run)).params)
    assert all(np.array_equal(a, b) for a, b in zip(leaves, jax.tree.leaves(bb.params)))

    # the engine reads exactly the logits training computes for the same record
    record = next(r for r in read_split(run / "data", "calibration") if r["readout"] == "choice")
    cfg = config.TrainConfig.from_json(meta["config"])
    ex = batches.Renderer(Planner(bb.tokenizer, **meta["engine"])).example(record, np.random.default_rng(0))
    plan = engine.plan(record["state"], {"q": record["question"]})
    served = engine.executor.read([(plan.prefix_ids, plan.rows)], [Usage()])[0]
    base = run_lib.load_base(cfg.model, "float32")
    trainer = loop.Trainer(cfg, base, mesh_lib.make("", devices=jax.devices()[:1]))
    _, trainable, _ = run_lib.load_checkpoint(run)
    arrays, _ = batches.pack([ex])
    logits = np.asarray(jax.jit(trainer.logits)(trainable, trainer.frozen, arrays))
    # fp32 rounding of the two paths' differently shaped calls (one packed training sequence vs prefix +
    # row buckets) depends on the host's matmul kernels: up to ~1e-4 on an AVX-512 Xeon, where an AMD
    # EPYC stayed below it; a row's label logits differ from each other by tenths, so a label, row or
    # position mix-up is still far outside this tolerance
    for r, (row, want) in enumerate(zip(ex.rows, served)):
        np.testing.assert_allclose(logits[r, : len(row.label_ids)], want, atol=5e-4, rtol=0)


def _same_checkpoint(a: Path, b: Path):
    import jax

    for item in ("trainable", "opt_state", "train"):  # adapter, optimiser moments and count, step and RNG
        ta, tb = _restore(a, item), _restore(b, item)
        for (pa, xa), (pb, xb) in zip(
            jax.tree_util.tree_flatten_with_path(ta)[0], jax.tree_util.tree_flatten_with_path(tb)[0]
        ):
            assert pa == pb
            assert np.array_equal(np.asarray(xa), np.asarray(xb)), f"{item} {jax.tree_util.keystr(pa)} differs"


def test_rlcd_from_the_start_as_a_stage_and_resumed_exactly(trained, tmp_path):
    run, _ = trained
    # from the start: the progress line carries the policy term; the config records the loss
    straight = tmp_path / "straight"
    p = train(straight, "--loss", "rlcd", "--steps", "4", "--checkpoint-every", "2", *FAST)
    assert "rlcd policy" in p.stdout and "step 4/4" in p.stdout
    assert json.loads((straight / "config.json").read_text())["loss"] == "rlcd"
    assert all("rlcd_policy" in e for e in _progress(straight))
    # resumed from its step-2 checkpoint in another process: bit-identical at step 4 (the noise comes
    # from the checkpointed RNG key)
    split = tmp_path / "split"
    again = train(
        split,
        "--resume",
        str(straight / "checkpoints" / "2"),
        "--loss",
        "rlcd",
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        *FAST,
    )
    assert "resumed from" in again.stdout and "at step 2" in again.stdout and "stage" not in again.stdout
    _same_checkpoint(straight / "checkpoints" / "4", split / "checkpoints" / "4")
    # a stage: the plain run's checkpoint continued with rlcd in another run directory
    stage = tmp_path / "stage"
    p = train(stage, "--resume", str(run / "checkpoints" / "16"), "--loss", "rlcd", "--steps", "18", *FAST)
    assert "stage: loss plain -> rlcd from step 16" in p.stdout and "step 18/18" in p.stdout
    events = json.loads((stage / "history.json").read_text())["events"]
    assert {"event": "stage", "step": 16, "loss": "rlcd", "from": "plain"} in events


def test_rerun_resumes_and_fresh_moves_the_run_aside(trained, tmp_path):
    import shutil

    # a copy: this test continues and supersedes its run, which the module's later tests read as trained
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    again = train(run, "--set", "calibrate=false")
    assert "nothing to do: the run is at step 24 of 24" in again.stdout
    bad = train(run, "--set", "lora_rank=4", check=False)
    assert bad.returncode == 2 and "needs --fresh" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    more = train(run, "--steps", "26", *FAST)
    assert "resumed from" in more.stdout and "checkpoints/24 at step 24" in more.stdout
    assert "step 26/26" in more.stdout and (run / "checkpoints" / "26").is_dir()
    fresh = train(run, "--fresh", "--steps", "2", *FAST)
    moved = [p for p in run.iterdir() if p.name.startswith("superseded-")]
    assert len(moved) == 1 and (moved[0] / "checkpoints" / "26").is_dir() and (moved[0] / "history.json").is_file()
    assert "moved the previous run" in fresh.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]


def test_a_failed_calibration_save_fails_the_run_and_serving_it_says_uncalibrated(trained, tmp_path, caplog):
    """A calibration that cannot be saved (a full disk) is an error in one line, not a run that passes
    for calibrated; the run served meanwhile warns that it is uncalibrated."""
    import logging
    import shutil

    import lev_jax

    run, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for fitted in copy.glob("calibration*"):  # the run's fit, not its data's calibration split
        fitted.unlink()
    full_disk = (
        "import sys\n"
        "import lev_jax.calibrate as C\n"
        "def save(self, directory):\n"
        "    raise OSError(28, 'No space left on device')\n"
        "C.Calibration.save = save\n"
        "from lev_jax.training.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    p = subprocess.run(
        # calibrate=true: an earlier test may have replaced the shared run with one that does not calibrate
        [sys.executable, "-c", full_disk, "--preset", "tiny", "--out", str(copy), "--set", "calibrate=true"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr[-3000:]
    assert "could not be saved" in err[0] and "No space left" in err[0] and "uncalibrated" in err[0]
    assert not (copy / "calibration.json").exists()
    with caplog.at_level(logging.WARNING, logger="lev_jax.training.run"):
        engine = lev_jax.load(str(copy))
    assert not engine.info()["calibrated"]
    assert any("serving uncalibrated" in r.getMessage() for r in caplog.records), caplog.text


def test_exact_resume_after_kill_9(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    args = ["--steps", "8", "--checkpoint-every", "4", *FAST]
    train(straight, *args)
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", "--preset", "tiny", "--out", str(killed), *args],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith("checkpoint step 4"):
            proc.send_signal(signal.SIGKILL)  # mid-run: steps 5.. are under way
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "checkpoints" / "8").exists(), "the run finished before the kill; nothing was resumed"
    resumed = train(killed, *args)
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    a, b = straight / "checkpoints" / "8", killed / "checkpoints" / "8"
    _same_checkpoint(a, b)
    # the next batch: the grain iterator states are the same, and so is the batch they read next
    state_a = json.loads((a / "data" / "process_0-of-1.json").read_text())
    state_b = json.loads((b / "data" / "process_0-of-1.json").read_text())
    assert state_a == state_b
    from lev_jax.data.pipeline import make_iterator

    cfg = json.loads((straight / "config.json").read_text())
    nxt = [
        next(
            make_iterator(
                run / "data",
                batch_size=cfg["batch_size"],
                seed=cfg["seed"],
                num_epochs=None,
                window_batches=cfg["window_batches"],
                state=state,
            )
        )["index"].tolist()
        for run, state in ((straight, state_a), (killed, state_b))
    ]
    assert nxt[0] == nxt[1]

    # a corrupt newest checkpoint is skipped by name (moved to corrupt/), never loaded: the run resumes
    # from the one before it
    newest = straight / "checkpoints" / "8"
    for f in (newest / "trainable").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name:
            f.write_bytes(b"\0" * 7)  # truncate the adapter's data
    p = train(straight, "--steps", "10", "--checkpoint-every", "4", *FAST)
    assert f"skipping corrupt checkpoint {newest}" in p.stdout
    assert "at step 4" in p.stdout and (straight / "checkpoints" / "10").is_dir()
    assert any(d.name.startswith("8-") for d in (straight / "corrupt").iterdir())


def adapter_unchanged(before_ckpt: Path, after_ckpt: Path, extra: str):
    """Assert a stage's checkpoint holds the restored adapter bit for bit beside its `extra` group
    (the Mode B head, the exits), and return that group."""
    import jax

    before = jax.tree_util.tree_flatten_with_path(_restore(before_ckpt, "trainable"))[0]
    after = dict(_restore(after_ckpt, "trainable"))
    group = after.pop(extra)
    flat = jax.tree_util.tree_flatten_with_path(after)[0]
    assert [p for p, _ in flat] == [p for p, _ in before]
    for (path, x), (_, y) in zip(before, flat):
        assert np.array_equal(np.asarray(x), np.asarray(y)), f"adapter {jax.tree_util.keystr(path)} moved"
    return group


def test_mode_b_stage_adds_a_head_to_a_plain_run_and_then_resumes_exactly(tmp_path):
    """`--mode-b --resume RUN/checkpoints/N`: a plain run's adapter (and data position) continued
    with a fresh head; the stage's own checkpoints then resume bit-identically."""
    run = tmp_path / "plain"
    train(run, "--steps", "4", "--checkpoint-every", "4", *FAST)
    stage = tmp_path / "stage-b"
    args = ["--resume", str(run / "checkpoints" / "4"), "--mode-b", "--set", "mode_b_min_options=2"]
    p = train(stage, *args, "--steps", "8", "--checkpoint-every", "2", *FAST)
    assert "stage: a fresh Mode B head and optimiser from step 4" in p.stdout and "step 8/8" in p.stdout
    # (batches hold one question each: these 4 steps need not meet a choice; the marker loss window is
    # checked where a --mode-b run trains choices, tests/test_release.py)
    events = json.loads((stage / "history.json").read_text())["events"]
    assert {"event": "stage", "step": 4, "mode_b": True} in events
    # the plain run's history up to the checkpoint comes along (a release of the stage names its lineage)
    plain = json.loads((run / "history.json").read_text())["events"]
    assert plain and events[: len(plain)] == [e for e in plain if e.get("step", 0) <= 4]
    # resumed from the stage's step-6 checkpoint in another directory: bit-identical at step 8
    again = tmp_path / "again-b"
    more = ["--mode-b", "--set", "mode_b_min_options=2", "--steps", "8", "--checkpoint-every", "2", *FAST]
    q = train(again, "--resume", str(stage / "checkpoints" / "6"), *more)
    assert "at step 6" in q.stdout and "stage:" not in q.stdout
    assert {"event": "stage", "step": 4, "mode_b": True} in json.loads((again / "history.json").read_text())["events"]
    _same_checkpoint(stage / "checkpoints" / "8", again / "checkpoints" / "8")


def test_head_only_mode_b_stage_leaves_the_adapter_untouched(tmp_path):
    """`--mode-b --set train_adapter=false`: the Mode B head learns (its loss window, a changed head
    each step), the restored adapter is bit-identical afterwards (no gradient, no weight decay)."""
    choices = ["--set", "readouts=choice"]  # every batch a choice: every step reaches the head
    plain = tmp_path / "plain"
    train(plain, "--steps", "2", "--checkpoint-every", "2", *choices, *FAST)
    stage = tmp_path / "head-only"
    args = ["--resume", str(plain / "checkpoints" / "2"), "--mode-b", "--set", "mode_b_min_options=2"]
    p = train(stage, *args, "--set", "train_adapter=false", *choices, "--steps", "4", "--checkpoint-every", "1", *FAST)
    assert "adapter frozen: only the Mode B head learns" in p.stdout and "step 4/4" in p.stdout
    progress = [e for e in _progress(stage) if e["step"] > 2]  # (the plain run's own came along)
    assert all("marker" in e["loss_by_mode"] and "letter" not in e["loss_by_mode"] for e in progress)
    from lev_jax.training import config, loop

    # the fresh optimiser's schedule restarted at the stage: the progress line shows the rate it applies
    _, schedule = loop.make_optimizer(config.resolve("tiny", {"steps": 4}))
    assert [e["lr"] for e in progress] == pytest.approx([float(schedule(k)) for k in range(len(progress))])

    heads = [
        adapter_unchanged(plain / "checkpoints" / "2", stage / "checkpoints" / str(step), "mode_b_head")
        for step in (3, 4)
    ]
    assert not np.array_equal(np.asarray(heads[0]["wq"]), np.asarray(heads[1]["wq"]))
    # a head-only stage needs the head: refused in one line before any work
    q = train(tmp_path / "bad", "--set", "train_adapter=false", check=False)
    assert q.returncode == 2 and "train_adapter=false trains only the Mode B head" in q.stderr
