"""The FastAPI application: `POST /v1/systemone`, `GET /v1/models`, `GET /health`, `GET /metrics`.

    app = create_app(engine, ServerConfig(max_pending=64, api_keys={"k1"}))

The engine is a `lev_jax.DecisionEngine` (`model_name`, `supports_images`, `plan`, `predict_many`,
`info`; lev_jax.Engine is one); anything else is refused when the app is created. Questions reach the
engine in the wire's own shape. docs/API.md is the contract.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
import ipaddress
import logging
import math
import os
import re
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from lev_jax.engine import DecisionEngine
from lev_jax.errors import ImageTooLargeError, RequestError, ReservedTextError, TokenLimitError
from lev_jax.server import body as body_lib
from lev_jax.server import errors as E
from lev_jax.server import wire
from lev_jax.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from lev_jax.server.metrics import Metrics
from lev_jax.server.scheduler import QueueFull, Scheduler, ShuttingDown, Unavailable
from lev_jax.server.warmup import ShapeLog, Warmup

log = logging.getLogger("lev_jax.server")

API_KEYS_ENV = "LEV_API_KEYS"
REQUEST_ID_HEADER = "x-typesafe-request-id"
# elastic depth: "auto", "full" or an exit's layer count (the Jev body stays as it is); the answer's
# `x_depth` says, per question, which depth answered
DEPTH_HEADER = "x-lev-depth"
ALIAS = "jev-latest"
RELEASE_DATE = "2026-12-01"


def api_keys_from_env(environ=os.environ) -> frozenset[str]:
    """Keys from $LEV_API_KEYS, separated by commas or whitespace. None set: auth is off."""
    raw = environ.get(API_KEYS_ENV, "")
    return frozenset(k for k in raw.replace(",", " ").split() if k)


@dataclass
class ServerConfig:
    max_pending: int = 64  # queued + running requests; more get 429
    max_batch_tokens: int = 16384  # input tokens per device call (one bigger request runs alone)
    max_batch_rows: int = 64  # requests per device call
    batch_wait_ms: float = 2.0  # an idle server waits this long for a burst to join the first batch
    timeout_s: float = 60.0  # request deadline, from arrival (parsing, planning, queue, device); 504 past it
    # a request's device call running longer than this makes /health 503 ("stuck") and new requests 503
    watchdog_s: float = 300.0
    max_body_bytes: int = 32 << 20  # raw and decompressed body limit; 413 past it
    drain_timeout_s: float = 60.0  # graceful shutdown: how long to wait for in-flight requests
    api_keys: frozenset[str] = field(default_factory=frozenset)
    release_date: str = RELEASE_DATE
    # seconds of background warm-up at start (lev_jax/server/warmup.py); 0: none, ready at once
    warmup_budget_s: float = 0.0
    # where to keep the shape log (warmup.ShapeLog): the compilation cache directory in use; None: no log
    shape_log_dir: str | None = None
    # answer only requests whose Host names a loopback address or localhost (421 otherwise): what
    # `lev serve` sets when bound to loopback with auth off, so that a web page whose name rebinds to
    # 127.0.0.1 (DNS rebinding) cannot use the server through a visitor's browser
    loopback_hosts_only: bool = False


class _ClientGone(Exception):
    pass


# The HTTP methods a request may be counted under; any other name a client sends is counted as
# "other", so that arbitrary method names cannot create metric series without bound.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"})


def is_loopback_name(host: str) -> bool:
    """Whether a host (an address, a name, or a Host header's value with its port) is loopback:
    127.0.0.0/8, ::1 (bracketed or not) or localhost."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:  # localhost:8000, 127.0.0.1:8000 (a bare IPv6 address has more colons)
        host = host.rsplit(":", 1)[0]
    if host in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another name: it may resolve anywhere, and a page may make it resolve here
        return False


class LoopbackHostsOnly:
    """Pure ASGI middleware: a request whose Host header names anything but loopback is answered 421
    before routing (a request without one, not a browser's, passes)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), None)
            if host is not None and not is_loopback_name(host):
                shown = host if len(host) <= 100 else host[:100] + "..."
                resp = _error_response(
                    421,
                    E.API_USAGE,
                    f"Host {shown!r} is not a loopback name: this server is bound to loopback with auth off and "
                    f"answers requests addressed to localhost or a loopback address only (set ${API_KEYS_ENV} to "
                    "serve other names)",
                )
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def _error_response(status: int, error_type: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": {"error_type": error_type, "message": message}}, status_code=status, headers=headers)


class RequestContext:
    """Pure ASGI middleware: a request id on every response, latency/status metrics, and a JSON 500
    (with the id) for anything unhandled. Pure ASGI, so a client disconnect still reaches the route."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = "req_" + secrets.token_hex(12)
        scope.setdefault("state", {})["request_id"] = rid
        t0 = time.perf_counter()
        status = {"code": 0, "started": False}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                status["started"] = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER.encode()]
                headers.append((REQUEST_ID_HEADER.encode(), rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 — anything that escaped the exception handlers
            log.exception("unhandled error in %s %s (%s)", scope.get("method"), scope.get("path"), rid)
            if not status["started"]:
                resp = _error_response(500, E.INTERNAL, f"Internal server error (request {rid})")
                await resp(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            code = status["code"] or 499  # no response started: the client went away
            method = scope.get("method", "")
            method = method if method in _METHODS else "other"
            self.metrics.observe_request(method, path, code, time.perf_counter() - t0)


def create_app(engine: DecisionEngine, config: ServerConfig | None = None) -> FastAPI:
    if not isinstance(engine, DecisionEngine):
        raise TypeError(
            f"create_app needs a lev_jax.DecisionEngine ({', '.join(_PROTOCOL_MEMBERS)}); "
            f"{type(engine).__name__} lacks {', '.join(_missing_members(engine))}"
        )
    cfg = config or ServerConfig()
    metrics = Metrics(
        max_pending=cfg.max_pending,
        compiled_programs=lambda: _engine_info(engine).get("compiled_programs"),
        vision=lambda: _engine_info(engine).get("vision"),
    )
    scheduler = Scheduler(
        # (answers, usage) per request: the response reports the engine's own token counts
        lambda requests: engine.predict_many(requests, with_usage=True),
        max_pending=cfg.max_pending,
        max_batch_tokens=cfg.max_batch_tokens,
        max_batch_rows=cfg.max_batch_rows,
        batch_wait_s=cfg.batch_wait_ms / 1000,
        metrics=metrics,
        # engines that know their compiled programs keep compiling requests out of the ready lane
        ready=getattr(engine, "ready", None),
        # a compile is one host thread's work: as many side by side as the host has cores, up to 2
        compile_lanes=max(1, min(2, os.cpu_count() or 1)),
        watchdog_s=cfg.watchdog_s,
    )
    shape_log = None
    if cfg.shape_log_dir and hasattr(engine, "warm"):
        shape_log = ShapeLog.for_engine(cfg.shape_log_dir, engine)
    warmup = Warmup(engine, cfg.warmup_budget_s, shape_log=shape_log)
    if shape_log is not None:
        engine.on_compile = warmup.record
    model_name = engine.model_name
    accepted_models = {ALIAS, model_name}
    takes_depth = "depth" in inspect.signature(engine.plan).parameters  # an engine with elastic depth
    started = time.time()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await scheduler.start()
        warmup.start()
        log.info(
            "serving %s (max_pending=%d, max_batch_tokens=%d, timeout=%gs, auth %s)",
            model_name,
            cfg.max_pending,
            cfg.max_batch_tokens,
            cfg.timeout_s,
            "on" if cfg.api_keys else "off",
        )
        try:
            yield
        finally:
            warmup.stop()
            n = scheduler.pending
            if n:
                log.info("shutting down: finishing %d request(s) in flight", n)
            if not await scheduler.drain(cfg.drain_timeout_s):
                log.warning("shutdown: gave up on requests still in flight after %gs", cfg.drain_timeout_s)

    app = FastAPI(
        title="lev-jax System One API",
        version=_version(),
        lifespan=lifespan,
        description="A Jev-compatible (TypeSafe System One) decision engine: calibrated probabilities "
        "over supplied candidates. Contract: docs/API.md.",
    )
    app.state.engine = engine
    app.state.scheduler = scheduler
    app.state.warmup = warmup
    app.state.metrics = metrics
    app.state.config = cfg
    if cfg.loopback_hosts_only:  # inside RequestContext: a refusal has a request id and is counted
        app.add_middleware(LoopbackHostsOnly)
    app.add_middleware(RequestContext, metrics=metrics)

    # -- error shapes (a 422 is FastAPI's own RequestValidationError answer: that shape is the contract)
    @app.exception_handler(E.ApiError)
    async def _api_error(request: Request, exc: E.ApiError):
        return _error_response(exc.status, exc.error_type, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        # FastAPI's shape, bounded: a 422 never grows with the body that earned it
        return JSONResponse({"detail": E.bounded_errors(exc.errors())}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        etype = E.STATUS_ERROR_TYPES.get(exc.status_code, E.API_USAGE if exc.status_code < 500 else E.INTERNAL)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return _error_response(exc.status_code, etype, message, getattr(exc, "headers", None))

    # -- auth ----------------------------------------------------------------------------------
    def check_auth(request: Request) -> None:
        if not cfg.api_keys:
            return  # auth off: any Authorization header is ignored
        header = request.headers.get("authorization")
        if not header:
            raise E.ApiError(403, E.AUTHENTICATION, "Missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise E.ApiError(403, E.AUTHENTICATION, "Missing API key: the Authorization header is not 'Bearer <key>'")
        given = token.encode("utf-8", "surrogateescape")
        ok = False
        for key in cfg.api_keys:
            ok |= hmac.compare_digest(given, key.encode("utf-8"))
        if not ok:
            raise E.ApiError(401, E.AUTHENTICATION, "Invalid API key")

    # -- routes --------------------------------------------------------------------------------
    @app.post(
        "/v1/systemone",
        response_model=wire.SystemOneResponse,
        responses=_ERROR_RESPONSES,
        openapi_extra=_REQUEST_BODY,
        summary="Answer questions about a state",
        description="Calibrated probabilities for noul, choice and score questions about one state.",
    )
    async def systemone(request: Request):
        t0 = time.perf_counter()
        deadline = t0 + cfg.timeout_s

        async def off_loop(fn, *args, **kwargs):
            """fn in a worker thread, within the request's deadline (504 past it). Parsing and planning
            count against the deadline as queueing does: a request that spends it before the queue is
            answered then, not after. The thread is abandoned, not stopped: its result is dropped."""
            call = functools.partial(fn, *args, **kwargs)
            try:
                with anyio.fail_after(max(0.0, deadline - time.perf_counter())):
                    return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
            except TimeoutError:
                metrics.timed_out.inc()
                raise E.ApiError(504, E.TIMEOUT, f"No answer within the server timeout of {cfg.timeout_s:g}s") from None

        check_auth(request)
        content_type = request.headers.get("content-type")
        body_lib.check_content_type(content_type)
        try:
            raw = await body_lib.read_body(request, cfg.max_body_bytes)
        except ClientDisconnect:
            metrics.cancelled.inc()
            return Response(status_code=499)
        # admitted before anything is spent on it (parsing, planning): a full server answers 429 at once
        try:
            scheduler.admit()
        except (QueueFull, ShuttingDown) as e:
            raise _refused(e) from None
        slot = [True]
        try:
            args = (raw, request.headers.get("content-encoding"), content_type, cfg.max_body_bytes)
            # decompression, JSON and validation off the event loop, whatever the size: a few hundred
            # compressed bytes can hold seconds of that work, and /health must answer meanwhile
            req, parts = await off_loop(_parse, *args)

            if req.model not in accepted_models:
                raise E.usage_error(f"Unknown model: {req.model}")
            boxes = [qid for qid, q in req.questions.items() if q.type == "box"]
            if boxes:
                raise E.usage_error(
                    f"Model {model_name} cannot locate boxes: question {boxes[0]!r} has type 'box', "
                    "which asks for coordinates; this server reads decisions: use noul, choice or score"
                )
            # base64, signatures and placeholder lookup walk the whole request: off the event loop too
            images = await off_loop(body_lib.resolve_assets, req.assets, parts, req.state, req.questions)
            if images and not engine.supports_images:
                where = sorted({w for img in images for w in img.references})
                raise E.usage_error(
                    f"Model {model_name} is text-only and cannot read images: the request has {len(images)} image "
                    f"asset(s)"
                    + (f" referenced in {', '.join(where)}" if where else "")
                    + ". Remove the images or serve a vision checkpoint (a Qwen3.5 VL model)."
                )

            # the wire shape is the engine's shape: nulls mean "nothing", as the engine reads them
            questions = {qid: q.model_dump() for qid, q in req.questions.items()}
            plan_args = (req.state, questions) + (({img.alias: img.data for img in images},) if images else ())
            plan_kwargs = {}
            depth = request.headers.get(DEPTH_HEADER)
            if depth is not None:
                if not takes_depth:
                    raise E.usage_error(f"Model {model_name} is served at one depth; remove the {DEPTH_HEADER} header")
                plan_kwargs["depth"] = depth.strip()
            try:  # plan once (images decoded too): count tokens and refuse over-budget requests before they queue
                plan = await off_loop(engine.plan, *plan_args, **plan_kwargs)
                counts = plan.token_counts()
            except (TokenLimitError, ImageTooLargeError) as e:
                raise E.too_large(str(e)) from None
            except ReservedTextError as e:  # text the model reads as structure: a validation failure of that field
                raise E.validation_error(e.loc, str(e), "value_error", None) from None
            except RequestError as e:
                raise E.ApiError(400, e.error_type, str(e)) from None

            try:
                ticket = scheduler.submit(plan, None, counts["input_tokens"], admitted=True)
            except ShuttingDown as e:
                raise _refused(e) from None
            slot.clear()  # the ticket holds it now, until its answer

            try:
                answers = await _await(request, ticket, max(0.0, deadline - time.perf_counter()))
            except _ClientGone:
                metrics.cancelled.inc()
                return Response(status_code=499)
            except TimeoutError:
                metrics.timed_out.inc()
                raise E.ApiError(504, E.TIMEOUT, f"No answer within the server timeout of {cfg.timeout_s:g}s") from None
            except TokenLimitError as e:
                raise E.too_large(str(e)) from None
            except RequestError as e:
                raise E.ApiError(400, e.error_type, str(e)) from None
            except ShuttingDown:
                raise E.ApiError(503, E.OVERLOADED, "Server is shutting down", {"Retry-After": "5"}) from None
            except Exception:  # noqa: BLE001 — the engine failed on this request: a server bug, not bad input
                rid = request.scope.get("state", {}).get("request_id", "?")
                log.exception("engine failed on request %s", rid)
                raise E.ApiError(500, E.INTERNAL, f"Internal server error (request {rid})") from None

            answers, usage_reported = answers  # predict_many(..., with_usage=True): (answers, usage)
            ordered = {}
            for qid, q in req.questions.items():
                a = answers[qid]
                if q.type == "score":  # the legend echoes the request's levels, structured ones unchanged
                    a = {**a, "legend": {str(i): level for i, level in enumerate(q.criteria)}}
                ordered[qid] = a
            input_tokens = int(usage_reported.get("input_tokens", counts["input_tokens"]))
            usage = {"input_tokens": input_tokens, "output_tokens": len(ordered)}
            metrics.observe_answer(usage["input_tokens"], usage["output_tokens"])
            return JSONResponse(
                {
                    "model": model_name,
                    "answers": ordered,
                    "usage": usage,
                    "x_cached_input_tokens": int(usage_reported.get("cached_input_tokens", 0)),
                    "x_readout": {qp.qid: qp.route for qp in plan.questions},
                    **({"x_depth": usage_reported["depths"]} if usage_reported.get("depths") else {}),
                    **(
                        {
                            "x_image_tokens": int(usage_reported["image_tokens"]),
                            "x_cached_image_tokens": int(usage_reported.get("cached_image_tokens", 0)),
                        }
                        if usage_reported.get("image_tokens")
                        else {}
                    ),
                }
            )
        finally:
            if slot:  # refused, failed or gone before its ticket took the slot
                scheduler.release()

    def _refused(e: ShuttingDown | QueueFull) -> E.ApiError:
        if isinstance(e, QueueFull):
            return E.ApiError(
                429,
                E.RATE_LIMIT,
                f"Server busy: {cfg.max_pending} requests in flight; retry after {e.retry_after_s:.2f}s",
                {"Retry-After": str(e.retry_after), "retry-after-ms": str(math.ceil(e.retry_after_s * 1000))},
            )
        if isinstance(e, Unavailable):
            return E.ApiError(503, E.OVERLOADED, f"Server unavailable: {e.reason}", {"Retry-After": "30"})
        return E.ApiError(503, E.OVERLOADED, "Server is shutting down", {"Retry-After": "5"})

    async def _await(request: Request, ticket, timeout: float):
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({ticket.future, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if ticket.future.done() and not ticket.future.cancelled():
            return ticket.future.result()
        scheduler.cancel(ticket)
        if gone in done:
            raise _ClientGone()
        raise TimeoutError()

    @app.get(
        "/v1/models",
        response_model=wire.ModelList,
        responses={k: _ERROR_RESPONSES[k] for k in (401, 403)},
        summary="List the models this server answers for",
    )
    async def models(request: Request):
        check_auth(request)
        return {
            "models": [
                {
                    "name": ALIAS,
                    "description": f"Alias of {model_name}, the model this server runs.",
                    "release_date": cfg.release_date,
                },
                {
                    "name": model_name,
                    "description": f"{model_name}: System One decision engine (lev-jax, "
                    f"{'reads images' if engine.supports_images else 'text only'})."
                    + release_note(_engine_info(engine)),
                    "release_date": cfg.release_date,
                },
            ]
        }

    @app.get(
        "/health",
        summary="Liveness, configuration and load",
        responses={503: {"description": "The device is stuck (a call past the watchdog) or the worker is dead"}},
    )
    async def health():
        info = _engine_info(engine)
        # not 200 when nothing admitted would be answered: a probe restarts what cannot recover
        down = scheduler.unavailable()
        if down:
            status = "dead" if scheduler.dead else "stuck"
        else:  # ready: the warm-up has run (requests are answered while warming, but may compile)
            status = "draining" if scheduler.closing else warmup.state
        body = {
            "status": status,
            **({"unavailable": down} if down else {}),
            "warmup": warmup.info(),
            "dtype": info.get("dtype"),
            "platform": info.get("platform"),
            # whether programs persist, not where: /health names no directory of the host
            "compilation_cache": bool(info.get("compilation_cache")),
            "compile_lane": {
                "requests": scheduler.cold_runs,
                "background_compiles": scheduler.background_compiles,
                "split_batches": scheduler.split_batches,
            },
            "model": info.get("model", model_name),
            "checkpoint": info.get("checkpoint"),
            "release": info.get("release"),
            "prompt_style": info.get("prompt_style"),
            "calibrated": info.get("calibrated"),
            "mode_b": info.get("mode_b"),
            # elastic depth: the layers, the exits a request can ask for, auto's threshold, per-exit quality
            "depth": info.get("depth"),
            "noul_readout": info.get("noul_readout"),
            "option_cap": info.get("option_cap"),
            "supports_images": bool(engine.supports_images),
            # a vision checkpoint's image limits and pixel budget, feature cache and tower counters
            "vision": info.get("vision"),
            "in_flight": scheduler.pending,
            "queued": scheduler.queued,
            "max_pending": cfg.max_pending,
            "max_batch_tokens": cfg.max_batch_tokens,
            "timeout_s": cfg.timeout_s,
            "batches": scheduler.batches,
            "compiled_programs": info.get("compiled_programs"),
            "programs": info.get("programs"),
            "buckets": info.get("buckets"),
            "auth": bool(cfg.api_keys),
            "uptime_s": round(time.time() - started, 3),
            "version": _version(),
        }
        return JSONResponse(_without_paths(body), status_code=503 if down else 200)

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, sub in _request_schemas().items():
            comps.setdefault(name, sub)
        schema["components"]["securitySchemes"] = {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": f"Required only when the server has keys in ${API_KEYS_ENV}; otherwise ignored.",
            }
        }
        for path in ("/v1/systemone", "/v1/models"):
            for op in schema["paths"].get(path, {}).values():
                op["security"] = [{"bearer": []}, {}]
        # (every header declared here is sent on every response of its status: `required`, so that a
        # conformance checker holds the server to it)
        rid = {
            "description": "Request id (req_ + 24 hex digits), on every response.",
            "required": True,
            "schema": {"type": "string", "pattern": "^req_[0-9a-f]{24}$"},
        }
        for ops in schema["paths"].values():
            for op in ops.values():
                for code, resp in op.get("responses", {}).items():
                    headers = resp.setdefault("headers", {})
                    headers[REQUEST_ID_HEADER] = rid
                    if code in ("429", "503"):
                        headers["Retry-After"] = {
                            "description": "Seconds to wait before retrying (integer, >= 1).",
                            "required": True,
                            "schema": {"type": "integer", "minimum": 1},
                        }
                    if code == "429":
                        headers["retry-after-ms"] = {
                            "description": "The same wait in milliseconds (what the SDKs read first).",
                            "required": True,
                            "schema": {"type": "integer", "minimum": 1},
                        }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
    return app


def _parse(raw: bytes, content_encoding: str | None, content_type: str | None, max_bytes: int):
    """Body bytes -> (validated request, multipart parts or None); raises ApiError / RequestValidationError."""
    data = body_lib.decode_content(raw, content_encoding, max_bytes)
    parts = None
    if body_lib.is_multipart(content_type):
        parts = body_lib.parse_multipart(data, content_type)
        doc = body_lib.request_from_multipart(parts)
    else:
        doc = body_lib.parse_json(data)
    try:
        return wire.SystemOneRequest.model_validate(doc), parts
    except ValidationError as e:
        raise E.from_pydantic(e) from None


# The protocol's members, for the error that names what a non-engine lacks.
_PROTOCOL_MEMBERS = (
    *DecisionEngine.__annotations__,
    *(n for n, v in vars(DecisionEngine).items() if callable(v) and not n.startswith("_")),
)


def _missing_members(obj) -> list[str]:
    return [m for m in _PROTOCOL_MEMBERS if not hasattr(obj, m)]


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is already read, so the next ASGI message
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def release_note(info: dict) -> str:
    """` Release NAME (step N); held-out accuracy: task 0.81 (ECE 0.02), ...` for a served release."""
    rel = info.get("release")
    if not rel:
        return ""
    held = ", ".join(
        f"{m['task']} {m['accuracy']:.2f} (ECE {m['ece']:.3f}, n={m['n']})"
        for m in rel["metrics"]
        if isinstance(m.get("accuracy"), float) and isinstance(m.get("ece"), float)
    )
    return f" Release {rel['name']} (step {rel['step']})" + (f"; held-out accuracy: {held}." if held else ".")


# An absolute path inside a string (a checkpoint "/srv/runs/x@step 24", a release "(/opt/...)"): the
# directories say where the host keeps things, which /health has no reason to tell anyone.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])(?:/|[A-Za-z]:[\\/])(?:[^\s/\\()'\"]+[/\\])+")


def _without_paths(value):
    """`value` with every absolute path in its strings cut to its last component (`.../x@step 24`)."""
    if isinstance(value, str):
        return _ABSOLUTE_PATH.sub(".../", value) if ("/" in value or "\\" in value) else value
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_paths(v) for v in value]
    return value


def _engine_info(engine) -> dict:
    try:
        return dict(engine.info())
    except Exception:  # noqa: BLE001 — health must answer even if info() breaks
        log.exception("engine.info() failed")
        return {}


def _version() -> str:
    try:
        import lev_jax

        return lev_jax.__version__
    except Exception:  # noqa: BLE001
        return "0"


def _request_schemas() -> dict[str, Any]:
    schema = wire.SystemOneRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    defs["SystemOneRequest"] = schema
    for model in (wire.ErrorResponse, wire.HTTPValidationError):
        s = model.model_json_schema(ref_template="#/components/schemas/{model}")
        defs.update(s.pop("$defs", {}))
        defs[model.__name__] = s
    return defs


_REQUEST_BODY = {
    "requestBody": {
        "required": True,
        "description": "JSON as application/json, optionally with one Content-Encoding (zstd, gzip or deflate; "
        "another Content-Type, or none, is answered 415). Requests with images may be "
        "multipart/form-data: a JSON part `request` and one raw part per asset (`asset-0`, ...). Every part "
        "besides `request` must be named by the `part` of exactly one entry in `assets`: a part that no asset "
        "names (or that two name) is answered 400, as the official API does.",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/SystemOneRequest"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["request"],
                    "properties": {"request": {"$ref": "#/components/schemas/SystemOneRequest"}},
                    "propertyNames": {"minLength": 1},
                    # The names the server accepts besides `request` are the `part` values of the request's
                    # own assets: a cross-reference JSON Schema cannot state, so it is declared here in words
                    # and answered 400 (documented under 400) when broken.
                    "additionalProperties": {
                        "type": "string",
                        "format": "binary",
                        "description": "The raw bytes of one image asset, in the part named by that asset's `part` "
                        "(the SDK sends asset-0, asset-1, ...). A part no asset names is answered 400.",
                    },
                },
                "encoding": {"request": {"contentType": "application/json"}},
            },
        },
    }
}


def _err(description: str) -> dict:
    return {"description": description, "model": wire.ErrorResponse}


_ERROR_RESPONSES: dict[int | str, dict] = {
    400: _err(
        "api_usage_error, also for requests the schema allows: an unknown model; a box question; images for a "
        "text-only model; an asset problem (a `part` the body does not have, a multipart part that no asset "
        "names or that two assets name, invalid base64, an empty asset, bytes that are not PNG/JPEG); a malformed "
        "multipart body; a body that cannot be decompressed; a request the engine cannot answer as asked"
    ),
    401: _err("authentication_error: wrong API key"),
    403: _err("authentication_error: missing API key"),
    413: _err(
        "request_too_large: over the token budget (64k tokens per request, 32k for state + longest question) "
        "or over the body size limit"
    ),
    415: _err(
        "api_usage_error: a Content-Type other than application/json (or multipart/form-data), or none; an "
        "unsupported Content-Encoding, or more than one"
    ),
    422: {
        "description": f"Validation error: at most {E.MAX_VALIDATION_ERRORS} errors are listed (then one counting "
        "the rest), long messages cut, large inputs not echoed",
        "model": wire.HTTPValidationError,
    },
    429: _err("rate_limit_error: the queue is full; see Retry-After"),
    500: _err("internal_error: a bug in the server (bad input never gets one); the message names the request id"),
    503: _err("overloaded_error: the server is shutting down; see Retry-After"),
    504: _err("timeout_error: no answer within the server timeout"),
}
