import sys

from lev_jax.data.cli import main

if __name__ == "__main__":
    sys.exit(main())
