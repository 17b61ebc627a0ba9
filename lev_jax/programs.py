"""The device programs serving runs: compiled per argument shapes, kept on disk, built without running by a warm-up.

`program` is `jax.jit` for the serving entry points (prefill, row reads, segments, long-row chunks,
the elastic cascade, the vision tower), with the executables kept here per argument signature (the
shapes and dtypes of the arguments and the static ones) rather than in jit's own cache, for two
reasons:

- **A restarted process loads an executable without tracing or lowering it** (`STORE_ENV=0` turns
  this off). JAX's persistent cache keys a program by its lowered HLO, so a process that finds it
  there has still traced and lowered the forward (30 unrolled layers: ~0.7 s of Python per program
  on the 2-core CPU) before loading it (~0.5 s). Here a program's executable is stored next to that
  cache under a key of its signature and of everything that could change the program without
  changing the signature (this package's source, jax's version, the device, the CPU's features), so
  a later process only loads it. Files are written atomically; one that cannot be read is deleted
  and the program compiled again; an executable JAX took from its own cache is never stored
  (`Program._executable` says why). A stored executable is machine code this process runs (and a
  pickle it unpickles), so the store is trusted only as far as it is the user's own: its directory
  is created 0700, nothing is read from a directory or file another user owns or may write (a
  warning, and the program is compiled), and every file carries an HMAC-SHA256 under a per-user key
  (`KEY_FILE`, 0600, made on first use) that is checked before a byte of it is unpacked, so a
  planted file never reaches the unpickler.
- **A warm-up computes nothing** (`compile_only()`): under it, a program call builds (compiles or
  loads) the executable of its signature and returns zeros of its output shapes without running it.
  The host code between calls decides every later shape from host values alone (a cache's next slot
  is planned from the prefix's length, never read back from the device), so a warm-up request walks
  through exactly the programs a real one would, and a server's warm-up costs its compiles (or loads),
  not the compute of its grid's requests. What such a run returns is never kept: caches that outlive a
  call (the prefix LRU, image features) are filled only when `computing()`.

XLA:CPU loads every compiled program's machine code into memory regions of its own: a model
program takes hundreds of entries of /proc/self/maps, and Linux refuses a process more than
vm.max_map_count of them (65,530 by default). A long-lived process that keeps compiling new shapes
(a test suite, a server seeing new bucket sizes for days, an evaluation sweep) would reach it, and
XLA does not fail cleanly there: the next compile crashes the process. `guard()` frees the compiled
programs (these and JAX's own; they are loaded or compiled again on demand) before that happens.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import hashlib
import hmac
import inspect
import logging
import os
import pickle
import secrets
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("lev_jax")

DEFAULT_MAX_MAPS = 65_530  # Linux's default vm.max_map_count
FREE_AT = 0.5  # free the compiled programs once this share of the limit is in use
CHECK_EVERY_S = 2.0  # reading /proc/self/maps costs ~ms at tens of thousands of entries

_lock = threading.Lock()
_last_check = 0.0


def map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return DEFAULT_MAX_MAPS


def maps_in_use() -> int | None:
    """Entries in this process's memory map (None where /proc is not there: not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def free_compiled() -> None:
    """Drop every compiled program this process holds, `program`'s and JAX's (loaded or compiled
    again when next called)."""
    import jax

    for p in list(_registry):
        p.clear()
    jax.clear_caches()
    gc.collect()


def guard(*, force: bool = False, free_at: float = FREE_AT) -> bool:
    """Free the compiled programs when the memory map is past `free_at` of the limit; checked at
    most every CHECK_EVERY_S unless `force`. True when it freed them."""
    global _last_check
    now = time.monotonic()
    with _lock:
        if not force and now - _last_check < CHECK_EVERY_S:
            return False
        _last_check = now
    used = maps_in_use()
    limit = map_limit()
    if used is None or used < free_at * limit:
        return False
    free_compiled()
    log.warning(
        "compiled programs freed: %d of the process's %d memory-map entries in use (now %s); they recompile on demand",
        used,
        limit,
        maps_in_use(),
    )
    return True


