"""`python -m train`: see lev_jax/training/cli.py (and docs/training.md)."""

import sys

from lev_jax.training.cli import main

sys.exit(main())
