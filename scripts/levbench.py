"""``python -m scripts.levbench export | eval | fit | sweep`` - see lev_jax/bench/cli.py and EVAL.md."""

import sys

from lev_jax.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
