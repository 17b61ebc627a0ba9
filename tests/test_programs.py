"""The memory-map guard (lev_jax/programs.py): compiled programs are freed past the threshold, and
recompile on demand."""

import jax
import jax.numpy as jnp

from lev_jax import programs


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
