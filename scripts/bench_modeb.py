"""Mode B vs Mode A for one large choice: tokens and warm latency, same run, same model.

    python -m scripts.bench_modeb [--ns 77,150,255] [--repeats 3] [--dtype float32] [--markdown]
    python -m scripts.bench_modeb --per-state out/evalsets/banking77-test.json out/evalsets/clinc150-test.json
    python -m scripts.bench_modeb --stream out/evalsets/clinc150-test.json --items 20

The embedded SmolLM2-135M with a (random) Mode B head — the cost of a readout does not depend on
what the head learned — answers one choice question of N options ("Queue 001": "Tickets routed to
queue 1", ...) about the ~2 KB ticket of scripts/bench_options, once read by Mode A (one row with a
label code per option; the engine's prompt settings decide whether both presentation orders are
read) and once by Mode B (one marked row). Per mode: the rows and their tokens (engine.plan), the
first call (compiles) and the median of --repeats warm calls (the state prefix then comes from the
cross-request cache: a warm call processes the question's rows only). Prints Mode B / Mode A ratios.

`--per-state EVALSET ...`: for a fixed taxonomy asked of many states (the shipped default's use), the
tokens a server computes once per question (the prefix every state's row shares: the prefix cache)
and the tokens each state adds, read by Mode A and by Mode B with the shipped default's prompt
settings, over the first --items items of each levbench eval set (token counts only: no model runs).

`--stream EVALSET ...`: the same served, one request per state, with the shipped default's prompt
settings (schema first): Mode A, Mode B (its options block and its markers' keys kept in the prefix
cache after the first request), and Mode B with the prefix cache off (every request computes the whole
marked row: what the server did before it kept them). Per mode: median warm ms a request and the
tokens a request computes (input minus cached), over --items states after one warm-up request.
"""

from __future__ import annotations

import argparse
import statistics
import time

from scripts.bench_options import STATE


def question(n: int) -> dict:
    opts = {f"Queue {i:03d}": f"Tickets routed to queue {i}" for i in range(1, n + 1)}
    return {"q": {"type": "choice", "instructions": "Which queue should handle this ticket?", "criteria": opts}}


def measure(engine, n: int, repeats: int) -> dict:
    qs = question(n)
    plan = engine.plan(STATE, qs)
    t0 = time.perf_counter()
    engine.predict(STATE, qs)
    first = time.perf_counter() - t0
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.predict(STATE, qs)
        warm.append(time.perf_counter() - t0)
    return {
        "route": plan.questions[0].route,
        "rows": len(plan.rows),
        "row_tokens": sum(len(r.tokens) for r in plan.rows),
        "first_ms": 1000 * first,
        "warm_ms": 1000 * statistics.median(warm),
    }


def common_length(seqs: list[list[int]]) -> int:
    n = min(len(q) for q in seqs)
    for k in range(n):
        if len({q[k] for q in seqs}) > 1:
            return k
    return n


def per_state(paths: list[str], items: int) -> int:
    """Shared and own tokens per state of Mode A and Mode B rows (the shipped default's settings)."""
    import json

    from lev_jax.bench.evalset import EvalSet
    from lev_jax.engine import DEFAULT_RELEASE, load_backbone
    from lev_jax.readout import Planner

    manifest = json.loads((DEFAULT_RELEASE / "lev_release.json").read_text())
    settings = {k: manifest["engine"][k] for k in ("prompt_style", "layout", "option_averaging")}
    tok = load_backbone().tokenizer
    planners = {
        "A": Planner(tok, mode_b=False, **settings),
        "B": Planner(tok, mode_b=True, mode_b_min_options=2, **settings),
    }
    print(f"settings: {settings}")
    print(
        "\n| task | options | Mode A: shared / own tokens per state "
        "| Mode B: shared / own tokens per state | B/A own tokens |"
    )
    print("|---|---:|---:|---:|---:|")
    for path in paths:
        es = EvalSet.load(path)
        counts = {}
        for mode, planner in planners.items():
            seqs = []
            for item in es.items[:items]:
                [(qid, q)] = es.questions_for(item).items()
                plan = planner.plan(item["state"], {qid: q})
                [row] = plan.rows
                seqs.append(list(plan.prefix_ids) + row.tokens)
            shared = common_length(seqs)
            counts[mode] = (shared, sum(len(q) - shared for q in seqs) / len(seqs))
        (sa, oa), (sb, ob) = counts["A"], counts["B"]
        n = len(next(iter(es.questions.values()))["criteria"])
        print(f"| {es.task} | {n} | {sa} / {oa:.1f} | {sb} / {ob:.1f} | {ob / oa:.2f}x |")
    return 0


