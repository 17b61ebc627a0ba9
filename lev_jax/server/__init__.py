"""The HTTP server: a Jev-compatible `POST /v1/systemone` (TypeSafe System One wire contract) over an engine.

    from lev_jax.server import create_app, ServerConfig
    app = create_app(lev_jax.load(), ServerConfig(max_pending=64))

`lev serve` (from the repository root `python -m serve`) is the command line (lev_jax.server.cli);
`engine` is a lev_jax.DecisionEngine; docs/API.md is the contract.
"""

from lev_jax.server.app import API_KEYS_ENV, ServerConfig, api_keys_from_env, create_app

__all__ = ["API_KEYS_ENV", "ServerConfig", "api_keys_from_env", "create_app"]
