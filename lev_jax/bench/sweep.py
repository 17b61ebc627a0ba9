"""``levbench sweep``: is the shared state really amortised?

On one state, for each N in {1, 2, 4, 8, 16, 32}: one call with N questions vs N calls with one
question each. Both are timed (median over ``repeats`` after an untimed warm-up, so compilation
is not counted) and their input tokens are recorded (the server's ``usage.input_tokens``, or the
engine's count in-process). ``speedup`` = time of the N single calls / time of the one batched
call; ``token_ratio`` = tokens of the N single calls / tokens of the batched call. Cached tokens
are the state-prefix tokens the engine served from its cross-request prefix cache (the warm-up
fills it, so the timed single calls reuse the state's prefix: that is what a server does).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lev_jax.bench.evalset import EvalSet

NS = (1, 2, 4, 8, 16, 32)

DEFAULT_STATE = (
    "Ticket #4821 from Dana (premium customer since 2019):\n"
    "I was charged twice for my March invoice (two payments of $49.90 on the 3rd) and the app now says my "
    "card is blocked. I already tried re-adding the card. I need this fixed before my trip on Friday, "
    "otherwise I will cancel my subscription. Please call me back, my number is in my profile."
)

_NOUL = [
    "Is the customer angry?",
    "Does the customer mention a refund?",
    "Is this a billing issue?",
    "Does the customer threaten to cancel?",
    "Is the customer a premium customer?",
    "Does the customer ask for a call back?",
    "Is there a deadline in the message?",
    "Does the message mention a blocked card?",
    "Is the message written in English?",
    "Does the customer say they already tried something?",
    "Is this message spam?",
    "Does the message contain a phone number?",
    "Is the customer asking about a delivery?",
    "Is the customer travelling soon?",
    "Was the customer charged more than once?",
    "Does the customer ask to close the account?",
    "Is the message polite?",
    "Does the customer mention a specific amount?",
    "Is this about a mobile app?",
    "Should this ticket be escalated?",
]
_CHOICE = [
    ("Which team should handle this ticket?", {"billing": None, "cards": None, "technical": None, "sales": None}),
    ("What is the main topic?", {"double charge": None, "card blocked": None, "travel": None, "cancellation": None}),
    ("What tone does the customer use?", {"calm": None, "frustrated": None, "furious": None}),
    ("What should happen first?", {"refund": None, "unblock card": None, "call back": None, "close ticket": None}),
    ("Which channel does the customer prefer?", {"email": None, "phone": None, "chat": None}),
    ("What is the customer's plan?", {"free": None, "premium": None, "unknown": None}),
]
_SCORE = [
    ("How urgent is this ticket?", ["not urgent", "somewhat urgent", "urgent", "critical"]),
    ("How likely is the customer to churn?", ["unlikely", "possible", "likely"]),
    ("How satisfied is the customer?", ["very unsatisfied", "unsatisfied", "neutral", "satisfied"]),
    ("How complex is the request?", ["simple", "moderate", "complex"]),
    ("How much detail does the customer give?", ["little", "some", "a lot"]),
    ("How polite is the message?", ["rude", "neutral", "polite"]),
]


def default_questions() -> list[dict[str, Any]]:
    """32 distinct questions about :data:`DEFAULT_STATE`: 20 noul, 6 choice, 6 score."""
    qs = [{"type": "noul", "instructions": t} for t in _NOUL]
    qs += [{"type": "choice", "instructions": t, "criteria": c} for t, c in _CHOICE]
    qs += [{"type": "score", "instructions": t, "criteria": c} for t, c in _SCORE]
    return qs


def from_evalset(es: EvalSet) -> tuple[Any, list[dict]]:
    """The first item's state and the set's questions."""
    return es.items[0]["state"], list(es.questions.values())


def _pick(questions: Sequence[Mapping], n: int) -> dict[str, dict]:
    """The first n questions (cycled if there are fewer), keyed q00, q01, ..."""
    return {f"q{i:02d}": dict(questions[i % len(questions)]) for i in range(n)}


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_sweep(
    client, state, questions: Sequence[Mapping], ns: Sequence[int] = NS, repeats: int = 3, progress: bool = True
) -> dict[str, Any]:
    rows = []
    for n in ns:
        qs = _pick(questions, n)
        singles = [{k: q} for k, q in qs.items()]
        # warm-up (compiles every shape this N uses), untimed
        batched = client.ask(state, qs)
        single_asked = [client.ask(state, s) for s in singles]
        t_batch, t_single = [], []
        for _ in range(repeats):
            t_batch.append(_time(lambda: client.ask(state, qs)))
            t_single.append(sum(_time(lambda s=s: client.ask(state, s)) for s in singles))
        tok_b = batched.input_tokens
        tok_s = (
            sum(a.input_tokens for a in single_asked) if all(a.input_tokens is not None for a in single_asked) else None
        )
        cached_s = [a.cached_input_tokens for a in single_asked]
        row = {
            "n": n,
            "batched_s": statistics.median(t_batch),
            "singles_s": statistics.median(t_single),
            "batched_tokens": tok_b,
            "singles_tokens": tok_s,
            "state_tokens": batched.state_tokens,
            "batched_cached_tokens": batched.cached_input_tokens,
            "singles_cached_tokens": sum(cached_s) if all(c is not None for c in cached_s) else None,
            "batched_runs_s": t_batch,
            "singles_runs_s": t_single,
        }
        row["speedup"] = row["singles_s"] / row["batched_s"] if row["batched_s"] > 0 else None
        row["token_ratio"] = tok_s / tok_b if tok_b and tok_s else None
        row["batched_s_per_question"] = row["batched_s"] / n
        rows.append(row)
        if progress:
            print(
                f"N={n:>2}: one call {row['batched_s']:.3f} s, {n} calls {row['singles_s']:.3f} s "
                f"(x{row['speedup']:.2f}); tokens {tok_b} vs {tok_s}",
                file=sys.stderr,
                flush=True,
            )
    return {"repeats": repeats, "rows": rows}


def sweep_markdown(res: Mapping[str, Any], info: Mapping[str, Any] | None = None) -> str:
    lines = ["# levbench sweep: one call with N questions vs N calls with one question", ""]
    if info:
        lines += [
            f"Answered by: {info.get('kind')} `{info.get('endpoint') or info.get('model')}`; "
            f"state tokens: {res['rows'][0].get('state_tokens')}; median of {res['repeats']} runs after a "
            "warm-up.",
            "",
        ]
    lines += [
        "| N | one call (s) | N calls (s) | speedup | s/question (one call) | tokens one call | tokens N calls "
        "| token ratio | cached tokens (one call / N calls) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        tr = "-" if r["token_ratio"] is None else f"{r['token_ratio']:.2f}"
        lines.append(
            f"| {r['n']} | {r['batched_s']:.3f} | {r['singles_s']:.3f} | {sp} | "
            f"{r['batched_s_per_question']:.3f} | {r['batched_tokens']} | {r['singles_tokens']} | {tr} "
            f"| {r.get('batched_cached_tokens', '-')} / {r.get('singles_cached_tokens', '-')} |"
        )
    return "\n".join(lines) + "\n"


def sweep_png(res: Mapping[str, Any], path: str | Path) -> Path | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("PNG plot skipped: matplotlib is not installed (pip install 'lev-jax[plot]')", stacklevel=2)
        return None
    fig = Figure(figsize=(5, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ns = [r["n"] for r in res["rows"]]
    ax.plot(ns, [r["batched_s"] for r in res["rows"]], "o-", label="one call, N questions")
    ax.plot(ns, [r["singles_s"] for r in res["rows"]], "s-", label="N calls, one question")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N questions")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, format="png")
    return p


def write_sweep(res: dict[str, Any], out_dir: str | Path, info: Mapping[str, Any] | None = None) -> dict[str, str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({**res, "client": info}, indent=1) + "\n", encoding="utf-8")
    (out / "sweep.md").write_text(sweep_markdown(res, info), encoding="utf-8")
    files = {"json": str(out / "sweep.json"), "md": str(out / "sweep.md")}
    png = sweep_png(res, out / "sweep.png")
    if png is not None:
        files["png"] = str(png)
    return files
