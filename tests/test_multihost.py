"""Many devices and hosts that agree (issue 42), through the command line as the README gives it:

* the tiny preset on 8 host devices (`--mesh data=2,fsdp=2,tensor=2`) trains, calibrates and answers
  `lev_jax.load(RUN).predict` in a process with 8 devices -- it hung in the calibration, on the delta
  rule's LAPACK solve -- and equals the same run on one device (<= 1e-5 on answers);
* two processes started with `LEV_JAX_DISTRIBUTED=1 JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES
  JAX_PROCESS_ID` (jax.distributed over localhost, one CPU device each, `--mesh data=2`) equal one
  process with two devices, on steps whose two halves differ in length;
* an incomplete set of those variables is one line and exit 2.

Every run is a subprocess with a timeout: a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 800  # each run; below make test's 900 s per test, so a hang fails here with the runs' output
# one step at the full learning rate, its loss logged: the runs' cost is compiling, not running
LR = 1e-5  # see _same_runs
SMALL = ["--steps", "1", "--set", "warmup_steps=0", "--set", f"lr={LR}", "--set", "log_every=1"]
ASK = {
    "stars": {"type": "score", "instructions": "How positive?", "criteria": ["bad", "so-so", "good"]},
    "liked": {"type": "noul", "instructions": "Is it positive?"},
    "topic": {
        "type": "choice",
        "instructions": "Which topic?",
        "criteria": {"sports": None, "world": None, "business": None},
    },
}
STATES = [{"review": "A tender, witty film."}, {"note": "The match was cancelled after a long delay."}]


def _env(devices: int = 1, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "LEV_JAX_DISTRIBUTED"}
    env |= {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "LEV_JAX_DTYPE": "float32", **extra}
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    return env


def _train(out: Path, *args: str, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "train", "--preset", "tiny", "--out", str(out), *SMALL, *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(*procs: subprocess.Popen) -> list[str]:
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = "\n".join(f"--- {p.args[-6:]}:\n{(p.communicate()[0] or '')[-1500:]}" for p in procs)
        pytest.fail(f"a training run did not finish in {TIMEOUT_S} s (a hang?):\n{tails}")
    for p, text in zip(procs, outs):
        assert p.returncode == 0, f"{p.args} exited {p.returncode}:\n{text[-4000:]}"
    return outs


ANSWER = r"""
import json, sys
import jax, lev_jax
from lev_jax.engine import Engine
from lev_jax.training import run as run_lib

def engine(name):
    if not name.startswith("base:"):
        return lev_jax.load(name)
    run = name.removeprefix("base:")  # the run's untrained base, read as the run reads
    return Engine(run_lib.load_base(run_lib.read_config(run).model), **run_lib.load_run(run)[2]["engine"])

def answers(e):
    return [e.predict(state, json.loads(sys.argv[1])) for state in json.loads(sys.argv[2])]

print(json.dumps({"devices": len(jax.devices()), "answers": {name: answers(engine(name)) for name in sys.argv[3:]}}))
"""


def _answers(names: list, devices: int) -> dict:
    """{name: its answers to ASK about each of STATES}, in a process with `devices` host devices; a
    name is a run directory, or "base:RUN" for that run's base model untrained."""
    p = subprocess.run(
        [sys.executable, "-c", ANSWER, json.dumps(ASK), json.dumps(STATES), *map(str, names)],
        cwd=REPO,
        env=_env(devices),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["devices"] == devices
    return got["answers"]


def _probabilities(answer) -> list[float]:
    """Every number in an answer, in a fixed order."""
    if isinstance(answer, dict):
        return [x for k in sorted(answer) for x in _probabilities(answer[k])]
    if isinstance(answer, list):
        return [x for a in answer for x in _probabilities(a)]
    if isinstance(answer, bool) or not isinstance(answer, int | float):
        return []
    return [float(answer)]


def _losses(run: Path) -> list[float]:
    events = json.loads((run / "history.json").read_text())["events"]
    return [e["loss"] for e in events if e["event"] == "progress"]


def _adapter(run: Path) -> dict:
    from lev_jax.training import run as run_lib

    step, trainable, _ = run_lib.load_checkpoint(run)
    import jax

    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(trainable)}


