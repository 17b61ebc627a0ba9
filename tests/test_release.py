"""Releases and peft adapters: `python -m train release` on a trained tiny run, the release as a peft
adapter directory read by transformers + peft (logits, not just the load: a wrong key prefix makes
peft load lora_B as zeros silently), adapters written by peft read back into lev-jax, and
`lev_jax.load` / `serve --checkpoint` on a release."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hf_reference as R
import lev_jax
from lev_jax.errors import CheckpointError
from lev_jax.loaders import peft as peft_format
from lev_jax.training import lora, release

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4


def _random_adapter(params, rank=4, seed=0):
    """An adapter whose B is not zero (a fresh one is the identity), large enough to move logits."""
    adapter = lora.init(params, rank, seed=seed)
    rng = np.random.default_rng(seed)
    return {
        p: {"a": np.asarray(ab["a"]), "b": rng.normal(0, 0.3, ab["b"].shape).astype(np.float32)}
        for p, ab in adapter.items()
    }


def _hf_model(kind, d):
    import transformers

    cls = transformers.Qwen3_5ForCausalLM if kind == "qwen3_5" else transformers.LlamaForCausalLM
    return cls.from_pretrained(str(d), torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def base_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"base-{request.param}")
    if request.param == "llama":
        R.save_llama_family("llama", d, seed=1)
    else:
        R.save_qwen3_5("mixed-gqa", d, seed=1)  # DeltaNet projections (in_proj_qkv/z/a/b, out_proj) too
    return request.param, d


def test_exported_adapter_gives_peft_the_same_logits_and_reimports_losslessly(base_dir, tmp_path):
    from peft import PeftModel

    kind, d = base_dir
    bb = lev_jax.load_backbone(str(d))
    adapter = _random_adapter(bb.params)
    peft_format.export(tmp_path, adapter, rank=4, alpha=8.0, hf_config=bb.hf_config, base_model=str(d))
    ids = np.random.default_rng(0).integers(0, R.VOCAB, (1, 24))
    ours = np.asarray(lev_jax.load_backbone(str(tmp_path)).logits(ids))  # the adapter on the base it names
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(_hf_model(kind, d), str(tmp_path))(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    assert np.abs(ours - np.asarray(bb.logits(ids))).max() > 1e-2  # the adapter really moved them
    back, scale = peft_format.read(tmp_path, bb.params, bb.hf_config)
    assert scale == 2.0 and set(back) == set(adapter)
    for p in adapter:
        np.testing.assert_array_equal(back[p]["a"], adapter[p]["a"])
        np.testing.assert_array_equal(back[p]["b"], adapter[p]["b"])


def test_an_adapter_written_by_peft_loads_into_lev_jax(base_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    kind, d = base_dir
    targets = ["q_proj", "v_proj", "down_proj"] + (["in_proj_qkv", "out_proj"] if kind == "qwen3_5" else [])
    model = get_peft_model(_hf_model(kind, d), LoraConfig(r=4, lora_alpha=16, target_modules=targets))
    with torch.no_grad():  # peft starts lora_B at zero: give it weight so the test can fail
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(tmp_path))
    ids = np.random.default_rng(1).integers(0, R.VOCAB, (1, 20))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(release.load_peft(tmp_path, base=str(d)).logits(ids))
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)


def test_adapter_problems_are_one_error(base_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, d = base_dir
    bb = lev_jax.load_backbone(str(d))
    peft_format.export(
        tmp_path, _random_adapter(bb.params), rank=4, alpha=8.0, hf_config=bb.hf_config, base_model=str(d)
    )
    tensors = load_file(str(tmp_path / peft_format.ADAPTER_WEIGHTS))
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors["model.layers.0.mlp.up_proj.lora_A.weight"] = tensors.pop(key)  # the prefix peft needs, dropped
    save_file(tensors, str(tmp_path / peft_format.ADAPTER_WEIGHTS))
    with pytest.raises(CheckpointError) as e:
        peft_format.read(tmp_path, bb.params, bb.hf_config)
    msg = str(e.value)
    assert "\n" not in msg and "unexpected tensor model.layers.0.mlp.up_proj.lora_A.weight" in msg
    assert "lora_A missing" in msg


# ------------------------------------------------------------------ a trained run, released and served


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def _train(*args):
    p = subprocess.run(
        [sys.executable, "-m", "train", *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900
    )
    return p


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    run_dir, rel = root / "run", root / "rel"
    p = _train("--preset", "tiny", "--out", str(run_dir), "--steps", "4", "--set", "checkpoint_every=4")
    assert p.returncode == 0, p.stderr[-3000:]
    p = _train("release", "--run", str(run_dir), "--out", str(rel))
    assert p.returncode == 0 and "released" in p.stdout, p.stderr[-3000:]
    return run_dir, rel


def test_release_directory_holds_the_adapter_not_the_optimiser(released):
    run_dir, rel = released
    names = {p.name for p in rel.rglob("*")}
    assert {"adapter_model.safetensors", "adapter_config.json", "lev_release.json", "README.md"} <= names
    assert not any("opt" in n for n in names) and not any(p.name.startswith(".rel.") for p in rel.parent.iterdir())
    m = json.loads((rel / "lev_release.json").read_text())
    assert m["step"] == 4 and m["training"]["preset"] == "tiny" and m["base"]["model"] == "tiny-qwen3_5"
    assert len(m["base"]["weights_sha256"]) == 64 and m["engine"]["prompt_style"] == "chat"
    assert set(m["files"]) >= {"adapter_model.safetensors", "adapter_config.json"}
    if m["calibration"]:
        assert (rel / "calibration.json").is_file()
    cfg = json.loads((rel / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16.0 and cfg["peft_type"] == "LORA"
    # the release serves what the run serves: the same merged weights, the same answers
    q = {
        "ok": {"type": "noul", "instructions": "Is it fine?"},
        "c": {"type": "choice", "criteria": {"a": None, "b": None}},
    }
    from_run = lev_jax.load(str(run_dir), dtype="float32").predict("A state.", q)
    from_release = lev_jax.load(str(rel), dtype="float32").predict("A state.", q)
    assert from_run == from_release
    # releasing again into an existing directory is refused, leaving it as it was
    p = _train("release", "--run", str(run_dir), "--out", str(rel))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "exists" in p.stderr


def test_release_refuses_another_base_and_changed_files(released, tmp_path):
    import shutil

    _, rel = released
    other = tmp_path / "other"
    shutil.copytree(rel, other)
    m = json.loads((other / "lev_release.json").read_text())
    m["base"]["weights_sha256"] = "0" * 64
    (other / "lev_release.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError) as e:
        lev_jax.load(str(other))
    assert "\n" not in str(e.value) and "0000000000000000" in str(e.value) and "tiny-qwen3_5" in str(e.value)
    changed = tmp_path / "changed"
    shutil.copytree(rel, changed)
    with open(changed / "adapter_model.safetensors", "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match="changed since the release: adapter_model.safetensors"):
        lev_jax.load(str(changed))
    # a Mode A vs Mode B report for a run without a head is refused before anything is written
    from lev_jax.training import release

    report = tmp_path / "agree"
    report.mkdir()
    (report / "agreement.json").write_text(json.dumps({"min_agreement": 0.8, "tasks": []}))
    with pytest.raises(CheckpointError, match="no Mode B head"):
        release.make(released[0], tmp_path / "rel", agree_dir=report)
    assert not (tmp_path / "rel").exists()


def test_data_distill_mixes_the_teachers_read_into_train_targets_only(released, tmp_path):
    """`python -m data distill`: train choices get mix * target + (1 - mix) * the teacher's served
    probabilities; calibration and test stay byte for byte; a second run resumes from the cache."""
    from lev_jax.data.build import read_split
    from lev_jax.data.guard import sha256_file

    run_dir, rel = released
    out = tmp_path / "kd"
    cmd = [sys.executable, "-m", "data", "distill", "--data", str(run_dir / "data"), "--teacher", str(rel)]
    p = subprocess.run([*cmd, "--out", str(out), "--mix", "0.25"], cwd=REPO, capture_output=True, text=True, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    before, after = read_split(run_dir / "data", "train"), read_split(out, "train")
    assert [r["uid"] for r in before] == [r["uid"] for r in after]
    choices = [(b, a) for b, a in zip(before, after) if b["primitive"] == "choice" and not b["abstain"]]
    kept = [(b, a) for b, a in zip(before, after) if b["primitive"] != "choice" or b["abstain"]]
    assert choices and kept and all(b["target_dist"] == a["target_dist"] for b, a in kept)
    teacher = lev_jax.load(str(rel))
    for b, a in choices[:3]:
        probs = teacher.predict(b["state"], {"q": b["question"]})["q"]["probabilities"]
        want = [0.25 * t + 0.75 * probs[k] for t, k in zip(b["target_dist"], b["question"]["criteria"])]
        np.testing.assert_allclose(a["target_dist"], want, atol=1e-4)  # read in batches of 8 here, alone there
        assert abs(sum(a["target_dist"]) - 1) < 1e-6
    for name in ("calibration.array_record", "test.array_record", "length_stats.json"):
        assert (out / name).read_bytes() == (run_dir / "data" / name).read_bytes()
    m = json.loads((out / "manifest.json").read_text())
    assert m["distilled"]["records"] == len(choices) and m["distilled"]["mix"] == 0.25
    assert m["splits"]["train"]["sha256"] == sha256_file(out / "train.array_record")
    # resume: every read is cached, so a rerun reads nothing and writes the same split
    lines = (out / "teacher.jsonl").read_text().count("\n")
    p = subprocess.run([*cmd, "--out", str(out), "--mix", "0.25"], cwd=REPO, capture_output=True, text=True, env=_env())
    assert p.returncode == 0 and (out / "teacher.jsonl").read_text().count("\n") == lines == len(choices)
    assert m["splits"]["train"]["sha256"] == sha256_file(out / "train.array_record")
    # bad input: one line, non-zero, nothing written
    p = subprocess.run(
        [*cmd, "--out", str(tmp_path / "bad"), "--mix", "2"], cwd=REPO, capture_output=True, text=True, env=_env()
    )
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "mix" in p.stderr
    assert not (tmp_path / "bad").exists()


def test_served_release_answers_the_sdk(released, tmp_path):
    import httpx
    from typesafe_sdk import Choice, Noul, TypeSafeClient

    from lev_jax.server.testing import ServerProcess

    _, rel = released
    with ServerProcess(["--checkpoint", str(rel)], log_path=tmp_path / "serve.log") as server:
        health = httpx.get(server.url + "/health").json()
        assert health["checkpoint"].startswith("release ") and "tiny" in health["model"]
        with TypeSafeClient(api_key="unused", base_url=server.url, timeout=120) as c:
            r = c.system_one(
                state="A parcel arrived late.",
                questions={
                    "late": Noul(instructions="Late?"),
                    "team": Choice(criteria={"Billing": None, "Shipping": None}),
                },
            )
        assert 0 <= r.nouls["late"].noul <= 1 and r.choices["team"].choice in {"Billing", "Shipping"}


def test_release_card_carries_a_levbench_evaluation(released, tmp_path):
    """`--eval DIR`: a levbench evaluation of the run (reports, reliability PNGs) goes into the release,
    its table into the card and its metrics into the manifest."""
    from lev_jax.bench import harness as H
    from lev_jax.bench.clients import InProcessClient
    from lev_jax.bench.evalset import EvalSet

    run_dir, _ = released
    questions = {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}
    states = ["My parcel is late.", "Thanks, all good.", "Refund me now!", "Where is my order?"]
    es = EvalSet(
        "tiny-held-out",
        questions,
        [{"state": s, "labels": {"urgent": i % 2 == 0}} for i, s in enumerate(states)],
        {"split": "tiny-test"},
    )
    es.save(tmp_path / "tiny-held-out.json")
    H.evaluate(
        InProcessClient(lev_jax.load(str(run_dir))),
        [H.SetSpec(tmp_path / "tiny-held-out.json")],
        tmp_path / "eval",
        progress=False,
    )
    rel = tmp_path / "rel"
    p = _train("release", "--run", str(run_dir), "--out", str(rel), "--eval", str(tmp_path / "eval"))
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.loads((rel / "lev_release.json").read_text())
    [task] = m["metrics"]
    assert task["task"] == "tiny-held-out" and task["n"] == 4 and 0 <= task["metrics"]["accuracy"] <= 1
    assert (rel / "eval" / "tiny-held-out.reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (rel / "README.md").read_text()
    assert (
        "| tiny-held-out | 4 |" in card and "![tiny-held-out.reliability](eval/tiny-held-out.reliability.png)" in card
    )
    assert "eval/tiny-held-out.reliability.png" in m["files"]


# ------------------------------------------------------------------ a Mode B run, released and served
@pytest.fixture(scope="module")
def released_b(tmp_path_factory):
    """`train --preset tiny --mode-b` (every choice of 3+ options read by the head, so the tiny
    recipe's choices train it), then `release`."""
    root = tmp_path_factory.mktemp("release-b")
    run_dir, rel = root / "run", root / "rel"
    p = _train(
        "--preset", "tiny", "--mode-b", "--out", str(run_dir), "--steps", "4",
        "--set", "checkpoint_every=4", "--set", "mode_b_min_options=3",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert " marker " in p.stdout, p.stdout[-2000:]  # Mode B's own loss window in the progress line
    p = _train("release", "--run", str(run_dir), "--out", str(rel))
    assert p.returncode == 0 and "released" in p.stdout, p.stderr[-3000:]
    return run_dir, rel


def test_mode_b_release_carries_the_head_and_serves_what_the_run_serves(released_b):
    from safetensors.numpy import load_file

    run_dir, rel = released_b
    m = json.loads((rel / "lev_release.json").read_text())
    assert m["mode_b"] == {"head": "mode_b_head.safetensors", "min_options": 3}
    assert "mode_b_head.safetensors" in m["files"] and "Mode B" in (rel / "README.md").read_text()
    head = load_file(str(rel / "mode_b_head.safetensors"))
    assert head["mode_b_head.wq"].dtype == np.float32 and head["mode_b_head.wq"].shape[1] == 256
    q = {
        "team": {"type": "choice", "criteria": {"Billing": None, "Shipping": "parcels", "Sales": None, "Legal": None}},
        "two": {"type": "choice", "criteria": {"a": None, "b": None}},
    }
    from_run, from_release = (lev_jax.load(str(d), dtype="float32") for d in (run_dir, rel))
    assert [qp.route for qp in from_release.plan("A state.", q).questions] == ["mode_b", "mode_a"]
    assert (
        from_run.info()["mode_b"] == from_release.info()["mode_b"] and from_release.info()["mode_b"]["min_options"] == 3
    )
    a, b = from_run.predict("A parcel is late.", q), from_release.predict("A parcel is late.", q)
    for k in q:
        np.testing.assert_allclose(
            list(a[k]["probabilities"].values()), list(b[k]["probabilities"].values()), atol=1e-6, rtol=0
        )
    # without its head file the release is refused in one line, not served as Mode A silently
    import shutil

    broken = rel.parent / "broken"
    shutil.copytree(rel, broken)
    (broken / "mode_b_head.safetensors").unlink()
    with pytest.raises(CheckpointError, match="mode_b_head.safetensors"):
        lev_jax.load(str(broken))


def test_mode_b_run_calibrates_the_choices_its_head_reads_both_ways(released_b, tmp_path):
    """The choices the head reads are also read by label codes for calibration, so an engine with the
    head switched off (`mode_b=False`, levbench agree's Mode A) has temperatures of its own for them
    rather than another band's. Refitted here with every choice routed to the head: without the
    second read no letter readout of a choice would be fitted at all."""
    import dataclasses

    from lev_jax.training import calibration, run

    run_dir, _ = released_b
    cfg = dataclasses.replace(run.read_config(run_dir), mode_b_min_options=2, calibration_rows=24)
    bb, _, _ = run.load_run(run_dir, "float32")
    calibration.fit_run(cfg, tmp_path, bb, run_dir / "data", out=lambda _: None)
    fitted = {b["key"]: b["n_rows"] for b in json.loads((tmp_path / "calibration.json").read_text())["buckets"]}
    marker = {k.split("/")[2]: n for k, n in fitted.items() if k.startswith("choice/marker/")}
    letter = {k.split("/")[2]: n for k, n in fitted.items() if k.startswith("choice/letter/")}
    assert marker and set(letter) == set(marker), sorted(fitted)
    assert all(letter[band] >= n for band, n in marker.items())  # each record read by its codes too


def test_served_mode_b_release_answers_jevcompat_and_the_sdk(released_b, tmp_path):
    import httpx
    from typesafe_sdk import Choice, Noul, TypeSafeClient

    from lev_jax.server.testing import ServerProcess

    _, rel = released_b
    with ServerProcess(["--checkpoint", str(rel)], log_path=tmp_path / "serve.log") as server:
        assert httpx.get(server.url + "/health").json()["mode_b"]["min_options"] == 3
        with TypeSafeClient(api_key="unused", base_url=server.url, timeout=120) as c:
            r = c.system_one(
                state="A parcel arrived late.",
                questions={
                    "late": Noul(instructions="Late?"),
                    "team": Choice(criteria={"Billing": None, "Shipping": None, "Sales": None}),
                },
            )
        assert 0 <= r.nouls["late"].noul <= 1 and r.choices["team"].choice in {"Billing", "Shipping", "Sales"}
        out = tmp_path / "jevcompat.json"
        cmd = [sys.executable, "-m", "jevcompat.cli", "test", server.url, "--json", str(out), "--timeout", "120"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    s = report["summary"]
    assert report["summary"]["verdict"] == "conformant" and s["MUST"]["failed"] == 0, p.stdout[-3000:]
    assert s["SHOULD"]["failed"] == 0, p.stdout[-3000:]


def test_levbench_agree_reports_mode_a_vs_mode_b_and_gates(released_b, tmp_path):
    from lev_jax.bench import cli as bench_cli
    from lev_jax.bench.evalset import EvalSet

    run_dir, _ = released_b
    team = {"type": "choice", "criteria": {"Billing": "money", "Shipping": "parcels", "Sales": "buying"}}
    states = ["My parcel is late.", "I was charged twice.", "I want to buy ten more seats.", "Where is my box?"]
    gold = ["Shipping", "Billing", "Sales", "Shipping"]
    es = EvalSet("tiny-agree", {"team": team}, [{"state": s, "labels": {"team": g}} for s, g in zip(states, gold)], {})
    es.save(tmp_path / "tiny-agree.json")
    args = [str(tmp_path / "tiny-agree.json"), "--model", str(run_dir), "--no-progress"]
    assert bench_cli.main(["agree", *args, "--out", str(tmp_path / "a"), "--min-agreement", "0"]) == 0
    doc = json.loads((tmp_path / "a" / "agreement.json").read_text())
    [rec] = doc["tasks"]
    assert rec["task"] == "tiny-agree" and rec["questions"] == 4 and 0 <= rec["agreement"] <= 1
    assert 0 <= rec["mean_tv"] <= 1 and rec["accuracy_mode_a"] is not None and rec["accuracy_mode_b"] is not None
    # the gate: below the required agreement the command fails
    assert bench_cli.main(["agree", *args, "--out", str(tmp_path / "b"), "--min-agreement", "1.01"]) == 1
    assert "FAIL" in (tmp_path / "b" / "agreement.md").read_text()
    # a release of the run carries the report: manifest and card
    from lev_jax.training import release

    rel = release.make(run_dir, tmp_path / "rel", agree_dir=tmp_path / "a")
    m = json.loads((rel / "lev_release.json").read_text())
    assert m["mode_b"]["agreement"] == {"min_agreement": 0.0, "tasks": [rec]} and m["mode_b"]["min_options"] == 3
    card = (rel / "README.md").read_text()
    assert "Mode A (label codes) vs Mode B" in card and f"| tiny-agree | 4 | {rec['agreement']:.3f} |" in card
    [served] = lev_jax.load(str(rel), dtype="float32").info()["release"]["mode_b_agreement"]  # /health's
    assert served == {k: rec[k] for k in ("task", "questions", "agreement", "accuracy_mode_a", "accuracy_mode_b")}
    with pytest.raises(CheckpointError, match="no readable levbench agreement.json"):
        release.make(run_dir, tmp_path / "rel2", agree_dir=tmp_path)
    assert not (tmp_path / "rel2").exists()


# ------------------------------------------------------------------ manifests name files inside the release


@pytest.fixture
def shipped_copy(tmp_path):
    """A copy of the shipped default release, whose manifest the tests below tamper with."""
    import shutil

    from lev_jax.engine import DEFAULT_RELEASE

    rel = tmp_path / "rel"
    shutil.copytree(DEFAULT_RELEASE, rel)
    release.check_files(rel, release.read_manifest(rel))  # untouched, it passes
    return rel


def _tamper(rel, edit):
    m = json.loads((rel / "lev_release.json").read_text())
    edit(m)
    (rel / "lev_release.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    "name", ["../outside.json", "/etc/hostname", "eval/../../outside.json", "C:/x.json", "eval\\..\\..\\x"]
)
def test_a_manifest_naming_a_file_outside_the_release_is_refused(shipped_copy, name):
    rel = shipped_copy
    outside = rel.parent / "outside.json"
    outside.write_text("{}")
    _tamper(rel, lambda m: m["files"].__setitem__(name, release._sha256(outside)))
    with pytest.raises(CheckpointError) as e:
        lev_jax.load(str(rel))  # refused before any weights load
    assert "\n" not in str(e.value) and ("outside the release" in str(e.value) or "invalid file" in str(e.value))


def test_a_loaded_file_outside_the_release_or_unlisted_is_refused(shipped_copy):
    rel = shipped_copy
    outside = rel.parent / "cal.json"
    outside.write_bytes((rel / "calibration.json").read_bytes())

    def point_out(m):
        m["calibration"] = "../cal.json"
        m["files"]["../cal.json"] = release._sha256(outside)

    _tamper(rel, point_out)
    with pytest.raises(CheckpointError, match="outside the release"):
        release.load_release(rel)

    # the head the loader reads must be listed with its hash, not merely present
    def unlist(m):
        m["calibration"] = "calibration.json"
        del m["files"]["../cal.json"], m["files"]["mode_b_head.safetensors"]

    _tamper(rel, unlist)
    with pytest.raises(CheckpointError, match="not listed with a hash in the manifest: mode_b_head.safetensors"):
        release.load_release(rel)


def test_a_symlink_out_of_the_release_is_refused(shipped_copy):
    rel = shipped_copy
    outside = rel.parent / "adapter.safetensors"
    (rel / "adapter_model.safetensors").rename(outside)
    (rel / "adapter_model.safetensors").symlink_to(outside)  # same bytes, same hash: only the place differs
    with pytest.raises(CheckpointError, match="adapter_model.safetensors leads outside the release"):
        release.load_release(rel)
