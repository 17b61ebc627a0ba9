"""lev_jax/programs.py: the memory-map guard (compiled programs are freed past the threshold, and
recompile on demand), the executable store (a program compiled once is loaded back, not compiled; a
damaged file is replaced) and compile-only runs (built, not computed; nothing kept; per thread)."""

import dataclasses
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lev_jax
from lev_jax import programs
from lev_jax.testing import tiny_backbone


def test_guard_frees_compiled_programs_past_its_threshold_only():
    f = jax.jit(lambda x: x * 2)
    f(jnp.ones(3))
    assert f._cache_size() == 1
    used = programs.maps_in_use()
    assert used is not None and 0 < used < programs.map_limit()
    assert programs.guard(force=True, free_at=1.0) is False  # far below the limit: nothing freed
    assert f._cache_size() == 1
    assert programs.guard(free_at=0.0) is False  # checked a moment ago: not again yet
    assert programs.guard(force=True, free_at=0.0) is True
    assert f._cache_size() == 0
    assert float(f(jnp.ones(3))[0]) == 2.0  # recompiled on demand
    assert f._cache_size() == 1


# -- programs: the executable store and compile-only runs ---------------------------------------------------


QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
    "team": {
        "type": "choice",
        "instructions": "Which team?",
        "criteria": {"Billing": None, "Tech": None, "Sales": None},
    },
}


def _engine(seed: int, **kwargs):
    bb = tiny_backbone("llama", seed=seed)
    # programs of its own: nothing another test compiled (in memory or in the session's store) is reused
    bb.config = dataclasses.replace(bb.config, rope_theta=bb.config.rope_theta + 0.25 * seed + 0.125)
    return lev_jax.Engine(bb, **{"prefix_cache_bytes": 0, **kwargs})


def _probs(answers: dict) -> list[float]:
    return [answers["refund"]["noul"], *answers["team"]["probabilities"].values()]


def test_a_program_is_stored_and_loaded_back_without_compiling():
    assert programs.store_dir() is not None  # tests/conftest.py: this session's own cache directory
    engine = _engine(seed=3)
    before = programs.stats()
    first = engine.predict("I was charged twice and want my money back.", QUESTIONS)
    compiled = programs.stats()["compiled"] - before["compiled"]
    assert compiled >= 2 and programs.stats()["loaded"] == before["loaded"]
    stored = {p.name for p in programs.store_dir().iterdir()}
    assert any(n.startswith("extend-") for n in stored) and any(n.startswith("read_slab-") for n in stored)

    programs.free_compiled()  # what a new process holds: nothing in memory, the store on disk
    mid = programs.stats()
    again = engine.predict("I was charged twice and want my money back.", QUESTIONS)
    after = programs.stats()
    assert after["compiled"] == mid["compiled"]  # every program came from the store
    assert after["loaded"] - mid["loaded"] == compiled
    # each build is logged with its time (/health shows them): the first request's compiles, then loads
    names = {b["program"] for b in after["builds"][-compiled:]}
    assert {b["how"] for b in after["builds"][-compiled:]} == {"loaded"} and {"extend", "read_slab"} <= names
    assert [b["how"] for b in mid["builds"][-compiled:]] == ["compiled"] * compiled
    assert after["build_seconds"] > mid["build_seconds"] > 0
    np.testing.assert_allclose(_probs(again), _probs(first), atol=1e-6)


