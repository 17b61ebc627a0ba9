"""Process-wide runtime settings: the persistent compilation cache and the default compute dtype.

The persistent cache keeps every compiled device program on disk, keyed by XLA on the program and
the device, so a restarted server or a new Python process loads a program instead of compiling it
again (on the 2-core CPU a ~1.3 s compile comes back in ~0.3 s). It is on by default, in a per-user
directory; `LEV_JAX_CACHE=DIR` moves it, `LEV_JAX_CACHE=` (empty) turns it off, and an explicit
argument (the server's `--compilation-cache DIR` / `--no-compilation-cache`) overrides both. A cache
the process's JAX was already given (`jax_compilation_cache_dir`) is left as it is.

`dtype="auto"` picks bfloat16 weights with fp32 accumulation where the hardware multiplies bf16
natively (GPU, TPU, CPUs with AMX or AVX512-BF16: ~2-3x faster than fp32 there, probabilities within
a few hundredths), and fp32 elsewhere: a CPU without native bf16 emulates it and gains nothing.
`LEV_JAX_DTYPE` fixes what "auto" means in a process.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("lev_jax")

CACHE_ENV = "LEV_JAX_CACHE"  # persistent compilation cache directory ("" disables it)
DTYPE_ENV = "LEV_JAX_DTYPE"  # what dtype="auto" means in this process (float32 / bfloat16), if set
DTYPES = ("auto", "float32", "bfloat16")
# How far one request's answer may move with the calls it is read in (alone, or in a micro-batch
# with others: other row counts and length buckets), per dtype. In fp32 the numbers do not depend on
# the call's shapes beyond rounding noise; in bf16 the matmuls' rounding follows the shapes, and the
# bound is the one bf16 answers keep to fp32's (tests/test_predict.py, EVAL.md).
ANSWER_TOLERANCE = {"float32": 1e-5, "bfloat16": 0.03}
# CPU features (Linux /proc/cpuinfo flags) that multiply bf16 natively
NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")

_lock = threading.Lock()
_configured: str | None = None  # the cache directory this module set ("" = it decided on none)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lev_jax" / "xla"


def cache_dir_setting(explicit: str | os.PathLike | None = None) -> str:
    """The cache directory to use ("" = none): `explicit` ("" disables), else $LEV_JAX_CACHE ("" disables),
    else the per-user default."""
    if explicit is not None:
        return str(explicit)
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return env
    return str(default_cache_dir())


def enable_compilation_cache(explicit: str | os.PathLike | None = None, *, min_compile_s: float = 0.0) -> str | None:
    """Point JAX's persistent compilation cache at the configured directory (see the module doc);
    returns the directory in use, or None when the cache is off. Idempotent; the first setting in a
    process wins, because JAX reads it when it compiles its first program. Programs that compile in
    under `min_compile_s` are not stored (0: every program, which is what a cold start needs: a
    model's first request compiles many small programs)."""
    global _configured
    import jax

    with _lock:
        current = jax.config.jax_compilation_cache_dir
        if current and _configured is None:  # set by the caller before lev_jax: theirs
            _configured = current
        if _configured is not None:
            return _configured or None
        path = cache_dir_setting(explicit)
        if path:
            try:
                private_dir(path)
            except OSError as e:  # a read-only home must not stop a model from loading
                log.warning("compilation cache disabled: cannot create %s (%s)", path, e)
                path = ""
        if path and (why := untrusted(path)):
            # the cache holds machine code this process runs: another user's writable directory
            # would let them run code in ours
            log.warning("compilation cache disabled: %s %s; programs compile afresh", path, why)
            path = ""
        if path:
            jax.config.update("jax_compilation_cache_dir", path)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        _configured = path
        return path or None


PRIVATE_DIR_MODE = 0o700  # the cache and program-store directories: the user's own


def private_dir(path: str | os.PathLike) -> Path:
    """Create `path` (and missing parents) readable and writable by this user only; an existing
    directory is left as it is (`untrusted` judges it)."""
    path = Path(path)
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
        os.chmod(path, PRIVATE_DIR_MODE)  # mkdir's mode is filtered by the umask; this one is meant
    return path


def untrusted(path: str | os.PathLike, *, secret: bool = False) -> str | None:
    """Why this process must not load code (or a key) from `path`, or None when it may: it must
    be this user's own (a link: its target) and writable by nobody else (`secret`: readable by
    nobody else either), so that no other user can plant what we run."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"cannot be checked ({e.strerror})"
    if not hasattr(os, "getuid"):  # no POSIX owners (Windows): nothing to check against
        return None
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not this user ({os.getuid()})"
    others = 0o077 if secret else 0o022
    if st.st_mode & others:
        return f"has mode {st.st_mode & 0o777:o} ({'accessible' if secret else 'writable'} by other users)"
    return None


def compilation_cache_dir() -> str | None:
    """The persistent cache directory JAX uses in this process (None: off)."""
    import jax

    return jax.config.jax_compilation_cache_dir or None


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(platform: str | None = None, flags: set[str] | None = None) -> bool:
    """Does the default device multiply bf16 natively?"""
    if platform is None:
        import jax

        platform = jax.default_backend()
    if platform != "cpu":
        return True  # GPUs and TPUs
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BF16_CPU_FLAGS)


def resolve_dtype(dtype: str | None, platform: str | None = None, flags: set[str] | None = None) -> str:
    """ "auto" (or None) -> $LEV_JAX_DTYPE if set, else "bfloat16" where bf16 is native, else "float32";
    other values are checked."""
    if dtype is None or dtype == "auto":
        forced = os.environ.get(DTYPE_ENV)
        if forced:
            if forced not in DTYPES[1:]:
                raise ValueError(f"{DTYPE_ENV} must be one of {DTYPES[1:]}, got {forced!r}")
            return forced
        return "bfloat16" if native_bf16(platform, flags) else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dtype
