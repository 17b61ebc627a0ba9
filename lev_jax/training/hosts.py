"""Several processes training one run (multi-host): starting jax.distributed, putting host data on a
global mesh without an all-gather, and the work one process does for all.

* `settings()`: jax.distributed.initialize's arguments from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
  and JAX_PROCESS_ID (JAX itself reads only the first, and refuses with "Number of processes must be
  defined"), or, with none of them set, none (JAX finds the cluster: Cloud TPU, SLURM, Open MPI).
* `put(tree, shardings)`: host values (the same on every process) onto global shardings, each process
  filling only its own devices' shards (`jax.make_array_from_callback`): no per-leaf equality check,
  which `jax.device_put` makes with an all-gather of every leaf across processes.
* `first(name)`: a block that process 0 runs alone (the shared run directory: data build, --fresh,
  calibration, quarantine) while the others wait for its outcome, and fail with it when it fails.

With one process every function is the plain single-process operation.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import jax
import numpy as np

from lev_jax.errors import TrainingError  # one line on stderr, exit 2, like process 0's

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# how long the other processes wait for process 0's work (a calibration of a large model, a data
# build): a day, so a slow step is never mistaken for a dead host (a dead process 0 is reported by
# the coordination service's heartbeat long before)
WAIT_S = 24 * 3600
_names = itertools.count()


class DistributedSetupError(ValueError):
    """The multi-host variables are incomplete or malformed (one line)."""


def settings(environ=None) -> dict:
    """jax.distributed.initialize's keyword arguments from the environment: all three variables, or
    none (JAX's own cluster detection); some but not all is an error naming the missing ones."""
    environ = os.environ if environ is None else environ
    given = {k: environ[k].strip() for k in ENV if environ.get(k, "").strip()}
    if not given:
        return {}
    missing = [k for k in ENV if k not in given]
    if missing:
        raise DistributedSetupError(
            f"LEV_JAX_DISTRIBUTED=1 with {', '.join(sorted(given))} set needs {' and '.join(missing)} too "
            "(or none of them, where JAX finds the cluster itself: Cloud TPU, SLURM, Open MPI)"
        )
    try:
        n, i = int(given["JAX_NUM_PROCESSES"]), int(given["JAX_PROCESS_ID"])
    except ValueError:
        raise DistributedSetupError(
            f"JAX_NUM_PROCESSES={given['JAX_NUM_PROCESSES']!r} and JAX_PROCESS_ID={given['JAX_PROCESS_ID']!r} "
            "must be integers"
        ) from None
    if n < 1 or not 0 <= i < n:
        raise DistributedSetupError(f"JAX_PROCESS_ID={i} must be in 0..{n - 1} (JAX_NUM_PROCESSES={n})")
    return {"coordinator_address": given["JAX_COORDINATOR_ADDRESS"], "num_processes": n, "process_id": i}


def multi() -> bool:
    return jax.process_count() > 1


def put(tree, shardings):
    """`tree`'s leaves (host or single-device values, equal on every process) as global arrays with
    `shardings` (a matching tree): each process builds only its own devices' shards."""
    if not multi():
        return jax.device_put(tree, shardings)

    def one(x, sh):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already global (restored): reshard
            return jax.device_put(x, sh)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    return jax.tree.map(one, tree, shardings)


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("several JAX processes but no jax.distributed client")
    return client


@contextlib.contextmanager
def first(name: str, timeout_s: float = WAIT_S):
    """`with first("calibration") as mine: if mine: ...`: process 0 runs the block's work (`mine`
    True), the others (`mine` False) wait at the block's end until process 0 has left it, and raise
    its error when it raised one. Every process must enter the same blocks in the same order."""
    if not multi():
        yield True
        return
    key = f"lev_jax/first/{next(_names)}/{name}"
    client = _client()
    if jax.process_index() == 0:
        try:
            yield True
        except BaseException as e:
            client.key_value_set(key, f"error: {type(e).__name__}: {' '.join(str(e).split())[:500]}")
            raise
        client.key_value_set(key, "ok")
        return
    yield False
    status = client.blocking_key_value_get(key, int(timeout_s * 1000))
    if status != "ok":
        raise TrainingError(f"process 0 failed {name}: {status.removeprefix('error: ')}")
