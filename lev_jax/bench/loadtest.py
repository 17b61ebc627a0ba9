"""Bounded load test of the System One server, on loopback only.

    python -m scripts.loadtest                          # starts `python -m serve` (embedded model) itself
    python -m scripts.loadtest --model /path/to/ckpt --burst 200 --max-pending 16 [--dtype bfloat16]
    python -m scripts.loadtest --url http://127.0.0.1:8000 --key KEY   # a server you started (loopback only)

The server this script starts runs its start-up warm-up (`--warmup-budget`, default the server's) with a
fresh, empty compilation cache in a temporary directory (`--compilation-cache DIR` to use another), so
the first phase measures a cold machine, not programs an earlier run left on disk.

Phases (every loop is bounded in count and time, and the script stops by itself):
0. after_ready: wait (bounded, `--ready-timeout`) until /health says "ready" (recorded: seconds to
                ready), then at once closed loops at concurrency 8 and 1 (`--requests` each) on fresh
                states never sent before: throughput right after ready (see "The after-ready phase").
1. alone:       each distinct request once, serially: the reference answers.
2. burst:       `--burst` requests at once against a small `--max-pending`: every one must get 200, or
                429/503 with Retry-After; none may be lost or hang; every 200 must equal its answer alone.
3. retry:       the same burst, each client honouring Retry-After until it gets its answer (bounded):
                all must end with 200 and the reference answers.
4. throughput:  warm closed loops at concurrency 1 and 8 (`--requests` each), measured once a round of
                them compiles nothing new: requests/s, p50/p99 latency.
At the end /health's compile-lane counters (requests served in the compile lane, background compiles
of micro-batch combinations, batches run one by one) are recorded.

The after-ready phase. Both loops send the question set of the other phases on fresh states: one of the
8 tickets with a unique, fixed-width reference appended, so every request pays its state's prefill (no
loop is helped by the cross-request prefix cache) and the states of one ticket land in the same
shape buckets. Whichever loop first meets a prefix bucket pays its single-request compiles (the warm-up
grid does not cover these ticket sizes); only concurrency 8 meets the stacked micro-batch combinations,
which are the compile cliff under test. So the phase is a crossover over two halves of shapes with
disjoint buckets and equally many programs: A, the tickets as they are, and B, each ticket written
twice (HALVES; `tests/test_default_release.py` checks the shipped default's programs), in the order
    c8 on A,  serial on B,  serial on A,  c8 on B          (`--requests` / 2 requests each)
Each loop meets one half cold (paying its single-request compiles) and the other half after the other
loop compiled it, so both pay about the same compiles and do the same work, and the difference is
what concurrency itself does (batching, and the new stacked combinations). The alternatives are
biased: c8 first on everything charges c8 every compile while serial runs warm (a server without a
cliff fails for compiles that have nothing to do with concurrency), serial first does the reverse and
flatters c8, and interleaved rounds still leave nearly all compiles to whichever goes first in the
first round. Between segments the script waits (bounded) until the server is quiet (nothing in
flight, no program compiled and no compile-lane counter moved for `--settle` s), so a background
compile a c8 segment queued does not slow the next segment; the first segment starts the moment
/health says ready. Each loop's throughput is its answered requests over its two segments' wall time,
and `after_ready_c8_vs_serial` must be >= 1.0 (no compile cliff). Per segment the report keeps the
programs compiled and the compile-lane counters' change, so who paid which compiles is visible.
Afterwards every c8 answer is asked again alone and must be the same.

Checks, printed as PASS/FAIL lines after the JSON report (exit code 1 when one fails): none lost and
every 200 equal to its answer alone (phases 0, 2, 3) within the served dtype's tolerance
(`runtime.ANSWER_TOLERANCE`: 1e-5 in fp32; in bf16 rounding follows the shapes of the calls a request
is read in, alone or stacked with others; the report keeps the largest difference seen per phase),
`after_ready_c8_vs_serial` >= 1.0 and
`warm_c8_vs_serial` >= 1.5 (`--min-after-ready`, `--min-warm`). `--markdown` adds a table for
BENCHMARKS.md. `run_load` is the same load test as a coroutine (tests/test_serve_load.py runs it
in-process).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import itertools
import json
import math
import random
import shutil
import tempfile
import time
from urllib.parse import urlparse

import httpx

from lev_jax import runtime

AFTER_READY_TARGET = 1.0  # after ready: concurrency-8 throughput / serial throughput, at least
WARM_TARGET = 1.5  # warm: concurrency-8 throughput / serial throughput, at least
AFTER_READY_CONCURRENCY = 8

TICKETS = [
    "I was charged twice for my March invoice (order #4471) and the refund I was promised last week "
    "still hasn't arrived.",
    "The app crashes every time I open the settings page on Android 14. I already reinstalled it twice.",
    "Hi! We're a team of 40 and would like to upgrade to the enterprise plan. Can someone send us a quote?",
    "My parcel was marked as delivered but it is not here. The neighbours haven't seen it either.",
    "How do I export my data as CSV? I can't find the option anywhere in the dashboard.",
    "Your support agent was extremely rude to me yesterday. I want to speak to a manager immediately.",
    "The API returns 502 errors for about a third of our requests since this morning. This is blocking production.",
    "Thanks for the quick fix last week, everything works perfectly now!",
]
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this ticket?",
        "criteria": {
            "Billing": "Payments, invoices, refunds",
            "Technical": "Bugs, outages, integrations",
            "Sales": "Pricing, upgrades, new contracts",
            "Logistics": "Deliveries and parcels",
        },
    },
    "anger": {
        "type": "score",
        "instructions": "How frustrated is the customer?",
        "criteria": ["Calm", "Slightly annoyed", "Frustrated", "Very angry"],
    },
}


def payloads(n_distinct: int) -> list[dict]:
    out = []
    for i in range(n_distinct):
        ticket = TICKETS[i % len(TICKETS)]
        state = ticket if i < len(TICKETS) else f"{ticket} (follow-up {i // len(TICKETS)})"
        out.append({"model": "jev-latest", "state": state, "questions": QUESTIONS})
    return out


# The after-ready phase's two halves of fresh states, as templates of a ticket: the 8 tickets as they are
# (half A) and each written twice around a short phrase (half B), so the halves differ in row length.
# Since the fixed program set (readout.execute: chunks, slabs and tails per cache capacity) the shipped
# default runs both halves, alone and eight at a time, with programs its warm-up grid already ran
# (tests/test_default_release.py checks it): the crossover then measures concurrency alone; before it,
# each half's row-length buckets were single-request programs of their own (9 each) that whichever loop
# met them first paid for.
HALVES = {"A": "{t}", "B": "{t} Again, in case it was missed: {t}"}


def fresh_payloads(half: str, n: int, run: int, counter) -> list[dict]:
    """`n` requests on states never sent before, cycling over the 8 tickets of `half` (HALVES), each with
    a fixed-width reference appended (`run`: 4 digits per load test, `counter`: this run's sequence
    numbers), so the states of one ticket have the same length in tokens, hence the same buckets."""
    return [
        {
            "model": "jev-latest",
            "state": f"{HALVES[half].format(t=TICKETS[k % len(TICKETS)])} (ref {run:04d}-{next(counter):05d})",
            "questions": QUESTIONS,
        }
        for k in range(n)
    ]


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"refusing to load-test {url}: only loopback addresses (127.0.0.0/8, ::1, localhost)")


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1))
    return xs[k]


def answer_difference(a: dict, b: dict) -> float:
    """The largest difference of any probability (or noul) between two answer sets; inf when they
    differ in questions, types or option names, or name different choices more than that apart."""
    if a.keys() != b.keys():
        return math.inf
    worst = 0.0
    for qid in a:
        x, y = a[qid], b[qid]
        if x.get("type") != y.get("type"):
            return math.inf
        vx = x.get("probabilities") or {"noul": x.get("noul")}
        vy = y.get("probabilities") or {"noul": y.get("noul")}
        if vx.keys() != vy.keys():
            return math.inf
        worst = max([worst] + [abs(vx[k] - vy[k]) for k in vx])
        if x.get("choice") is not None and x.get("choice") != y.get("choice"):
            # a tie broken the other way is fine; a different winner is as far apart as its margin
            worst = max(worst, abs(vx[x["choice"]] - vx[y["choice"]]))
    return worst


def _finite(x: float) -> float | None:
    """x for the JSON report; None for inf (answers that do not match in form)."""
    return None if math.isinf(x) else x


def same_answers(a: dict, b: dict, tol: float = runtime.ANSWER_TOLERANCE["float32"]) -> bool:
    return answer_difference(a, b) <= tol


class Load:
    def __init__(self, url: str, key: str | None, timeout: float, deadline: float):
        self.url = url.rstrip("/")
        self.headers = {"authorization": f"Bearer {key}"} if key else {}
        self.timeout = timeout
        self.deadline = deadline  # absolute monotonic time after which nothing new is sent

    def client(self, connections: int) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        return httpx.AsyncClient(timeout=self.timeout, limits=limits, headers=self.headers)

    async def one(self, c: httpx.AsyncClient, payload: dict) -> dict:
        t0 = time.perf_counter()
        try:
            r = await c.post(self.url + "/v1/systemone", json=payload)
        except httpx.TimeoutException:
            return {"status": "timeout", "s": time.perf_counter() - t0}
        except httpx.HTTPError as e:
            return {"status": f"error: {type(e).__name__}", "s": time.perf_counter() - t0}
        out = {
            "status": r.status_code,
            "s": time.perf_counter() - t0,
            "retry_after": r.headers.get("retry-after"),
            "retry_after_ms": r.headers.get("retry-after-ms"),
            "request_id": r.headers.get("x-typesafe-request-id"),
        }
        if r.status_code == 200:
            out["answers"] = r.json()["answers"]
        return out

    async def alone(self, reqs: list[dict]) -> list[dict]:
        async with self.client(1) as c:
            return [await self.one(c, p) for p in reqs]

    async def burst(self, reqs: list[dict], n: int, retry: bool, max_attempts: int = 50) -> list[dict]:
        async with self.client(n) as c:

            async def client_task(i: int) -> dict:
                attempts = 0
                while True:
                    attempts += 1
                    res = await self.one(c, reqs[i % len(reqs)])
                    res["i"], res["attempts"] = i, attempts
                    if (
                        not retry
                        or res["status"] not in (429, 503)
                        or attempts >= max_attempts
                        or time.monotonic() > self.deadline
                    ):
                        return res
                    # as the official SDK does: retry-after-ms when given, else Retry-After seconds
                    if res.get("retry_after_ms"):
                        wait = float(res["retry_after_ms"]) / 1000
                    else:
                        wait = float(res.get("retry_after") or 1)
                    await asyncio.sleep(min(wait, 5.0))

            return await asyncio.gather(*(client_task(i) for i in range(n)))

    async def closed_loop(self, reqs: list[dict], concurrency: int, total: int, keep: bool = False) -> dict:
        """`concurrency` clients, each sending its next request when the last is answered, `total` in
        all (request i is reqs[i % len(reqs)]). `keep`: the raw results (with "i") under "results"."""
        results: list[dict] = []
        counter = iter(range(total))
        async with self.client(concurrency) as c:

            async def worker():
                for i in counter:
                    if time.monotonic() > self.deadline:
                        return
                    res = await self.one(c, reqs[i % len(reqs)])
                    res["i"] = i
                    results.append(res)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall = time.perf_counter() - t0
        ok = [r["s"] for r in results if r["status"] == 200]
        return {
            "concurrency": concurrency,
            "requests": len(results),
            "ok": len(ok),
            "wall_s": round(wall, 3),
            "throughput_rps": round(len(ok) / wall, 2) if wall else None,
            "p50_ms": _ms(percentile(ok, 50)),
            "p99_ms": _ms(percentile(ok, 99)),
            "statuses": _count(r["status"] for r in results),
        } | ({"results": results} if keep else {})


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 1)


def _count(xs) -> dict:
    out: dict = {}
    for x in xs:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


async def get_health(load: Load, c: httpx.AsyncClient | None = None) -> dict | None:
    """/health's JSON, or None when it does not answer with a JSON object."""
    if c is None:
        async with load.client(1) as c:
            return await get_health(load, c)
    try:
        h = (await c.get(load.url + "/health", timeout=10)).json()
    except (httpx.HTTPError, ValueError):
        return None
    return h if isinstance(h, dict) else None


