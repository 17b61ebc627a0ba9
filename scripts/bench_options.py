"""Latency per option count: one choice question with N options against a plain prefill, same run.

    python -m scripts.bench_options [--ns 2,8,32,64,128,255] [--dtypes float32,bfloat16] [--repeats 3]
                                    [--model PATH] [--json OUT] [--markdown]

A ~2 KB support-ticket state and ONE choice question with N options ("Queue 001": "Tickets routed to
queue 1", ...), answered by `engine.predict` on the embedded SmolLM2-135M (or --model). For each N:

  first call  the first predict() of this question: compiles the row programs its shapes need
              (the state prefix is prefilled, and its programs compiled, once per dtype before the
              first N, and is reported on its own line)
  warm        the median of --repeats further predict() calls (whatever the engine's cross-request
              prefix cache holds is reused: the state prefix with the state first; with the schema
              first, as the shipped default reads, the question and its option list, so a warm call
              then processes the state's tokens only: a taxonomy asked about many states)
  new question  one predict() of another question of the same shape right after (the options say
              "Group" where they said "Queue": the same token counts, so the same programs): nothing
              cached helps with the schema first, so this is the cost of a question seen for the first
              time on a warm server; the programs it compiled are counted (0 when the shapes matched)
  tokens      usage["input_tokens"] minus usage["cached_input_tokens"] of a warm call: the row tokens
              processed (round-2 rows of a grouped large choice included); the row count and lengths
              come from engine.plan(state, questions).rows
  baseline    a plain prefill of the same number of tokens, measured in the same run the way the
              executor prefills a state prefix (executor.prefix_cache: pack_prefixes into the prefix
              bucket, backbone.prefill in PREFILL_CHUNK chunks): first call and median of --repeats

and prints ms per processed token for both and **row cost / prefill cost at equal tokens**: how much
dearer the question's rows are than the same number of tokens prefilled as one sequence (the machines
are noisy, so the ratio is the number that survives between runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

STATE = (
    "Support ticket #58127 (priority: unset, channel: web form, received 2026-12-01 08:42 CET). "
    "Customer: Dana Whitfield, account 88-40213, business plan since 2021, 14 seats, billed annually. "
    "Subject: Invoices doubled after the seat change, export broken, and nobody answers. "
    "Message: Hello, I am writing for the third time this week. On November 20th we reduced our plan "
    "from 20 to 14 seats, and your admin console confirmed the change and showed a prorated credit of "
    "312.40 euros. Instead, the December invoice (INV-2026-11893) charges us for 20 seats again, and a "
    "second invoice (INV-2026-11894) appeared the same day for the same period, both already taken from "
    "our company card. Our finance team needs a corrected invoice before the month closes on December "
    "15th, otherwise we have to book the whole amount as an open dispute. Separately, since your update "
    "last Tuesday the CSV export of the audit log stops at exactly 10,000 rows and the file is cut off "
    "mid-line, so our compliance officer cannot finish the quarterly review; we tried Chrome and Firefox "
    "and the API endpoint /v2/audit/export, which returns HTTP 502 after about thirty seconds. Two of our "
    "users were also logged out every few minutes yesterday afternoon, which may or may not be related. "
    "I called the hotline on Monday and was promised a callback within 24 hours, which never came; the "
    "chat assistant only sent me links to the billing FAQ. We like the product, but if the billing is "
    "not fixed and the double charge refunded by Friday, we will cancel the renewal and move the team "
    "to another vendor. Please escalate this to someone who can actually change an invoice. "
    "Attachments: invoice_11893.pdf, invoice_11894.pdf, export_error.png, audit_log_partial.csv. "
    "Browser: Chrome 131 on Windows 11; admin role: owner; SSO: Okta; two-factor authentication: enforced. "
    "Account notes: 3 earlier tickets (2 billing, 1 SSO setup), all resolved; last NPS answer 8; "
    "customer success manager: R. Okafor; region: EU-Central; language: English; data residency: Frankfurt."
)

DEFAULT_NS = (2, 8, 32, 64, 128, 255)
MAX_OPTIONS = 255  # the wire contract's choice limit


def option_question(n: int, word: str = "Queue") -> dict:
    """One choice question with `n` options: "Queue 001": "Tickets routed to queue 1", ... (`word`
    another one-token noun for a question of the same shape that no cache has seen)."""
    if not 2 <= n <= MAX_OPTIONS:
        raise ValueError(f"a choice has 2 to {MAX_OPTIONS} options, not {n}")
    return {
        "queue": {
            "type": "choice",
            "instructions": "Which queue should this support ticket be routed to?",
            "criteria": {f"{word} {i:03d}": f"Tickets routed to {word.lower()} {i}" for i in range(1, n + 1)},
        }
    }


def parse_ns(text: str) -> list[int]:
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ns wants comma-separated integers, not {text!r}") from None
    if not ns or any(not 2 <= n <= MAX_OPTIONS for n in ns):
        raise argparse.ArgumentTypeError(f"--ns: every option count must be within 2..{MAX_OPTIONS} ({text!r})")
    return ns


def parse_dtypes(text: str) -> list[str]:
    dtypes = [x.strip() for x in text.split(",") if x.strip()]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if not dtypes or bad:
        raise argparse.ArgumentTypeError(f"--dtypes: float32 and/or bfloat16, not {text!r}")
    return dtypes


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench_options",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--ns", type=parse_ns, default=list(DEFAULT_NS), help="option counts (default 2,8,32,64,128,255)")
    ap.add_argument("--dtypes", type=parse_dtypes, default=["float32", "bfloat16"], help="weight dtypes")
    ap.add_argument("--repeats", type=int, default=3, help="warm calls timed per measurement (median)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--json", metavar="OUT", help="write the results here")
    ap.add_argument("--markdown", action="store_true", help="also print a Markdown table for BENCHMARKS.md")
    return ap


def timed(fn, repeats: int) -> tuple[float, float, list[float]]:
    """(first call s, median of `repeats` further calls s, those samples). `fn` must block on its result."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return first, statistics.median(samples), samples


