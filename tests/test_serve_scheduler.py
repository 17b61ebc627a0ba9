"""The micro-batching scheduler with an injected run_batch (the engine's predict_many contract):
token-budget batching, bounded admission, cancellation, failure isolation, graceful drain; and the
Prometheus exposition it feeds."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lev_jax.server.metrics import Metrics
from lev_jax.server.scheduler import QueueFull, Scheduler, ShuttingDown


class Recorder:
    """run_batch that answers each request with its own state, records the batches, and can be held."""

    def __init__(self, delay: float = 0.0):
        self.batches: list[list] = []
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, requests):
        self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        self.batches.append([s for s, _ in requests])
        out = []
        for state, _questions in requests:
            if state == "bad":
                out.append(ValueError("bad request"))
            else:
                out.append({"echo": state})
        return out


def run(coro):
    return asyncio.run(coro)


async def _started(rb, **kw) -> Scheduler:
    s = Scheduler(rb, **kw)
    await s.start()
    return s


def test_concurrent_requests_share_a_batch_within_the_token_budget():
    async def main():
        rb = Recorder()
        rb.gate.clear()
        s = await _started(rb, max_pending=100, max_batch_tokens=100)
        first = s.submit("first", {}, 10)
        await asyncio.sleep(0.05)  # the worker is now blocked inside run_batch on "first"
        tickets = [s.submit(f"r{i}", {}, 30) for i in range(7)]
        rb.gate.set()
        results = await asyncio.gather(first.future, *(t.future for t in tickets))
        assert [r["echo"] for r in results] == ["first"] + [f"r{i}" for i in range(7)]
        # 30-token requests, 100-token budget: batches of 3, 3, 1 after the first
        assert rb.batches == [["first"], ["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
        assert s.pending == 0
        await s.stop()

    run(main())


def test_a_request_over_the_batch_budget_runs_alone():
    async def main():
        rb = Recorder()
        rb.gate.clear()
        s = await _started(rb, max_pending=10, max_batch_tokens=50)
        ts = [s.submit("a", {}, 10), s.submit("big", {}, 500), s.submit("b", {}, 10)]
        rb.gate.set()
        await asyncio.gather(*(t.future for t in ts))
        assert rb.batches == [["a"], ["big"], ["b"]]
        await s.stop()

    run(main())


def test_batch_rows_cap():
    async def main():
        rb = Recorder()
        rb.gate.clear()
        s = await _started(rb, max_pending=10, max_batch_tokens=10**6, max_batch_rows=2)
        ts = [s.submit(str(i), {}, 1) for i in range(5)]
        rb.gate.set()
        await asyncio.gather(*(t.future for t in ts))
        assert [len(b) for b in rb.batches] == [1, 2, 2] or [len(b) for b in rb.batches] == [2, 2, 1]
        await s.stop()

    run(main())


def test_admission_is_bounded_and_says_when_to_retry():
    async def main():
        rb = Recorder()
        rb.gate.clear()
        s = await _started(rb, max_pending=3)
        ts = [s.submit(str(i), {}, 1) for i in range(3)]
        with pytest.raises(QueueFull) as ei:
            s.submit("x", {}, 1)
        assert ei.value.retry_after >= 1 and ei.value.retry_after_s >= 0.05
        rb.gate.set()
        await asyncio.gather(*(t.future for t in ts))
        s.submit("again", {}, 1)  # slots are free again
        await s.drain(5)

    run(main())


def test_cancelling_a_queued_request_frees_its_slot_and_skips_it():
    async def main():
        rb = Recorder()
        rb.gate.clear()
        s = await _started(rb, max_pending=2, max_batch_rows=1)
        running = s.submit("running", {}, 1)
        await asyncio.sleep(0.05)
        queued = s.submit("queued", {}, 1)
        assert s.pending == 2
        s.cancel(queued)
        assert s.pending == 1 and queued.future.cancelled()
        later = s.submit("later", {}, 1)  # the freed slot is usable at once
        rb.gate.set()
        await asyncio.gather(running.future, later.future)
        assert rb.batches == [["running"], ["later"]]
        await s.stop()

    run(main())


def test_cancelling_a_running_request_holds_its_slot_until_the_batch_ends():
    async def main():
        rb = Recorder()
        rb.gate.clear()
        s = await _started(rb, max_pending=1)
        t = s.submit("r", {}, 1)
        await asyncio.sleep(0.05)
        s.cancel(t)
        assert s.pending == 1  # the device is still busy with it
        with pytest.raises(QueueFull):
            s.submit("x", {}, 1)
        rb.gate.set()
        for _ in range(100):
            if s.pending == 0:
                break
            await asyncio.sleep(0.01)
        assert s.pending == 0
        await s.stop()

    run(main())


def test_per_request_errors_stay_with_their_request():
    async def main():
        rb = Recorder()
        rb.gate.clear()
        s = await _started(rb)
        ts = [s.submit("ok1", {}, 1), s.submit("bad", {}, 1), s.submit("ok2", {}, 1)]
        rb.gate.set()
        res = await asyncio.gather(*(t.future for t in ts), return_exceptions=True)
        assert res[0] == {"echo": "ok1"} and isinstance(res[1], ValueError) and res[2] == {"echo": "ok2"}
        await s.stop()

    run(main())


def test_a_batch_that_raises_is_retried_one_request_at_a_time():
    calls = []

    def run_batch(requests):
        calls.append(len(requests))
        if any(state == "poison" for state, _ in requests):
            raise RuntimeError("engine bug")
        return [{"echo": state} for state, _ in requests]

    async def main():
        s = await _started(run_batch, batch_wait_s=0.05)
        ts = [s.submit(x, {}, 1) for x in ("a", "poison", "b")]
        res = await asyncio.gather(*(t.future for t in ts), return_exceptions=True)
        assert res[0] == {"echo": "a"} and isinstance(res[1], RuntimeError) and res[2] == {"echo": "b"}
        assert calls == [3, 1, 1, 1]
        await s.stop()

    run(main())


def test_drain_finishes_in_flight_work_and_refuses_new():
    async def main():
        rb = Recorder(delay=0.05)
        s = await _started(rb, max_batch_rows=1)
        ts = [s.submit(str(i), {}, 1) for i in range(4)]
        drain = asyncio.create_task(s.drain(10))
        await asyncio.sleep(0)
        with pytest.raises(ShuttingDown):
            s.submit("late", {}, 1)
        assert await drain is True
        assert [t.future.result() for t in ts] == [{"echo": str(i)} for i in range(4)]

    run(main())


def test_drain_gives_up_after_its_timeout():
    async def main():
        rb = Recorder()
        rb.gate.clear()
        s = await _started(rb)
        t = s.submit("stuck", {}, 1)
        assert await s.drain(0.1) is False
        rb.gate.set()
        assert t.future.done()

    run(main())


def test_metrics_exposition():
    async def main():
        m = Metrics(max_pending=3, compiled_programs=lambda: 7)
        rb = Recorder()
        s = await _started(rb, metrics=m)
        ts = [s.submit(str(i), {}, 100) for i in range(3)]
        await asyncio.gather(*(t.future for t in ts))
        m.observe_request("POST", "/v1/systemone", 200, 0.02)
        m.observe_request("POST", "/v1/systemone", 429, 0.001)
        m.observe_answer(100, 1)
        text = m.render().decode("utf-8")
        await s.stop()
        return text

    text = run(main())
    samples = {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }
    route = ("route", "/v1/systemone")
    assert samples[("lev_http_requests_total", frozenset({("method", "POST"), route, ("status", "429")}))] == 1
    assert samples[("lev_http_request_duration_seconds_bucket", frozenset({route, ("le", "+Inf")}))] == 2
    assert samples[("lev_http_request_duration_seconds_bucket", frozenset({route, ("le", "0.005")}))] == 1
    assert samples[("lev_batch_rows_count", frozenset())] >= 1 and samples[("lev_batch_rows_sum", frozenset())] == 3
    assert samples[("lev_queue_depth", frozenset())] == 0 and samples[("lev_max_pending", frozenset())] == 3
    assert samples[("lev_compiled_programs", frozenset())] == 7
    assert samples[("lev_input_tokens_total", frozenset())] == 100
    # every sample line is NAME{labels} VALUE and every metric has HELP and TYPE
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            names.add(line.split()[2])
        elif not line.startswith("#"):
            assert re.fullmatch(r"[a-z_]+(\{[^}]*\})? [-+0-9.eInf]+", line), line
            base = re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0].split()[0])
            assert base in names or line.split("{")[0].split()[0] in names, line
    # histogram buckets are cumulative, at the documented boundaries
    rows = [(float(dict(k[1])["le"]), v) for k, v in samples.items() if k[0] == "lev_batch_rows_bucket"]
    assert [le for le, _ in rows] == [1, 2, 4, 8, 16, 32, 64, 128, float("inf")]
    assert [v for _, v in rows] == sorted(v for _, v in rows)


def test_metrics_keep_their_names_labels_and_buckets():
    """The exposition is a contract (docs/API.md, dashboards): every family, its type, its labels and
    its bucket boundaries, as they were before prometheus-client formatted them."""
    m = Metrics(max_pending=4, compiled_programs=lambda: 2)
    m.observe_request("GET", "/health", 200, 0.003)
    m.observe_batch(3, 500, 0.2)
    m.set_queue(1, 2)
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode("utf-8"))}
    # the parser names counter families without their _total suffix
    kinds = {
        "lev_http_requests": "counter",
        "lev_http_request_duration_seconds": "histogram",
        "lev_queue_depth": "gauge",
        "lev_in_flight": "gauge",
        "lev_max_pending": "gauge",
        "lev_batch_rows": "histogram",
        "lev_batch_tokens": "histogram",
        "lev_batch_duration_seconds": "histogram",
        "lev_input_tokens": "counter",
        "lev_output_tokens": "counter",
        "lev_answered_requests": "counter",
        "lev_cancelled_requests": "counter",
        "lev_timed_out_requests": "counter",
        "lev_uptime_seconds": "gauge",
        "lev_compiled_programs": "gauge",
    }
    assert {name: f.type for name, f in families.items()} == kinds
    (req,) = families["lev_http_requests"].samples
    assert req.labels == {"method": "GET", "route": "/health", "status": "200"}
    latency = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, float("inf")]
    buckets = {
        "lev_http_request_duration_seconds": latency,
        "lev_batch_duration_seconds": latency,
        "lev_batch_rows": [1, 2, 4, 8, 16, 32, 64, 128, float("inf")],
        "lev_batch_tokens": [64, 256, 1024, 4096, 16384, 32768, 65536, 131072, float("inf")],
    }
    for name, bounds in buckets.items():
        les = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
        assert les == bounds, name
    assert {s.labels.get("route") for s in families["lev_http_request_duration_seconds"].samples} == {"/health"}
    assert families["lev_queue_depth"].samples[0].value == 1 and families["lev_in_flight"].samples[0].value == 2
    assert families["lev_uptime_seconds"].samples[0].value >= 0
    # no engine count (or a broken one): no lev_compiled_programs family at all
    assert "lev_compiled_programs" not in Metrics(compiled_programs=lambda: None).render().decode("utf-8")


def test_stop_waits_for_the_device_call_in_flight():
    """No device thread outlives its scheduler (a later server's compiles would overlap it); a
    drain that gave up does not wait any longer."""

    async def main():
        rb = Recorder(delay=0.3)
        s = await _started(rb)
        t = s.submit("running", {}, 1)
        await asyncio.sleep(0.05)  # inside run_batch now
        await s.stop()
        assert rb.batches == [["running"]]  # the call had finished when stop() returned
        with pytest.raises(ShuttingDown):
            t.future.result()

        rb2 = Recorder()
        rb2.gate.clear()
        s2 = await _started(rb2)
        s2.submit("stuck", {}, 1)
        t0 = time.perf_counter()
        assert await s2.drain(0.1) is False
        assert time.perf_counter() - t0 < 5  # the gate holds the call for 10 s
        rb2.gate.set()

    run(main())
