"""predict(): calibrated probabilities over supplied candidates, read from next-token logits (Mode A).

    engine = lev_jax.load()                      # the embedded SmolLM2-135M-Instruct
    engine.predict({"ticket": "..."}, {"intent": {"type": "choice", "instructions": "...",
                                                 "criteria": {"refund": None, "delivery": "late parcel"}}})

`Engine` is a facade over the readout package (lev_jax.readout): the planner lays a request out as
token rows, the executor reads their label logits (the state prefix once, every question row after it
in bucketed batched calls, question headers as cache segments where that pays), and composition
turns logits into calibrated answers. Calibration is an argument of every call (default: the
engine's own).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lev_jax import backbone as backbone_lib
from lev_jax import buckets, domain, programs, readout, runtime
from lev_jax.backbone import Backbone, compiled_programs
from lev_jax.calibrate import Calibration
from lev_jax.elastic import policy
from lev_jax.elastic import serving as elastic_serving
from lev_jax.errors import RequestError
from lev_jax.readout import logits as logits_lib
from lev_jax.readout import shapes

AUTO = "auto"  # depth="auto": elastic.policy's confidence cascade over the exits
# the top probability at which depth="auto" stops at an exit (a release may carry its own, fitted on
# its calibration split: `levbench depth`)
DEPTH_THRESHOLD = 0.9


def depth_of(plan, full: int):
    """A plan's depth (plans made before elastic depth: the full depth)."""
    return getattr(plan, "depth", None) or full


def tag(depth: int, keys: set, full: int) -> set:
    """Program keys at an exit carry its depth (another config: other programs); the full depth's are as they were."""
    return keys if depth == full else {("depth", depth, *k) for k in keys}


@runtime_checkable
class DecisionEngine(Protocol):
    """What a server (and levbench over HTTP) needs of an engine. `Engine` is one; a test double or
    another backend implements the same four members."""

    model_name: str
    supports_images: bool

    def plan(self, state, questions, images: dict | None = None) -> Any:
        """Validate and tokenize a request (RequestError / TokenLimitError before any device work);
        the result has `token_counts()` and may be passed to `predict_many` as (plan, None).
        `images` (only where `supports_images`): placeholder -> encoded image bytes."""

    def predict_many(self, requests: list, *, with_usage: bool = False) -> list:
        """Per request: its answers ((answers, usage) with `with_usage`) or the RequestError it raised."""

    def info(self) -> dict:
        """What /health reports about the model and its readout."""


