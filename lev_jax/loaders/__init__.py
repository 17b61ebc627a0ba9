"""Checkpoint loaders: GGUF files (``lev_jax.loaders.gguf``) and Hugging Face safetensors directories."""
