"""``python -m data build|check|eval|list`` from the repository root (installed: ``lev data``); a thin
wrapper around :mod:`lev_jax.data.cli`."""

import sys

from lev_jax.data.cli import main

if __name__ == "__main__":
    sys.exit(main())
