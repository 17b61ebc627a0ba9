"""`python -m serve`: the Jev-compatible HTTP server (the implementation is lev_jax.server)."""