def test_a_damaged_stored_program_is_dropped_and_never_stored_from_jax_s_cache(caplog, monkeypatch):
    """A stored file that cannot be read is deleted and the program built again; here JAX's own
    persistent cache (this session's, where the first call also put it) has it, and an executable
    JAX loaded from there is not stored (serialised again it loads but cannot run: XLA:CPU), so the
    answers stay right in this process and in the next."""
    engine = _engine(seed=4)
    saved = []  # this engine's files only: other test processes store into the same directory meanwhile
    save = programs.Program._save

    def spy(self, key, exe):
        save(self, key, exe)
        saved.append(self._path(key))

    monkeypatch.setattr(programs.Program, "_save", spy)
    first = engine.predict("Where is my parcel?", QUESTIONS)
    mine = {p for p in saved if p is not None and p.is_file()}
    assert len(mine) >= 2
    for p in mine:
        p.write_bytes(b"not an executable")
    programs.free_compiled()
    before = programs.stats()
    again = engine.predict("Where is my parcel?", QUESTIONS)
    after = programs.stats()
    assert after["loaded"] == before["loaded"]
    assert after["jax_cache_hits"] - before["jax_cache_hits"] == len(mine)
    assert "ignoring the stored program" in caplog.text
    assert not any(p.exists() for p in mine)  # dropped, and not written again from JAX's cache
    np.testing.assert_allclose(_probs(again), _probs(first), atol=1e-6)
    programs.free_compiled()
    np.testing.assert_allclose(_probs(engine.predict("Where is my parcel?", QUESTIONS)), _probs(first), atol=1e-6)


@pytest.mark.parametrize("layout", ["state_first", "schema_first"])
def test_a_compile_only_run_builds_every_program_a_request_runs_and_computes_and_keeps_nothing(layout):
    """Under compile_only every program call builds its executable and returns zeros without running:
    a request then walks through exactly the programs the same request computed runs (a long state:
    schema first, rows of chunks and a tail continuing the cached question lead, whose next slot the
    host plans), and nothing it returned is kept -- the prefix LRU holds no zero cache."""
    engine = _engine(seed=5, layout=layout, prefix_cache_bytes=256 << 20)
    state = " ".join(["My parcel never arrived and I was charged twice for the same order."] * 30)
    keys = engine.programs(state, QUESTIONS)
    assert any(k[0] == "chunk" for k in keys) and any(k[0] in ("tail", "slab") for k in keys)
    before = programs.stats()
    with programs.compile_only():
        assert not programs.computing()
        dry = engine.predict(state, QUESTIONS)
    assert programs.computing()
    after = programs.stats()
    assert after["skipped_calls"] > before["skipped_calls"]
    assert after["compiled"] + after["loaded"] + after["jax_cache_hits"] > (
        before["compiled"] + before["loaded"] + before["jax_cache_hits"]
    )
    assert keys <= engine.compiled_keys
    assert not engine.executor.prefixes  # no zero cache was kept for the next request
    # every read returned zeros: each question's labels tie
    assert dry["refund"]["noul"] == 0.5
    assert len(set(dry["team"]["probabilities"].values())) == 1
    built = programs.stats()
    real = engine.predict(state, QUESTIONS)  # builds nothing: the compile-only run did
    now = programs.stats()
    assert (now["compiled"], now["loaded"], now["jax_cache_hits"]) == (
        built["compiled"],
        built["loaded"],
        built["jax_cache_hits"],
    )
    assert engine.executor.prefixes  # a computed prefix is kept
    reference = engine.predict(state, QUESTIONS, reference=True)
    np.testing.assert_allclose(_probs(real), _probs(reference), atol=1e-5)
    assert real["refund"]["noul"] != 0.5


def test_compile_only_is_per_thread_and_programs_work_inside_a_trace():
    seen = []
    with programs.compile_only():
        t = threading.Thread(target=lambda: seen.append(programs.computing()))
        t.start()
        t.join()
    assert seen == [True]

    x = jnp.arange(3.0)
    assert np.asarray(jax.grad(lambda v: _scaled(v, 2.0).sum())(x)).tolist() == [2.0, 2.0, 2.0]
    assert np.asarray(jax.jit(lambda v: _scaled(v, 3.0))(x)).tolist() == [0.0, 3.0, 6.0]
    assert np.asarray(_scaled(x, 3.0)).tolist() == [0.0, 3.0, 6.0]
    assert _scaled.count() == 1  # the plain call's executable; the traced ones ran as jit
    with programs.compile_only():
        assert np.asarray(_scaled(x, 3.0)).tolist() == [0.0, 0.0, 0.0]  # built, not run
    assert _scaled.count() == 1