# -- programs ---------------------------------------------------------------------------------------
STORE_DIR = "lev_jax_programs"  # inside the persistent compilation cache's directory
STORE_ENV = "LEV_JAX_PROGRAM_STORE"  # "0": no store (JAX's own cache still applies)
_registry: list[Program] = []
_local = threading.local()
_stats = {"compiled": 0, "loaded": 0, "jax_cache_hits": 0, "skipped_calls": 0}
_stats_lock = threading.Lock()
_listening = False


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits" and getattr(_local, "compiling", False):
        _local.jax_cache_hit = True  # recorded in the compiling thread, during its compile


def _listen() -> None:
    global _listening
    with _stats_lock:
        if not _listening:
            import jax.monitoring

            jax.monitoring.register_event_listener(_on_event)
            _listening = True


@functools.lru_cache(maxsize=1)
def prepare_loading() -> None:
    """Set up, once per process, what compiling would have set up before an executable runs. XLA:CPU
    calls LAPACK through custom calls whose function pointers jaxlib fills in when it first *lowers*
    a LAPACK operation; a process that only loads a stored executable never lowers one, and running
    a program that calls LAPACK (Qwen3.5's delta rule solves a triangular system: `lapack_strsm_ffi`)
    then jumps through a null pointer -- SIGSEGV, measured. Lowering one tiny triangular solve (no
    compile; milliseconds) sets them all up."""
    import jax
    import jax.numpy as jnp

    spec = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    jax.jit(lambda a, b: jax.lax.linalg.triangular_solve(a, b, left_side=True, lower=True)).lower(spec, spec)


@contextlib.contextmanager
def _thread_flag(name: str):
    """Set a per-thread flag for the block (restored after it: the contexts nest)."""
    before = getattr(_local, name, False)
    setattr(_local, name, True)
    try:
        yield
    finally:
        setattr(_local, name, before)


@contextlib.contextmanager
def compile_only():
    """In this thread, program calls build their executables and return zeros of their output shapes
    instead of running: for a warm-up or a background compile, whose answers nobody reads. (A context
    manager.)"""
    outer = getattr(_local, "zeros", None)
    _local.zeros = {} if outer is None else outer
    try:
        with _thread_flag("compile_only"):
            yield
    finally:
        _local.zeros = outer


def _zeros(spec):
    """Zeros of `spec`'s shape and dtype, one array per shape for a compile-only run (arrays are
    immutable: a grid's requests pass the same cache shapes around hundreds of times)."""
    import jax.numpy as jnp

    key = (tuple(spec.shape), str(spec.dtype))
    made = _local.zeros.get(key)
    if made is None:
        made = _local.zeros[key] = jnp.zeros(spec.shape, spec.dtype)
    return made


def computing() -> bool:
    """Whether program calls in this thread compute (False under `compile_only`): what they return
    may be kept (in a cache that outlives the call) only when they do."""
    return not getattr(_local, "compile_only", False)


# -- priority: requests before background work ------------------------------------------------------
# A server warms its programs in a background thread while it already answers. On a machine with a
# few cores a request whose programs the warm-up has not reached would queue behind the warm-up's
# compiles (each takes the cores XLA has); instead, while any request is in flight, a background
# thread waits before each of its program calls and compiles, and goes on when none is.
_foreground = 0
_foreground_cond = threading.Condition()
BACKGROUND_POLL_S = 0.05  # how often a waiting background thread looks again (a lost wakeup costs this)


@contextlib.contextmanager
def foreground():
    """Work for a request: background threads (`background`) yield to it at their next program call."""
    global _foreground
    with _foreground_cond:
        _foreground += 1
    try:
        yield
    finally:
        with _foreground_cond:
            _foreground -= 1
            _foreground_cond.notify_all()


def background():
    """In this thread, every program call and compile first waits until no request is in flight.
    (A context manager.)"""
    return _thread_flag("background")


