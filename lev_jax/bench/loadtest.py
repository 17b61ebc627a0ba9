"""Bounded load test of the System One server, on loopback only.

    python -m scripts.loadtest                          # starts `python -m serve` (embedded model) itself
    python -m scripts.loadtest --model /path/to/ckpt --burst 200 --max-pending 16 [--dtype bfloat16]
    python -m scripts.loadtest --url http://127.0.0.1:8000 --key KEY   # a server you started (loopback only)

Phases (every loop is bounded in count and time, and the script stops by itself):
1. alone:       each distinct request once, serially: the reference answers.
2. burst:       `--burst` requests at once against a small `--max-pending`: every one must get 200, or
                429/503 with Retry-After; none may be lost or hang; every 200 must equal its answer alone.
3. retry:       the same burst, each client honouring Retry-After until it gets its answer (bounded):
                all must end with 200 and the reference answers.
4. throughput:  closed loops at concurrency 1 and 8 (`--requests` each): requests/s, p50/p99 latency.

Prints a JSON report (and `--markdown` a table for BENCHMARKS.md); exits 1 if a check fails.
`run_load` is the same load test as a coroutine (tests/test_serve_load.py runs it in-process).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import time
from urllib.parse import urlparse

import httpx

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


def same_answers(a: dict, b: dict, tol: float = 1e-5) -> bool:
    if a.keys() != b.keys():
        return False
    for qid in a:
        x, y = a[qid], b[qid]
        if x.get("type") != y.get("type"):
            return False
        vx = x.get("probabilities") or {"noul": x.get("noul")}
        vy = y.get("probabilities") or {"noul": y.get("noul")}
        if vx.keys() != vy.keys() or any(abs(vx[k] - vy[k]) > tol for k in vx):
            return False
        if x.get("choice") is not None and x.get("choice") != y.get("choice"):
            if abs(vx[x["choice"]] - vx[y["choice"]]) > tol:
                return False
    return True


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

    async def closed_loop(self, reqs: list[dict], concurrency: int, total: int) -> dict:
        results: list[dict] = []
        counter = iter(range(total))
        async with self.client(concurrency) as c:

            async def worker():
                for i in counter:
                    if time.monotonic() > self.deadline:
                        return
                    results.append(await self.one(c, reqs[i % len(reqs)]))

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
        }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 1)


def _count(xs) -> dict:
    out: dict = {}
    for x in xs:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


async def compiled_programs(load: Load) -> int | None:
    async with load.client(1) as c:
        try:
            return (await c.get(load.url + "/health")).json().get("compiled_programs")
        except (httpx.HTTPError, ValueError):
            return None


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
) -> dict:
    """All four phases against `url` (loopback). Returns the report; report["failures"] lists broken checks."""
    check_loopback(url)
    load = Load(url, key, timeout, time.monotonic() + budget_s)
    reqs = payloads(distinct)
    failures: list[str] = []
    report: dict = {"url": url, "burst_size": burst, "distinct_requests": distinct}

    alone = await load.alone(reqs)
    if any(r["status"] != 200 for r in alone):
        failures.append(f"alone: not every request was answered: {_count(r['status'] for r in alone)}")
        report["failures"] = failures
        return report
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
        differ = [r["i"] for r in ok if not same_answers(r["answers"], reference[r["i"] % distinct])]
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
        report["speedup_8_vs_1"] = round(parallel["throughput_rps"] / serial["throughput_rps"], 2)
    for phase in (serial, parallel):
        if phase["ok"] != phase["requests"]:
            failures.append(f"throughput at concurrency {phase['concurrency']}: statuses {phase['statuses']}")
    report["failures"] = failures
    return report


def markdown(report: dict, title: str = "Serving load test") -> str:
    lines = [
        f"### {title}",
        "",
        "| phase | requests | answered | statuses | p50 ms | p99 ms | wall s | throughput req/s |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
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
            p = report[key]
            lines.append(
                f"| closed loop, concurrency {p['concurrency']} | {p['requests']} | {p['ok']} | "
                f"{json.dumps(p['statuses'])} | {p['p50_ms']} | {p['p99_ms']} | {p['wall_s']} | "
                f"{p['throughput_rps']} |"
            )
    if "speedup_8_vs_1" in report:
        lines += ["", f"Throughput at concurrency 8 vs 1: **{report['speedup_8_vs_1']}x**."]
    if report.get("failures"):
        lines += ["", "Failed checks: " + "; ".join(report["failures"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
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
    p.add_argument("--burst", type=int, default=200)
    p.add_argument("--distinct", type=int, default=8, help="distinct request bodies")
    p.add_argument("--requests", type=int, default=64, help="requests per closed-loop throughput phase")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request client timeout (s)")
    p.add_argument("--budget", type=float, default=600.0, help="overall time budget (s)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    args = p.parse_args(argv)

    server = None
    if args.url:
        url = args.url
    else:
        from lev_jax.server.testing import ServerProcess

        server_args = ["--max-pending", str(args.max_pending), "--dtype", args.dtype] + (
            ["--model", args.model] if args.model else []
        )
        server = ServerProcess(server_args, startup_timeout=600).__enter__()
        url = server.url
    try:
        report = asyncio.run(
            run_load(
                url,
                key=args.key,
                burst=args.burst,
                distinct=args.distinct,
                requests=args.requests,
                timeout=args.timeout,
                budget_s=args.budget,
            )
        )
    finally:
        if server is not None:
            server.stop()
    report["burst_label"] = f"max_pending {args.max_pending}" if server is not None else "external server"
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.markdown:
        print()
        print(markdown(report))
    return 1 if report["failures"] else 0
