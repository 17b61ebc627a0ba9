"""`python -m train`: the fine-tuning entry point (LoRA as parameter trees, CE + Brier + ordinal loss).

Not built yet: the training loop lands with its own issue. The data it will consume is built by
`python -m data build` (lev_jax.data) today.
"""