def yield_to_requests() -> float:
    """Wait (a background thread only) while a request is in flight; returns the seconds waited."""
    if not getattr(_local, "background", False):
        return 0.0
    t0 = time.perf_counter()
    with _foreground_cond:
        while _foreground > 0:
            _foreground_cond.wait(BACKGROUND_POLL_S)
    return time.perf_counter() - t0


def stats() -> dict:
    """Executables compiled, loaded from the store and found in JAX's own cache in this process, and
    calls that only built their executable (`compile_only`); the seconds they took in all, and the
    most recent ones each (`builds`: the program's name, compiled or loaded, seconds; a signature
    counts once)."""
    with _stats_lock:
        return {
            **_stats,
            "build_seconds": round(_build_seconds[0], 3),
            "builds": [{"program": n, "how": h, "seconds": round(s, 3)} for n, h, s in _builds],
        }


BUILDS_KEPT = 128  # per-program build times kept for /health (the most recent)
_builds: collections.deque = collections.deque(maxlen=BUILDS_KEPT)
_build_seconds = [0.0]


def _log_build(name: str, how: str, seconds: float) -> None:
    with _stats_lock:
        _builds.append((name, how, seconds))
        _build_seconds[0] += seconds


def _count(what: str) -> None:
    with _stats_lock:
        _stats[what] += 1


def store_dir() -> Path | None:
    """Where executables are stored: inside the persistent compilation cache (runtime.py), so one
    setting moves or disables both; None when that cache is off or $LEV_JAX_PROGRAM_STORE is "0"."""
    from lev_jax import runtime

    if os.environ.get(STORE_ENV, "1") == "0":
        return None
    cache = runtime.compilation_cache_dir()
    return Path(cache) / STORE_DIR if cache else None


KEY_FILE = ".hmac-key"  # in the store: the per-user key its files are authenticated with (0600)
KEY_BYTES = 32
MAGIC = b"LEVPROG1"  # a stored file: MAGIC, HMAC-SHA256(key, file name + body), body (zstd pickle)
MAC_BYTES = hashlib.sha256().digest_size
_warned: set[tuple[str, str]] = set()


def _warn_once(path: Path, why: str) -> None:
    with _stats_lock:
        if (str(path), why) in _warned:
            return
        _warned.add((str(path), why))
    log.warning("not using the program store: %s %s; programs compile afresh", path, why)


def store_key(root: Path, *, create: bool = False) -> bytes | None:
    """The key `root`'s files are authenticated with, or None (warned once) when `root` or its key
    is not this user's own alone (`runtime.untrusted`); `create`: make the directory (0700) and the
    key (0600) where they are missing."""
    from lev_jax import runtime

    if create:
        runtime.private_dir(root)
    elif not root.is_dir():
        return None
    if why := runtime.untrusted(root):
        _warn_once(root, why)
        return None
    path = root / KEY_FILE
    if not path.exists():
        _new_key(path)
    if why := runtime.untrusted(path, secret=True):
        _warn_once(path, why)
        return None
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        _warn_once(path, f"is not a {KEY_BYTES}-byte key")
        return None
    return key


def _new_key(path: Path) -> None:
    """Write a random key at `path` atomically: written whole under another name (mkstemp: 0600),
    then linked into place, so two processes starting at once agree on the first one's key."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: its key is the store's
    finally:
        os.unlink(tmp)


def _mac(key: bytes, name: str, body: bytes) -> bytes:
    # the file's name is its signature's key: a file moved under another program's name fails too
    return hmac.new(key, name.encode() + b"\0" + body, hashlib.sha256).digest()


def seal(key: bytes, name: str, body: bytes) -> bytes:
    """A stored file's bytes: `body` authenticated for the file `name`."""
    return MAGIC + _mac(key, name, body) + body


