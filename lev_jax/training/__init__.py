"""Fine-tuning a backbone into a decision model: `python -m train` (cli) and its parts.

config (TrainConfig, PRESETS) | lora (adapters as parameter trees) | loss (CE + Brier + ordinal) |
mesh (the device mesh, one sharding table) | batches (records -> served readout rows -> arrays) |
loop (the jitted step, progress, checkpoints) | checkpoint (Orbax, exact resume) | calibration
(temperatures on the calibration split) | recipes (data a preset builds itself) | plan (`train plan`) |
run (the run directory, `load_run`).
"""
