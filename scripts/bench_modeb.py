"""Mode B vs Mode A for one large choice: tokens and warm latency, same run, same model.

    python -m scripts.bench_modeb [--ns 77,150,255] [--repeats 3] [--dtype float32] [--markdown]

The embedded SmolLM2-135M with a (random) Mode B head — the cost of a readout does not depend on
what the head learned — answers one choice question of N options ("Queue 001": "Tickets routed to
queue 1", ...) about the ~2 KB ticket of scripts/bench_options, once read by Mode A (one row with a
label code per option; the engine's prompt settings decide whether both presentation orders are
read) and once by Mode B (one marked row). Per mode: the rows and their tokens (engine.plan), the
first call (compiles) and the median of --repeats warm calls (the state prefix then comes from the
cross-request cache: a warm call processes the question's rows only). Prints Mode B / Mode A ratios.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="77,150,255")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)

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
