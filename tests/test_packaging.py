"""Packaging: no import circle in lev_jax, a wheel holding only lev_jax, the `lev` console script, and the
repository-root entry points (`python -m serve|data`) still working."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from lev_jax import cli

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lev_jax"


def _module_files() -> dict[str, Path]:
    """Every lev_jax module by dotted name (a package by its own name, for its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """lev_jax modules that ``module`` imports anywhere in its source (function-level imports count:
    a circle through a lazy import is still a circle, it only fails later)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `lev_jax.x.y.Name` -> the module that defines it
                name = name.rpartition(".")[0]
            if name.startswith("lev_jax") and name != module:
                out.add(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_lazy_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_lev_jax():
    known = _module_files()
    graph = {m: _imported(p, m, known) for m, p in known.items()}
    assert "lev_jax.loaders.gguf_tokenizer" in graph["lev_jax.loaders.gguf"]  # the graph sees imports
    assert _cycles(graph) == []


def test_tokenizer_imports_nothing_from_the_loaders():
    """The loaders build on the tokenizer (GGUF vocabularies), never the other way round."""
    tree = ast.parse((PACKAGE / "tokenizer.py").read_text(encoding="utf-8"))
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            # tokenizer.py sits directly in lev_jax: `from .x import y` is `lev_jax.x`
            base = ".".join(["lev_jax"] * (node.level > 0) + [node.module or ""]).strip(".")
            imported += [base] + [f"{base}.{a.name}" for a in node.names]
    assert "jinja2" in imported  # the walk sees the function-level imports
    offending = [n for n in imported if n == "lev_jax.loaders" or n.startswith("lev_jax.loaders.")]
    assert offending == []


_IMPORT_EACH_FIRST = r"""
import importlib, json, sys
failed = {}
for name in json.loads(sys.argv[1]):
    for key in [k for k in sys.modules if k == "lev_jax" or k.startswith("lev_jax.")]:
        del sys.modules[key]  # so `name` is the first lev_jax module this process imports
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
print(json.dumps(failed))
"""


def test_every_module_imports_first_in_a_fresh_process():
    """Each lev_jax module imported as the first of the package (third-party modules stay loaded, so
    this takes seconds): an import-time circle fails whichever module is entered first."""
    names = sorted(_module_files())
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_FIRST, json.dumps(names)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    # A re-import can fail for its own reasons (a process-wide registry); only a failure that a
    # process of its own reproduces counts.
    for name in list(failed):
        alone = subprocess.run(
            [sys.executable, "-c", f"import {name}"], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        if alone.returncode == 0:
            del failed[name]
    assert failed == {}


# --------------------------------------------------------------------------------------------------
# The `lev` console script
# --------------------------------------------------------------------------------------------------


def test_lev_help_lists_every_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("serve", "train", "data", "bench"):
        assert f"\n  {name} " in out, out


def test_lev_without_a_subcommand_is_a_usage_error(capsys):
    assert cli.main([]) == 2
    assert "usage: lev" in capsys.readouterr().err


def test_lev_unknown_subcommand_is_one_line_and_exit_2(capsys):
    assert cli.main(["frobnicate", "--x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown subcommand 'frobnicate'" in err, err


def test_lev_dispatches_to_the_subcommand_cli(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["data", "--help"])
    assert info.value.code == 0
    assert "build" in capsys.readouterr().out


def test_lev_subcommand_not_installed_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setitem(cli.SUBCOMMANDS, "train", ("lev_jax.no_such_package.cli", "the training loop"))
    assert cli.main(["train", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lev train: not available" in err, err


def test_lev_keeps_a_missing_dependency_traceback(tmp_path, monkeypatch):
    """A subcommand whose module exists but lacks a dependency is a broken install, not 'not available'."""
    (tmp_path / "lev_test_broken_cli.py").write_text("import lev_test_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.SUBCOMMANDS, "train", ("lev_test_broken_cli", "broken"))
    with pytest.raises(ModuleNotFoundError, match="lev_test_no_such_dependency"):
        cli.main(["train"])


def test_entry_points_work_from_the_root_and_lev_from_anywhere(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for cmd, cwd, expect in (
        (["-m", "serve", "--help"], REPO, "--port"),
        (["-m", "data", "--help"], REPO, "build"),
        (["-m", "lev_jax.cli", "--help"], tmp_path, "bench"),
    ):
        run = subprocess.run([sys.executable, *cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and expect in run.stdout, (cmd, run.stderr[-2000:])


# --------------------------------------------------------------------------------------------------
# The wheel
# --------------------------------------------------------------------------------------------------


def _build_requirements_unmet() -> list[str]:
    """The [build-system] requirements this environment does not satisfy: an offline build without
    isolation uses the environment's own, so they must be the ones an isolated build would pick."""
    from packaging.requirements import Requirement

    unmet = []
    for req in map(Requirement, tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]):
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req} (installed: {have})")
    return unmet


def test_wheel_holds_only_lev_jax(tmp_path):
    """Build the wheel offline from a copy of the sources (no build/ or egg-info in the work tree). A
    wheel that does not build is a failure, never a skip: it is what `pip install .` gives users."""
    unmet = _build_requirements_unmet()
    assert not unmet, f"the build requirements are not installed: {unmet} (`make install-test` installs them)"
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("lev_jax", "serve", "data", "train", "scripts"):  # the folders that must stay out
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"the wheel does not build:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    (wheel,) = (tmp_path / "dist").glob("lev_jax-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    top = {n.split("/")[0] for n in names} - {dist_info}
    assert top == {"lev_jax"}, sorted(top)
    assert "lev_jax/cli.py" in names and "lev_jax/loaders/gguf_tokenizer.py" in names
    profiles = [n for n in names if n.startswith("lev_jax/profiles/")]
    assert any(n.endswith("/calibration.json") for n in profiles), profiles
    # the fine-tuned default ships inside the wheel: adapter, manifest, calibration, card (<= 20 MB)
    default = {n.removeprefix("lev_jax/default/"): n for n in names if n.startswith("lev_jax/default/")}
    assert {"adapter_model.safetensors", "adapter_config.json", "lev_release.json", "README.md"} <= set(default)
    with zipfile.ZipFile(wheel) as zf:
        assert sum(zf.getinfo(n).file_size for n in default.values()) <= 20 << 20
    assert "lev = lev_jax.cli:main" in entry_points and "levbench = lev_jax.bench.cli:main" in entry_points
    core = [
        line.split(":", 1)[1].strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    for test_only in ("pytest", "torch", "transformers", "matplotlib", "datasets", "ruff"):
        assert not any(dep.startswith(test_only) for dep in core), (test_only, core)
    assert any(dep.startswith("prometheus-client") for dep in core), core
