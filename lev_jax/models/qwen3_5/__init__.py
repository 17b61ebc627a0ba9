from lev_jax.models.qwen3_5.modeling import Qwen3_5Config, Qwen3_5LM  # noqa: F401
