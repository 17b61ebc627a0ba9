"""`python -m serve` (installed: `lev serve`): the Jev-compatible HTTP server (the implementation is lev_jax.server)."""