def stream(paths: list[str], items: int, dtype: str) -> int:
    """Warm per-request latency and computed tokens of a stream of states asked one large choice."""
    import json

    import lev_jax
    from lev_jax.bench.evalset import EvalSet
    from lev_jax.engine import DEFAULT_RELEASE, Engine
    from lev_jax.readout import modeb

    manifest = json.loads((DEFAULT_RELEASE / "lev_release.json").read_text())
    kw = {k: manifest["engine"][k] for k in ("prompt_style", "layout", "option_averaging")}
    bb = lev_jax.load(base_only=True, dtype=dtype).backbone
    bb.mode_b_head = modeb.init_head(bb.config.hidden_size, seed=0)  # cost does not depend on what it learned
    engines = {
        "Mode A": lambda: Engine(bb, mode_b=False, **kw),
        "Mode B": lambda: Engine(bb, mode_b_min_options=2, **kw),
        "Mode B, no prefix cache": lambda: Engine(bb, mode_b_min_options=2, prefix_cache_bytes=0, **kw),
    }
    print(f"settings: {kw}, dtype {dtype}")
    print(
        "\n| task | options | mode | warm ms / request (median) | computed tokens / request | cached tokens / request |"
    )
    print("|---|---:|---|---:|---:|---:|")
    for path in paths:
        es = EvalSet.load(path)
        reqs = [(item["state"], es.questions_for(item)) for item in es.items[: items + 1]]
        n = len(next(iter(es.questions.values()))["criteria"])
        base_ms = None
        for name, make in engines.items():
            engine = make()
            engine.predict_with_usage(*reqs[0])  # compiles and fills the cache
            ms, computed, cached = [], [], []
            for state, qs in reqs[1:]:
                t0 = time.perf_counter()
                _, usage = engine.predict_with_usage(state, qs)
                ms.append(1000 * (time.perf_counter() - t0))
                computed.append(usage["input_tokens"] - usage["cached_input_tokens"])
                cached.append(usage["cached_input_tokens"])
            med = statistics.median(ms)
            base_ms = base_ms or med
            print(
                f"| {es.task} | {n} | {name} | {med:.0f} ({med / base_ms:.2f}x Mode A) | "
                f"{statistics.mean(computed):.1f} | {statistics.mean(cached):.1f} |",
                flush=True,
            )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="77,150,255")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--per-state", nargs="+", metavar="EVALSET", help="token counts per state (no model runs)")
    ap.add_argument("--stream", nargs="+", metavar="EVALSET", help="served warm latency per state")
    ap.add_argument("--items", type=int, default=50)
    args = ap.parse_args(argv)
    if args.per_state:
        return per_state(args.per_state, args.items)
    if args.stream:
        return stream(args.stream, args.items, args.dtype)

    import lev_jax
    from lev_jax.engine import Engine
    from lev_jax.readout import modeb

    base = lev_jax.load(base_only=True, dtype=args.dtype)  # the raw embedded model and its prompt settings
    bb = base.backbone
    bb.mode_b_head = modeb.init_head(bb.config.hidden_size, seed=0)
    kw = dict(prompt_style=base.prompt_style, layout=base.layout, option_averaging=base.option_averaging)
    mode_a, mode_b = Engine(bb, mode_b=False, **kw), Engine(bb, mode_b_min_options=2, **kw)
    rows = []
    for n in (int(x) for x in args.ns.split(",")):
        a, b = measure(mode_a, n, args.repeats), measure(mode_b, n, args.repeats)
        rows.append((n, a, b))
        print(
            f"N={n}: Mode A {a['rows']} row(s) {a['row_tokens']} tokens {a['warm_ms']:.0f} ms warm "
            f"({a['first_ms']:.0f} first) | Mode B {b['rows']} row {b['row_tokens']} tokens {b['warm_ms']:.0f} ms "
            f"warm ({b['first_ms']:.0f} first) | B/A tokens {b['row_tokens'] / a['row_tokens']:.2f}, "
            f"warm {b['warm_ms'] / a['warm_ms']:.2f}",
            flush=True,
        )
    if args.markdown:
        print(
            "\n| options | Mode A rows / tokens | Mode A warm ms | Mode B rows / tokens | Mode B warm ms "
            "| B/A tokens | B/A warm |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n, a, b in rows:
            print(
                f"| {n} | {a['rows']} / {a['row_tokens']} | {a['warm_ms']:.0f} | {b['rows']} / {b['row_tokens']} | "
                f"{b['warm_ms']:.0f} | {b['row_tokens'] / a['row_tokens']:.2f} | {b['warm_ms'] / a['warm_ms']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
