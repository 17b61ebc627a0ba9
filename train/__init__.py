"""`python -m train`: fine-tune a backbone into a decision model (LoRA as parameter trees, CE + Brier +
ordinal loss on the served readout rows, exact resume, mesh sharding). The loop lives in
lev_jax.training; this package is its command line (docs/training.md).
"""
