"""``python -m serve [--model PATH] [--port 8000] ...`` from the repository root (installed: ``lev serve``).
A thin wrapper: the server and its options are :mod:`lev_jax.server` (``python -m serve --help``)."""

import sys

from lev_jax.server.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m serve"))