class Engine:
    def __init__(
        self,
        backbone: Backbone,
        *,
        prompt_style: str = "chat",
        calibration: Calibration | None = None,
        option_averaging: bool = True,
        noul_readout: str = domain.BINARY,
        layout: str = "state_first",
        model_name: str | None = None,
        checkpoint: str | None = None,
        prefix_cache_bytes: int = 256 << 20,
        mode_b: bool = True,
        mode_b_min_options: int = domain.MODE_B_MIN_OPTIONS,
        depth_threshold: float = DEPTH_THRESHOLD,
        exit_calibrations: dict[int, Calibration] | None = None,
    ):
        if backbone.tokenizer is None:
            raise ValueError("predict() needs a tokenizer; this checkpoint ships none")
        self.backbone = backbone
        self.tokenizer = backbone.tokenizer
        self.planner = readout.Planner(
            self.tokenizer,
            prompt_style=prompt_style,
            layout=layout,
            noul_readout=noul_readout,
            option_averaging=option_averaging,
            vision=backbone.vision,
            # Mode B where the backbone carries a trained head (mode_b=False reads everything with Mode A)
            mode_b=mode_b and backbone.mode_b_head is not None,
            mode_b_min_options=mode_b_min_options,
        )
        self.executor = readout.Executor(backbone, prefix_cache_bytes=prefix_cache_bytes)
        # elastic depth: an executor per exit served so far (each its own prefix cache and programs),
        # the top probability at which depth="auto" stops at an exit, and each exit's calibration
        # (identity where none was fitted: the full depth's temperatures do not fit a shallower readout)
        self.executors: dict[int, readout.Executor] = {backbone.depth: self.executor}
        self.depth_threshold = float(depth_threshold)
        # depth="auto" as a vertical cascade (elastic.serving): each deeper reading continues the
        # shallower one's residual streams, so no layer runs twice
        self.cascade = elastic_serving.Cascade(backbone, self.executor, prefix_cache_bytes=prefix_cache_bytes)
        self.exit_calibrations = dict(exit_calibrations or {})
        self.calibration = calibration or Calibration.identity(model_name or backbone.name)
        self.model_name = model_name or backbone.name
        self.checkpoint = checkpoint
        self.supports_images = backbone.vision is not None
        # program keys (Executor.batch_programs) this process has run: what `ready` knows compiles nothing
        self.compiled_keys: set[tuple] = set()
        # called with the shape (readout.shapes.signature) of each batch that compiled a program: a
        # server records them so that its next start compiles them before it reports ready
        self.on_compile = None
        self.release = None  # the manifest of the release served (lev_jax.load of a release directory)

    prompt_style = property(lambda self: self.planner.prompt_style)
    layout = property(lambda self: self.planner.layout)
    noul_readout = property(lambda self: self.planner.noul_readout)
    option_averaging = property(lambda self: self.planner.option_averaging)
    platform = property(lambda self: self.executor.platform)
    exact_reruns = property(lambda self: self.executor.exact_reruns)

    # -- public API ----------------------------------------------------------------------------
    def plan(self, state, questions, images: dict | None = None, *, depth=None) -> readout.RequestPlan:
        """Validate, lay out and tokenize a request, checking the token limits (RequestError /
        TokenLimitError) before any device work. `images` (a vision checkpoint): placeholder ->
        image (encoded PNG/JPEG bytes, a file path, or an `images.PreparedImage`), each placeholder
        written where the state shows the image; decoded and preprocessed here (ImageError /
        ImageTooLargeError name the asset). `depth` (elastic depth, `resolve_depth`) travels with the
        plan; an unknown one is a RequestError here, before any work."""
        depth = self.resolve_depth(depth)
        prepared = None
        if images:
            if self.backbone.vision is None:
                raise RequestError(f"model {self.model_name} is text-only and cannot read images")
            if len(images) > domain.MAX_IMAGES_PER_REQUEST:
                raise RequestError(f"{len(images)} images; the limit is {domain.MAX_IMAGES_PER_REQUEST} per request")
            prepared = {alias: self.backbone.vision.prepare(alias, data) for alias, data in images.items()}
        plan = self.planner.plan(state, questions, prepared)
        plan.depth = depth
        return plan

    # -- elastic depth -------------------------------------------------------------------------
    @property
    def depths(self) -> tuple[int, ...]:
        """The depths a request can be served at: the trained exits and the full depth."""
        return self.backbone.exit_depths()

    def resolve_depth(self, depth) -> int | str:
        """A request's depth: None or "full" -> the full depth; "auto" (the confidence cascade over the
        exits, `answer`); an exit's layer count (an int, or its decimal text). RequestError otherwise."""
        full = self.backbone.depth
        if depth is None or depth == "full":
            return full
        if depth == AUTO:
            return AUTO if len(self.depths) > 1 else full
        try:
            d = int(depth)
        except (TypeError, ValueError):
            d = None
        if d is None or isinstance(depth, bool) or d not in self.depths or str(d) != str(depth).strip():
            have = ", ".join(map(str, self.depths))
            raise RequestError(f"depth must be 'auto', 'full' or one of this model's exits ({have}), not {depth!r}")
        return d

    def executor_at(self, depth: int) -> readout.Executor:
        """The executor reading at exit `depth` (built on first use: the backbone truncated there)."""
        if depth not in self.executors:
            self.executors[depth] = readout.Executor(
                self.backbone.at_depth(depth), prefix_cache_bytes=self.executor.prefix_cache_bytes
            )
        return self.executors[depth]

    def calibration_at(self, depth: int, calibration: Calibration | None = None) -> Calibration:
        if depth == self.backbone.depth:
            return calibration or self.calibration
        return self.exit_calibrations.get(depth) or Calibration.identity(self.model_name)

    def count_tokens(self, state, questions, images: dict | None = None) -> dict:
        return self.plan(state, questions, images).token_counts()

    def answer(
        self,
        plans: list[readout.RequestPlan],
        usages: list[readout.Usage],
        *,
        reader=None,
        calibration: Calibration | None = None,
        reference: bool = False,
    ) -> list[dict]:
        """Answers of planned requests, each at its plan's depth (plans of one depth share device
        calls). `reader` (default: the executor's fast path; full-depth plans only) maps
        [(prefix_ids, rows)] to label logits; `reference=True` reads every row with an independent
        forward of the model at its depth; `calibration` defaults to the engine's. Each usage's
        `depths` says, per question, the depth that answered it (models with exits only: without
        exits every answer is the full model's, and the usage stays as it always was)."""
        if programs.guard():  # a long-lived process must not run out of memory-map entries (programs.py)
            self.compiled_keys.clear()  # every program was freed: each recompiles on next use
        out: list = [None] * len(plans)
        groups: dict = {}
        for i, p in enumerate(plans):
            groups.setdefault(depth_of(p, self.backbone.depth), []).append(i)
        for depth, idx in groups.items():
            sub = [plans[i] for i in idx]
            subu = [usages[i] for i in idx]
            if reader is not None and depth != self.backbone.depth:
                raise ValueError("a custom reader reads the full model; these plans ask for another depth")
            kw = {"reader": reader, "calibration": calibration, "reference": reference}
            if depth == AUTO:
                answers = [self.answer_auto(p, u, **kw) for p, u in zip(sub, subu)]
            else:
                answers = self.answer_at(depth, sub, subu, **kw)
            for i, a in zip(idx, answers):
                out[i] = a
        return out

    def answer_at(self, depth: int, plans, usages, *, reader=None, calibration=None, reference=False) -> list[dict]:
        """Answers of plans read at one depth (the full model, or truncated at an exit)."""
        executor = self.executor_at(depth)
        if reference:
            reader = executor.read_reference
        keys = self.programs_at(depth, plans) if reader is None else set()
        cal = self.calibration_at(depth, calibration)
        out = readout.run(plans, reader or executor.read, usages, self.planner, cal)
        if len(self.depths) > 1:
            for plan, usage in zip(plans, usages):
                usage.depths.update({qp.qid: depth for qp in plan.questions})
        images = any(getattr(p.prefix_ids, "images", ()) for p in plans)  # shapes.signature records text only
        recorded = self.on_compile is not None and not images and depth == self.backbone.depth  # full depth: warm-up's
        if recorded and not keys <= self.compiled_keys:
            self.on_compile(shapes.signature([(p.prefix_ids, p.rows) for p in plans]))
        self.compiled_keys |= keys
        return out

    def answer_auto(self, plan, usage, *, reader=None, calibration=None, reference=False) -> dict:
        """depth="auto": every question read at the shallowest exit, and each one whose top
        probability is below `depth_threshold` read again at the next exit, up to the full depth
        (elastic.policy.threshold, the policy `levbench depth` evaluates). A text request of Mode A
        rows up to a prefill chunk (after a schema-first row's question lead) reads through the
        vertical cascade (`elastic.serving`: a deeper reading runs only the layers below the last
        one); others (images, Mode B rows, rows read chunk by chunk, the reference path) through
        each exit's executor, re-running the shallower layers of a question read again."""
        cascade = reader is None and not reference and self.cascade.serves(plan)
        trail = elastic_serving.Trail()
        answers, todo = {}, list(plan.questions)
        for depth in self.depths:
            if not todo:
                break
            sub = dataclasses.replace(plan, questions=todo, depth=depth)
            if cascade:
                read = functools.partial(self.cascade.read, depth=depth, trail=trail)
                got = readout.run([sub], read, [usage], self.planner, self.calibration_at(depth, calibration))[0]
                usage.depths.update({qp.qid: depth for qp in todo})
            else:
                got = self.answer_at(depth, [sub], [usage], reader=reader, calibration=calibration, reference=reference)
                got = got[0]
            last = depth == self.backbone.depth
            keep = [qp for qp in todo if not last and policy.top_probability(got[qp.qid]) < self.depth_threshold]
            answers.update({qp.qid: got[qp.qid] for qp in todo if qp not in keep})
            todo = keep
        if cascade:
            self.compiled_keys |= self.cascade.programs(plan, self.depths)
        return {qp.qid: answers[qp.qid] for qp in plan.questions}

    def auto_programs(self, plan) -> set[tuple]:
        """The program keys a depth="auto" plan may run (every depth it may reach)."""
        if self.cascade.serves(plan):
            return self.cascade.programs(plan, self.depths)
        return set().union(*(self.programs_at(x, [plan]) for x in self.depths))

    def warm(self, signature: dict) -> int:
        """Run a batch of the recorded shape (made-up tokens, `readout.shapes`), compiling what it
        needs; returns how many of its programs were new. ValueError for a shape this model cannot
        run."""
        entries = shapes.synthesize(signature, self.backbone.config.vocab_size)
        keys = self.executor.batch_programs(entries)
        new = len(keys - self.compiled_keys)
        if new:
            try:
                self.executor.read(entries, [readout.Usage() for _ in entries])
            except RequestError as e:  # a recorded shape past this configuration's limits
                raise ValueError(str(e)) from e
        self.compiled_keys |= keys
        return new

    def predict(
        self,
        state,
        questions,
        *,
        images: dict | None = None,
        reference: bool = False,
        calibration: Calibration | None = None,
        depth=None,
    ) -> dict:
        """Answers in the Jev shapes. `images` (a vision checkpoint): placeholder -> image, as in
        `plan`. `reference=True` runs one independent full forward per row (no shared prefix, no
        bucketing): slow, for checking the fast path. `depth` (elastic depth): None / "full", an
        exit's layer count, or "auto" (`resolve_depth`, `answer_auto`)."""
        return self.predict_with_usage(
            state, questions, images=images, reference=reference, calibration=calibration, depth=depth
        )[0]

    def predict_with_usage(
        self,
        state,
        questions,
        *,
        images: dict | None = None,
        reference: bool = False,
        calibration: Calibration | None = None,
        depth=None,
    ) -> tuple[dict, dict]:
        """(answers, usage): usage = {"input_tokens": state prefix once + every question row,
        including round-2 rows of grouped choices, "cached_input_tokens": of those, prefix tokens
        reused from an earlier request with the same state}; with images also "image_tokens" (of
        the input tokens) and "cached_image_tokens" (of those, ones whose features were cached);
        "depths" (a model with exits): per question, the depth that answered it."""
        plan = self.plan(state, questions, images, depth=depth)
        usage = readout.Usage()
        answers = self.answer([plan], [usage], calibration=calibration, reference=reference)[0]
        return answers, usage.as_dict()

    def predict_many(self, requests, *, with_usage: bool = False) -> list:
        """Many requests in one go (a server's micro-batch): every request's rows share the same
        batched device calls. A request is a (state, questions) pair, or (plan, None) with a plan from
        `engine.plan()` (not tokenized again). Returns, per request, its answers ((answers, usage)
        with `with_usage`) or the RequestError that request raised; one bad request spoils no other."""
        out: list = [None] * len(requests)
        plans, where = [], []
        for i, (state, questions) in enumerate(requests):
            try:
                plans.append(state if isinstance(state, readout.RequestPlan) else self.plan(state, questions))
                where.append(i)
            except RequestError as e:
                out[i] = e
        if plans:
            usages = [readout.Usage() for _ in plans]
            for i, answers, usage in zip(where, self.answer(plans, usages), usages):
                out[i] = (answers, usage.as_dict()) if with_usage else answers
        return out

    def programs(self, state, questions, *, depth=None) -> set[tuple]:
        """The device programs (shape-bucket keys) a request's first round needs; a request whose
        keys were all seen before compiles nothing."""
        plan = self.plan(state, questions, depth=depth)
        d = depth_of(plan, self.backbone.depth)
        if d == AUTO:
            return self.auto_programs(plan)
        return tag(d, self.executor_at(d).programs(plan.prefix_ids, plan.rows), self.backbone.depth)

    def programs_at(self, depth: int, plans: list[readout.RequestPlan]) -> set[tuple]:
        """The program keys reading `plans` together at one depth (tagged with the depth below the full one)."""
        keys = self.executor_at(depth).batch_programs([(p.prefix_ids, p.rows) for p in plans])
        return tag(depth, keys, self.backbone.depth)

    def batch_programs(self, plans: list[readout.RequestPlan]) -> set[tuple]:
        """The device programs (shape-bucket keys) answering these planned requests together (one
        micro-batch) runs; a depth="auto" plan counts every depth it may reach."""
        groups: dict = {}
        for p in plans:
            groups.setdefault(depth_of(p, self.backbone.depth), []).append(p)
        keys: set = set()
        for d, ps in groups.items():
            keys |= set().union(*map(self.auto_programs, ps)) if d == AUTO else self.programs_at(d, ps)
        return keys

    def ready(self, requests) -> bool:
        """Would answering these requests together (a micro-batch of (state, questions) or (plan,
        None) pairs) run only programs this process has already run, i.e. compile nothing? A server
        keeps requests that compile out of the way of those that do not."""
        plans = [s if isinstance(s, readout.RequestPlan) else self.plan(s, q) for s, q in requests]
        return self.batch_programs(plans) <= self.compiled_keys

    @property
    def compiled_programs(self) -> int:
        """Device programs compiled so far (prefill chunks + row readouts)."""
        return logits_lib.compiled_programs() + compiled_programs() + elastic_serving.compiled_programs()

    def info(self) -> dict:
        return {
            "model": self.model_name,
            "checkpoint": self.checkpoint,
            "prompt_style": self.prompt_style,
            "layout": self.layout,
            "calibrated": not self.calibration.is_identity,
            # a served release: its name, step and held-out metrics (the card's table)
            "release": None
            if self.release is None
            else {
                "name": self.release["name"],
                "step": self.release["step"],
                "base": self.release["base"]["name"],
                "metrics": [
                    {"task": t["task"], "n": t["n"], **{k: t["metrics"].get(k) for k in ("accuracy", "ece")}}
                    for t in self.release.get("metrics") or []
                ],
                # Mode A vs Mode B on the same held-out choices (`train release --agree`)
                "mode_b_agreement": [
                    {k: t.get(k) for k in ("task", "questions", "agreement", "accuracy_mode_a", "accuracy_mode_b")}
                    for t in ((self.release.get("mode_b") or {}).get("agreement") or {}).get("tasks", [])
                ],
            },
            "mode_b": (
                {"marker": self.planner.marker[0], "min_options": self.planner.mode_b_min_options}
                if self.planner.marker
                else None
            ),
            "depth": {
                "layers": self.backbone.depth,
                "exits": list(self.depths),
                "auto_threshold": self.depth_threshold if len(self.depths) > 1 else None,
                # held-out quality per exit, where the release measured it
                "quality": None if self.release is None else (self.release.get("exits") or {}).get("metrics"),
                "calibrated": sorted(self.exit_calibrations),
            },
            "supports_images": self.supports_images,
            "vision": None if self.backbone.vision is None else self.backbone.vision.info(),
            "noul_readout": self.noul_readout,
            "option_averaging": self.option_averaging,
            "option_cap": domain.CHOICE_OPTIONS[1],
            "label_codes": self.planner.group_size,
            "dtype": self.backbone.dtype,
            "platform": self.platform,
            "compilation_cache": runtime.compilation_cache_dir(),
            "row_tokens_per_call": buckets.row_tokens_per_call(self.platform),
            "compiled_programs": self.compiled_programs,
            # of this process's executables: compiled here, loaded from the store (programs.py); calls
            # a warm-up or background compile only built (programs.compile_only)
            "programs": programs.stats(),
            # the shapes every device call takes (readout.execute): prefixes and long rows in chunks
            # into caches of these capacities, short rows in slabs (lanes x tokens), tails
            "buckets": {
                "chunk": buckets.PREFILL_CHUNK,
                "first_chunks": buckets.FIRST_CHUNKS,
                "capacity": buckets.CAPACITY,
                "slabs": buckets.slab_shapes(self.platform),
                "tail": buckets.TAIL,
                "codes": buckets.READ_CODES,
            },
        }


