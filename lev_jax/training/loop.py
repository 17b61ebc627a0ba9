"""The training loop: trainer state, the jitted step, progress lines and checkpoints.

The trainer state is a pytree {"trainable", "opt_state", "train": {"step", "rng"}}. `trainable` is the
LoRA adapter (fp32 master; the frozen base stays in the compute dtype and never enters the optimiser)
or, for a full fine-tune, an fp32 master copy of every parameter. One step:

    params  = base with the adapter beside its kernels (lora.apply: x W + (x a) b)   [inside jit]
    logits  = readout.prefixed_label_logits(params, prefixes, rows, ...)             [E prefixes once]
    loss    = CE + 0.5 Brier + 0.25 ordinal                                          [loss.py, fp32]
    update  = AdamW(warmup + cosine) after clipping the global gradient norm to 1.0

jitted once per shape bucket with explicit in/out shardings over the (data, fsdp, tensor) mesh.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lev_jax import models, readout
from lev_jax.errors import TrainingError
from lev_jax.readout import exits as exits_lib
from lev_jax.readout import modeb
from lev_jax.training import batches, checkpoint, hosts, lora
from lev_jax.training import loss as loss_lib
from lev_jax.training import mesh as mesh_lib
from lev_jax.training.config import TrainConfig

# trainable groups beside the adapter (fp32, replicated, their own optimiser moments): the Mode B
# head and the exit adapters; a stage may add one to a restored run
EXTRAS = (modeb.HEAD_KEY, exits_lib.EXITS_KEY)


def parts(trainable: dict) -> tuple[dict, dict | None, dict | None]:
    """(adapter, Mode B head or None, exit adapters or None) of a trainable tree."""
    adapter = {k: v for k, v in trainable.items() if k not in EXTRAS}
    return adapter, trainable.get(modeb.HEAD_KEY), trainable.get(exits_lib.EXITS_KEY)


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    warmup = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio
    )
    opt = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=cfg.weight_decay),
    )
    return opt, schedule


def schedule_count(opt_state, default):
    """The step count the optimiser's learning-rate schedule is at: the run's step, except after a
    stage that started a fresh optimiser (its schedule restarted there)."""
    found = [
        x.count
        for x in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
        if isinstance(x, optax.ScaleByScheduleState)
    ]
    return found[0] if found else default


def fingerprint(cfg: TrainConfig, backbone) -> dict:
    """What identifies the base model a checkpoint belongs to."""
    mc = backbone.config
    return {
        "model": cfg.model,
        "name": backbone.name,
        "model_type": mc.model_type,
        "layers": int(mc.num_hidden_layers),
        "hidden": int(mc.hidden_size),
        "vocab": int(mc.vocab_size),
        "parameters": lora.n_params(backbone.params),
    }


def same_base(a: dict, b: dict) -> bool:
    keys = ("model", "model_type", "layers", "hidden", "vocab", "parameters")
    return all(a.get(k) == b.get(k) for k in keys)


class Trainer:
    """The state, its shardings and the jitted step for one config, base model and mesh."""

    def __init__(self, cfg: TrainConfig, backbone, mesh):
        self.cfg = cfg
        # what a step differentiates must enter the layer scan as itself, not as bits (models.scan):
        # the adapter and the caches of rows continued in the step always, every weight when all train
        self.model_cfg = dataclasses.replace(backbone.config, scan_frozen=() if cfg.full_finetune else ("weights",))
        self.mesh = mesh
        self.optimizer, self.schedule = make_optimizer(cfg)
        self.base_sh = mesh_lib.param_shardings(backbone.params, mesh)
        # every process holds the whole base; each puts only its own devices' shards (no all-gather)
        self.base = hosts.put(backbone.params, self.base_sh)
        self.frozen = {} if cfg.full_finetune else self.base
        self.frozen_sh = {} if cfg.full_finetune else self.base_sh
        try:
            self.exit_depths = exits_lib.depths_of(cfg.exits, backbone.config)
        except ValueError as e:
            raise TrainingError(str(e)) from None
        if cfg.exits and not self.exit_depths:
            raise TrainingError(
                f"exits={cfg.exits!r} names no layer below the model's {backbone.config.num_hidden_layers}"
            )
        self._step_fns: dict = {}  # per batch layout (one part, or with Mode B rows two: batches.pack)

    # -- state -------------------------------------------------------------------------------------
    def init_state(self) -> dict:
        cfg = self.cfg
        key = jax.random.key(cfg.seed)
        k_init, key = jax.random.split(key)
        if cfg.full_finetune:
            trainable = jax.tree.map(lambda x: x.astype(jnp.float32), self.base)
        else:
            trainable = lora.init(
                self.base, cfg.lora_rank, targets=cfg.lora_targets, top_layers=cfg.lora_layers, key=k_init
            )
        if cfg.mode_b:  # the scorer head trains with the adapter (fp32, its own optimiser moments)
            k_head, key = jax.random.split(key)
            seed = int(jax.random.randint(k_head, (), 0, 2**31 - 1))
            trainable = {**trainable, modeb.HEAD_KEY: modeb.init_head(self.model_cfg.hidden_size, seed=seed)}
        if self.exit_depths:
            k_exits, key = jax.random.split(key)
            seed = int(jax.random.randint(k_exits, (), 0, 2**31 - 1))
            trainable = {
                **trainable,
                exits_lib.EXITS_KEY: exits_lib.init_exits(self.model_cfg, self.exit_depths, cfg.exit_rank, seed),
            }
        state = {
            "trainable": trainable,
            "opt_state": self.optimizer.init(trainable),
            "train": {"step": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(key)},
        }
        return hosts.put(state, self.state_shardings(state))

    def state_shardings(self, state) -> dict:
        m = self.mesh
        adapter = parts(state["trainable"])[0]
        t_sh = (
            mesh_lib.param_shardings(adapter, m) if self.cfg.full_finetune else mesh_lib.adapter_shardings(adapter, m)
        )
        for k in EXTRAS:  # small: every device holds them
            if k in state["trainable"]:
                t_sh = {**t_sh, k: jax.tree.map(lambda _: mesh_lib.replicated(m), state["trainable"][k])}
        return {
            "trainable": t_sh,
            "opt_state": mesh_lib.like(state["opt_state"], state["trainable"], t_sh, m),
            "train": jax.tree.map(lambda _: mesh_lib.replicated(m), state["train"]),
        }

    # -- the step ----------------------------------------------------------------------------------
    def params(self, trainable, frozen):
        """The compute-dtype parameters the model runs with (differentiable in `trainable`)."""
        adapter = parts(trainable)[0]
        if self.cfg.full_finetune:
            return models.cast_params(adapter, self.model_cfg, models.params_dtype(self.base))
        return lora.apply(frozen, adapter, self.cfg.lora_scale)

    def logits(self, trainable, frozen, batch):
        """[E*R, C] scores of a packed batch (groups of rows over computed prefixes): label logits,
        and the Mode B head's scores for marked rows. With exits: {depth: [E*R, C]} label logits at
        each exit (the rows run to the deepest exit only)."""
        _, head, exits = parts(trainable)
        params = self.params(trainable, frozen)
        scores = [
            group_scores(
                params,
                head,
                part,
                self.model_cfg,
                remat=self.cfg.remat,
                rows_per_call=self.cfg.rows_per_call,
                exits=exits,
                exit_depths=self.read_depths,
            )
            for part in batches.parts(batch)  # a batch's Mode B groups are their own part (batches.pack)
        ]
        return scores[0] if len(scores) == 1 else jax.tree.map(lambda *x: jnp.concatenate(x), *scores)

    @property
    def read_depths(self) -> tuple[int, ...]:
        """The depths a step reads labels at: the exits, and the full depth when it is their teacher."""
        if self.exit_depths and self.cfg.exit_distill > 0:
            return (*self.exit_depths, models.num_layers(self.model_cfg))
        return self.exit_depths

    def loss(self, trainable, frozen, batch, key=None):
        """(scalar, stats) of the configured loss; `key` draws RLCD's noise (unused by "plain"). With
        exits, the mean over exits of the loss at each plus `exit_distill` x its KL divergence from the
        full depth's answer (stats averaged likewise; "distill" is the mean KL)."""
        logits, rows = self.logits(trainable, frozen, batch), batches.flat_rows(batch)
        if self.cfg.loss == "rlcd" and key is None:
            raise ValueError("the rlcd loss draws noise: pass a PRNG key")

        def one(lg, k):
            if self.cfg.loss == "rlcd":
                return loss_lib.rlcd(lg, rows, k, **self.cfg.loss_options)
            return loss_lib.loss(lg, rows, **self.cfg.loss_options)

        if not isinstance(logits, dict):
            return one(logits, key)
        depths = self.exit_depths
        keys = [None] * len(depths) if key is None else list(jax.random.split(key, len(depths)))
        outs = [one(logits[d], k) for d, k in zip(depths, keys)]
        if len(self.read_depths) > len(depths):  # the full depth's answer is each exit's soft target too
            teacher = jax.lax.stop_gradient(logits[self.read_depths[-1]])
            beta = self.cfg.exit_distill
            for i, d in enumerate(depths):
                kl = loss_lib.distill(logits[d], teacher, rows)
                outs[i] = (outs[i][0] + beta * kl, {**outs[i][1], "distill": kl})
        return jax.tree.map(lambda *xs: sum(xs) / len(xs), *outs)

    def _step(self, state, frozen, batch):
        # the state's key advances every step (one split); the step's noise is the split's other half,
        # so exact resume reproduces it
        next_key, noise_key = jax.random.split(jax.random.wrap_key_data(state["train"]["rng"]))
        if self.cfg.train_adapter:
            (value, stats), grads = jax.value_and_grad(self.loss, has_aux=True)(
                state["trainable"], frozen, batch, noise_key
            )
        else:  # the head / exits alone: no gradient flows into the backbone, whose forward is all the step runs
            adapter = parts(state["trainable"])[0]
            extras = {k: v for k, v in state["trainable"].items() if k in EXTRAS}

            def extras_loss(x):
                return self.loss({**adapter, **x}, frozen, batch, noise_key)

            (value, stats), g_extras = jax.value_and_grad(extras_loss, has_aux=True)(extras)
            grads = {**jax.tree.map(jnp.zeros_like, adapter), **g_extras}
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["trainable"])
        if not self.cfg.train_adapter:  # weight decay must not move the frozen adapter either
            updates = {
                **jax.tree.map(jnp.zeros_like, parts(updates)[0]),
                **{k: v for k, v in updates.items() if k in EXTRAS},
            }
        trainable = optax.apply_updates(state["trainable"], updates)
        step = state["train"]["step"]
        rng = jax.random.key_data(next_key)
        lr = self.schedule(schedule_count(state["opt_state"], step))
        metrics = {"loss": value, **stats, "grad_norm": optax.global_norm(grads), "lr": lr}
        return {"trainable": trainable, "opt_state": opt_state, "train": {"step": step + 1, "rng": rng}}, metrics

    def step(self, state, batch):
        layout = tuple(sorted(batch))
        if layout not in self._step_fns:
            rep = mesh_lib.replicated(self.mesh)
            state_sh = self.state_shardings(state)
            batch_sh = {k: mesh_lib.batch_sharding(self.mesh, v.ndim) for k, v in batch.items()}
            self._step_fns[layout] = jax.jit(
                self._step,
                in_shardings=(state_sh, self.frozen_sh, batch_sh),
                out_shardings=(state_sh, rep),
                donate_argnums=(0,),
            )
        return self._step_fns[layout](state, self.frozen, batch)

    def put_batch(self, arrays: dict[str, np.ndarray]) -> dict:
        """Host arrays of the global batch (the same on every process: `data_iterator`) -> global
        device arrays, groups split over the batch axes; each process puts only its own devices'
        groups (rows only ever read their own group's prefix)."""
        return hosts.put(arrays, {k: mesh_lib.batch_sharding(self.mesh, v.ndim) for k, v in arrays.items()})


