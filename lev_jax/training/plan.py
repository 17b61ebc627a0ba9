"""`python -m train plan`: tokens, FLOPs, hours and memory of a run before it starts.

* tokens  - from the data build's train lengths (per readout: the rendering-agnostic length of state,
            instructions and options, plus the prompt template and label codes per row, times the rows
            an example trains: two presentation orders with option averaging); without a build, a
            nominal 300 tokens per row;
* FLOPs   - the model's forward matmul FLOPs per token (its config's `flops_per_token`) times 2 for
            a LoRA step (forward and input gradients: the adapter sits beside the frozen kernels, which
            get no gradient) or 3 for a full fine-tune (the weights' gradients too), plus one forward
            more under remat "full" (the recomputation); with `lora_layers` the layers below the
            adapted ones run forward only;
* hours   - FLOPs / (peak x an assumed utilisation) of the accelerator;
* memory  - per device: the frozen weights (compute dtype) and the trainable tree, its gradient and
            Adam's two moments (fp32), sharded over fsdp x tensor, plus activations for this device's
            share of a step's tokens under the remat policy.

A preset whose memory estimate exceeds 90 % of the device refuses, naming the knob to turn.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np

from lev_jax.training.config import EMBEDDED, TINY_MODEL, TrainConfig

GiB = 2**30
HEADROOM = 0.9
TEMPLATE_TOKENS = 40  # chat template + question scaffolding per row, beyond the data's own length
CODE_TOKENS = 2  # per option or level: its code and ") "
NOMINAL_ROW_TOKENS = 300


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    memory: float  # bytes per device
    peak: float  # dense bf16 FLOP/s per device
    utilisation: float  # assumed model-FLOPs utilisation of a training step


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 16 * GiB


ACCELERATORS = {
    "h100": Accelerator("NVIDIA H100 80GB", 80e9, 989e12, 0.40),
    "v5p": Accelerator("TPU v5p chip", 95e9, 459e12, 0.40),
    # this project's 2-core AVX-512 machines: ~1.4 TFLOP/s bf16 matmul ceiling (BENCHMARKS.md), and a
    # LoRA step of the embedded model measured at ~0.12 of it (docs/training.md)
    "cpu": Accelerator("this host's CPU", _host_memory(), 1.4e12, 0.12),
}

# Nominal Qwen3.5 text shapes for planning without a local checkpoint (a checkpoint directory's
# config.json replaces them). Layer types: three Gated DeltaNet layers, then one attention layer.
_QWEN35 = dict(
    model_type="qwen3_5_text",
    vocab_size=248320,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    rms_norm_eps=1e-6,
    full_attention_interval=4,
)
NOMINAL = {
    "Qwen/Qwen3.5-0.8B-Base": dict(
        _QWEN35,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen3.5-2B-Base": dict(
        _QWEN35,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen3.5-4B-Base": dict(
        _QWEN35,
        hidden_size=2560,
        intermediate_size=9216,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        linear_num_value_heads=32,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen3.5-9B-Base": dict(
        _QWEN35,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        linear_num_value_heads=32,
        tie_word_embeddings=False,
    ),
}
NOMINAL["Qwen/Qwen3.5-4B"] = NOMINAL["Qwen/Qwen3.5-4B-Base"]


@dataclasses.dataclass
class Estimate:
    cfg: TrainConfig
    accelerator: Accelerator
    devices: int
    model: str
    shapes: str  # where the shapes came from
    params: int
    trainable: int
    examples: int
    tokens_per_example: float
    tokens: float
    flops: float
    hours: float
    memory: dict  # part -> bytes per device
    data: str

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.total_memory <= HEADROOM * self.accelerator.memory

    @property
    def refusal(self) -> str:
        m = self.memory
        if m["activations"] >= max(m["weights"], m["optimiser"]):
            knob = (
                "--set remat=full"
                if self.cfg.remat != "full"
                else f"--set batch_size={max(1, self.cfg.batch_size // 2)} (or more devices on --mesh data=N)"
            )
        elif m["optimiser"] > m["weights"]:
            knob = "--set lora_rank=32 (LoRA instead of a full fine-tune) or --mesh fsdp=N"
        else:
            knob = "--mesh fsdp=N (shard the weights) or --set dtype=bfloat16"
        return (
            f"preset {self.cfg.preset!r} needs ~{self.total_memory / GiB:.1f} GiB per device, more than "
            f"{HEADROOM:.0%} of {self.accelerator.memory / GiB:.0f} GiB on {self.accelerator.name}; "
            f"turn {knob}"
        )


def model_config(cfg: TrainConfig):
    """(model config, where its shapes came from) without loading any weights."""
    from lev_jax import models

    if cfg.model == TINY_MODEL:
        from lev_jax import testing

        return models.config_from_hf({**testing.TINY_QWEN3_5, "vocab_size": 248077}), "tiny random Qwen3.5"
    if cfg.model == EMBEDDED or str(cfg.model).endswith(".gguf"):
        from lev_jax.loaders import gguf

        path = gguf.embedded_default_path() if cfg.model == EMBEDDED else Path(cfg.model)
        return models.config_from_hf(gguf.read_gguf(path).hf_config), f"GGUF {Path(path).name}"
    local = Path(os.path.expanduser(str(cfg.model))) / "config.json"
    if local.is_file():
        return models.config_from_hf(json.loads(local.read_text())), f"{local}"
    if cfg.model in NOMINAL:
        return models.config_from_hf(dict(NOMINAL[cfg.model])), "nominal shapes (no local checkpoint)"
    raise ValueError(f"cannot size {cfg.model!r}: pass a local checkpoint directory with --set model=DIR")


def _counts(cfg: TrainConfig, mcfg) -> tuple[int, int]:
    """(base parameters, trainable parameters) from abstract shapes."""
    from lev_jax import models
    from lev_jax.training import lora

    abstract = models.abstract_params(mcfg, "float32")
    flat = lora.flatten(abstract)
    params = int(sum(math.prod(x.shape) for x in flat.values()))
    if cfg.full_finetune:
        return params, params
    paths = lora.target_paths(abstract, cfg.lora_targets, cfg.lora_layers)
    return params, int(sum(cfg.lora_rank * (flat[p].shape[0] + flat[p].shape[1]) for p in paths))


def data_tokens(cfg: TrainConfig, data_dir: Path | None) -> tuple[float, int, str]:
    """(mean tokens per training example, train examples, description)."""
    rows_of = {
        "choice": 2 if cfg.option_averaging else 1,
        "score": 1,
        "noul_rating": 2 if (cfg.noul_readout == "binary" and cfg.option_averaging) else 1,
    }
    if data_dir is None:
        return 2 * NOMINAL_ROW_TOKENS, 0, f"no data build (nominal {NOMINAL_ROW_TOKENS} tokens per row)"
    index = json.loads((Path(data_dir) / "train.index.json").read_text())
    ro = np.asarray(index["readout"])
    lengths = np.asarray(index["length"], np.float64)
    keep = np.isin(ro, list(cfg.readouts)) if cfg.readouts else np.ones(len(ro), bool)
    per = np.array([rows_of.get(r, 2) for r in ro[keep]], np.float64)
    tokens = (lengths[keep] + TEMPLATE_TOKENS) * per  # the data length includes the options' own words
    return float(tokens.mean()), int(keep.sum()), f"{data_dir}: {int(keep.sum()):,} train examples"


def estimate(cfg: TrainConfig, *, data_dir: Path | None = None, devices: int | None = None) -> Estimate:
    from lev_jax.training import mesh as mesh_lib

    acc = ACCELERATORS[cfg.accelerator]
    mcfg, shapes = model_config(cfg)
    params, trainable = _counts(cfg, mcfg)
    per_example, n_examples, data = data_tokens(cfg, data_dir)
    devices = devices or (1 if not cfg.mesh else math.prod(_mesh_sizes(cfg.mesh).values()))
    sizes = mesh_lib.parse(cfg.mesh, devices)
    examples = cfg.steps * cfg.batch_size
    tokens = examples * per_example
    context = per_example / 2
    L = mcfg.num_hidden_layers
    # layers under `lora_layers` run forward only: no gradient flows below the lowest adapted layer
    trained = min(cfg.lora_layers, L) / L if (cfg.lora_layers and not cfg.full_finetune) else 1.0
    backward = 2 if cfg.full_finetune else 1  # input gradients (+ weight gradients when they train)
    passes = 1 + (backward + (1 if cfg.remat == "full" else 0)) * trained
    flops = passes * mcfg.flops_per_token(context) * tokens
    hours = flops / (acc.peak * acc.utilisation * devices) / 3600
    dtype_bytes = 2 if cfg.dtype == "bfloat16" else 4
    shard = sizes["fsdp"] * sizes["tensor"]
    weights = params * (4 if cfg.full_finetune else dtype_bytes) / shard
    optimiser = trainable * 4 * 3 / shard  # gradient + two Adam moments, fp32
    E, F = mcfg.hidden_size, mcfg.intermediate_size
    batch_split = sizes["data"] * sizes["fsdp"]
    step_tokens = cfg.batch_size * per_example / batch_split
    per_token_layer = {"none": 4 * (12 * E + 3 * F), "dots": 4 * (6 * E + 2 * F), "full": 4 * E}[cfg.remat]
    one_layer = 4 * (12 * E + 3 * F) * step_tokens  # the layer being recomputed
    activations = step_tokens * per_token_layer * L * trained + one_layer
    memory = {"weights": weights, "optimiser": optimiser, "activations": activations}
    return Estimate(
        cfg,
        acc,
        devices,
        str(cfg.model),
        shapes,
        params,
        trainable,
        n_examples,
        per_example,
        tokens,
        flops,
        hours,
        memory,
        data,
    )


def _mesh_sizes(spec: str) -> dict[str, int]:
    out = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        out[name.strip()] = int(value)
    return out


def report(e: Estimate) -> str:
    c = e.cfg
    kind = "full fine-tune" if c.full_finetune else f"LoRA r{c.lora_rank}"
    mem = " + ".join(f"{k} {v / GiB:.2f}" for k, v in e.memory.items())
    return "\n".join(
        [
            f"plan {c.preset} on {e.devices} x {e.accelerator.name} (mesh {c.mesh or 'data=' + str(e.devices)})",
            f"  model        {e.model}: {e.params / 1e9:.3f} B parameters ({e.shapes})",
            f"  trainable    {kind}: {e.trainable / 1e6:.2f} M parameters, remat {c.remat}, compute {c.dtype}",
            f"  data         {e.data}",
            f"  tokens       {c.steps} steps x {c.batch_size} examples x ~{e.tokens_per_example:.0f} tokens "
            f"= {e.tokens / 1e6:.2f} M real tokens",
            f"  compute      {e.flops:.3g} FLOPs = {e.hours:.2f} h at {e.accelerator.utilisation:.0%} of "
            f"{e.accelerator.peak / 1e12:.0f} TFLOP/s per device",
            f"  memory       per device: {mem} = {e.total_memory / GiB:.2f} GiB of "
            f"{e.accelerator.memory / GiB:.0f} GiB "
            f"({e.total_memory / e.accelerator.memory:.0%}) {'ok' if e.fits else 'TOO MUCH'}",
        ]
    )
