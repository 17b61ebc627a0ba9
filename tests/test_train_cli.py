"""Bad input to `python -m train` is one line on stderr and exit code 2; config overrides are typed;
`train plan` sizes presets and refuses one without memory headroom."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lev_jax import runtime
from lev_jax.data.guard import default_eval_data_dir
from lev_jax.training import cli, config

REPO = Path(__file__).resolve().parents[1]
EVAL = default_eval_data_dir()


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch):
    monkeypatch.setenv(runtime.CACHE_ENV, "")  # in-process: leave the test process's JAX config alone
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _fails(capsys, argv, match):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert match in err, err
    return err


def test_bad_presets_keys_and_values(capsys, tmp_path):
    out = str(tmp_path / "run")
    _fails(capsys, ["--preset", "nope", "--out", out], "unknown preset 'nope'")
    _fails(capsys, ["--preset", "tiny", "--out", out, "--set", "colour=blue"], "unknown config key 'colour'")
    _fails(capsys, ["--preset", "tiny", "--out", out, "--set", "steps=many"], "--set steps=many")
    _fails(capsys, ["--preset", "tiny", "--out", out, "--set", "remat=sometimes"], "remat must be one of")
    _fails(capsys, ["--preset", "tiny", "--out", out, "--set", "steps"], "--set takes key=value")
    _fails(capsys, ["--preset", "tiny"], "--out")  # argparse errors are one line too
    _fails(capsys, ["--preset", "tiny", "--out", out, "--fresh", "--resume", out], "not allowed with")
    assert not (tmp_path / "run").exists()  # nothing was written for bad input


def test_overrides_are_typed():
    cfg = config.resolve("tiny", config.parse_sets(["lr=0.5", "calibrate=false", "readouts=choice,score", "steps=3"]))
    assert (cfg.lr, cfg.calibrate, cfg.readouts, cfg.steps) == (0.5, False, ("choice", "score"), 3)
    assert config.TrainConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    assert set(config.PRESETS) == {"tiny", "smollm2", "general", "smoke", "2b", "4b", "4b-instruct", "9b"}
    assert config.resolve("2b").full_finetune and config.resolve("4b-instruct").prompt_style == "chat"


def test_hub_presets_fail_at_once_offline(capsys, tmp_path):
    _fails(capsys, ["--preset", "smoke", "--out", str(tmp_path / "r")], "could not fetch 'Qwen/Qwen3.5-0.8B-Base'")


def test_data_that_is_not_a_build(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    argv = ["--preset", "tiny", "--out", str(tmp_path / "r"), "--set"]
    _fails(capsys, argv + [f"data={tmp_path / 'empty'}"], "is not a data build")
    _fails(capsys, argv + [f"data={tmp_path / 'missing'}"], "no such data directory")
    (tmp_path / "test.array_record").write_bytes(b"x")
    _fails(capsys, argv + [f"data={tmp_path / 'test.array_record'}"], "test split")
    assert not (tmp_path / "r").exists()  # a run refused at its start leaves no directory (nor lock)


@pytest.mark.needs_shared(EVAL / "banking77-test.csv")
def test_evaluation_files_are_refused(capsys, tmp_path):
    argv = ["--preset", "tiny", "--out", str(tmp_path / "r"), "--set"]
    _fails(capsys, argv + [f"data={EVAL / 'banking77-test.csv'}"], "refusing training input")
    copy = tmp_path / "renamed.csv"  # a renamed copy is caught by its digest
    copy.write_bytes((EVAL / "banking77-test.csv").read_bytes())
    _fails(capsys, argv + [f"data={copy}"], "banking77-test.csv")


def test_a_checkpoint_of_another_base_model_is_refused(tmp_path):
    """A tiny run, then a run of another base model (a tiny Llama checkpoint) resuming from it."""
    from lev_jax import testing

    env = {**os.environ, "LEV_JAX_CACHE": "", "HF_HUB_OFFLINE": "1"}
    first = tmp_path / "first"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "--preset",
            "tiny",
            "--out",
            str(first),
            "--steps",
            "1",
            "--set",
            "calibrate=false",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    other = testing.save_tiny_checkpoint(tmp_path / "llama")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "--preset",
            "tiny",
            "--out",
            str(tmp_path / "second"),
            "--set",
            f"model={other}",
            "--set",
            f"data={first / 'data'}",
            "--resume",
            str(first / "checkpoints" / "1"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr[-2000:]
    assert "belongs to base model 'tiny-qwen3_5'" in p.stderr


def test_plan_sizes_presets_and_refuses_without_headroom(capsys):
    assert cli.main(["plan", "--preset", "9b", "--accelerator", "h100"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen3.5-9B-Base" in out and "FLOPs" in out and "GiB of" in out and " ok" in out
    assert (
        cli.main(["plan", "--preset", "9b", "--accelerator", "h100", "--set", "remat=none", "--set", "batch_size=256"])
        == 2
    )
    captured = capsys.readouterr()
    assert "TOO MUCH" in captured.out
    assert len(captured.err.strip().splitlines()) == 1 and "--set remat=full" in captured.err
    assert cli.main(["plan", "--preset", "tiny", "--accelerator", "cpu"]) == 0


def test_plan_counts_mode_b_marked_rows_the_head_and_their_attention(tmp_path):
    """With Mode B the plan reads the build's questions and routes them as the trainer does: a routed
    choice adds its marked row (its options and their markers in one row: tokens, and attention scores
    quadratic in its length) and the head joins the trainable tree; a head-only stage runs no backward
    through the backbone. (It once sized a Mode B stage of the embedded model at 2.5 GiB: it was killed
    at 22.7 GiB.)"""
    from lev_jax.data.build import read_split
    from lev_jax.readout import modeb
    from lev_jax.training import config, plan, recipes

    base = config.resolve("tiny")
    data = tmp_path / "data"
    recipes.build(base, data)
    choices = sum(r["readout"] == "choice" and len(r["question"]["criteria"]) >= 3 for r in read_split(data, "train"))
    assert choices > 0
    a = plan.estimate(base, data_dir=data)
    b = plan.estimate(config.resolve("tiny", {"mode_b": True, "mode_b_min_options": 3}), data_dir=data)
    assert f"{choices:,} routed to Mode B" in b.data and "routed" not in a.data
    assert b.tokens_per_example > a.tokens_per_example and b.flops > a.flops
    E = plan.model_config(base)[0].hidden_size
    assert b.trainable - a.trainable == 2 * E * modeb.HEAD_WIDTH + E  # the pointer's query, key and prior
    assert b.memory["activations"] > a.memory["activations"]
    head_only = config.resolve("tiny", {"mode_b": True, "mode_b_min_options": 3, "train_adapter": False})
    c = plan.estimate(head_only, data_dir=data)
    assert c.flops < b.flops and c.memory["activations"] < b.memory["activations"]
    # nothing routes above the choices' size: the plan is the Mode A one
    d = plan.estimate(config.resolve("tiny", {"mode_b": True, "mode_b_min_options": 200}), data_dir=data)
    assert "0 routed" in d.data and d.tokens_per_example == a.tokens_per_example


def test_training_refuses_before_it_starts_when_the_plan_exceeds_the_device(tmp_path, monkeypatch, capsys):
    """`python -m train` refuses in one line (exit 2) before the trainer exists when the plan's estimate
    exceeds the named accelerator, naming settings that would fit (a process past the host's memory is
    killed without a word in its log); a run that fits passes."""
    import dataclasses

    from lev_jax.training import plan, recipes

    data = tmp_path / "data"
    cfg = config.resolve("tiny", {"data": str(data)})
    recipes.build(cfg, data)
    cli.refuse_if_too_big(cfg, data)  # fits: nothing
    need = plan.estimate(cfg, data_dir=data).total_memory
    need_full = plan.estimate(dataclasses.replace(cfg, remat="full"), data_dir=data).total_memory
    assert need_full < need
    # room for the run under full remat, not as the preset sets it
    room = dataclasses.replace(plan.ACCELERATORS["cpu"], memory=(need + need_full) / 2 / plan.HEADROOM)
    monkeypatch.setitem(plan.ACCELERATORS, "cpu", room)
    fit = cli.settings_that_fit(cfg, data)
    assert fit is not None and "remat" in fit
    assert plan.estimate(dataclasses.replace(cfg, **fit), data_dir=data).fits
    run = ["--preset", "tiny", "--out", str(tmp_path / "run"), "--set", f"data={data}"]
    assert cli.main(run) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: preset 'tiny' needs ~"), err
    assert " ".join(f"--set {k}={v}" for k, v in fit.items()) in err
    assert "training tiny" not in captured.out and not (tmp_path / "run" / "checkpoints").exists()
    # the named settings do start (a run whose every example is over max_tokens stops at its first batch)
    sets = [x for k, v in fit.items() for x in ("--set", f"{k}={v}")]
    assert cli.main([*run, *sets, "--set", "max_tokens=16"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    # where nothing the trainer can turn fits, it says to shard
    monkeypatch.setitem(plan.ACCELERATORS, "cpu", dataclasses.replace(room, memory=1e6))
    assert cli.main(run) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--mesh fsdp=N" in err


def test_a_second_trainer_on_a_run_directory_refuses_at_once(tmp_path):
    """While a trainer holds RUN_DIR/.lock (here: this process, through the trainer's own lock), a second
    `python -m train --out RUN_DIR` exits 2 with one line naming the lock, having written nothing."""
    from lev_jax.training import run

    out = tmp_path / "run"
    env = {**os.environ, runtime.CACHE_ENV: "", "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    with run.lock(out) as lock_path:
        p = subprocess.run(
            [sys.executable, "-m", "train", "--preset", "tiny", "--out", str(out), "--steps", "2"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 2, p.stderr[-2000:]
        err = p.stderr.strip()
        assert len(err.splitlines()) == 1 and str(lock_path) in err and f"pid {os.getpid()}" in err, err
        assert sorted(x.name for x in out.iterdir()) == [".lock"]  # no config, data or checkpoint written
    # the lock goes with its holder: the next trainer takes it
    with run.lock(out):
        pass