def group_scores(params, head, batch, cfg, *, remat: str = "none", rows_per_call: int = 0, exits=None, exit_depths=()):
    """[E*R, C] fp32 scores: the E group prefixes computed in one forward (gradients flow through
    them), then each group's R rows continuing its prefix as a 1-row shared cache
    (`readout.rows_scores`, the serving readout, vmapped over groups: label logits, or with a Mode
    B `head` its scores at the marked rows' markers): attention reads the prefix in place, so
    memory and work do not grow with copies of it per row, as with a per-row gathered cache.
    `rows_per_call` > 0 reads a group's rows that many at a time, one after another (`lax.map`):
    the same scores, but a CPU keeps a few long rows' activations in its caches where all of them
    at once run several times slower per token (docs/training.md).
    With `exits` (readout.exits adapters) and `exit_depths`: {depth: [E*R, C]} label logits at each
    exit (`readout.rows_exit_logits`); prefixes and rows run to the deepest exit only."""
    E, R = batch["answer_ER"].shape
    deepest = max(exit_depths) if exits is not None else None
    # a group whose prefix holds its Mode B rows' options has its markers read there, once
    keyed = head is not None and exits is None and "prefix_markers_EC" in batch
    hidden_ECE, cache = models.forward(
        params,
        batch["prefix_EP"],
        None,
        cfg,
        valid_BT=batch["prefix_valid_EP"],
        readout_BR=batch["prefix_markers_EC"] if keyed else jnp.zeros((E, 1), jnp.int32),
        remat=remat,
        layer_range=None if deepest is None else (0, deepest),
    )
    keys_ECK = modeb.marker_keys(head, hidden_ECE) if keyed else jnp.zeros((E, 1, 1), jnp.float32)
    keyed_E = batch["prefix_keyed_E"] if keyed else jnp.zeros((E,), bool)
    row_axes = models.cache_row_axes(cache)

    def rows(cache_1, keys_CK, keyed_1, tokens_RT, valid_RT, answer_R, ids_RC, markers_RC, marked_R):
        cache_1 = jax.tree.map(
            lambda x, ax: x if ax is None else jnp.expand_dims(x, ax), cache_1, row_axes, is_leaf=lambda x: x is None
        )
        if exits is not None:
            return readout.rows_exit_logits(
                params, exits, cache_1, None, tokens_RT, valid_RT, answer_R, ids_RC, cfg, exit_depths, remat=remat
            )[0]
        n = tokens_RT.shape[0]
        return readout.rows_scores(
            params,
            head,
            cache_1,
            None,
            tokens_RT,
            valid_RT,
            answer_R,
            ids_RC,
            markers_RC,
            marked_R,
            cfg,
            remat=remat,
            keys_BCK=jnp.broadcast_to(keys_CK, (n,) + keys_CK.shape) if keyed else None,
            keyed_B=jnp.broadcast_to(keyed_1, (n,)) if keyed else None,
        )

    if 0 < rows_per_call < R:
        whole = rows
        k = rows_per_call

        def rows(cache_1, keys_CK, keyed_1, *per_row):  # noqa: F811 - the same rows, `k` at a time
            pad = -R % k
            padded = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in per_row]
            chunks = [x.reshape(-1, k, *x.shape[1:]) for x in padded]
            out = jax.lax.map(lambda xs: whole(cache_1, keys_CK, keyed_1, *xs), tuple(chunks))
            return jax.tree.map(lambda o: o.reshape(-1, *o.shape[2:])[:R], out)

    in_axes = (row_axes, 0, 0, 0, 0, 0, 0, 0, 0)
    names = ("tokens_ERT", "valid_ERT", "answer_ER", "label_ids_ERC", "markers_ERC", "marked_ER")
    logits_ERC = jax.vmap(rows, in_axes=in_axes)(cache, keys_ECK, keyed_E, *(batch[k] for k in names))
    return jax.tree.map(lambda x: x.reshape(E * R, -1), logits_ERC)


