"""``python -m data``: thin entry point into :mod:`lev_jax.data`."""