async def compiled_programs(load: Load) -> int | None:
    h = await get_health(load)
    return None if h is None else h.get("compiled_programs")


def is_ready(health: dict) -> bool:
    """A /health that says "ready" (or a server without a warming state: no status, or "ok")."""
    return health.get("status") in (None, "ok", "ready")


async def wait_ready(load: Load, timeout_s: float, interval: float = 0.2) -> tuple[dict | None, float]:
    """Polls /health until it says ready, at most `timeout_s`: (the ready /health or None, seconds waited)."""
    t0 = time.monotonic()
    async with load.client(1) as c:
        while True:
            h = await get_health(load, c)
            if h is not None and is_ready(h):
                return h, time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                return None, time.monotonic() - t0
            await asyncio.sleep(interval)


def _activity(h: dict) -> tuple:
    return (
        h.get("in_flight"),
        h.get("queued"),
        h.get("batches"),
        h.get("compiled_programs"),
        json.dumps(h.get("compile_lane"), sort_keys=True),
    )


async def settle(load: Load, quiet_s: float, max_s: float = 60.0, interval: float = 0.2) -> float:
    """Waits until the server is quiet: nothing in flight or queued, and no batch run, program compiled
    or compile-lane counter moved for `quiet_s` (so a background compile another loop queued is over),
    at most `max_s`. Returns the seconds waited. A heuristic: /health cannot see a compile in progress."""
    t0 = time.monotonic()
    if quiet_s <= 0:
        return 0.0
    last, since = None, t0
    async with load.client(1) as c:
        while time.monotonic() - t0 < max_s:
            h = await get_health(load, c)
            if h is None:
                break
            now = time.monotonic()
            sig = _activity(h)
            if sig != last or h.get("in_flight") or h.get("queued"):
                last, since = sig, now
            elif now - since >= quiet_s:
                break
            await asyncio.sleep(interval)
    return round(time.monotonic() - t0, 3)