# -- operator output ---------------------------------------------------------------------------------
def memory() -> str:
    """Device memory in use (accelerators) or this process's resident memory (CPU)."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and "bytes_in_use" in stats:
        used = sum((d.memory_stats() or {}).get("bytes_in_use", 0) for d in jax.local_devices())
        return f"mem {used / 2**30:.1f} GiB"
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return f"rss {rss / 2**30:.1f} GiB"
    except (OSError, ValueError):
        return "mem ?"


def clock(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


@dataclasses.dataclass
class Window:
    """Progress since the last line: windowed rates, not cumulative ones."""

    t0: float
    steps: int = 0
    tokens: int = 0
    metrics: list = dataclasses.field(default_factory=list)

    def line(self, step: int, total: int, elapsed: float) -> tuple[str, dict]:
        m = jax.device_get(self.metrics)
        dt_ = max(time.perf_counter() - self.t0, 1e-9)
        loss_sum = np.sum([x["loss_sum_M"] for x in m], 0)
        rows = np.sum([x["rows_M"] for x in m], 0)
        per_mode = {mode: float(loss_sum[i] / rows[i]) for i, mode in enumerate(loss_lib.MODES) if rows[i] > 0}
        mean = float(loss_sum.sum() / max(rows.sum(), 1e-9))
        sps, tps = self.steps / dt_, self.tokens / dt_
        eta = (total - step) / sps if sps > 0 else float("nan")
        modes = " ".join(f"{k} {v:.3f}" for k, v in per_mode.items())
        policy = float(np.mean([x["policy"] for x in m])) if "policy" in m[-1] else None
        if policy is not None:  # the RLCD loss: its policy term and mean reward beside the plain loss
            modes += f" | rlcd policy {policy:+.4f} reward {float(np.mean([x['reward'] for x in m])):.3f}"
        distill = float(np.mean([x["distill"] for x in m])) if "distill" in m[-1] else None
        if distill is not None:  # exits learning from the full depth: their mean KL from it
            modes += f" | exits KL {distill:.4f}"
        text = (
            f"step {step}/{total} {100 * step / total:5.1f}% | loss {mean:.4f} ({modes}) | "
            f"lr {float(m[-1]['lr']):.2e} | {sps:.3f} steps/s | {tps:.0f} tok/s | elapsed {clock(elapsed)} | "
            f"ETA {clock(eta) if math.isfinite(eta) else '?'} | {memory()}"
        )
        record = {
            "event": "progress",
            "step": step,
            "loss": mean,
            "loss_by_mode": per_mode,
            "lr": float(m[-1]["lr"]),
            "grad_norm": float(m[-1]["grad_norm"]),
            **({"rlcd_policy": policy} if policy is not None else {}),
            **({"exit_kl": distill} if distill is not None else {}),
            "steps_per_s": sps,
            "tokens_per_s": tps,
            "elapsed_s": round(elapsed, 2),
        }
        return text, record


def data_iterator(cfg: TrainConfig, data_dir: Path, renderer: batches.Renderer):
    """The grain iterator of the train split, rendered through the planner: whole global batches.
    Every process reads the same plan and renders every example of each step (cheap beside the
    step), so all of them pack the same global arrays -- the same shapes, the same skipped examples,
    the same programs -- and each puts only its own devices' groups on them (`Trainer.put_batch`).
    Per-process shards padded to per-process buckets would give the processes different global
    shapes (a hang or a crash at the first step), and a different skip count per process."""
    from lev_jax.data import pipeline

    def render(grain_batch):
        examples, skipped = renderer.batch(grain_batch)
        return {"examples": examples, "skipped": skipped, "epoch": int(grain_batch["epoch"])}

    try:
        if cfg.group_by_question:
            keys = batches.question_keys(data_dir, min_count=cfg.question_group_min)
            keep = [not cfg.readouts or k.split("|")[0] in cfg.readouts for k in keys]
            return batches.keyed_iterator(
                data_dir,
                keys,
                keep=keep,
                batch_size=cfg.batch_size,
                seed=cfg.seed,
                window_batches=cfg.window_batches,
                transform=render,
            )
        return pipeline.make_iterator(
            data_dir,
            "train",
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            num_epochs=None,
            window_batches=cfg.window_batches,
            readouts=list(cfg.readouts) or None,
            transform=render,
        )
    except ValueError as e:
        raise TrainingError(f"no training batches in {data_dir}: {e}") from None


def make_renderer(cfg: TrainConfig, tokenizer) -> batches.Renderer:
    """The planner(s) and renderer that turn `cfg`'s training records into examples."""
    from lev_jax.readout import Planner

    planners = {
        layout: Planner(
            tokenizer,
            prompt_style=cfg.prompt_style,
            layout=layout,
            noul_readout=cfg.noul_readout,
            option_averaging=cfg.option_averaging,
            mode_b=cfg.mode_b,
            mode_b_min_options=cfg.mode_b_min_options,
        )
        for layout in dict.fromkeys((cfg.layout, *cfg.layouts, *([cfg.large_layout] if cfg.large_layout else [])))
    }
    return batches.Renderer(
        planners[cfg.layout],
        planners=planners,
        mix=cfg.layouts,
        large_layout=cfg.large_layout,
        seed=cfg.seed,
        round2=cfg.round2,
        max_tokens=cfg.max_tokens,
        # Mode A rows train the adapter: with it frozen they would cost a forward and teach nothing
        mode_b_joint=cfg.mode_b_joint and cfg.train_adapter,
        mode_b_options=cfg.mode_b_options,
    )


