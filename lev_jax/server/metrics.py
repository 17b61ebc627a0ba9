"""Server metrics for `GET /metrics`, kept and formatted by prometheus-client.

Each app instance owns its own CollectorRegistry (never the process-wide default one), so several
servers in one process (tests, the load test) count separately. The text is the Prometheus text
format 0.0.4. Metric names, labels and bucket boundaries are a contract (docs/API.md, dashboards):
change them only together with the docs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 32768, 65536, 131072)
# What generate_latest writes. Not the library's CONTENT_TYPE_LATEST: since prometheus-client 0.22 that
# names text format 1.0.0, which the library itself only serves with an explicit `escaping` parameter.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class _CompiledPrograms:
    """`lev_compiled_programs`, read from the engine at scrape time; absent when the engine has no count."""

    def __init__(self, read: Callable[[], float | None]):
        self.read = read

    def describe(self):
        return []  # the family is absent when read() has no number, so nothing is promised up front

    def collect(self):
        value = self.read()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            yield GaugeMetricFamily("lev_compiled_programs", "Device programs compiled so far.", value=value)


class _Vision:
    """The vision side's counters (`lev_image_feature_cache_{hits,misses}_total`,
    `lev_vision_tower_runs_total`), read from the engine at scrape time; absent for a text-only model."""

    def __init__(self, read: Callable[[], dict | None]):
        self.read = read

    def describe(self):
        return []

    def collect(self):
        info = self.read()
        if not isinstance(info, dict):
            return
        stats = info.get("feature_cache") or {}
        for name, doc, value in (
            ("lev_image_feature_cache_hits", "Images whose vision features came from the cache.", stats.get("hits")),
            ("lev_image_feature_cache_misses", "Images the feature cache did not hold.", stats.get("misses")),
            ("lev_vision_tower_runs", "Images the vision tower encoded.", info.get("tower_runs")),
        ):
            if isinstance(value, int):
                yield CounterMetricFamily(name, doc, value=value)


class _WithoutCreated:
    """The registry's families without their `_created` samples: the 0.0.4 text format has no such
    series (the library would write each as an extra gauge), and the exposition keeps the series it had."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class Metrics:
    """The server's metrics. The scheduler and the app record into it; `render()` is the /metrics body.
    prometheus-client's metrics are thread-safe, so recording needs no lock of ours."""

    def __init__(
        self,
        *,
        max_pending: int = 0,
        compiled_programs: Callable[[], float | None] | None = None,
        vision: Callable[[], dict | None] | None = None,
    ):
        self.registry = r = CollectorRegistry()
        if vision is not None:
            r.register(_Vision(vision))
        self.requests = Counter(
            "lev_http_requests_total",
            "HTTP requests answered, by method, route and status code.",
            ("method", "route", "status"),
            registry=r,
        )
        self.request_seconds = Histogram(
            "lev_http_request_duration_seconds",
            "Time from request start to the response, by route.",
            ("route",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("lev_queue_depth", "Requests waiting for a device call.", registry=r)
        self.in_flight = Gauge(
            "lev_in_flight", "Requests admitted and not finished (being planned, queued or running).", registry=r
        )
        self.max_pending = Gauge(
            "lev_max_pending", "Admission limit: more in flight than this are refused with 429.", registry=r
        )
        self.max_pending.set(max_pending)
        self.batch_rows = Histogram("lev_batch_rows", "Requests per device call.", buckets=ROW_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "lev_batch_tokens", "Input tokens per device call.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.batch_seconds = Histogram(
            "lev_batch_duration_seconds",
            "Wall time of one device call (a micro-batch).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.input_tokens = Counter("lev_input_tokens_total", "Input tokens of answered requests.", registry=r)
        self.output_tokens = Counter("lev_output_tokens_total", "Output tokens of answered requests.", registry=r)
        self.answered = Counter("lev_answered_requests_total", "Requests answered with 200.", registry=r)
        self.cancelled = Counter(
            "lev_cancelled_requests_total", "Requests whose client went away before the answer.", registry=r
        )
        self.timed_out = Counter(
            "lev_timed_out_requests_total", "Requests answered 504 after the server timeout.", registry=r
        )
        started = time.time()
        uptime = Gauge("lev_uptime_seconds", "Seconds since the server started.", registry=r)
        uptime.set_function(lambda: time.time() - started)
        if compiled_programs is not None:
            r.register(_CompiledPrograms(compiled_programs))

    # -- recording -----------------------------------------------------------------------------
    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method=method, route=route, status=str(status)).inc()
        self.request_seconds.labels(route=route).observe(seconds)

    def observe_batch(self, rows: int, tokens: int, seconds: float) -> None:
        self.batch_rows.observe(rows)
        self.batch_tokens.observe(tokens)
        self.batch_seconds.observe(seconds)

    def observe_answer(self, input_tokens: int, output_tokens: int) -> None:
        self.answered.inc()
        self.input_tokens.inc(input_tokens)
        self.output_tokens.inc(output_tokens)

    def set_queue(self, queued: int, pending: int) -> None:
        self.queue_depth.set(queued)
        self.in_flight.set(pending)

    # -- exposition ----------------------------------------------------------------------------
    def render(self) -> bytes:
        """The /metrics body (Prometheus text format 0.0.4, UTF-8; content type CONTENT_TYPE)."""
        return generate_latest(_WithoutCreated(self.registry))