def _lane(h: dict | None) -> dict:
    return dict((h or {}).get("compile_lane") or {})


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int | float)}


async def warm_up(load: Load, reqs: list[dict], requests: int, max_rounds: int = 8) -> int:
    """Closed loops at concurrency 1 and 8 until a round compiles no new device program (each new
    batch shape compiles once; the throughput phases measure the steady state)."""
    for rounds in range(1, max_rounds + 1):
        before = await compiled_programs(load)
        await load.closed_loop(reqs, 1, len(reqs))
        await load.closed_loop(reqs, 8, requests)
        after = await compiled_programs(load)
        if before is None or before == after:
            return rounds
    return max_rounds


async def steady(load: Load, reqs: list[dict], concurrency: int, requests: int, tries: int = 3) -> dict:
    """A closed loop measured again (up to `tries` times) while the server compiled during it, so the
    numbers are the steady state, not a one-off compile."""
    attempt = 0
    while attempt < tries:
        attempt += 1
        before = await compiled_programs(load)
        result = await load.closed_loop(reqs, concurrency, requests)
        after = await compiled_programs(load)
        result["compiled_during"] = None if before is None or after is None else after - before
        if not result["compiled_during"]:
            break
    result["attempts"] = attempt
    return result


async def after_ready_phase(
    load: Load,
    requests: int,
    settle_quiet_s: float,
    failures: list[str],
    tol: float = runtime.ANSWER_TOLERANCE["float32"],
) -> dict:
    """The crossover of the module doc: c8 on A, serial on B, serial on A, c8 on B, on fresh states;
    then every c8 answer asked again alone (equal within `tol`). Appends broken checks to `failures`."""
    first, second = requests - requests // 2, requests // 2
    plan = [("c8", "A", first), ("serial", "B", first), ("serial", "A", second), ("c8", "B", second)]
    run, counter = random.randrange(10000), itertools.count()
    segments, kept = [], {"c8": [], "serial": []}
    for n, (loop, half, count) in enumerate(plan):
        if count == 0:
            continue
        settle_s = await settle(load, settle_quiet_s) if n else 0.0  # the first starts at ready
        reqs = fresh_payloads(half, count, run, counter)
        before = await get_health(load)
        concurrency = AFTER_READY_CONCURRENCY if loop == "c8" else 1
        res = await load.closed_loop(reqs, concurrency, count, keep=True)
        after = await get_health(load)
        results = res.pop("results")
        for r in results:
            r["payload"] = reqs[r["i"]]
        kept[loop] += results
        res.update(
            loop=loop,
            half=half,
            settle_s=settle_s,
            compiled_during=_compiled_delta(after, before),
            compile_lane=_delta(_lane(after), _lane(before)),
        )
        segments.append(res)
        if len(results) != count:
            failures.append(f"after_ready {loop} on half {half}: {count - len(results)} of {count} not sent")
        if res["ok"] != len(results):
            failures.append(f"after_ready {loop} on half {half}: statuses {res['statuses']}")

    summary: dict = {
        "requests_per_loop": requests,
        "order": [f"{s['loop']} on {s['half']}" for s in segments],
    }
    for loop in ("c8", "serial"):
        segs = [s for s in segments if s["loop"] == loop]
        ok = [r["s"] for r in kept[loop] if r["status"] == 200]
        wall = sum(s["wall_s"] for s in segs)
        summary[loop] = {
            "concurrency": AFTER_READY_CONCURRENCY if loop == "c8" else 1,
            "requests": len(kept[loop]),
            "ok": len(ok),
            "wall_s": round(wall, 3),
            "throughput_rps": round(len(ok) / wall, 2) if wall else None,
            "p50_ms": _ms(percentile(ok, 50)),
            "p99_ms": _ms(percentile(ok, 99)),
            "statuses": _count(r["status"] for r in kept[loop]),
            "compiled_during": _sum_or_none(s["compiled_during"] for s in segs),
            "compile_lane": _sum_dicts(s["compile_lane"] for s in segs),
        }
    summary["segments"] = segments
    c8, serial = summary["c8"]["throughput_rps"], summary["serial"]["throughput_rps"]
    summary["c8_vs_serial"] = round(c8 / serial, 2) if c8 and serial else None

    # every concurrent answer must equal the same request's answer alone (serial answers are alone)
    answered = [r for r in kept["c8"] if r["status"] == 200]
    again = await load.alone([r["payload"] for r in answered])
    gaps = [
        answer_difference(r["answers"], a["answers"]) if a["status"] == 200 else math.inf
        for r, a in zip(answered, again, strict=True)
    ]
    differ = [r["payload"]["state"] for r, gap in zip(answered, gaps) if gap > tol]
    summary["checked_alone"] = len(again)
    summary["largest_difference_from_alone"] = _finite(max(gaps, default=0.0))
    if differ:
        failures.append(
            f"after_ready: {len(differ)} concurrency-8 answers differ from the same request alone (e.g. {differ[0]!r})"
        )
    return summary