def next_examples(it: Iterator, counters: dict) -> list[batches.Example]:
    """The next batch that has at least one example within the token budget."""
    for _ in range(1000):
        b = next(it)
        counters["skipped"] += b["skipped"]
        counters["epoch"] = b["epoch"]
        if b["examples"]:
            return b["examples"]
    raise TrainingError("1000 batches in a row had no example within max_tokens; raise --set max_tokens=...")


def train(
    cfg: TrainConfig,
    run_dir: Path,
    backbone,
    data_dir: Path,
    *,
    mesh,
    resume: Path | None = None,
    start_adapter: Callable[[dict], tuple[dict, str]] | None = None,
    out: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
) -> dict:
    """Train `cfg.steps` steps (resuming from the newest checkpoint of `run_dir`, or from `resume`),
    checkpointing every `checkpoint_every` steps and at the end. Returns a summary. `start_adapter`: a
    run with no checkpoint yet starts from the adapter it returns, given the freshly initialised one
    (shapes to match), with a name for the history -- the CLI's --from-release passes
    `release.stage_adapter`; a rerun resumes its own checkpoints."""
    warn = warn or out
    it = data_iterator(cfg, data_dir, make_renderer(cfg, backbone.tokenizer))
    trainer = Trainer(cfg, backbone, mesh)
    state = trainer.init_state()
    base = fingerprint(cfg, backbone)
    ckpts = checkpoint.Checkpoints(run_dir, cfg.keep_checkpoints, warn=warn)
    targets = {k: checkpoint.abstract(state[k], sh) for k, sh in trainer.state_shardings(state).items()}
    source = ckpts if resume is None else checkpoint.Checkpoints(_run_of(resume), read_only=True, warn=warn)
    wanted = _step_of(resume)
    fresh: dict = {}  # trainable groups a stage adds to the restored state (started fresh)
    started_from = None
    if start_adapter is not None and resume is None and not ckpts.steps():
        adapter, name = start_adapter(parts(state["trainable"])[0])
        state = {**state, "trainable": {**state["trainable"], **adapter}}
        state["opt_state"] = trainer.optimizer.init(state["trainable"])
        state = hosts.put(state, trainer.state_shardings(state))
        started_from = name
    for s in [wanted] if wanted is not None else source.steps()[::-1]:
        try:  # refuse another base model before restoring anything (an unreadable one: restore says)
            meta = source.read_meta(s)
        except Exception:  # noqa: BLE001
            continue
        was = meta.get("config", {})
        # a Mode B stage: a checkpoint trained without a head, continued with one (--mode-b)
        if cfg.mode_b and not was.get("mode_b", False):
            fresh[modeb.HEAD_KEY] = state["trainable"][modeb.HEAD_KEY]
        # an exits stage: a checkpoint trained without exits, continued with them
        if cfg.exits and not was.get("exits", ""):
            fresh[exits_lib.EXITS_KEY] = state["trainable"][exits_lib.EXITS_KEY]
        elif was.get("exits", "") != cfg.exits and "exits" in was and was.get("exits"):
            raise TrainingError(
                f"checkpoint {source.path(s)} trained exits {was['exits']!r}; this run asks {cfg.exits!r} "
                "(start the new exits from a checkpoint without exits, or another --out)"
            )
        if not same_base(meta.get("base", {}), base):
            raise TrainingError(
                f"checkpoint {source.path(s)} belongs to base model "
                f"{meta.get('base', {}).get('model')!r} ({meta.get('base', {}).get('name')}), "
                f"not {cfg.model!r} ({backbone.name}); use --fresh or another --out"
            )
        break
    if fresh:  # restore the state as it was saved; the fresh groups join it below
        saved = {k: v for k, v in state["trainable"].items() if k not in fresh}
        bare = {"trainable": saved, "opt_state": trainer.optimizer.init(saved), "train": state["train"]}
        targets = {k: checkpoint.abstract(bare[k], sh) for k, sh in trainer.state_shardings(bare).items()}
    try:
        restored = source.restore(**targets, iterator=it, step=wanted)
    except Exception as e:  # noqa: BLE001 - a checkpoint asked for by name that cannot be read
        if wanted is None:
            raise
        raise TrainingError(
            f"checkpoint {source.path(wanted)} cannot be restored into this run "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    history = checkpoint.read_history(run_dir)
    if not history and resume is not None and Path(_run_of(resume)).resolve() != Path(run_dir).resolve():
        # continued from another run's checkpoint: that run's events up to it come along (cut at the
        # restored step below), so the lineage -- the release it started from, its stages -- reaches
        # this run's releases
        history = checkpoint.read_history(_run_of(resume))
    if started_from is not None:
        out(f"starting from release {started_from}'s adapter")
        history.append({"event": "stage", "step": 0, "from_release": started_from})
    tokens_before, elapsed_before = 0, 0.0
    if restored is not None:
        start, trainable, opt_state, train_state, meta = restored
        if fresh:
            # a new group starts fresh, and so does the optimiser (warmup, then the cosine of --steps):
            # a new parameter group at the end of a decayed schedule would barely move
            trainable = {**trainable, **fresh}
            opt_state = trainer.optimizer.init(trainable)
        state = {"trainable": trainable, "opt_state": opt_state, "train": train_state}
        state = hosts.put(state, trainer.state_shardings(state))
        tokens_before, elapsed_before = int(meta.get("tokens", 0)), float(meta.get("elapsed_s", 0.0))
        history = [e for e in history if e.get("step", 0) <= start]
        out(f"resumed from {source.path(start)} at step {start}")
        was = meta.get("config", {}).get("loss", "plain")
        if was != cfg.loss:  # a stage: e.g. the plain loss's checkpoint continued with rlcd
            out(f"stage: loss {was} -> {cfg.loss} from step {start}")
            history.append({"event": "stage", "step": start, "loss": cfg.loss, "from": was})
        if modeb.HEAD_KEY in fresh:
            out(f"stage: a fresh Mode B head and optimiser from step {start}")
            history.append({"event": "stage", "step": start, "mode_b": True})
        if exits_lib.EXITS_KEY in fresh:
            out(f"stage: fresh exit adapters at depths {list(trainer.exit_depths)} and optimiser from step {start}")
            history.append({"event": "stage", "step": start, "exits": list(trainer.exit_depths)})
    start = int(jax.device_get(state["train"]["step"]))
    if start >= cfg.steps:
        out(f"nothing to do: the run is at step {start} of {cfg.steps} (pass a larger --steps to continue)")
        return {"step": start, "tokens": tokens_before, "history": history}
    counters = {"skipped": 0, "epoch": 0}
    mult = mesh_lib.batch_multiple(mesh)  # the global batch's groups split over every batch device
    t_start = time.perf_counter()
    window = Window(t_start)
    tokens = tokens_before
    step = start
    extras_name = " and ".join(
        n
        for k, n in ((modeb.HEAD_KEY, "the Mode B head"), (exits_lib.EXITS_KEY, "the exit adapters"))
        if k in state["trainable"]
    ) + (" learns" if exits_lib.EXITS_KEY not in state["trainable"] else " learn")
    out(
        f"training {cfg.preset}: steps {start}..{cfg.steps}, {cfg.batch_size} examples/step, "
        f"{'full fine-tune' if cfg.full_finetune else f'LoRA r{cfg.lora_rank}'} "
        f"({lora.n_params(state['trainable']):,} trainable parameters"
        f"{'' if cfg.train_adapter else f'; adapter frozen: only {extras_name}'}), {cfg.dtype}, "
        f"mesh {dict(mesh.shape)}, "
        f"{len(jax.devices())} {jax.devices()[0].platform} device(s)"
    )

    def save(step: int):
        t0 = time.perf_counter()
        elapsed = elapsed_before + time.perf_counter() - t_start
        meta = {
            "step": step,
            "epoch": counters["epoch"],
            "base": base,
            "tokens": tokens,
            "elapsed_s": round(elapsed, 2),
            "skipped_examples": counters["skipped"],
            "config": cfg.to_json(),
        }
        path = ckpts.save(
            step,
            trainable=state["trainable"],
            opt_state=state["opt_state"],
            train=state["train"],
            meta=meta,
            iterator=it,
        )
        history.append(
            {
                "event": "checkpoint",
                "step": step,
                "path": str(path.relative_to(run_dir.absolute())),
                "elapsed_s": round(elapsed, 2),
            }
        )
        if jax.process_index() == 0:  # one writer; Orbax coordinates the checkpoint itself
            checkpoint.write_history(run_dir, history)
        out(f"checkpoint step {step} -> {path} ({time.perf_counter() - t0:.1f} s)")

    while step < cfg.steps:
        examples = next_examples(it, counters)
        arrays, n_tok = batches.pack(examples, multiple=mult, min_length=cfg.min_length)
        state, metrics = trainer.step(state, trainer.put_batch(arrays))
        step += 1
        tokens += n_tok
        window.steps += 1
        window.tokens += n_tok
        window.metrics.append(metrics)
        if step % cfg.log_every == 0 or step == cfg.steps:
            text, record = window.line(step, cfg.steps, elapsed_before + time.perf_counter() - t_start)
            out(text)
            history.append(record)
            window = Window(time.perf_counter())
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save(step)
    ckpts.close()
    if counters["skipped"]:
        out(f"{counters['skipped']} example(s) over max_tokens={cfg.max_tokens} were skipped")
    return {"step": step, "tokens": tokens, "history": history, "state": state, "trainer": trainer}


def _run_of(path: Path) -> Path:
    """The run directory of a --resume PATH (a run directory or one of its checkpoint steps)."""
    path = Path(path).absolute()
    if path.parent.name == "checkpoints":
        return path.parent.parent
    return path


def _step_of(path: Path | None) -> int | None:
    if path is None:
        return None
    p = Path(path)
    return int(p.name) if p.parent.name == "checkpoints" and p.name.isdigit() else None
