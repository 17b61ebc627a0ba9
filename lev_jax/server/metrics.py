"""Server metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

Everything is updated from the event loop thread (the scheduler resolves futures there), so a lock
only guards against a scrape formatting while a batch is being recorded.
"""
from __future__ import annotations

import math
import threading
import time
from collections import defaultdict

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 32768, 65536, 131072)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
                break

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, cum = [], 0
        sep = "," if labels else ""
        for b, c in zip(self.buckets, self.counts, strict=True):
            cum += c
            out.append(f'{name}_bucket{{{labels}{sep}le="{_num(b)}"}} {cum}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        lb = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{lb} {_num(self.sum)}")
        out.append(f"{name}_count{lb} {self.count}")
        return out


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)  # (method, route, status)
        self.latency: dict[str, Histogram] = {}
        self.batch_rows = Histogram(ROW_BUCKETS)
        self.batch_tokens = Histogram(TOKEN_BUCKETS)
        self.batch_seconds = Histogram(LATENCY_BUCKETS)
        self.input_tokens = 0
        self.output_tokens = 0
        self.answers = 0
        self.cancelled = 0
        self.timeouts = 0
        self.queued = 0
        self.pending = 0
        self.max_pending = 0

    # -- recording -----------------------------------------------------------------------------
    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(method, route, status)] += 1
            h = self.latency.get(route)
            if h is None:
                h = self.latency[route] = Histogram(LATENCY_BUCKETS)
            h.observe(seconds)

    def observe_batch(self, rows: int, tokens: int, seconds: float) -> None:
        with self._lock:
            self.batch_rows.observe(rows)
            self.batch_tokens.observe(tokens)
            self.batch_seconds.observe(seconds)

    def observe_answer(self, input_tokens: int, output_tokens: int) -> None:
        with self._lock:
            self.answers += 1
            self.input_tokens += input_tokens
            self.output_tokens += output_tokens

    def set_queue(self, queued: int, pending: int) -> None:
        self.queued, self.pending = queued, pending

    # -- exposition ----------------------------------------------------------------------------
    def render(self, extra_gauges: dict[str, tuple[str, float]] | None = None) -> str:
        with self._lock:
            out: list[str] = []

            def head(name: str, kind: str, help_: str) -> None:
                out.append(f"# HELP {name} {help_}")
                out.append(f"# TYPE {name} {kind}")

            head("lev_http_requests_total", "counter", "HTTP requests answered, by method, route and status code.")
            for (method, route, status), n in sorted(self.requests.items()):
                out.append(f'lev_http_requests_total{{method="{_esc(method)}",route="{_esc(route)}",status="{status}"}} {n}')
            head("lev_http_request_duration_seconds", "histogram", "Time from request start to the response, by route.")
            for route, h in sorted(self.latency.items()):
                out += h.lines("lev_http_request_duration_seconds", f'route="{_esc(route)}"')
            head("lev_queue_depth", "gauge", "Requests waiting for a device call.")
            out.append(f"lev_queue_depth {self.queued}")
            head("lev_in_flight", "gauge", "Requests admitted and not finished (queued plus running).")
            out.append(f"lev_in_flight {self.pending}")
            head("lev_max_pending", "gauge", "Admission limit: more in flight than this are refused with 429.")
            out.append(f"lev_max_pending {self.max_pending}")
            head("lev_batch_rows", "histogram", "Requests per device call.")
            out += self.batch_rows.lines("lev_batch_rows")
            head("lev_batch_tokens", "histogram", "Input tokens per device call.")
            out += self.batch_tokens.lines("lev_batch_tokens")
            head("lev_batch_duration_seconds", "histogram", "Wall time of one device call (a micro-batch).")
            out += self.batch_seconds.lines("lev_batch_duration_seconds")
            head("lev_input_tokens_total", "counter", "Input tokens of answered requests.")
            out.append(f"lev_input_tokens_total {self.input_tokens}")
            head("lev_output_tokens_total", "counter", "Output tokens of answered requests.")
            out.append(f"lev_output_tokens_total {self.output_tokens}")
            head("lev_answered_requests_total", "counter", "Requests answered with 200.")
            out.append(f"lev_answered_requests_total {self.answers}")
            head("lev_cancelled_requests_total", "counter", "Requests whose client went away before the answer.")
            out.append(f"lev_cancelled_requests_total {self.cancelled}")
            head("lev_timed_out_requests_total", "counter", "Requests answered 504 after the server timeout.")
            out.append(f"lev_timed_out_requests_total {self.timeouts}")
            head("lev_uptime_seconds", "gauge", "Seconds since the server started.")
            out.append(f"lev_uptime_seconds {_num(time.time() - self.started)}")
            for name, (help_, value) in (extra_gauges or {}).items():
                head(name, "gauge", help_)
                out.append(f"{name} {_num(value)}")
            return "\n".join(out) + "\n"
