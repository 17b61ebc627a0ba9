"""``python -m scripts.levbench`` (or ``levbench``): export | eval | fit | sweep | compare | agree | depth.

    levbench export --out evalsets                       # eval-data exports (test + calibration)
    levbench export --out evalsets --pipeline DATA --split calibration
    levbench eval evalsets/banking77-test.json:limit=150 --out results/        # embedded model, in-process
    levbench eval evalsets/ --url http://127.0.0.1:8000 --concurrency 8 --out results/
    levbench fit evalsets/banking77-train.json:limit=80 ... --rows-out rows.jsonl   # -> shipped profile
    levbench sweep --out results/sweep [--url URL]
    levbench compare results/plain results/rlcd --out results/plain-vs-rlcd   # paired bootstrap B - A
    levbench agree evalsets/banking77-test.json:limit=200 --model RELEASE --out results/agree   # Mode A vs B
    levbench depth evalsets/banking77-test.json:limit=200 --model RELEASE --out results/depth   # elastic depth

A set argument is ``PATH[:limit=N][:max_options=K][:split=NAME]``; a directory means every
eval-set file in it. Samples are fixed-seed shuffles (``--seed``), never head slices.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lev_jax.bench import export as export_lib
from lev_jax.bench import harness
from lev_jax.bench import sweep as sweep_lib


def _expand_sets(args: Sequence[str], limit: int | None) -> list[harness.SetSpec]:
    specs = []
    for a in args:
        spec = harness.SetSpec.parse(a, limit)
        if spec.path.is_dir():
            for f in sorted(spec.path.glob("*.json")):
                try:
                    doc = json.loads(f.read_text(encoding="utf-8"))
                except (OSError, json.JSONDecodeError):
                    continue
                if isinstance(doc, dict) and "questions" in doc and "items" in doc:
                    specs.append(harness.SetSpec(f, spec.limit, spec.max_options, spec.split))
        elif spec.path.is_file():
            specs.append(spec)
        else:
            raise SystemExit(f"no eval set at {spec.path}")
    if not specs:
        raise SystemExit("no eval-set files given")
    return specs


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="in-process: a checkpoint dir, .gguf, training run dir or hub id (default: the embedded model)"
    )
    p.add_argument("--prompt-style", default=None, help="chat (default) or plain; a run directory: as trained")
    p.add_argument("--noul-readout", choices=("binary", "rating"), default=None)
    p.add_argument(
        "--base-only", action="store_true", help="with no --model: the raw embedded model, not the shipped release"
    )


def _load_engine(args, calibration):
    import lev_jax

    return lev_jax.load(
        model=args.model,
        prompt_style=args.prompt_style,
        calibration=calibration,
        noul_readout=args.noul_readout,
        base_only=args.base_only,
    )


def _calibration_arg(value: str):
    return None if value in ("none", "off") else value


def cmd_export(args) -> int:
    if args.pipeline:
        counts = export_lib.export_pipeline(args.pipeline, args.out, args.split)
    else:
        counts = export_lib.export_eval_data(args.out, args.eval_data, args.which, args.task or None)
    for task, n in counts.items():
        print(f"{task}: {n} items")
    print(f"wrote {len(counts)} eval set(s) to {args.out}")
    return 0


def _client(args, *, baseline: bool):
    from lev_jax.bench.clients import HttpClient, InProcessClient

    if args.url:
        return HttpClient(args.url, model=args.served_model, api_key=args.api_key, timeout=args.timeout)
    engine = _load_engine(args, _calibration_arg(args.calibration))
    base = None
    if baseline and not engine.calibration.is_identity:
        from lev_jax.calibrate import Calibration

        base = Calibration.identity(engine.model_name)
    return InProcessClient(engine, baseline=base)


def cmd_eval(args) -> int:
    specs = _expand_sets(args.sets, args.limit)
    client = _client(args, baseline=args.baseline)
    results = harness.evaluate(
        client,
        specs,
        args.out,
        seed=args.seed,
        concurrency=args.concurrency,
        progress=not args.no_progress,
        n_bins=args.bins,
    )
    print((Path(args.out) / "summary.md").read_text(encoding="utf-8"))
    return 1 if any(r["n_errors"] for r in results) and args.strict else 0


def cmd_fit(args) -> int:
    from lev_jax import calibrate

    argv = ["python -m scripts.levbench", *map(shlex.quote, args.argv)]
    # with no --model the fit is the raw embedded model's profile (lev_jax/profiles), never the release's
    args.base_only = args.base_only or args.model is None
    rows, splits, report = [], [], {}
    engine = None
    if args.sets:
        engine = _load_engine(args, None)
        specs = _expand_sets(args.sets, args.limit)
        rows, splits, report = harness.collect_rows(
            engine, specs, seed=args.seed, progress=not args.no_progress, eval_data=args.eval_data
        )
        if args.rows_out:
            harness.save_rows(rows, args.rows_out)
            print(f"wrote {len(rows)} calibration rows to {args.rows_out}")
    for path in args.rows or []:
        got = harness.load_rows(path)
        rows += got
        splits += sorted({r.split for r in got if r.split})
    if not rows:
        raise SystemExit("no calibration rows (give calibration sets, or --rows FILE)")
    model_id = args.model_id or (engine.model_name if engine is not None else None)
    if model_id is None:
        import lev_jax

        model_id = lev_jax.load_backbone(args.model).name
    cal = calibrate.fit(rows, splits=list(dict.fromkeys(splits)), model_id=model_id, min_rows=args.min_rows)
    doc = cal.to_dict()
    doc["fitted_on"]["sets"] = report or None
    doc["fitted_on"]["seed"] = args.seed
    doc["fitted_on"]["command"] = " ".join(argv)
    cal = calibrate.Calibration(doc)
    save = args.save
    if save is None and args.model is None:
        from lev_jax.engine import PROFILES

        save = str(PROFILES / model_id)
    elif save is None and args.model is not None and Path(args.model).is_dir():
        save = args.model
    if save and save != "-":
        path = cal.save(save)
        report_path = path.parent / calibrate.REPORT_FILE
        report_path.write_text(harness.fit_report_markdown(cal, report, argv), encoding="utf-8")
        print(f"wrote {path} and {report_path}")
    print(cal.report_markdown())
    return 0


def cmd_sweep(args) -> int:
    from lev_jax.bench.evalset import EvalSet

    client = _client(args, baseline=False)
    if args.set:
        state, questions = sweep_lib.from_evalset(EvalSet.load(args.set))
    else:
        state, questions = sweep_lib.DEFAULT_STATE, sweep_lib.default_questions()
    ns = [int(x) for x in args.ns.split(",")]
    res = sweep_lib.run_sweep(client, state, questions, ns, args.repeats, progress=not args.no_progress)
    info = client.describe()
    files = sweep_lib.write_sweep(res, args.out, info)
    print(sweep_lib.sweep_markdown(res, info))
    print(f"wrote {', '.join(files.values())}")
    return 0


def cmd_compare(args) -> int:
    from lev_jax.bench import compare as compare_lib

    res = compare_lib.compare(
        compare_lib.load_results(args.a), compare_lib.load_results(args.b), resamples=args.resamples, seed=args.seed
    )
    text = compare_lib.markdown(res, args.a, args.b, args.resamples)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text, encoding="utf-8")
        doc = {"a": args.a, "b": args.b, "resamples": args.resamples, "seed": args.seed, "results": res}
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
        print(f"wrote {out.with_suffix('.md')}, {out.with_suffix('.json')}")
    return 0


def cmd_agree(args) -> int:
    from lev_jax.bench import agree

    specs = _expand_sets(args.sets, args.limit)
    engine = _load_engine(args, _calibration_arg(args.calibration))
    try:
        _, passed = agree.run(engine, [s.load(args.seed) for s in specs], args.out, min_agreement=args.min_agreement)
    except ValueError as e:  # a model without a head
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((Path(args.out) / "agreement.md").read_text(encoding="utf-8"))
    return 0 if passed else 1


def cmd_depth(args) -> int:
    from lev_jax.bench import depth

    specs = _expand_sets(args.sets, args.limit)
    engine = _load_engine(args, _calibration_arg(args.calibration))
    if args.threshold is not None:
        engine.depth_threshold = args.threshold
    try:
        depth.run(
            engine,
            [s.load(args.seed) for s in specs],
            args.out,
            timing_items=args.timing_items,
            folds=args.folds,
            seed=args.seed,
        )
    except ValueError as e:  # a model without exits; too few states for the folds
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((Path(args.out) / "depth.md").read_text(encoding="utf-8"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="levbench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("export", help="write eval-set files")
    e.add_argument("--out", required=True)
    e.add_argument("--eval-data", help="eval-data folder (default $LEV_EVAL_DATA or <repo>/../shared/eval-data)")
    e.add_argument("--which", choices=("test", "calibration", "all"), default="all")
    e.add_argument("--task", action="append", help=f"only these ({', '.join(export_lib.EXPORTS)})")
    e.add_argument("--pipeline", metavar="DATA", help="a `python -m data build --out DATA` folder instead")
    e.add_argument("--split", default="calibration", help="with --pipeline: the split to export")
    e.set_defaults(fn=cmd_export)

    def common(p):
        p.add_argument("--seed", type=int, default=0, help="sampling seed (fixed-seed shuffle)")
        p.add_argument("--limit", type=int, default=None, help="items per set (default all; PATH:limit=N overrides)")
        p.add_argument("--no-progress", action="store_true")

    v = sub.add_parser("eval", help="run eval sets against a URL or in-process; JSON + Markdown + PNG per task")
    v.add_argument("sets", nargs="+")
    v.add_argument("--out", required=True)
    v.add_argument("--url", help="a Jev-compatible server (base URL or .../v1/systemone); default: in-process")
    v.add_argument("--served-model", default="jev-latest", help="the request's model field (with --url)")
    v.add_argument("--api-key", help="bearer token (default $LEV_API_KEY)")
    v.add_argument("--timeout", type=float, default=300.0)
    v.add_argument("--concurrency", type=int, default=4, help="requests in flight (URL; in-process is serial)")
    v.add_argument("--calibration", default="auto", help="in-process: auto | none | PATH")
    v.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="in-process: do not also score the uncalibrated readout of the same logits",
    )
    v.add_argument("--bins", type=int, default=10)
    v.add_argument("--strict", action="store_true", help="exit 1 if any item failed")
    _engine_args(v)
    common(v)
    v.set_defaults(fn=cmd_eval)

    f = sub.add_parser("fit", help="fit temperatures on calibration sets (in-process) and save the profile")
    f.add_argument("sets", nargs="*")
    f.add_argument("--rows", action="append", help="calibration rows saved by --rows-out (no model run)")
    f.add_argument("--rows-out", help="save the rows read (JSON lines) for refitting without the model")
    f.add_argument(
        "--save",
        help="profile directory (default: lev_jax/profiles/<model> for the embedded model, "
        "the checkpoint dir for a local one; '-' = do not save)",
    )
    f.add_argument("--model-id", help="the model id recorded in the profile (default: the engine's)")
    f.add_argument("--min-rows", type=int, default=50)
    f.add_argument("--eval-data", help="eval-data folder for the contamination check")
    _engine_args(f)
    common(f)
    f.set_defaults(fn=cmd_fit)

    s = sub.add_parser("sweep", help="N questions in one call vs N calls, N in 1..32: latency and tokens")
    s.add_argument("--out", required=True)
    s.add_argument("--url")
    s.add_argument("--served-model", default="jev-latest")
    s.add_argument("--api-key")
    s.add_argument("--timeout", type=float, default=300.0)
    s.add_argument("--calibration", default="auto")
    s.add_argument("--set", help="take the state (first item) and questions from this eval set")
    s.add_argument("--ns", default=",".join(map(str, sweep_lib.NS)))
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--no-progress", action="store_true")
    _engine_args(s)
    s.set_defaults(fn=cmd_sweep)

    c = sub.add_parser("compare", help="two eval results on the same items: B - A per metric, paired bootstrap")
    c.add_argument("a", help="a `levbench eval --out` directory (or one task JSON): the baseline")
    c.add_argument("b", help="the same for the model compared against it")
    c.add_argument("--out", help="write OUT.md and OUT.json")
    c.add_argument("--resamples", type=int, default=2000)
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(fn=cmd_compare)

    g = sub.add_parser("agree", help="Mode A vs Mode B on the choices both can read: agreement gate (in-process)")
    g.add_argument("sets", nargs="+")
    g.add_argument("--out", required=True)
    g.add_argument("--calibration", default="auto", help="auto | none | PATH")
    g.add_argument("--min-agreement", type=float, default=0.8, help="exit 1 below this argmax agreement")
    _engine_args(g)
    common(g)
    g.set_defaults(fn=cmd_agree)

    d = sub.add_parser("depth", help="elastic depth: every exit and depth policy, with verdicts (in-process)")
    d.add_argument("sets", nargs="+")
    d.add_argument("--out", required=True)
    d.add_argument("--calibration", default="auto", help="auto | none | PATH")
    d.add_argument("--folds", type=int, default=5, help="the controller's out-of-fold folds (by state)")
    d.add_argument("--timing-items", type=int, default=30, help="items timed per depth (0: no timing)")
    d.add_argument("--threshold", type=float, default=None, help="depth=auto's threshold for the timing")
    _engine_args(d)
    common(d)
    d.set_defaults(fn=cmd_depth)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    t0 = time.perf_counter()
    from lev_jax.bench.compare import CompareError
    from lev_jax.bench.evalset import EvalSetError

    try:
        return args.fn(args)
    except (harness.FitRefused, EvalSetError, CompareError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        print(
            f"[levbench {args.cmd}: {time.perf_counter() - t0:.1f} s wall, {time.process_time():.1f} s cpu]",
            file=sys.stderr,
        )
