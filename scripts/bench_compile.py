"""Compile cost of a model's programs, layers under `jax.lax.scan` vs unrolled, from abstract shapes.

    python -m scripts.bench_compile [--model Qwen/Qwen3.5-4B | smollm2] [--preset 4b-instruct]
                                    [--programs train,prefill,rows] [--layers N] [--json OUT]

No weights are loaded or allocated: the config comes from `train plan`'s table of nominal shapes
(`training.plan.NOMINAL`), the parameters are `jax.ShapeDtypeStruct`s, and each program is traced,
lowered and compiled for this machine's backend (`jax.jit(...).lower(...).compile()`). Both
variants are measured in the same run, one after the other, with JAX's persistent compilation
cache off (every compile is real):

  scan      the config's `scan_unroll` = 1: one scan step (a period of layers) in the program
  unrolled  `scan_unroll` = the layer count: every layer in the program, as a Python layer loop gives

Programs:
  train    one training step of the preset: value_and_grad of a loss over `training.loop.group_scores`
           (the prefixes and rows the trainer runs: the LoRA adapter of the preset's rank on its
           targets and `lora_layers`, its remat policy and compute dtype); E=8 groups of a 256-token
           prefix and 4 rows of 32 tokens, 4 labels (compile cost barely depends on these sizes)
  prefill  a 512-token prefill of one state (the serving engine's prefill chunk)
  rows     32 rows of 16 tokens reading a 512-slot prefix cache in place (a readout call)

Prints one line per (program, variant) and the ratio unrolled / scan of compile seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

# no compile may come from a cache: the point is to time them
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from lev_jax import models  # noqa: E402
from lev_jax.training import config as train_config  # noqa: E402
from lev_jax.training import lora, plan  # noqa: E402
from lev_jax.training.loop import group_scores  # noqa: E402

SDS = jax.ShapeDtypeStruct
EMBEDDED = "smollm2"  # the embedded SmolLM2-135M-Instruct's config (read from its GGUF header)


def _adapter(abstract, cfg: train_config.TrainConfig) -> dict:
    shapes = lora.shapes(abstract)
    out = {}
    for path in lora.target_paths(abstract, cfg.lora_targets, cfg.lora_layers):
        n_in, n_out = shapes[path].shape
        out[path] = {"a": SDS((n_in, cfg.lora_rank), jnp.float32), "b": SDS((cfg.lora_rank, n_out), jnp.float32)}
    return out


def train_program(mcfg, tcfg: train_config.TrainConfig, dtype: str):
    E, P, R, T, C = 8, 256, 4, 32, 4
    abstract = models.abstract_params(mcfg, dtype)
    batch = {
        "prefix_EP": SDS((E, P), jnp.int32),
        "prefix_valid_EP": SDS((E, P), bool),
        "tokens_ERT": SDS((E, R, T), jnp.int32),
        "valid_ERT": SDS((E, R, T), bool),
        "answer_ER": SDS((E, R), jnp.int32),
        "label_ids_ERC": SDS((E, R, C), jnp.int32),
        "markers_ERC": SDS((E, R, C), jnp.int32),
        "marked_ER": SDS((E, R), bool),
    }

    def loss(adapter, frozen, batch):
        params = lora.apply(frozen, adapter, tcfg.lora_scale)
        logits = group_scores(params, None, batch, mcfg, remat=tcfg.remat, rows_per_call=tcfg.rows_per_call)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[:, 0])

    return jax.jit(jax.value_and_grad(loss)), (_adapter(abstract, tcfg), abstract, batch)


def prefill_program(mcfg, dtype: str):
    abstract = models.abstract_params(mcfg, dtype)

    def prefill(params, tokens, valid):
        return models.forward(params, tokens, None, mcfg, valid_BT=valid, readout_BR=jnp.zeros((1, 1), jnp.int32))

    return jax.jit(prefill), (abstract, SDS((1, 512), jnp.int32), SDS((1, 512), bool))


def rows_program(mcfg, dtype: str):
    abstract = models.abstract_params(mcfg, dtype)
    cache = jax.eval_shape(lambda: models.init_cache(mcfg, 1, 512, dtype))
    B, T = 32, 16

    def rows(params, cache, tokens, valid, readout):
        hidden, _ = models.forward(
            params, tokens, cache, mcfg, valid_BT=valid, readout_BR=readout, cache_write=models.CacheWrite.NONE
        )
        return hidden

    args = (abstract, cache, SDS((B, T), jnp.int32), SDS((B, T), bool), SDS((B, 1), jnp.int32))
    return jax.jit(rows), args


def measure(fn, args) -> dict:
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"lower_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default="Qwen/Qwen3.5-4B",
        help=f"one of {', '.join(plan.NOMINAL)}, or {EMBEDDED} (the default's base)",
    )
    ap.add_argument("--preset", default="4b-instruct", help="the training preset of the train program")
    ap.add_argument("--programs", default="train,prefill,rows")
    ap.add_argument("--layers", type=int, default=0, help="> 0: that many layers instead of the model's")
    ap.add_argument("--variants", default="scan,unrolled")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    if args.model == EMBEDDED:
        from lev_jax.loaders import gguf

        hf = dict(gguf.read_gguf(gguf.embedded_default_path()).hf_config)
    elif args.model in plan.NOMINAL:
        hf = dict(plan.NOMINAL[args.model])
    else:
        ap.error(f"--model must be one of {', '.join(plan.NOMINAL)}, {EMBEDDED}")
    if args.layers:
        hf["num_hidden_layers"] = args.layers
        hf.pop("layer_types", None)
    base_cfg = models.config_from_hf(hf)
    tcfg = train_config.resolve(args.preset)
    dtype = "bfloat16" if tcfg.dtype == "bfloat16" else "float32"
    L = models.num_layers(base_cfg)
    print(
        f"# {args.model} ({L} layers, period {models.layer_period(base_cfg)}), {dtype}, preset {args.preset}; "
        f"jax {jax.__version__} on {jax.default_backend()} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores)"
    )
    jax.jit(lambda x: x + 1).lower(SDS((2,), jnp.float32)).compile()  # JAX's one-time start-up, timed by neither
    results = []
    for name in args.programs.split(","):
        for variant in args.variants.split(","):
            mcfg = dataclasses.replace(base_cfg, scan_unroll=1 if variant == "scan" else L)
            if name == "train":
                fn, fargs = train_program(mcfg, tcfg, dtype)
            elif name == "prefill":
                fn, fargs = prefill_program(mcfg, dtype)
            elif name == "rows":
                fn, fargs = rows_program(mcfg, dtype)
            else:
                ap.error(f"unknown program {name!r}")
            row = {"program": name, "variant": variant, **measure(fn, fargs)}
            results.append(row)
            print(
                f"{name:8s} {variant:9s} lower {row['lower_s']:7.2f} s  compile {row['compile_s']:7.2f} s", flush=True
            )
    for name in args.programs.split(","):
        got = {r["variant"]: r for r in results if r["program"] == name}
        if {"scan", "unrolled"} <= set(got):
            s, u = got["scan"], got["unrolled"]
            total = lambda r: r["lower_s"] + r["compile_s"]
            print(
                f"{name:8s} unrolled / scan: compile {u['compile_s'] / s['compile_s']:.1f}x, "
                f"lower + compile {total(u) / total(s):.1f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "preset": args.preset, "layers": L, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