def baseline_ids(prefix_ids: list[int], rows, n_tokens: int) -> list[int]:
    """`n_tokens` real token ids for the prefill baseline: the state prefix and the rows' tokens, cycled."""
    pool = list(prefix_ids) + [t for r in rows for t in r.tokens]
    if not pool:
        raise ValueError("no tokens to build the baseline from")
    return list(itertools.islice(itertools.cycle(pool), n_tokens))


def prefill_fn(backbone, ids: list[int]):
    """(a call that prefills `ids` as executor.prefix_cache does and blocks on the cache, its bucket)."""
    import jax

    from lev_jax import buckets
    from lev_jax.readout.logits import pack_prefixes

    bucket = buckets.fit(len(ids), buckets.PREFIX[1:], "prefill length")
    tokens, valid = pack_prefixes([ids], 1, bucket)
    return (lambda: jax.block_until_ready(backbone.prefill(tokens, valid, chunk=buckets.PREFILL_CHUNK))), bucket


def measure(engine, n: int, repeats: int, state: str = STATE) -> dict:
    """One option count on one engine: predict first/warm, usage, row lengths, the prefill baseline."""
    from lev_jax import buckets

    qs = option_question(n)
    plan = engine.plan(state, qs)
    lens = [len(r.tokens) for r in plan.rows]
    last: dict = {}

    def run():
        last["answers"], last["usage"] = engine.predict_with_usage(state, qs)

    first_s, warm_s, samples = timed(run, repeats)
    usage = last["usage"]
    processed = usage["input_tokens"] - usage.get("cached_input_tokens", 0)
    programs0 = engine.compiled_programs
    t0 = time.perf_counter()
    _, new_usage = engine.predict_with_usage(state, option_question(n, word="Group"))
    new_s = time.perf_counter() - t0
    out = {
        "n": n,
        "rows": len(lens),
        "row_tokens_min": min(lens),
        "row_tokens_max": max(lens),
        "row_tokens_mean": round(statistics.fmean(lens), 1),
        "plan_row_tokens": sum(lens),
        "input_tokens": usage["input_tokens"],
        "cached_input_tokens": usage.get("cached_input_tokens", 0),
        "processed_tokens": processed,
        "first_s": round(first_s, 4),
        "warm_s": round(warm_s, 4),
        "warm_samples_s": [round(s, 4) for s in samples],
        "compile_s": round(max(0.0, first_s - warm_s), 4),  # first call minus a warm one: ~compilation
        "ms_per_token": round(1e3 * warm_s / processed, 4) if processed else None,
        "choice": last["answers"]["queue"].get("choice"),
        "new_question_s": round(new_s, 4),
        "new_question_tokens": new_usage["input_tokens"] - new_usage.get("cached_input_tokens", 0),
        "new_question_programs": engine.compiled_programs - programs0,
    }
    if processed > buckets.PREFIX[-1]:
        out.update(prefill_tokens=processed, prefill_bucket=None, prefill_s=None, ratio=None)
        return out
    fn, bucket = prefill_fn(engine.backbone, baseline_ids(plan.prefix_ids, plan.rows, processed))
    p_first, p_warm, _ = timed(fn, repeats)
    out.update(
        prefill_tokens=processed,
        prefill_bucket=bucket,
        prefill_first_s=round(p_first, 4),
        prefill_s=round(p_warm, 4),
        prefill_ms_per_token=round(1e3 * p_warm / processed, 4),
        ratio=round(warm_s / p_warm, 3),
    )
    return out


