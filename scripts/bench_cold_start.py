"""Cold start of a fresh server process: time to ready, then the first requests' latency.

    python -m scripts.bench_cold_start [--scenarios cold,warmup,cache-first,cache-second]
                                       [--model PATH] [--dtype auto] [--json OUT] [--markdown]

For each scenario this starts `python -m serve --host 127.0.0.1 --port P ...` (a free loopback port, a
fresh API key in $LEV_API_KEYS, no JAX compilation-cache variables inherited), polls GET /health every
--poll-interval seconds and measures, from the spawn:

  up_s              the first 200 from /health
  ready_s           the first /health whose JSON says "status": "ready" (a /health with no "status", or
                    "status": "ok", counts as ready at its first 200: servers without a warming state)
  first_request_s   then the first SDK-style request: 3 questions (a noul, a 4-option choice, a
                    3-level score) about a ~2 KB ticket, sent on a fresh connection the way the official
                    typesafe-sdk sends it (compact JSON body, zstd-compressed at >= 1 KiB, its headers)
  second_request_s  a second request with a different shape (a 6-option choice), same connection
  at_up_request_s   with --at-up: the first request is instead sent at the first 200 from /health
                    (what an SDK client started beside the server meets), timed with its status;
                    the after-ready pair follows as usual
  programs          from /health at ready: programs compiled / loaded, their seconds in all, and
                    each one's (name, compiled or loaded, seconds)

Scenarios (server flags):
  cold          --no-compilation-cache --no-warmup   nothing compiled before the first request
  warmup        --no-compilation-cache               the start-up warm-up, no on-disk cache
  cache-first   --compilation-cache <fresh temp dir> first start: compiles and fills the cache
  cache-second  --compilation-cache <the same dir>   second start: reads it (implies cache-first)
`--no-compilation-cache` is passed only where `python -m serve --help` lists it (older servers have no
default cache, so leaving it out is the same). The server is always stopped (SIGTERM, then SIGKILL),
on errors and Ctrl-C too; every wait is bounded.

Checks (printed as PASS/FAIL/SKIP, exit code 1 when one fails):
  * the first SDK-style request after ready answers in < --first-request-target s (2) in every
    scenario that warms up (all but `cold`, which is reported for reference)
  * a second start is ready in well under the first's time: cache-second ready_s <
    --second-start-ratio (0.5) x cache-first ready_s
  * with --at-up, the request sent at /health up answers with 200 in < --at-up-target s (5) in
    every scenario
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from scripts.bench_options import STATE

ROOT = Path(__file__).resolve().parent.parent  # the repository root: `python -m serve` runs from here
LOOPBACK = "127.0.0.1"
SCENARIOS = ("cold", "warmup", "cache-first", "cache-second")
WARMED = ("warmup", "cache-first", "cache-second")  # the scenarios the first-request check applies to
NO_CACHE_FLAG = "--no-compilation-cache"
CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
CACHE_ENV_PREFIX = "JAX_PERSISTENT_CACHE_"
MODEL = "jev-latest"  # what the SDK sends by default

FIRST_QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this ticket?",
        "criteria": {
            "Billing": "Payments, invoices, refunds",
            "Technical": "Bugs, outages, exports, integrations",
            "Sales": "Pricing, upgrades, new contracts",
            "Account": "Seats, logins, SSO",
        },
    },
    "urgency": {
        "type": "score",
        "instructions": "How urgent is this ticket?",
        "criteria": ["Can wait", "Soon", "Immediately"],
    },
}
SECOND_QUESTIONS = {
    "topic": {
        "type": "choice",
        "instructions": "What is the main topic of this ticket?",
        "criteria": {
            "Double charge": "The customer was billed twice",
            "Seat change": "The number of seats or the plan changed",
            "Data export": "Exports or downloads fail",
            "Login": "Sessions, passwords, SSO",
            "Callback": "A promised call or answer never came",
            "Cancellation": "The customer wants to leave",
        },
    }
}


# --------------------------------------------------------------------------- pure helpers


def parse_scenarios(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in SCENARIOS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"--scenarios: pick from {', '.join(SCENARIOS)} (got {text!r})")
    if "cache-second" in names and "cache-first" not in names:
        names.insert(names.index("cache-second"), "cache-first")  # the second start needs a first one
    return sorted(set(names), key=SCENARIOS.index)


def scenario_flags(name: str, cache_dir: str | os.PathLike | None, has_no_cache_flag: bool) -> list[str]:
    """The `python -m serve` flags of a scenario."""
    no_cache = [NO_CACHE_FLAG] if has_no_cache_flag else []
    if name == "cold":
        return [*no_cache, "--no-warmup"]
    if name == "warmup":
        return no_cache
    if name in ("cache-first", "cache-second"):
        if cache_dir is None:
            raise ValueError(f"{name} needs a cache directory")
        return ["--compilation-cache", str(cache_dir)]
    raise ValueError(f"unknown scenario {name!r}")


def health_state(status_code: int, body: bytes | str | None) -> tuple[bool, bool]:
    """(up, ready) of one /health answer: up at a 200; ready when its JSON says "status": "ready", or
    has no "status" or says "ok" (a server without a warming state is ready when it answers)."""
    if status_code != 200:
        return False, False
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        doc = {}
    status = doc.get("status") if isinstance(doc, dict) else None
    return True, status in (None, "ok", "ready")


def sdk_version() -> str:
    try:
        from importlib.metadata import version

        return version("typesafe-sdk")
    except Exception:  # not installed: the version this script was written against
        return "0.7.5"


def sdk_request(state, questions: dict, *, api_key: str, model: str = MODEL) -> tuple[dict[str, str], bytes]:
    """(headers, body) of `client.system_one(state=..., questions=...)` as typesafe-sdk sends it: the body
    {"state", "model", "questions"} as compact UTF-8 JSON, zstd-compressed when it is 1 KiB or more
    (typesafe_sdk._core.compression), and the SDK's headers (typesafe_sdk._core.transport.prepare)."""
    body = json.dumps(
        {"state": state, "model": model, "questions": questions}, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")
    version = sdk_version()
    headers = {
        "Authorization": f"Bearer {api_key}",
        "Accept": "application/json",
        "User-Agent": f"typesafe-sdk/{version}",
        "X-TypeSafe-SDK": f"typesafe-sdk/{version}",
        "X-TypeSafe-Runtime": f"python/{platform.python_version()} ({sys.platform}; {platform.machine()})",
        "Content-Type": "application/json",
    }
    if len(body) >= 1024:
        compress = _zstd_compress()
        if compress is not None:
            body = compress(body)
            headers["Content-Encoding"] = "zstd"
    return headers, body


def _zstd_compress():
    try:
        if sys.version_info >= (3, 14):
            from compression.zstd import compress
        else:
            from backports.zstd import compress
        return compress
    except ImportError:
        try:
            import zstandard

            return zstandard.ZstdCompressor().compress
        except ImportError:
            return None


def checks(
    results: dict[str, dict], first_target_s: float, second_ratio: float, at_up_target_s: float = 5.0
) -> list[tuple[str, str]]:
    """[(PASS|FAIL|SKIP, text)] for the acceptance checks over the scenarios measured."""
    out = []
    for name, r in results.items():
        if "at_up_request" in r:
            s = r.get("at_up_request_s")
            ok = s is not None and s < at_up_target_s
            shown = "no answer" if s is None else f"{s:.3f} s"
            out.append(("PASS" if ok else "FAIL", f"{name}: request sent at /health up {shown} < {at_up_target_s:g} s"))
    warmed = [n for n in WARMED if n in results]
    if not warmed:
        out.append(("SKIP", f"first SDK-style request after ready < {first_target_s:g} s: no warmed-up scenario run"))
    for name in warmed:
        s = results[name].get("first_request_s")
        ok = s is not None and s < first_target_s
        shown = "no answer" if s is None else f"{s:.3f} s"
        out.append(
            ("PASS" if ok else "FAIL", f"{name}: first SDK-style request after ready {shown} < {first_target_s:g} s")
        )
    first, second = results.get("cache-first"), results.get("cache-second")
    if first is None or second is None:
        out.append(("SKIP", "second start ready well under the first: cache-first and cache-second not both run"))
    else:
        r = ratio(second.get("ready_s"), first.get("ready_s"))
        ok = r is not None and r < second_ratio
        out.append(
            (
                "PASS" if ok else "FAIL",
                f"second start ready in {_s(second.get('ready_s'))} vs first {_s(first.get('ready_s'))}: "
                f"ratio {'n/a' if r is None else f'{r:.2f}'} < {second_ratio:g}",
            )
        )
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def _cell(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def table(results: dict[str, dict]) -> str:
    lines = [f"{'scenario':13s} {'up_s':>8s} {'ready_s':>8s} {'first_req_s':>12s} {'second_req_s':>13s}  flags"]
    for name, r in results.items():
        lines.append(
            f"{name:13s} {_cell(r.get('up_s')):>8s} {_cell(r.get('ready_s')):>8s} "
            f"{_cell(r.get('first_request_s'), '.3f'):>12s} {_cell(r.get('second_request_s'), '.3f'):>13s}  "
            f"{' '.join(r.get('flags', []))}" + (f"  ERROR: {r['error']}" if r.get("error") else "")
        )
    return "\n".join(lines)


def markdown(report: dict) -> str:
    results = report["results"]
    lines = [
        "| scenario | server flags | dtype in use | up s | ready s | first request s | second request s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | `{' '.join(r.get('flags', [])) or '(defaults)'}` | {served_dtype(r) or '?'} | "
            f"{_cell(r.get('up_s'))} | "
            f"{_cell(r.get('ready_s'))} | {_cell(r.get('first_request_s'), '.3f')} | "
            f"{_cell(r.get('second_request_s'), '.3f')} |"
        )
    at_up = [(n, r) for n, r in results.items() if "at_up_request" in r]
    if at_up:
        lines.append("")
    for name, r in at_up:
        status = (r.get("at_up_request") or {}).get("status")
        lines.append(
            f"- {name}: the request sent at /health up answered in {_cell(r.get('at_up_request_s'), '.3f')} s "
            f"(HTTP {status})"
        )
    if report.get("cache_second_vs_first") is not None:
        lines += ["", f"cache-second ready time / cache-first: **{report['cache_second_vs_first']:.2f}**."]
    if report.get("checks"):
        lines += [""] + [f"- {verdict}: {text}" for verdict, text in report["checks"]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the server process


def served_dtype(result: dict) -> str | None:
    """The dtype the server said it computes in (/health at ready): what `--dtype auto` resolved to."""
    health = result.get("health")
    return health.get("dtype") if isinstance(health, dict) else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def serve_has_flag(flag: str, timeout: float = 120.0) -> bool:
    """Whether `python -m serve --help` lists `flag`."""
    try:
        p = subprocess.run(
            [sys.executable, "-m", "serve", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in p.stdout


def child_env(api_key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV and not k.startswith(CACHE_ENV_PREFIX)}
    env["LEV_API_KEYS"] = api_key
    return env


@contextlib.contextmanager
def server_process(args: list[str], env: dict[str, str], log_path: Path, stop_timeout: float = 30.0):
    """`python -m serve ARGS` with its output in `log_path`; always stopped on exit (SIGTERM, then SIGKILL)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "serve", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield proc
        finally:
            stop(proc, stop_timeout)


def stop(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    except KeyboardInterrupt:  # a second Ctrl-C while draining: go straight to SIGKILL
        pass
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def wait_ready(
    url: str, proc: subprocess.Popen, t_spawn: float, timeout: float, interval: float, *, up_only: bool = False
) -> dict:
    """Poll /health until ready (`up_only`: until it first answers): {"up_s", "ready_s", "health"}
    (seconds since `t_spawn`)."""
    out: dict = {"up_s": None, "ready_s": None, "health": None}
    deadline = t_spawn + timeout
    with httpx.Client(timeout=httpx.Timeout(2.0)) as c:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
            try:
                r = c.get(url + "/health")
                up, ready = health_state(r.status_code, r.content)
            except httpx.HTTPError:
                up = ready = False
            now = time.perf_counter() - t_spawn
            if up and out["up_s"] is None:
                out["up_s"] = round(now, 3)
                if up_only:
                    return out
            if ready:
                out["ready_s"] = round(now, 3)
                with contextlib.suppress(ValueError):
                    out["health"] = r.json()
                return out
            if time.perf_counter() > deadline:
                raise TimeoutError(f"not ready {timeout:g} s after the spawn (up: {out['up_s']})")
            time.sleep(interval)


def timed_request(c: httpx.Client, url: str, headers: dict, body: bytes) -> dict:
    t0 = time.perf_counter()
    r = c.post(url + "/v1/systemone", content=body, headers=headers)
    s = time.perf_counter() - t0
    out = {"s": round(s, 4), "status": r.status_code}
    if r.status_code == 200:
        doc = r.json()
        out["input_tokens"] = (doc.get("usage") or {}).get("input_tokens")
        out["answers"] = {k: a.get("choice", a.get("noul", a.get("score"))) for k, a in doc["answers"].items()}
    else:
        out["error"] = r.text[:300]
    return out


def run_scenario(
    name: str,
    flags: list[str],
    *,
    server_args: list[str],
    workdir: Path,
    startup_timeout: float,
    request_timeout: float,
    interval: float,
    at_up: bool = False,
) -> dict:
    api_key = "sk-bench-" + secrets.token_hex(12)
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    args = ["--host", LOOPBACK, "--port", str(port), *server_args, *flags]
    log_path = workdir / f"{name}.log"
    result: dict = {"flags": flags, "log": str(log_path)}
    first = sdk_request(STATE, FIRST_QUESTIONS, api_key=api_key)
    second = sdk_request(STATE, SECOND_QUESTIONS, api_key=api_key)
    t_spawn = time.perf_counter()
    with server_process(args, child_env(api_key), log_path) as proc:
        try:
            if at_up:
                result.update(wait_ready(url, proc, t_spawn, startup_timeout, interval, up_only=True))
                with httpx.Client(timeout=httpx.Timeout(request_timeout)) as c:
                    r0 = timed_request(c, url, *first)
                result["at_up_request"] = r0
                result["at_up_request_s"] = r0["s"] if r0["status"] == 200 else None
                up_s = result["up_s"]
                result.update(wait_ready(url, proc, t_spawn, startup_timeout, interval))
                result["up_s"] = up_s
            else:
                result.update(wait_ready(url, proc, t_spawn, startup_timeout, interval))
            result["programs"] = programs_of(result.get("health"))
            # a fresh client, as an SDK client created after the server came up: a new connection
            with httpx.Client(timeout=httpx.Timeout(request_timeout)) as c:
                r1 = timed_request(c, url, *first)
                r2 = timed_request(c, url, *second)
            result["first_request"], result["second_request"] = r1, r2
            result["first_request_s"] = r1["s"] if r1["status"] == 200 else None
            result["second_request_s"] = r2["s"] if r2["status"] == 200 else None
            if r1["status"] != 200 or r2["status"] != 200:
                result["error"] = f"HTTP {r1['status']} / {r2['status']}: {r1.get('error') or r2.get('error')}"
        except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
            result["error"] = f"{type(e).__name__}: {e}"
    if result.get("error"):
        with contextlib.suppress(OSError):
            result["log_tail"] = log_path.read_text(errors="replace")[-3000:]
    return result


def programs_of(health) -> dict | None:
    """What /health says of the programs at ready: counts, seconds, and each build."""
    p = health.get("programs") if isinstance(health, dict) else None
    if not isinstance(p, dict):
        return None
    keep = ("compiled", "loaded", "jax_cache_hits", "skipped_calls", "build_seconds", "builds")
    return {k: p[k] for k in keep if k in p}


def programs_lines(name: str, programs: dict | None) -> list[str]:
    if not programs:
        return [f"{name}: /health reports no programs"]
    builds = programs.get("builds") or []
    lines = [
        f"{name}: {programs.get('compiled', 0)} programs compiled, {programs.get('loaded', 0)} loaded, "
        f"{programs.get('build_seconds', 0):.1f} s in all (the last {len(builds)} below, slowest first)"
    ]
    for b in sorted(builds, key=lambda b: -b["seconds"]):
        lines.append(f"  {b['seconds']:7.3f} s  {b['how']:8s} {b['program']}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scripts.bench_cold_start",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--scenarios", type=parse_scenarios, default=list(SCENARIOS), help=",".join(SCENARIOS))
    p.add_argument("--model", help="--model for the server (default: the embedded SmolLM2-135M)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="the server's --dtype (default auto, as `make serve`: bf16 where the CPU multiplies it natively)",
    )
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="extra server argument (repeat)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds from spawn to ready (default 900)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="per-request client timeout (default 300)")
    p.add_argument("--poll-interval", type=float, default=0.05, help="seconds between /health polls (default 0.05)")
    p.add_argument("--first-request-target", type=float, default=2.0, help="seconds (default 2)")
    p.add_argument(
        "--at-up",
        action="store_true",
        help="send the first request as soon as /health first answers (not after ready), as the SDK would",
    )
    p.add_argument("--at-up-target", type=float, default=5.0, help="seconds for the --at-up request (default 5)")
    p.add_argument(
        "--second-start-ratio", type=float, default=0.5, help="cache-second / cache-first ready time (default 0.5)"
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the server logs and the cache directory")
    p.add_argument("--json", metavar="OUT", help="write the report here")
    p.add_argument("--markdown", action="store_true", help="also print a Markdown table for BENCHMARKS.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    server_args = ["--dtype", args.dtype, *(["--model", args.model] if args.model else []), *args.server_arg]
    has_no_cache = serve_has_flag(NO_CACHE_FLAG)
    workdir = Path(tempfile.mkdtemp(prefix="lev-cold-start-"))
    cache_dir = workdir / "jax-cache"  # fresh and empty: cache-first fills it, cache-second reads it
    cache_dir.mkdir()
    report: dict = {
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "state_chars": len(STATE),
        "no_compilation_cache_flag": has_no_cache,
        "results": {},
    }
    print(
        f"server: python -m serve {' '.join(server_args)}; {NO_CACHE_FLAG} "
        f"{'available' if has_no_cache else 'not available (omitted)'}; logs in {workdir}",
        flush=True,
    )
    try:
        for name in args.scenarios:
            flags = scenario_flags(name, cache_dir, has_no_cache)
            r = run_scenario(
                name,
                flags,
                server_args=server_args,
                workdir=workdir,
                startup_timeout=args.startup_timeout,
                request_timeout=args.request_timeout,
                interval=args.poll_interval,
                at_up=args.at_up,
            )
            report["results"][name] = r
            print(
                f"{name} ({served_dtype(r) or 'dtype ?'}): up {_s(r.get('up_s'))}, ready {_s(r.get('ready_s'))}, "
                f"first request {_cell(r.get('first_request_s'), '.3f')} s, "
                f"second request {_cell(r.get('second_request_s'), '.3f')} s"
                + (f", request at up {_cell(r.get('at_up_request_s'), '.3f')} s" if "at_up_request" in r else "")
                + (f"\n  ERROR {r['error']}\n{r.get('log_tail', '')}" if r.get("error") else ""),
                flush=True,
            )
            print("\n".join(programs_lines(name, r.get("programs"))), flush=True)
    except KeyboardInterrupt:
        print("interrupted; the server was stopped", file=sys.stderr)
        return 130
    finally:
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
            for r in report["results"].values():
                r.pop("log", None)
    res = report["results"]
    report["cache_second_vs_first"] = ratio(
        (res.get("cache-second") or {}).get("ready_s"), (res.get("cache-first") or {}).get("ready_s")
    )
    report["checks"] = checks(res, args.first_request_target, args.second_start_ratio, args.at_up_target)
    print()
    print(table(res))
    if report["cache_second_vs_first"] is not None:
        print(f"cache-second ready / cache-first ready: {report['cache_second_vs_first']:.2f}")
    for verdict, text in report["checks"]:
        print(f"{verdict}: {text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if args.markdown:
        print()
        print(markdown(report))
    failed = any(v == "FAIL" for v, _ in report["checks"]) or any(r.get("error") for r in res.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