def _compiled_delta(after: dict | None, before: dict | None) -> int | None:
    a, b = (after or {}).get("compiled_programs"), (before or {}).get("compiled_programs")
    return a - b if isinstance(a, int) and isinstance(b, int) else None


def _sum_or_none(xs) -> int | None:
    xs = list(xs)
    return None if any(x is None for x in xs) else sum(xs)


def _sum_dicts(ds) -> dict:
    out: dict = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _ratio_check(name: str, what: str, c8: dict | None, serial: dict | None, ratio, target: float) -> list:
    shown = "n/a" if ratio is None else f"{ratio:.2f}x"
    rates = (
        f"concurrency 8 {(c8 or {}).get('throughput_rps')} req/s vs serial {(serial or {}).get('throughput_rps')} req/s"
    )
    return [
        "PASS" if ratio is not None and ratio >= target else "FAIL",
        f"{name} {shown} >= {target:g}x ({what}: {rates})",
    ]


async def run_load(
    url: str,
    *,
    key: str | None = None,
    burst: int = 200,
    distinct: int = 8,
    requests: int = 64,
    timeout: float = 120.0,
    budget_s: float = 600.0,
    retry_phase: bool = True,
    after_ready: bool = True,
    after_ready_requests: int | None = None,
    ready_timeout_s: float = 600.0,
    spawned_at: float | None = None,
    settle_quiet_s: float = 3.0,
    min_after_ready: float = AFTER_READY_TARGET,
    min_warm: float = WARM_TARGET,
) -> dict:
    """All phases against `url` (loopback). Returns the report: report["failures"] lists broken
    correctness checks (lost requests, wrong answers, bad statuses), report["checks"] every check as
    [PASS|FAIL, text], the throughput targets included. `spawned_at`: time.monotonic() when the server
    was started, for the seconds from spawn to ready. `budget_s` starts once the server is ready.
    `after_ready_requests`: per loop of the after-ready phase (default `requests`)."""
    check_loopback(url)
    failures: list[str] = []
    report: dict = {"url": url, "burst_size": burst, "distinct_requests": distinct}

    t0 = time.monotonic()
    ready, waited = await wait_ready(Load(url, key, timeout, math.inf), ready_timeout_s)
    load = Load(url, key, timeout, time.monotonic() + budget_s)
    if ready is None:
        failures.append(f"the server did not say ready within {ready_timeout_s:g}s")
    # answers under load must equal the answer alone within the served dtype's tolerance
    dtype = (ready or {}).get("dtype") or "float32"
    tol = runtime.ANSWER_TOLERANCE.get(dtype, runtime.ANSWER_TOLERANCE["float32"])
    report["answer_tolerance"] = {"dtype": dtype, "tolerance": tol}
    if ready is not None and after_ready:
        report["after_ready"] = {
            "ready_s": round(time.monotonic() - spawned_at, 3) if spawned_at is not None else None,
            "ready_wait_s": round(waited, 3),
            "warmup": ready.get("warmup"),
            "compilation_cache": ready.get("compilation_cache"),
            "compiled_programs_at_ready": ready.get("compiled_programs"),
        }
        n = requests if after_ready_requests is None else after_ready_requests
        report["after_ready"] |= await after_ready_phase(load, n, settle_quiet_s, failures, tol)
        report["after_ready_c8_vs_serial"] = report["after_ready"]["c8_vs_serial"]
    report["ready_wait_s"] = round(time.monotonic() - t0, 3) if ready is None else round(waited, 3)

    alone = await load.alone(payloads(distinct))
    if any(r["status"] != 200 for r in alone):
        failures.append(f"alone: not every request was answered: {_count(r['status'] for r in alone)}")
        return _finish(report, failures, min_after_ready, min_warm, await get_health(load))
    reqs = payloads(distinct)
    reference = [r["answers"] for r in alone]
    report["alone_ms"] = [_ms(r["s"]) for r in alone]

    phases = [("burst", False)] + ([("retry", True)] if retry_phase else [])
    for name, retry in phases:
        t0 = time.perf_counter()
        res = await load.burst(reqs, burst, retry)
        wall = time.perf_counter() - t0
        statuses = _count(r["status"] for r in res)
        ok = [r for r in res if r["status"] == 200]
        summary = {
            "wall_s": round(wall, 3),
            "statuses": statuses,
            "answered": len(ok),
            "p50_ms": _ms(percentile([r["s"] for r in ok], 50)),
            "p99_ms": _ms(percentile([r["s"] for r in ok], 99)),
            "max_attempts": max(r["attempts"] for r in res),
        }
        report[name] = summary
        if len(res) != burst:
            failures.append(f"{name}: {burst - len(res)} requests lost")
        bad = [r for r in res if r["status"] not in (200, 429, 503)]
        if bad:
            failures.append(f"{name}: statuses other than 200/429/503: {_count(r['status'] for r in bad)}")
        no_retry_after = [r for r in res if r["status"] in (429, 503) and not r.get("retry_after")]
        if no_retry_after:
            failures.append(f"{name}: {len(no_retry_after)} refusals without Retry-After")
        gaps = [answer_difference(r["answers"], reference[r["i"] % distinct]) for r in ok]
        summary["largest_difference_from_alone"] = _finite(max(gaps, default=0.0))
        differ = [r["i"] for r, gap in zip(ok, gaps) if gap > tol]
        if differ:
            failures.append(
                f"{name}: {len(differ)} answers under load differ from the answer alone (e.g. #{differ[0]})"
            )
        if any(not (r.get("request_id") or "").startswith("req_") for r in res if isinstance(r["status"], int)):
            failures.append(f"{name}: a response without x-typesafe-request-id")
        if retry and len(ok) != burst:
            failures.append(f"{name}: only {len(ok)}/{burst} requests answered after honouring Retry-After")
    if "burst" in report and report["burst"]["statuses"].get("429", 0) == 0:
        report["note"] = "the burst did not overflow max_pending (no 429 seen); use a smaller --max-pending"

    report["warmup_rounds"] = await warm_up(load, reqs, requests)
    serial = await steady(load, reqs, 1, requests)
    parallel = await steady(load, reqs, 8, requests)
    report["concurrency_1"], report["concurrency_8"] = serial, parallel
    if serial["throughput_rps"] and parallel["throughput_rps"]:
        report["warm_c8_vs_serial"] = round(parallel["throughput_rps"] / serial["throughput_rps"], 2)
    for phase in (serial, parallel):
        if phase["ok"] != phase["requests"]:
            failures.append(f"throughput at concurrency {phase['concurrency']}: statuses {phase['statuses']}")
    return _finish(report, failures, min_after_ready, min_warm, await get_health(load))


