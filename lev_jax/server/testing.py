"""Running a server for tests, the load test and conformance runs: on a free loopback port, either as
a `lev serve` subprocess (what clients meet) or as uvicorn in a thread over an engine already loaded
(cheap to start several with different settings)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout:g}s ({last})")


def compile_cache_env(cache_dir: str | os.PathLike) -> dict[str, str]:
    """Environment that makes JAX keep compiled programs on disk, so a second server (or a rerun)
    skips compilation it has seen."""
    return {"LEV_JAX_CACHE": str(cache_dir)}  # lev_jax.runtime


class ServerProcess:
    """`lev serve ARGS` on a free loopback port; stopped with SIGTERM (graceful) on exit. Runs
    `python -m lev_jax.cli serve` with this interpreter, so it needs only the installed package (no
    repository checkout, no console script on PATH); `cwd` defaults to the caller's."""

    def __init__(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        api_keys: str | None = None,
        startup_timeout: float = 180.0,
        log_path: str | os.PathLike | None = None,
        cwd: str | None = None,
    ):
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        if not any(a in ("--no-warmup", "--warmup-budget") for a in args):
            # tests meet the server without its background warm-up (minutes of compiling on 2 cores
            # next to the test's own requests) unless they ask for it
            args = [*args, "--no-warmup"]
        self.args = [sys.executable, "-m", "lev_jax.cli", "serve", "--host", LOOPBACK, "--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.env.pop("LEV_API_KEYS", None)
        if api_keys:
            self.env["LEV_API_KEYS"] = api_keys
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="lev-serve-", suffix=".log")[1])
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd)
        try:
            wait_healthy(self.url, self.startup_timeout, self.proc)
        except BaseException as e:
            self.stop()
            raise RuntimeError(f"server did not start:\n{self.log()}") from e
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except OSError:
            return ""


class ThreadServer:
    """uvicorn serving `app` in a background thread (its own event loop) on a free loopback port."""

    def __init__(self, app, *, startup_timeout: float = 30.0):
        import uvicorn

        from .cli import uvicorn_config

        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, host=LOOPBACK, port=self.port, log_level="warning"))
        self.server.install_signal_handlers = lambda: None  # not the main thread
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.startup_timeout = startup_timeout

    def _run(self) -> None:
        asyncio.run(self.server.serve())

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("thread server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@contextlib.contextmanager
def serving(app):
    with ThreadServer(app) as s:
        yield s