def load_backbone(path_or_hub_id=None, dtype: str = "auto") -> Backbone:
    """`lev_jax.backbone.load_backbone`, and a training run directory (`python -m train --out
    RUN_DIR`): its newest readable checkpoint with the adapter merged. `dtype`: as in `load`."""
    from lev_jax.training import release, run

    dtype = runtime.resolve_dtype(dtype)

    if path_or_hub_id is not None and run.is_run(path_or_hub_id):
        return run.load_run(path_or_hub_id, dtype)[0]
    if path_or_hub_id is not None and release.is_release(path_or_hub_id):
        return release.load_release(path_or_hub_id, dtype)[0]
    if path_or_hub_id is not None and _is_adapter(path_or_hub_id):
        return release.load_peft(path_or_hub_id, dtype=dtype)
    return backbone_lib.load_backbone(path_or_hub_id, dtype=dtype)


def _is_adapter(path) -> bool:
    """A peft adapter directory (not a full checkpoint that happens to hold an adapter too)."""
    from lev_jax.loaders import peft

    return peft.is_peft_dir(path) and not (Path(path) / "config.json").is_file()


def load(
    model=None,
    checkpoint=None,
    prompt_style: str | None = None,
    dtype: str = "auto",
    *,
    calibration="auto",
    noul_readout: str | None = None,
    image_pixel_budget: int | None = None,
    base_only: bool = False,
    **engine_kwargs,
) -> Engine:
    """An engine over `model` (None = the embedded default, a checkpoint directory, a .gguf file, a
    hub id, a training run directory, a release directory (`python -m train release`), a peft
    LoRA adapter directory on the base its adapter_config names, or an already loaded Backbone). `calibration`: "auto"
    (calibration.json beside the weights or in the run, else the profile shipped for the backbone,
    else none), a path, a Calibration, or None. `dtype`: "auto" (bfloat16 weights with fp32
    accumulation where the device multiplies bf16 natively, else float32; `lev_jax.runtime`),
    "float32" or "bfloat16". Compiled programs persist on disk across processes (the per-user
    compilation cache, `lev_jax.runtime`; LEV_JAX_CACHE moves it, empty turns it off).

    A run directory serves its newest checkpoint (adapter merged) with the prompt settings it was
    trained with (prompt style, layout, noul readout, option averaging: the served rows are the
    trained rows); arguments given here override them. `image_pixel_budget` (a vision checkpoint):
    each image is resized to at most this many pixels (default `domain.IMAGE_PIXEL_BUDGET`).

    With no model the default is the fine-tuned release shipped inside the package (`DEFAULT_RELEASE`:
    a LoRA adapter and calibration for the embedded SmolLM2, no download); `base_only=True` serves the
    raw embedded model instead (with its zero-shot calibration profile)."""
    if checkpoint is not None:
        raise ValueError("checkpoint= is not supported; pass a training run directory as the model")
    runtime.enable_compilation_cache()
    dtype = runtime.resolve_dtype(dtype)
    settings = {"prompt_style": "chat", "noul_readout": domain.BINARY}
    run_cal = served = manifest = None
    if model is None and not base_only and (DEFAULT_RELEASE / "lev_release.json").is_file():
        model = DEFAULT_RELEASE
    if isinstance(model, Backbone):
        bb = model
    else:
        from lev_jax.training import release, run

        if model is not None and run.is_run(model):
            bb, run_cal, meta = run.load_run(model, dtype)
            settings.update(meta["engine"])
            served = f"{model}@step {meta['step']}"
        elif model is not None and release.is_release(model):
            bb, run_cal, manifest = release.load_release(model, dtype)
            settings.update(manifest["engine"])
            served = f"release {manifest['name']}" + (" (the shipped default)" if model == DEFAULT_RELEASE else "")
        elif model is not None and _is_adapter(model):
            bb = release.load_peft(model, dtype=dtype)
            served = f"peft adapter {model}"
        else:
            bb = backbone_lib.load_backbone(model, dtype=dtype)
    if image_pixel_budget is not None:
        if bb.vision is None:
            raise ValueError(f"image_pixel_budget applies to vision checkpoints; {bb.name} is text-only")
        bb.vision.set_pixel_budget(image_pixel_budget)
    if prompt_style is not None:
        settings["prompt_style"] = prompt_style
    if noul_readout is not None:
        settings["noul_readout"] = noul_readout
    settings.update(engine_kwargs)
    if calibration == "auto" and run_cal is not None:
        cal = run_cal
    else:
        cal = _resolve_calibration(calibration, model, bb)
    engine = Engine(bb, calibration=cal, model_name=bb.name, checkpoint=served, **settings)
    engine.release = manifest
    return engine


PROFILES = Path(__file__).parent / "profiles"
# the fine-tuned default (`python -m train release` of the smollm2 preset; EVAL.md says how it was made)
DEFAULT_RELEASE = Path(__file__).parent / "default"


def _resolve_calibration(calibration, model, bb) -> Calibration:
    if isinstance(calibration, Calibration):
        return calibration
    if calibration is None:
        return Calibration.identity(bb.name)
    if calibration != "auto":
        return Calibration.load(calibration)
    candidates = []
    if isinstance(model, (str, Path)) and Path(model).is_dir():
        candidates.append(Path(model) / "calibration.json")
    if model is None or isinstance(model, Backbone):
        candidates.append(PROFILES / bb.name / "calibration.json")
    for c in candidates:
        if c.is_file():
            return Calibration.load(c)
    return Calibration.identity(bb.name)