def _same_runs(a: Path, b: Path, tol: float = 1e-5) -> None:
    """The same loss, adapter and calibration. Adam's first step is ~lr * sign(gradient): an element
    whose gradient is near Adam's eps (1e-8) moves by up to 2 lr on fp32 summation-order noise alone
    (another split of the batch or of the weights sums in another order), so a few elements may
    differ by that much; the learning rate is small enough that this stays far below `tol` in the
    answers, and the step still moves them ~1e-3."""
    la, lb = _losses(a), _losses(b)
    # the step's loss: a mean over the batch, summed in another order over another split (~1e-5 apart)
    assert len(la) == len(lb) >= 1 and np.allclose(la, lb, atol=5 * tol, rtol=0), (la, lb)
    ta, tb = _adapter(a), _adapter(b)
    assert ta.keys() == tb.keys()
    diff = np.concatenate([np.abs(ta[k] - tb[k]).ravel() for k in ta])
    assert (diff > LR / 100).mean() <= 0.01 and diff.max() <= 2 * LR, (int((diff > LR / 100).sum()), diff.size)
    assert max(float(np.abs(tb[k]).max()) for k in tb if k.endswith("['b']")) > LR / 2  # it trained
    # the same calibration fitted on the same rows (its log-likelihoods read through the engine)
    ca, cb = ({x["key"]: x for x in json.loads((r / "calibration.json").read_text())["buckets"]} for r in (a, b))
    assert ca.keys() == cb.keys() and len(ca) >= 2
    for k in ca:
        assert ca[k]["n_rows"] == cb[k]["n_rows"] > 0
        assert abs(ca[k]["nll_before"] - cb[k]["nll_before"]) <= 1e-4
        assert abs(ca[k]["temperature"] - cb[k]["temperature"]) <= 1e-3


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The reference: the same run in one process on one device (started here, finished by whichever
    test first needs it, beside that test's own runs)."""
    out = tmp_path_factory.mktemp("one") / "run"
    ref = {"out": out, "proc": _train(out, env=_env(1)), "done": False}
    yield ref
    if ref["proc"].poll() is None:
        ref["proc"].kill()


def _with_reference(ref: dict, *procs: subprocess.Popen) -> list[str]:
    outs = _finish(*procs, *([] if ref["done"] else [ref["proc"]]))
    ref["done"] = True
    return outs[: len(procs)]


@pytest.mark.slow
def test_eight_host_devices_train_calibrate_and_answer_as_one_device(tmp_path, one_device):
    many, one = tmp_path / "many", one_device["out"]
    _with_reference(one_device, _train(many, "--mesh", "data=2,fsdp=2,tensor=2", env=_env(8)))
    _same_runs(many, one)
    # served in a process with 8 host devices (predict hung there too): each run's answers, the same,
    # and the same as in a process with one device
    got, alone = _answers([many, one], devices=8), _answers([one, f"base:{one}"], devices=1)
    a, b, c, base = (
        np.asarray(_probabilities(x[str(r)]))
        for x, r in ((got, many), (got, one), (alone, one), (alone, f"base:{one}"))
    )
    assert a.shape == b.shape == c.shape == base.shape and a.size > 10
    assert float(np.abs(a - b).max()) <= 1e-5 and float(np.abs(b - c).max()) <= 1e-6
    assert float(np.abs(b - base).max()) > 1e-3  # the step moved the answers: the comparison is not idle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_as_one_process(tmp_path, one_device):
    """The README's multi-node command on localhost: two processes, one CPU device each, one run
    directory (`--mesh data=2`); equal to one process. Process 0 alone builds the data and calibrates;
    both agree on the step's shapes though their halves of it differ in length."""
    two, one = tmp_path / "two", one_device["out"]
    port = _free_port()
    hosts = {"LEV_JAX_DISTRIBUTED": "1", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2"}
    procs = [_train(two, "--mesh", "data=2", env=_env(1, **hosts, JAX_PROCESS_ID=str(i))) for i in range(2)]
    outs = _with_reference(one_device, *procs)
    assert "building the 'tiny' data recipe" in outs[0] and "building" not in outs[1]  # process 0 alone
    assert "calibration:" in outs[0] and "calibration:" not in outs[1]
    _same_runs(two, one)
    got = _answers([two, one], devices=1)
    a, b = (np.asarray(_probabilities(got[str(r)])) for r in (two, one))
    assert a.size > 10 and float(np.abs(a - b).max()) <= 1e-5
    # the step's two halves (one per process) held different token counts: uneven per-host lengths
    assert _uneven_halves(one, steps=1)


def _uneven_halves(run: Path, steps: int) -> bool:
    """Whether some step of `run` (as `loop.train` packs it) gives the two halves of its groups
    different numbers of real tokens."""
    from lev_jax.training import batches, loop
    from lev_jax.training import run as run_lib

    cfg = run_lib.read_config(run)
    it = loop.data_iterator(cfg, run / "data", loop.make_renderer(cfg, run_lib.load_base(cfg.model).tokenizer))
    counters = {"skipped": 0, "epoch": 0}
    for _ in range(steps):
        arrays, _ = batches.pack(loop.next_examples(it, counters), multiple=2, min_length=cfg.min_length)
        tokens = arrays["prefix_valid_EP"].sum(1) + arrays["valid_ERT"].sum((1, 2))
        half = len(tokens) // 2
        if tokens[:half].sum() != tokens[half:].sum():
            return True
    return False


@pytest.mark.parametrize(
    "given",
    [
        {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
        {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_PROCESS_ID": "1"},
    ],
)
def test_incomplete_distributed_variables_are_one_line(tmp_path, given):
    p = subprocess.run(
        [sys.executable, "-m", "train", "--preset", "tiny", "--out", str(tmp_path / "r")],
        cwd=REPO,
        env=_env(1, LEV_JAX_DISTRIBUTED="1", **given),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2
    line = p.stderr.strip()
    assert "\n" not in line and line.startswith("error: ")
    missing = {"JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"} - set(given)
    assert all(m in line for m in missing)


def test_distributed_settings():
    from lev_jax.training import hosts

    assert hosts.settings({}) == {}
    full = {"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert hosts.settings(full) == {"coordinator_address": "h0:1234", "num_processes": 4, "process_id": 3}
    for bad in ({**full, "JAX_PROCESS_ID": "4"}, {**full, "JAX_NUM_PROCESSES": "two"}):
        with pytest.raises(hosts.DistributedSetupError):
            hosts.settings(bad)