def line(r: dict) -> str:
    base = (
        f"prefill {r['prefill_tokens']} tok (bucket {r['prefill_bucket']}) {r['prefill_s']:.3f} s "
        f"= {r['prefill_ms_per_token']:.3f} ms/tok (first {r['prefill_first_s']:.2f} s) | "
        f"row / prefill at equal tokens {r['ratio']:.2f}x"
        if r.get("prefill_s")
        else "prefill baseline: n/a (beyond the largest prefill bucket)"
    )
    return (
        f"{r['dtype']:8s} N={r['n']:3d} rows={r['rows']:2d} (row tokens {r['row_tokens_min']}-{r['row_tokens_max']}, "
        f"mean {r['row_tokens_mean']}) processed {r['processed_tokens']} tok | first call {r['first_s']:.2f} s "
        f"(compile ~{r['compile_s']:.2f} s) warm {r['warm_s']:.3f} s = {r['ms_per_token']:.3f} ms/tok | "
        f"new question {r['new_question_s']:.3f} s ({r['new_question_tokens']} tok, "
        f"{r['new_question_programs']} programs compiled) | {base}"
    )


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    lines = [
        f"One choice question with N options about a {report['state_chars']}-character ticket "
        f"({', '.join(f'{d}: {p} prefix tokens' for d, p in report['prefix_tokens'].items())}); "
        f"warm = median of {report['repeats']} after a first call; the prefill baseline processes the same "
        "number of tokens as one sequence, in the same run.",
        "",
        "| dtype | N | rows | row tokens | processed tokens | first call s | compile s | warm s | ms/token "
        "| new question s (tokens, programs compiled) | prefill s (equal tokens) | prefill ms/token "
        "| **row / prefill** |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['dtype']} | {r['n']} | {r['rows']} | {r['row_tokens_min']}–{r['row_tokens_max']} | "
            f"{r['processed_tokens']} | {r['first_s']:.2f} | {r['compile_s']:.2f} | {r['warm_s']:.3f} | "
            f"{_fmt(r['ms_per_token'], '.3f')} | "
            f"{_fmt(r.get('new_question_s'), '.3f')} ({r.get('new_question_tokens', '–')}, "
            f"{r.get('new_question_programs', '–')}) | {_fmt(r.get('prefill_s'), '.3f')} | "
            f"{_fmt(r.get('prefill_ms_per_token'), '.3f')} | **{_fmt(r.get('ratio'), '.2f')}×** |"
        )
    pre = report.get("prefix_first_s") or {}
    if pre:
        lines += [
            "",
            "State prefix, prefilled once per dtype before the first N (its compile + prefill, not in the "
            "rows above): " + ", ".join(f"{d} {s:.2f} s" for d, s in pre.items()) + ".",
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")

    import jax

    import lev_jax

    report: dict = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "state_chars": len(STATE),
        "repeats": args.repeats,
        "prefix_tokens": {},
        "prefix_first_s": {},
        "results": [],
    }
    print(f"jax {jax.__version__} ({jax.default_backend()}); state {len(STATE)} chars; repeats {args.repeats}")
    for dtype in args.dtypes:
        t0 = time.perf_counter()
        engine = lev_jax.load(model=args.model, dtype=dtype)
        load_s = time.perf_counter() - t0
        prefix_ids = engine.plan(STATE, option_question(2)).prefix_ids
        t0 = time.perf_counter()
        cache, _ = engine.executor.prefix_cache(prefix_ids)  # compile + prefill the state prefix once
        jax.block_until_ready(cache)
        prefix_s = time.perf_counter() - t0
        report["prefix_tokens"][dtype] = len(prefix_ids)
        report["prefix_first_s"][dtype] = round(prefix_s, 3)
        print(
            f"{dtype}: {engine.model_name} loaded in {load_s:.1f} s; state prefix {len(prefix_ids)} tokens, "
            f"first prefill (compile + run) {prefix_s:.2f} s",
            flush=True,
        )
        for n in args.ns:
            r = {"dtype": dtype, **measure(engine, n, args.repeats, STATE)}
            report["results"].append(r)
            print(line(r), flush=True)
        del engine
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if args.markdown:
        print()
        print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
