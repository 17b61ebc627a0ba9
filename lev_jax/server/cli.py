"""`lev serve` (from the repository root also `python -m serve`): load an engine, then serve it with uvicorn.

The port is bound only after the model is loaded, so a client that can connect can be answered; the
warm-up then compiles common shapes in the background (/health: "warming", then "ready").
SIGINT/SIGTERM: stop accepting, finish what is in flight, exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from lev_jax import domain, runtime
from lev_jax.server.app import API_KEYS_ENV, ServerConfig, api_keys_from_env, create_app, is_loopback_name
from lev_jax.server.warmup import DEFAULT_BUDGET_S

log = logging.getLogger("lev_jax.server")

# Idle keep-alive connections stay open longer than any Retry-After the server hands out
# (scheduler.MAX_RETRY_AFTER_S): a client that waits it out reuses its connection instead of racing
# the server's close (uvicorn's default of 5 s lost requests in the load test's retry phase).
KEEP_ALIVE_S = 75


def uvicorn_config(app, *, host: str, port: int, log_level: str = "info", drain_timeout_s: float = 30.0):
    """The one uvicorn configuration every server runs with (`python -m serve` and the test servers), so
    tests meet the connection handling clients do."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=drain_timeout_s + 5,
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def exposure_warning(host: str, api_keys) -> str | None:
    """The warning for a server others can reach with auth off: bound beyond loopback (an address
    that is not 127.0.0.0/8 or ::1, a wildcard, or a host name other than localhost) without keys."""
    if api_keys or is_loopback_name(host):
        return None
    return (
        f"serving on {host} with auth off: anyone who can reach this address can use the server; "
        f"set ${API_KEYS_ENV} or bind to 127.0.0.1"
    )


