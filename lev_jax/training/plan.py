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
            share of a step's tokens under the remat policy, and the attention scores of its rows
            (fp32, quadratic in a row's length: what a batch of long rows runs out of memory on).
* Mode B  - with `mode_b` the build's records are read to route each choice by its size, as the
            router does (`mode_b_min_options`): a routed choice trains its marked row (every option and its marker in
            one row, the state with it) besides, or with the adapter frozen instead of, its Mode A rows;
            the head joins the trainable tree.

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
MARKED_OPTION_TOKENS = 4  # per option of a Mode B row: its marker and line punctuation (3-4 on SmolLM2)
# fp32 [heads, T, T] arrays an attention layer keeps per row: its scores and probabilities for the
# backward and one temporary (on this CPU a step of 8 marked rows of ~1,400 tokens, remat "none", was
# killed at 22.7 GiB; with two copies this plan said 15 GiB)
ATTENTION_COPIES = 3


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


@dataclasses.dataclass(frozen=True)
class DataTokens:
    per_example: float  # mean real tokens an example puts through the model
    examples: int
    long_row: float  # the 90th percentile of an example's longest row that holds its question
    rows: float  # mean rows per example that hold their question (their attention is quadratic in it)
    description: str


def _option_counts(data_dir: Path, keep: np.ndarray) -> np.ndarray:
    """Options of each kept train record's question (0 for scores and nouls)."""
    from lev_jax.data.build import read_split

    records = read_split(data_dir, "train")
    counts = [len(r["question"].get("criteria") or ()) if r["readout"] == "choice" else 0 for r in records]
    return np.asarray(counts, np.float64)[keep]


def data_tokens(cfg: TrainConfig, data_dir: Path | None) -> DataTokens:
    """Tokens per training example of the build in `data_dir` (nominal rows without one). With
    `cfg.mode_b`, choices the router sends to Mode B by size (at least `mode_b_min_options` options;
    the tokenizer's code count, the router's other reason, is not known without loading it) add their
    marked row: the question, the state and every option with its marker in one row; their Mode A
    rows stay only where they train (`mode_b_joint` and the adapter trained)."""
    rows_of = {
        "choice": 2 if cfg.option_averaging else 1,
        "score": 1,
        "noul_rating": 2 if (cfg.noul_readout == "binary" and cfg.option_averaging) else 1,
    }
    if data_dir is None:
        nominal = f"no data build (nominal {NOMINAL_ROW_TOKENS} tokens per row)"
        return DataTokens(2 * NOMINAL_ROW_TOKENS, 0, NOMINAL_ROW_TOKENS, 2, nominal)
    index = json.loads((Path(data_dir) / "train.index.json").read_text())
    ro = np.asarray(index["readout"])
    lengths = np.asarray(index["length"], np.float64)
    keep = np.isin(ro, list(cfg.readouts)) if cfg.readouts else np.ones(len(ro), bool)
    per = np.array([rows_of.get(r, 2) for r in ro[keep]], np.float64)
    row = lengths[keep] + TEMPLATE_TOKENS  # the data length includes the options' own words
    a_rows, b_rows = per, np.zeros_like(per)
    marked = row  # a marked row: the same words, plus each option's marker and line
    note = ""
    if cfg.mode_b:
        n = _option_counts(Path(data_dir), keep)
        routed = n >= cfg.mode_b_min_options
        k = np.minimum(n, cfg.mode_b_options) if cfg.mode_b_options else n
        # a sampled row (mode_b_options) lists k of the n options: the options are most of a large
        # choice's words, so its words scale by k / n
        b_rows, marked = routed.astype(np.float64), row * k / np.maximum(n, 1) + MARKED_OPTION_TOKENS * k
        if not (cfg.mode_b_joint and cfg.train_adapter):
            a_rows = np.where(routed, 0.0, per)
        note = f", {int(routed.sum()):,} routed to Mode B"
    tokens = row * a_rows + marked * b_rows
    # with the schema first and one question per batch, a Mode A row is the state after the shared
    # question: short next to the rows that carry the options, whose attention is counted
    if cfg.layout == "schema_first" and cfg.group_by_question:
        a_rows = np.zeros_like(a_rows)
        if not cfg.mode_b_options:  # every option, one order per batch: marked rows share them too
            b_rows = np.zeros_like(b_rows)
    longest = np.where(b_rows > 0, marked, np.where(a_rows > 0, row, 0.0))
    return DataTokens(
        float(tokens.mean()),
        int(keep.sum()),
        float(np.percentile(longest, 90)),
        float((a_rows + b_rows).mean()),
        f"{data_dir}: {int(keep.sum()):,} train examples{note}",
    )


def estimate(
    cfg: TrainConfig, *, data_dir: Path | None = None, devices: int | None = None, tokens: DataTokens | None = None
) -> Estimate:
    """The plan of `cfg`; `tokens`: `data_tokens(cfg, data_dir)` already read (it does not depend on
    remat, batch size or dtype: a search over those reads the build once)."""
    from lev_jax.training import mesh as mesh_lib
    from lev_jax.training.batches import LENGTHS

    acc = ACCELERATORS[cfg.accelerator]
    mcfg, shapes = model_config(cfg)
    params, trainable = _counts(cfg, mcfg)
    if cfg.mode_b:
        from lev_jax.readout import modeb

        trainable += modeb.head_parameters(int(mcfg.hidden_size))
    dt = tokens if tokens is not None else data_tokens(cfg, data_dir)
    per_example = dt.per_example
    devices = devices or (1 if not cfg.mesh else math.prod(_mesh_sizes(cfg.mesh).values()))
    sizes = mesh_lib.parse(cfg.mesh, devices)
    examples = cfg.steps * cfg.batch_size
    tokens = examples * per_example
    context = per_example / 2
    L = mcfg.num_hidden_layers
    # layers under `lora_layers` run forward only: no gradient flows below the lowest adapted layer
    trained = min(cfg.lora_layers, L) / L if (cfg.lora_layers and not cfg.full_finetune) else 1.0
    if not cfg.train_adapter:  # a heads-only stage (Mode B head, exits): no gradient enters the backbone
        trained = 0.0
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
    # an attention layer keeps its fp32 scores and probabilities for the backward: heads x T x T per
    # row, T the step's long rows (a prefix is shared, so a row's own length bounds it from below)
    attention_layers = sum(k == "full_attention" for k in getattr(mcfg, "layer_types", ())) or L
    step_rows = cfg.batch_size * dt.rows / batch_split
    padded = LENGTHS[min(int(np.searchsorted(LENGTHS, dt.long_row)), len(LENGTHS) - 1)]  # the step's shape
    scores = ATTENTION_COPIES * 4 * mcfg.num_attention_heads * padded**2 * step_rows
    kept = {"none": attention_layers * trained, "dots": attention_layers * trained, "full": 1}[cfg.remat]
    activations = step_tokens * per_token_layer * L * trained + one_layer + scores * kept
    memory = {"weights": weights, "optimiser": optimiser, "activations": activations}
    return Estimate(
        cfg,
        acc,
        devices,
        str(cfg.model),
        shapes,
        params,
        trainable,
        dt.examples,
        per_example,
        tokens,
        flops,
        hours,
        memory,
        dt.description,
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
