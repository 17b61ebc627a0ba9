"""The device programs a model is served by, counted without compiling any: the warm-up grid's
(singles, large choices, long rows, micro-batches), and which of them a new user's first requests,
jevcompat's option ladder and the load test's fresh requests need.

    python -m scripts.program_set [--model PATH] [--base-only] [--json OUT]

Each program is a key (readout.execute): ("prefill", 0, first chunk), ("chunk", capacity, chunk),
("slab", capacity, lanes, lane tokens, shared | stacked), ("tail", capacity, tail tokens, codes),
("chunk-marked", ...), ("vision", grid). Planning only: no weights are run, nothing compiles.

Next to the counts, the padding the fixed shapes cost (`Executor.batch_work`): per scenario, the
device calls it makes, the tokens of the requests in them and the tokens they compute (a prefix
counted as computed, as on its first sight).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

LADDER = (2, 26, 64, 128, 255)  # jevcompat's choice.options sizes
SDK_STATE_WORDS = 380  # ~2 KB of the grid's words


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model or release (default: the shipped default)")
    ap.add_argument("--base-only", action="store_true", help="the embedded base model, no release")
    ap.add_argument("--json", default=None, help="write the counts and keys here")
    args = ap.parse_args(argv)

    import lev_jax
    from lev_jax.bench import loadtest
    from lev_jax.server import warmup

    engine = lev_jax.load(args.model, base_only=args.base_only) if args.model or args.base_only else lev_jax.load()

    def keys_of(batch):
        return engine.batch_programs([engine.plan(s, q) for s, q in batch])

    padding = {}

    def measure(name, batch):
        plans = [engine.plan(s, q) for s, q in batch]
        work = engine.executor.batch_work([(p.prefix_ids, p.rows) for p in plans])
        real, computed = sum(w[1] for w in work), sum(w[2] for w in work)
        padding[name] = {"calls": len(work), "tokens": real, "computed": computed, "padding": 1 - real / computed}

    w = warmup.Warmup(engine)
    grid = w.plan_programs(
        warmup.default_batches(engine), warmup.long_row_shapes(engine) + warmup.prefill_shapes(engine)
    )
    state = " ".join(warmup.WORDS[i % len(warmup.WORDS)] for i in range(SDK_STATE_WORDS))
    sdk = keys_of([(state, warmup.MIXES[-1])])
    measure("sdk_request", [(state, warmup.MIXES[-1])])
    ladder = set()
    for n in LADDER:
        q = {
            "type": "choice",
            "instructions": "Which queue should this ticket go to?",
            "criteria": {f"Queue {i:03d}": f"Tickets routed to queue {i}" for i in range(n)},
        }
        ladder |= keys_of([("My invoice shows a charge I do not recognise", {"q": q})])
        measure(f"ladder_{n}", [("My invoice shows a charge I do not recognise", {"q": q})])
    load = set()
    for half in loadtest.HALVES:
        reqs = loadtest.fresh_payloads(half, len(loadtest.TICKETS), 1, iter(range(100)))
        batch = [(p["state"], p["questions"]) for p in reqs]
        load |= keys_of(batch) | set().union(*(keys_of([r]) for r in batch))
        measure(f"load_test_{half}_alone", batch[:1])
        measure(f"load_test_{half}_x{len(batch)}", batch)
    everything = grid | sdk | ladder | load
    report = {
        "model": engine.info().get("model") or engine.backbone.name,
        "grid": len(grid),
        "grid_by_kind": dict(collections.Counter(k[0] for k in grid)),
        "sdk_request": len(sdk),
        "sdk_request_outside_grid": sorted(map(str, sdk - grid)),
        "ladder": len(ladder),
        "ladder_outside_grid": sorted(map(str, ladder - grid)),
        "load_test": len(load),
        "load_test_outside_grid": sorted(map(str, load - grid)),
        "all": len(everything),
        "keys": sorted(map(str, everything)),
        "padding": padding,
    }
    print(f"model {report['model']}")
    print(f"warm-up grid: {report['grid']} programs {report['grid_by_kind']}")
    for name in ("sdk_request", "ladder", "load_test"):
        outside = report[f"{name}_outside_grid"]
        print(f"{name}: {report[name]} programs, {len(outside)} outside the grid {outside}")
    print(f"all of them: {report['all']}")
    for k in report["keys"]:
        print(f"  {k}")
    print("| scenario | device calls | request tokens | computed tokens | padding |")
    print("|---|---:|---:|---:|---:|")
    for name, p in padding.items():
        print(f"| {name} | {p['calls']} | {p['tokens']} | {p['computed']} | {p['padding']:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