def _tolerance(report: dict) -> str:
    t = report.get("answer_tolerance") or {}
    return f"within {t.get('tolerance', runtime.ANSWER_TOLERANCE['float32']):g}, {t.get('dtype', 'float32')}"


def _finish(report: dict, failures: list[str], min_after_ready: float, min_warm: float, health: dict | None) -> dict:
    """Records the end-of-run /health counters and the PASS/FAIL checks."""
    health = health or {}
    report["compile_lane"] = health.get("compile_lane")
    report["health_end"] = {
        k: health.get(k) for k in ("status", "warmup", "compiled_programs", "batches", "compilation_cache")
    }
    checks = [["FAIL", f] for f in failures] or [
        ["PASS", f"none lost; every 200 equals its answer alone ({_tolerance(report)}); every refusal has Retry-After"]
    ]
    if "after_ready" in report:
        a = report["after_ready"]
        checks.append(
            _ratio_check(
                "after_ready_c8_vs_serial",
                "right after ready, fresh states",
                a.get("c8"),
                a.get("serial"),
                report.get("after_ready_c8_vs_serial"),
                min_after_ready,
            )
        )
    if "concurrency_8" in report:
        checks.append(
            _ratio_check(
                "warm_c8_vs_serial",
                "warm",
                report["concurrency_8"],
                report["concurrency_1"],
                report.get("warm_c8_vs_serial"),
                min_warm,
            )
        )
    report["failures"] = failures
    report["checks"] = checks
    return report