PROG = "lev serve"  # how the installed console script runs this; serve/__main__.py passes its own


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Serve a Jev-compatible POST /v1/systemone API. API keys: $"
            + API_KEYS_ENV
            + " (comma- or space-separated); auth is off when it is empty. Contract: docs/API.md."
        ),
    )
    p.add_argument(
        "--model",
        "--checkpoint",
        dest="model",
        default=None,
        help="checkpoint directory (a Qwen3.5 VL one reads images), .gguf file, training run directory, release "
        "directory (python -m train release), peft adapter directory, or hub id (default: the fine-tuned release "
        "shipped in the package, on the embedded SmolLM2-135M)",
    )
    p.add_argument(
        "--base-only",
        action="store_true",
        help="with no --model: serve the raw embedded SmolLM2-135M, not the shipped fine-tuned release",
    )
    p.add_argument(
        "--image-pixels",
        type=int,
        default=None,
        help=f"vision checkpoints: resize each image to at most this many pixels (default {domain.IMAGE_PIXEL_BUDGET})",
    )
    p.add_argument(
        "--prompt-style",
        default=None,
        choices=("chat", "plain"),
        help="default: chat, or what a training run directory was trained with",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=runtime.DTYPES,
        help="auto (default): bfloat16 with fp32 accumulation where the device multiplies bf16 natively "
        "(GPU, TPU, CPUs with AMX / AVX512-BF16), else float32",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--any-host",
        action="store_true",
        help="bound to loopback with auth off, still answer requests whose Host names something else (behind a "
        "local reverse proxy that passes the public name); by default those are answered 421",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--max-pending",
        type=int,
        default=d.max_pending,
        help=f"requests queued or running at once; more are answered 429 (default {d.max_pending})",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=d.max_batch_tokens,
        help=f"input tokens per device call (default {d.max_batch_tokens})",
    )
    p.add_argument(
        "--max-batch-rows",
        type=int,
        default=d.max_batch_rows,
        help=f"requests per device call (default {d.max_batch_rows})",
    )
    p.add_argument(
        "--batch-wait-ms",
        type=float,
        default=d.batch_wait_ms,
        help=f"an idle server waits this long for concurrent requests to join a batch (default {d.batch_wait_ms:g})",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=d.timeout_s,
        help=f"seconds from arrival to answer before a 504 (default {d.timeout_s:g})",
    )
    p.add_argument(
        "--watchdog",
        type=float,
        default=d.watchdog_s,
        metavar="SECONDS",
        help="a request's device call running longer than this (a cold compile included) makes /health answer "
        "503 and new requests 503 until it returns (default %(default)g)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=d.max_body_bytes / 2**20,
        help=f"request body limit, compressed and decompressed (default {d.max_body_bytes / 2**20:g})",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout_s,
        help="on shutdown, how long to wait for requests in flight (default %(default)g)",
    )
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--compilation-cache",
        metavar="DIR",
        default=None,
        help=f"keep compiled device programs in DIR, so a restart skips compiling what it has seen "
        f"(default: ${runtime.CACHE_ENV}, else {runtime.default_cache_dir()})",
    )
    cache.add_argument(
        "--no-compilation-cache", action="store_true", help="compile every program afresh in this process"
    )
    p.add_argument(
        "--warmup-budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        metavar="SECONDS",
        help="at start, compile the programs ordinary requests hit, in the background, for at most this "
        "long; /health says warming, then ready (default %(default)g)",
    )
    p.add_argument("--no-warmup", action="store_true", help="no warm-up: ready at once, every new shape compiles")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServerConfig:
    """The server settings; a value out of range is a usage error (one line, exit code 2)."""
    for flag, value in (
        ("--max-pending", args.max_pending),
        ("--max-batch-tokens", args.max_batch_tokens),
        ("--max-batch-rows", args.max_batch_rows),
    ):
        if value < 1:
            parser.error(f"{flag} must be at least 1")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.watchdog <= 0:
        parser.error("--watchdog must be positive")
    if args.image_pixels is not None and args.image_pixels < 1:
        parser.error("--image-pixels must be positive")
    if args.warmup_budget < 0:
        parser.error("--warmup-budget must not be negative")
    return ServerConfig(
        max_pending=args.max_pending,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_rows=args.max_batch_rows,
        batch_wait_ms=args.batch_wait_ms,
        timeout_s=args.timeout,
        watchdog_s=args.watchdog,
        max_body_bytes=int(args.max_body_mb * 2**20),
        drain_timeout_s=args.drain_timeout,
        api_keys=(keys := api_keys_from_env()),
        # bound to loopback with auth off: a browser page must not reach it under another name
        loopback_hosts_only=is_loopback_name(args.host) and not keys and not args.any_host,
        warmup_budget_s=0.0 if args.no_warmup else args.warmup_budget,
    )


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    config = config_from_args(args, parser)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )

    import uvicorn

    import lev_jax

    runtime.enable_compilation_cache("" if args.no_compilation_cache else args.compilation_cache)
    t0 = time.perf_counter()
    try:
        if args.base_only and args.model is not None:
            raise ValueError("--base-only applies to the default model; drop it or --model")
        engine = lev_jax.load(
            model=args.model,
            prompt_style=args.prompt_style,
            dtype=args.dtype,
            image_pixel_budget=args.image_pixels,
            base_only=args.base_only,
        )
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(f"{prog}: cannot load the model: {e}", file=sys.stderr)
        return 2
    log.info(
        "loaded %s in %.1fs (%s on %s; compilation cache %s)",
        engine.model_name,
        time.perf_counter() - t0,
        engine.backbone.dtype,
        engine.platform,
        runtime.compilation_cache_dir() or "off",
    )
    if warning := exposure_warning(args.host, config.api_keys):
        log.warning(warning)
    # the shapes traffic compiles are recorded beside the compiled programs, to be warmed next start
    app = create_app(engine, dataclasses.replace(config, shape_log_dir=runtime.compilation_cache_dir()))
    uv = uvicorn_config(
        app, host=args.host, port=args.port, log_level=args.log_level, drain_timeout_s=config.drain_timeout_s
    )
    uvicorn.Server(uv).run()
    return 0