@programs.program(("factor",))
def _scaled(x, factor):
    return x * factor


@programs.program()
def _shifted(x):
    return x + 0.8125


def test_the_store_is_on_by_default_and_arrays_over_a_mesh_are_never_stored(monkeypatch):
    """An executable compiled for arrays over a mesh (a training run's parameters, even over one
    device) is bound to that mesh's devices, which nothing in the key names, so such a signature is
    neither stored nor looked up; the same arrays on one device are stored."""
    monkeypatch.delenv(programs.STORE_ENV, raising=False)
    store = programs.store_dir()
    assert store is not None  # on unless turned off
    monkeypatch.setenv(programs.STORE_ENV, "0")
    assert programs.store_dir() is None
    monkeypatch.delenv(programs.STORE_ENV)

    def mine():
        return {p.name for p in store.iterdir() if p.name.startswith("shifted-")} if store.is_dir() else set()

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    x = jnp.arange(7.0)
    on_mesh = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    assert not isinstance(on_mesh.sharding, jax.sharding.SingleDeviceSharding)
    before = programs.stats()
    np.testing.assert_allclose(np.asarray(_shifted(on_mesh)), np.asarray(x) + 0.8125)
    assert programs.stats()["compiled"] - before["compiled"] == 1 and mine() == set()
    programs.free_compiled()
    loaded = programs.stats()["loaded"]
    np.testing.assert_allclose(np.asarray(_shifted(on_mesh)), np.asarray(x) + 0.8125)  # built again
    assert programs.stats()["loaded"] == loaded
    _shifted(x)  # one device: stored
    assert len(mine()) == 1


LAPACK_PROGRAM = """
import jax, jax.numpy as jnp, numpy as np
from lev_jax import programs, runtime

runtime.enable_compilation_cache()  # $LEV_JAX_CACHE: the store lives in it

@programs.program()
def solve(a, b):  # what Qwen3.5's delta rule does: a LAPACK custom call (lapack_strsm_ffi on CPU)
    return jax.lax.linalg.triangular_solve(a, b, left_side=True, lower=True, unit_diagonal=True)

a = jnp.asarray(np.tril(np.full((4, 4), 0.5, np.float32), -1))
x = np.asarray(solve(a, jnp.ones((4, 3), jnp.float32)))
print(programs.stats()["loaded"], float(x.sum()))
"""


