"""Compiled programs and the process's memory-map limit.

XLA:CPU loads every compiled program's machine code into memory regions of its own: a model
program takes hundreds of entries of /proc/self/maps, and Linux refuses a process more than
vm.max_map_count of them (65,530 by default). A long-lived process that keeps compiling new shapes
(a test suite, a server seeing new bucket sizes for days, an evaluation sweep) would reach it, and
XLA does not fail cleanly there: the next compile crashes the process. `guard()` frees JAX's
compiled programs (`jax.clear_caches()`; they recompile on demand) before that happens.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

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
    """Drop every compiled program JAX holds (they recompile when next called)."""
    import jax

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