def unseal(key: bytes, name: str, data: bytes) -> bytes | None:
    """The body of a stored file whose MAC is right, else None (nothing of it is unpacked)."""
    head = len(MAGIC) + MAC_BYTES
    if len(data) < head or not data.startswith(MAGIC):
        return None
    body = data[head:]
    return body if hmac.compare_digest(data[len(MAGIC) : head], _mac(key, name, body)) else None


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """What a stored executable was built by besides its signature: this package's source (a changed
    forward compiles another program for the same shapes), jax / jaxlib, the device, the process's
    XLA flags, and on a CPU its feature flags (machine code for AMX must not run on a CPU without it)."""
    import jax
    import jaxlib

    from lev_jax import runtime

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    dev = jax.devices()[0]
    versions = (jax.__version__, jaxlib.__version__, dev.platform, dev.device_kind, dev.client.platform_version)
    # the process's XLA flags and devices shape the machine code (a forced host device count, say)
    setup = (os.environ.get("XLA_FLAGS", ""), jax.device_count(), jax.config.jax_enable_x64)
    h.update(repr((versions, setup)).encode())
    if dev.platform == "cpu":
        h.update(" ".join(sorted(runtime.cpu_flags())).encode())
    return h.hexdigest()


def _aval(x) -> tuple:
    shape = getattr(x, "shape", None)
    if shape is None:  # a Python scalar: jit traces it as a weakly typed array of its type
        return ("py", type(x).__name__)
    aval = (tuple(shape), str(x.dtype), bool(getattr(x, "weak_type", False)))
    sharding = getattr(x, "sharding", None)
    if sharding is not None and not isinstance(sharding, _single_device()):
        # an array spread over a mesh: an executable is compiled for its inputs' shardings
        aval += (sharding,)
    return aval


@functools.lru_cache(maxsize=1)
def _single_device():
    import jax

    return jax.sharding.SingleDeviceSharding


