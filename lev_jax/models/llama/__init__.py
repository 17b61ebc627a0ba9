from lev_jax.models.llama.modeling import LlamaConfig, LlamaLM  # noqa: F401
