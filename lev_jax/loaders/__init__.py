"""Checkpoint loaders: GGUF files (``lev_jax.loaders.gguf``: weights and config; ``gguf_tokenizer``: the
tokenizer from its metadata; ``gguf_reader``: opening and metadata, under both) and Hugging Face
safetensors directories (``hf``)."""