def _row(label: str, p: dict) -> str:
    return (
        f"| {label} | {p['requests']} | {p['ok']} | {json.dumps(p['statuses'])} | {p['p50_ms']} | {p['p99_ms']} | "
        f"{p['wall_s']} | {p['throughput_rps']} |"
    )


def markdown(report: dict, title: str = "Serving load test") -> str:
    lines = [
        f"### {title}",
        "",
        "| phase | requests | answered | statuses | p50 ms | p99 ms | wall s | throughput req/s |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    a = report.get("after_ready")
    if a and "c8" in a:
        lines.append(_row("after ready, concurrency 8 (fresh states)", a["c8"]))
        lines.append(_row("after ready, serial (fresh states)", a["serial"]))
    for name in ("burst", "retry"):
        if name in report:
            p = report[name]
            lines.append(
                f"| {name} ({report.get('burst_label', '')}) | {report['burst_size']} | {p['answered']} | "
                f"{json.dumps(p['statuses'])} | {p['p50_ms']} | {p['p99_ms']} | {p['wall_s']} | "
                f"{round(p['answered'] / p['wall_s'], 2) if p['wall_s'] else '-'} |"
            )
    for key in ("concurrency_1", "concurrency_8"):
        if key in report:
            lines.append(_row(f"warm closed loop, concurrency {report[key]['concurrency']}", report[key]))
    if a:
        w = a.get("warmup") or {}
        ready = f"{a['ready_s']} s after spawn" if a.get("ready_s") is not None else f"after {a.get('ready_wait_s')} s"
        lines += [
            "",
            f"Ready {ready} (warm-up {w.get('batches_done')} of {w.get('batches_planned')} batches in "
            f"{w.get('seconds')} s); compile lane at the end: {json.dumps(report.get('compile_lane'))}.",
        ]
    if report.get("after_ready_c8_vs_serial") is not None:
        lines += ["", f"Right after ready, concurrency 8 vs serial: **{report['after_ready_c8_vs_serial']}x**."]
    if "warm_c8_vs_serial" in report:
        lines += ["", f"Warm, concurrency 8 vs serial: **{report['warm_c8_vs_serial']}x**."]
    if report.get("checks"):
        lines += [""] + [f"- {verdict}: {text}" for verdict, text in report["checks"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from lev_jax.server.warmup import DEFAULT_BUDGET_S

    p = argparse.ArgumentParser(
        prog="python -m scripts.loadtest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="a running server on loopback (default: start `python -m serve`)")
    p.add_argument("--key", help="API key for --url")
    p.add_argument("--model", help="--model for the server this script starts (default: the embedded model)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="--dtype for the server this script starts"
    )
    p.add_argument("--max-pending", type=int, default=16, help="--max-pending for the server this script starts")
    p.add_argument(
        "--warmup-budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        metavar="SECONDS",
        help="--warmup-budget for the server this script starts (default: the server's, %(default)g)",
    )
    p.add_argument(
        "--compilation-cache",
        metavar="DIR",
        help="--compilation-cache for the server this script starts (default: a fresh temporary directory, "
        "removed afterwards: a cold machine)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        help="seconds to wait for /health to say ready (default: 600 + the warm-up budget)",
    )
    p.add_argument("--no-after-ready", action="store_true", help="skip the after-ready phase")
    p.add_argument(
        "--settle",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="after ready: between segments, wait until the server has been quiet this long (default %(default)g)",
    )
    p.add_argument("--burst", type=int, default=200)
    p.add_argument("--distinct", type=int, default=8, help="distinct request bodies")
    p.add_argument("--requests", type=int, default=64, help="requests per closed-loop throughput loop")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request client timeout (s)")
    p.add_argument("--budget", type=float, default=600.0, help="time budget once the server is ready (s)")
    p.add_argument("--min-after-ready", type=float, default=AFTER_READY_TARGET, help="target, default %(default)g")
    p.add_argument("--min-warm", type=float, default=WARM_TARGET, help="target, default %(default)g")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    args = p.parse_args(argv)
    if args.warmup_budget < 0:
        p.error("--warmup-budget must not be negative")
    ready_timeout = args.ready_timeout if args.ready_timeout is not None else 600.0 + args.warmup_budget

    server = spawned_at = cache_dir = None
    try:
        if args.url:
            url = args.url
        else:
            from lev_jax.server.testing import ServerProcess

            if args.compilation_cache:
                cache = args.compilation_cache
            else:
                cache = cache_dir = tempfile.mkdtemp(prefix="lev-loadtest-cache-")
            server_args = [
                "--max-pending",
                str(args.max_pending),
                "--dtype",
                args.dtype,
                "--warmup-budget",
                f"{args.warmup_budget:g}",
                "--compilation-cache",
                cache,
            ] + (["--model", args.model] if args.model else [])
            server = ServerProcess(server_args, startup_timeout=600)
            for k in list(server.env):  # a JAX cache from the environment would override --compilation-cache
                if k == "JAX_COMPILATION_CACHE_DIR" or k.startswith("JAX_PERSISTENT_CACHE_"):
                    del server.env[k]
            spawned_at = time.monotonic()
            server.__enter__()
            url = server.url
        report = asyncio.run(
            run_load(
                url,
                key=args.key,
                burst=args.burst,
                distinct=args.distinct,
                requests=args.requests,
                timeout=args.timeout,
                budget_s=args.budget,
                after_ready=not args.no_after_ready,
                ready_timeout_s=ready_timeout,
                spawned_at=spawned_at,
                settle_quiet_s=args.settle,
                min_after_ready=args.min_after_ready,
                min_warm=args.min_warm,
            )
        )
    finally:
        if server is not None:
            server.stop()
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    if server is not None:
        report["server_args"] = server.args[3:]
    else:
        report["note_server"] = "a server this script did not start: not necessarily right after ready, nor cold"
    report["burst_label"] = f"max_pending {args.max_pending}" if server is not None else "external server"
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.markdown:
        print()
        print(markdown(report))
    print()
    for verdict, line in report["checks"]:
        print(f"{verdict}: {line}")
    return 1 if any(verdict == "FAIL" for verdict, _ in report["checks"]) else 0
