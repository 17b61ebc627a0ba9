"""`python -m train --preset tiny --set exits=...`: an exits stage over a restored run (issue 14). The exit
adapters learn with the adapter frozen (bit-identical), the stage resumes exactly, and a release
carries the adapters back into a Backbone whose exits read what the trained tree reads."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.test_train_run import FAST, REPO, _env, _progress, _restore, _same_checkpoint, adapter_unchanged, train

CHOICES = ["--set", "readouts=choice"]  # every batch a choice: every step has rows to read


def make_release(run, out, *more, check=True):
    """`python -m train release --run RUN --out OUT [more]`, which must succeed (`check`)."""
    p = subprocess.run(
        [sys.executable, "-m", "train", "release", "--run", str(run), "--out", str(out), *more],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert not check or p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    root = tmp_path_factory.mktemp("exits")
    plain = root / "plain"
    train(plain, "--steps", "2", "--checkpoint-every", "2", *CHOICES, *FAST)
    run = root / "stage"
    args = ["--resume", str(plain / "checkpoints" / "2"), "--set", "exits=default", "--set", "train_adapter=false"]
    p = train(run, *args, *CHOICES, "--steps", "5", "--checkpoint-every", "1", "--set", "lr=3e-2", *FAST)
    return root, plain, run, p.stdout


def test_an_exits_stage_trains_the_exits_and_leaves_the_adapter_untouched(stage):
    root, plain, run, stdout = stage
    assert "stage: fresh exit adapters at depths [1, 2, 3]" in stdout
    assert "adapter frozen: only the exit adapters learn" in stdout and "step 5/5" in stdout
    assert {"event": "stage", "step": 2, "exits": [1, 2, 3]} in json.loads((run / "history.json").read_text())["events"]
    exits = [  # (the stage's first step runs at the warmup's lr 0)
        adapter_unchanged(plain / "checkpoints" / "2", run / "checkpoints" / str(step), "exits") for step in (4, 5)
    ]
    assert sorted(exits[0]) == ["1", "2", "3"]
    for d in ("1", "2", "3"):  # every exit's map and gain moved off the logit lens (b = 0, gain = 1) and on
        assert np.abs(np.asarray(exits[0][d]["b"])).max() > 0
        assert not np.array_equal(np.asarray(exits[0][d]["b"]), np.asarray(exits[1][d]["b"]))
        assert np.abs(np.asarray(exits[0][d]["gain"]) - 1).max() > 0
    assert "exits KL" in stdout  # each exit also learned from the full depth's answer (exit_distill)
    losses = [e["loss"] for e in _progress(run) if e["step"] > 2]  # (the plain run's own came along)
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_the_exits_stage_resumes_exactly(stage, tmp_path):
    root, plain, run, _ = stage
    again = tmp_path / "again"
    more = ["--set", "exits=default", "--set", "train_adapter=false", "--set", "lr=3e-2", *CHOICES]
    more += ["--steps", "5", "--checkpoint-every", "1", *FAST]
    q = train(again, "--resume", str(run / "checkpoints" / "3"), *more)
    assert "at step 3" in q.stdout and "stage:" not in q.stdout
    _same_checkpoint(run / "checkpoints" / "5", again / "checkpoints" / "5")


def test_a_release_carries_the_exits(stage):
    """... with their held-out quality when given a `levbench depth` report of the checkpoint
    (`--depth-eval`): in the manifest, the card and /health; a report of other exits is refused."""
    import lev_jax
    from lev_jax.bench import depth
    from tests.test_bench_depth import eval_set

    root, plain, run, _ = stage
    report = depth.run(
        lev_jax.load(str(run), dtype="float32"), [eval_set(n=6)], root / "depth", timing_items=2, folds=3
    )
    out = root / "release"
    make_release(run, out, "--depth-eval", str(root / "depth"))
    manifest = json.loads((out / "lev_release.json").read_text())
    assert manifest["exits"]["depths"] == [1, 2, 3] and (out / manifest["exits"]["adapters"]).is_file()
    fixed = {p["policy"]: p for p in report["policies"]}
    quality = manifest["exits"]["metrics"]
    assert [q["depth"] for q in quality] == [1, 2, 3, 4]
    for q in quality:
        assert q["accuracy"] == fixed[f"fixed {q['depth']}"]["accuracy"] and q["n"] == report["questions"]
    assert lev_jax.load(str(out)).info()["depth"]["quality"] == quality
    assert "Held-out per depth" in (out / "README.md").read_text() and (out / "eval" / "depth.md").is_file()
    other = json.loads((root / "depth" / "depth.json").read_text()) | {"depths": [2, 4]}
    (root / "depth-other").mkdir()
    (root / "depth-other" / "depth.json").write_text(json.dumps(other))
    (root / "depth-other" / "depth.md").write_text("")
    bad = make_release(run, root / "bad-release", "--depth-eval", str(root / "depth-other"), check=False)
    assert bad.returncode == 2 and "its exits are [2], this run's [1, 2, 3]" in bad.stderr
    (root / "depth-other" / "depth.json").write_text(json.dumps(other | {"depths": [1, 2, 3, 4], "model": "another"}))
    bad = make_release(run, root / "bad-release", "--depth-eval", str(root / "depth-other"), check=False)
    assert bad.returncode == 2 and "a report of 'another'" in bad.stderr
    assert not (root / "bad-release").exists()
    from lev_jax.training import release

    bb, _, _ = release.load_release(out)
    trained = _restore(run / "checkpoints" / "5", "trainable")["exits"]
    for d in ("1", "2", "3"):
        for k in ("scale", "a", "b", "gain"):
            np.testing.assert_array_equal(np.asarray(bb.exits[d][k]), np.asarray(trained[d][k], np.float32))


def test_an_exits_run_starts_from_a_release(stage):
    """`--from-release`: a new run continues a release's adapter (how a shipped default gets exits);
    the adapter comes in bit for bit and stays so; a release that does not fit is one line, exit 2."""
    root, plain, _, _ = stage
    rel = root / "plain-release"
    make_release(plain, rel)
    run = root / "from-release"
    args = ["--from-release", str(rel), "--set", "exits=default", "--set", "train_adapter=false", *CHOICES]
    q = train(run, *args, "--steps", "2", "--checkpoint-every", "2", *FAST)
    assert f"starting from release {json.loads((rel / 'lev_release.json').read_text())['name']}" in q.stdout
    exits = adapter_unchanged(plain / "checkpoints" / "2", run / "checkpoints" / "2", "exits")
    assert sorted(exits) == ["1", "2", "3"]
    events = json.loads((run / "history.json").read_text())["events"]
    assert any(e.get("from_release") for e in events)
    # its release names the release it continued (the adapter's lineage), and its card says so
    staged = root / "from-release-release"
    make_release(run, staged)
    name = json.loads((rel / "lev_release.json").read_text())["name"]
    m = json.loads((staged / "lev_release.json").read_text())
    assert m["training"]["started_from"] == name and m["training"]["distilled"] is None
    assert f"starting from the release `{name}`" in (staged / "README.md").read_text()
    bad = train(root / "misfit", *args, "--set", "lora_rank=4", "--steps", "1", *FAST, check=False)
    assert bad.returncode == 2 and not (root / "misfit" / "checkpoints").exists()
    [line] = bad.stderr.strip().splitlines()
    assert "does not fit this run: lora_rank" in line


def test_exits_are_refused_where_they_cannot_train():
    """Refused before any work, with the line the CLI prints (ConfigError / TrainingError: exit 2)."""
    from lev_jax import models, testing
    from lev_jax.readout import exits as exits_lib
    from lev_jax.training import config

    with pytest.raises(config.ConfigError, match="add --set train_adapter=false"):
        config.resolve("tiny", {"exits": "default"})
    with pytest.raises(config.ConfigError, match="exits must be"):
        config.resolve("tiny", {"exits": "half", "train_adapter": False})
    with pytest.raises(config.ConfigError, match="without --mode-b"):
        config.resolve("tiny", {"exits": "default", "train_adapter": False, "mode_b": True})
    with pytest.raises(config.ConfigError, match="exit_distill must be >= 0"):
        config.resolve("tiny", {"exits": "default", "train_adapter": False, "exit_distill": -1.0})
    cfg = models.config_from_hf({**testing.TINY_QWEN3_5, "vocab_size": 512})
    with pytest.raises(ValueError, match=r"exit depths must be layer counts in \[1, 4\]"):
        exits_lib.depths_of("9", cfg)
    assert exits_lib.depths_of("default", cfg) == (1, 2, 3) and exits_lib.depths_of("2,4", cfg) == (2,)


def test_exit_distillation_is_the_kl_from_the_full_depths_answer():
    """loss.distill: KL(teacher || student) over each row's real codes, weighted over real rows."""
    import jax
    import jax.numpy as jnp

    from lev_jax.training import loss as loss_lib

    teacher = jnp.asarray([[2.0, 0.0, -1.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    valid = jnp.asarray([[True, True, True, False], [True, True, False, False]])
    batch = {"valid_BC": valid, "weight_B": jnp.asarray([1.0, 1.0])}
    # the same reading on the real codes (a padded slot may hold anything): nothing to learn
    assert float(loss_lib.distill(teacher.at[0, 3].set(50.0), teacher, batch)) == pytest.approx(0.0, abs=1e-6)
    student = jnp.asarray([[0.0, 1.0, 0.0, 9.0], [0.0, 2.0, 7.0, 7.0]])
    p0, q0 = jax.nn.softmax(teacher[0, :3]), jax.nn.softmax(student[0, :3])
    p1, q1 = jax.nn.softmax(teacher[1, :2]), jax.nn.softmax(student[1, :2])
    kl = [float(jnp.sum(p * (jnp.log(p) - jnp.log(q)))) for p, q in ((p0, q0), (p1, q1))]
    assert float(loss_lib.distill(student, teacher, batch)) == pytest.approx(np.mean(kl), rel=1e-5)
    only_first = {**batch, "weight_B": jnp.asarray([1.0, 0.0])}  # a padding row counts for nothing
    assert float(loss_lib.distill(student, teacher, only_first)) == pytest.approx(kl[0], rel=1e-5)


def test_exits_saved_before_the_gain_read_with_the_identity_gain():
    import jax

    from lev_jax import testing
    from lev_jax.readout import exits as exits_lib

    bb = testing.tiny_backbone("llama", seed=4, layers=4)
    tensors = exits_lib.exits_tensors(exits_lib.init_exits(bb.config, (1, 3), rank=4))
    assert sorted(k for k in tensors if k.startswith("exits.1.")) == [
        f"exits.1.{k}" for k in ("a", "b", "gain", "scale")
    ]
    old = {k: v for k, v in tensors.items() if not k.endswith(".gain")}
    back = exits_lib.exits_from_tensors(old, bb.config)
    np.testing.assert_array_equal(np.asarray(back["3"]["gain"]), np.ones(bb.config.hidden_size, np.float32))
    x = jax.random.normal(jax.random.key(0), (2, bb.config.hidden_size))
    np.testing.assert_array_equal(
        np.asarray(exits_lib.exit_hidden(bb.params, back, x, 3, bb.config)),
        np.asarray(exits_lib.exit_hidden(bb.params, exits_lib.exits_from_tensors(tensors, bb.config), x, 3, bb.config)),
    )
    with pytest.raises(ValueError, match="does not fit hidden size"):
        exits_lib.exits_from_tensors({**tensors, "exits.1.gain": np.ones(3, np.float32)}, bb.config)
