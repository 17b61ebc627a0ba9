"""Thin entry point; the training loop lives in lev_jax once its issue lands."""
import sys

sys.exit("python -m train: the training loop is not implemented yet (it lands with the training issue). "
         "Build its data today with `python -m data build --out DIR`.")
