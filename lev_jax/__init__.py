"""lev-jax: a System One decision engine in JAX/Flax.

Calibrated probabilities over supplied candidates, read from an LLM's next-token distribution;
the state is computed once and every question continues from its cached prefix.
"""

from lev_jax.backbone import Backbone
from lev_jax.errors import CheckpointError

__all__ = ["Backbone", "CheckpointError"]
__version__ = "0.1.0"
from lev_jax.engine import DecisionEngine, Engine, load, load_backbone  # noqa: E402
from lev_jax.errors import RequestError, TokenLimitError  # noqa: E402

__all__ += ["DecisionEngine", "Engine", "RequestError", "TokenLimitError", "load", "load_backbone"]