class Program:
    """`jax.jit(fun, static_argnames=static)` whose executables are kept here, per signature (module
    doc): called like `fun`; `count()` is how many it holds."""

    def __init__(self, fun, static: tuple[str, ...] = ()):
        self.fun = fun
        self.name = f"{fun.__module__}.{fun.__qualname__}"
        self.static = tuple(static)
        self._jitted = None
        self.signature = inspect.signature(fun)
        self.executables: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self._compiling: dict[tuple, threading.Lock] = {}
        functools.update_wrapper(self, fun)
        _registry.append(self)

    @property
    def jitted(self):
        """The jitted function, named after this package's source (`fingerprint`): JAX's own cache keys
        a program by its module's name too, so another version of lev-jax never finds this one's
        executable there (a program JAX loads from its cache cannot be stored: `_executable`)."""
        if self._jitted is None:
            import jax

            fun = self.fun

            def named(*args, **kwargs):
                return fun(*args, **kwargs)

            functools.update_wrapper(named, fun)
            named.__name__ = named.__qualname__ = f"{fun.__name__.strip('_')}_{fingerprint()[:12]}"
            self._jitted = jax.jit(named, static_argnames=self.static)
        return self._jitted

    def count(self) -> int:
        return len(self.executables)

    def clear(self) -> None:
        with self._lock:
            self.executables.clear()

    def __call__(self, *args, **kwargs):
        import jax

        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        dynamic = {k: v for k, v in arguments.items() if k not in self.static}
        leaves, tree = jax.tree.flatten(dynamic)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):  # called inside another trace (jit, grad)
            return self.jitted(*args, **kwargs)
        yield_to_requests()
        key = (tree, tuple(arguments[k] for k in self.static), tuple(map(_aval, leaves)))
        exe = self.executables.get(key)
        if exe is None:
            exe = self._executable(key, arguments)
        if not computing():
            _count("skipped_calls")
            return jax.tree.map(_zeros, exe.out_info)
        return exe(**dynamic)

    def _executable(self, key: tuple, arguments: dict):
        with self._lock:
            lock = self._compiling.setdefault(key, threading.Lock())
        with lock:  # one thread compiles a signature; another asking for it waits for that one
            exe = self.executables.get(key)
            if exe is None:
                t0 = time.perf_counter()
                exe = self._load(key)
                how = "loaded"
                if exe is None:
                    how = "compiled"
                    _listen()
                    _local.compiling, _local.jax_cache_hit = True, False
                    try:
                        exe = self.jitted.trace(**arguments).lower().compile()
                    finally:
                        _local.compiling = False
                    if _local.jax_cache_hit:
                        # JAX found it in its own persistent cache: such an executable serialises
                        # into a file that loads but cannot run (XLA:CPU, measured), so it is not
                        # stored; a process without JAX's cache entry compiles and stores it
                        _count("jax_cache_hits")
                    else:
                        _count("compiled")
                        self._save(key, exe)
                _log_build(self.fun.__name__.strip("_"), how, time.perf_counter() - t0)
                self.executables[key] = exe
        with self._lock:
            self._compiling.pop(key, None)
        return exe

    def _path(self, key: tuple) -> Path | None:
        root = store_dir()
        tree, static, avals = key
        if root is None or any(len(a) > 3 for a in avals):
            # arrays spread over a mesh (a training run's parameters): an executable for a mesh is
            # bound to its devices, which nothing in the key names, so it is neither stored nor loaded
            return None
        ident = repr((self.name, fingerprint(), str(tree), static, avals)).encode()
        return root / f"{self.fun.__name__.strip('_')}-{hashlib.sha256(ident).hexdigest()[:40]}.bin"

    def _load(self, key: tuple):
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        body = self._authentic(path)
        if body is None:
            return None
        import jax
        import zstandard
        from jax.experimental import serialize_executable

        try:
            prepare_loading()
        except Exception as e:  # noqa: BLE001 — cannot make loading safe here: compile instead
            log.warning("not loading stored programs (%s: %s)", type(e).__name__, e)
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(zstandard.ZstdDecompressor().decompress(body))
            # stored programs take single-device inputs (`_path`): loaded for this process's default
            # device, not (deserialize_and_load's default) for all of them -- in a process with
            # several, that executable would expect every argument sharded over them all
            exe = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=jax.devices()[:1]
            )
        except Exception as e:  # noqa: BLE001 — a damaged or stale file: compile instead
            log.warning("ignoring the stored program %s (%s: %s)", path.name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None
        _count("loaded")
        return exe

    @staticmethod
    def _authentic(path: Path) -> bytes | None:
        """The body of the stored file `path` when the store and the file are this user's own and
        its MAC is right; else None (warned; a bad MAC: the file is dropped)."""
        from lev_jax import runtime

        key = store_key(path.parent)
        if key is None:
            return None
        if why := runtime.untrusted(path):
            _warn_once(path, why)
            return None
        body = unseal(key, path.name, path.read_bytes())
        if body is None:  # damaged, stale, or not written by this user's processes: never unpacked
            log.warning("ignoring the stored program %s (its MAC does not match this store's key)", path.name)
            path.unlink(missing_ok=True)
        return body

    def _save(self, key: tuple, exe) -> None:
        path = self._path(key)
        if path is None:
            return
        import zstandard
        from jax.experimental import serialize_executable

        tmp = None
        try:
            mac_key = store_key(path.parent, create=True)
            if mac_key is None:
                return  # a store that is not the user's own alone is not written to either
            # compressed like JAX's own cache entries (machine code: ~10x smaller, ~ms to unpack)
            body = zstandard.ZstdCompressor(level=3).compress(pickle.dumps(serialize_executable.serialize(exe)))
            data = seal(mac_key, path.name, body)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".program-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 — a read-only cache or an unserialisable program: keep it in memory only
            log.warning("cannot store the program %s (%s: %s)", path.name, type(e).__name__, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


def program(static_argnames: tuple[str, ...] = ()):
    """Decorator: `fun` as a `Program` (`functools.partial(jax.jit, static_argnames=...)`'s place)."""

    def wrap(fun):
        return Program(fun, static_argnames)

    return wrap