@pytest.mark.parametrize("devices", [1, 8])
def test_a_new_process_runs_a_stored_program_that_calls_lapack(tmp_path, devices):
    """A process that only loads a stored executable never lowers anything, and jaxlib fills in
    LAPACK's function pointers when it first lowers a LAPACK operation: without
    `programs.prepare_loading` the second process below crashed (SIGSEGV) running the loaded solve --
    the cause of the crashes that kept the store opt-in for one stop (Qwen3.5's servers and training
    runs). With 8 host devices a loaded executable expected its arguments sharded over all 8 (loaded
    for every device, not the default one) and failed on its first call."""
    env = {k: v for k, v in os.environ.items() if k != programs.STORE_ENV}  # the default: stored
    env["LEV_JAX_CACHE"] = str(tmp_path)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    runs = [
        subprocess.run([sys.executable, "-c", LAPACK_PROGRAM], env=env, capture_output=True, text=True, timeout=300)
        for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    first, second = (r.stdout.split() for r in runs)
    assert first[0] == "0" and second[0] == "1"  # compiled, then loaded from the store
    assert first[1] == second[1]


# -- a trusted store: planted files never reach the unpickler --------------------------------------


class _Planted:
    """What another user could plant in a shared store: a pickle whose loading writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _planted_body(marker) -> bytes:
    import pickle

    import zstandard

    return zstandard.ZstdCompressor().compress(pickle.dumps(_Planted(marker)))  # a stored program's body


@programs.program()
def _tripled(x):
    return x * 3.0 + 0.0625


def _stored_program(tmp_path, monkeypatch):
    """A store of this test's own with `_tripled`'s executable in it: (store, its file, the input)."""
    root = tmp_path / "cache" / programs.STORE_DIR
    monkeypatch.setattr(programs, "store_dir", lambda: root)
    _tripled.clear()
    x = jnp.arange(5.0)
    np.testing.assert_allclose(np.asarray(_tripled(x)), np.arange(5.0) * 3 + 0.0625)
    files = list(root.glob("tripled-*.bin"))
    assert len(files) == 1, sorted(p.name for p in root.iterdir())
    return root, files[0], x


def _runs_without_loading(path, x, marker, caplog, fragment):
    _tripled.clear()  # a new process: the store on disk, nothing in memory
    loaded = programs.stats()["loaded"]
    np.testing.assert_allclose(np.asarray(_tripled(x)), np.arange(5.0) * 3 + 0.0625)  # compiled afresh
    assert not marker.exists(), "a planted pickle was unpickled"
    assert programs.stats()["loaded"] == loaded
    assert fragment in caplog.text


def test_the_store_is_private_and_a_planted_file_with_a_bad_mac_is_never_unpickled(tmp_path, monkeypatch, caplog):
    root, path, x = _stored_program(tmp_path, monkeypatch)
    marker = tmp_path / "pwned"
    path.write_bytes(_planted_body(marker))  # as files were written before they carried a MAC
    _runs_without_loading(path, x, marker, caplog, "MAC does not match")
    path.write_bytes(programs.MAGIC + bytes(programs.MAC_BYTES) + _planted_body(marker))  # a forged MAC
    _runs_without_loading(path, x, marker, caplog, "MAC does not match")
    assert root.stat().st_mode & 0o777 == 0o700
    assert (root / programs.KEY_FILE).stat().st_mode & 0o777 == 0o600


def test_a_store_file_or_directory_others_may_write_is_never_read(tmp_path, monkeypatch, caplog):
    root, path, x = _stored_program(tmp_path, monkeypatch)
    key = programs.store_key(root)
    marker = tmp_path / "pwned"
    path.write_bytes(programs.seal(key, path.name, _planted_body(marker)))  # even with a right MAC
    os.chmod(path, 0o666)
    _runs_without_loading(path, x, marker, caplog, "writable by other users")
    os.chmod(path, 0o600)
    os.chmod(root, 0o777)
    try:
        _runs_without_loading(path, x, marker, caplog, "has mode 777")
    finally:
        os.chmod(root, 0o700)
    os.chmod(root / programs.KEY_FILE, 0o644)  # a key others can read is no secret
    _runs_without_loading(path, x, marker, caplog, "accessible by other users")


def test_runtime_creates_private_directories_and_judges_them(tmp_path):
    from lev_jax import runtime

    made = runtime.private_dir(tmp_path / "a" / "b")
    assert made.stat().st_mode & 0o777 == 0o700 and runtime.untrusted(made) is None
    os.chmod(made, 0o775)
    assert "writable by other users" in runtime.untrusted(made)
    os.chmod(made, 0o755)
    assert runtime.untrusted(made) is None and "accessible" in runtime.untrusted(made, secret=True)


# -- priority: requests before background work -----------------------------------------------------


@programs.program()
def _plus_one(x):
    return x + 1


def test_background_work_waits_while_a_request_is_in_flight():
    """A warm-up thread (programs.background) makes no program call while a request is in flight
    (programs.foreground), and goes on as soon as none is; a request's own calls never wait."""
    done, started = [], threading.Event()

    def warmup():
        with programs.background():
            started.set()
            done.append(float(_plus_one(jnp.ones(()))))

    with programs.foreground():
        assert float(_plus_one(jnp.zeros(()))) == 1.0  # the request's own call runs at once
        t = threading.Thread(target=warmup)
        t.start()
        assert started.wait(5)
        t.join(0.5)
        assert t.is_alive() and done == []  # held back while the request is in flight
    t.join(10)
    assert done == [2.0]
    with programs.background():  # no request in flight: no wait
        assert programs.yield_to_requests() < 0.5
