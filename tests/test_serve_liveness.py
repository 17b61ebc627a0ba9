"""Liveness that tells the truth (issue 45): /health is 503 while a request's device call is past the
watchdog or when the scheduler's worker has died, and new requests are refused 503 meanwhile instead of
queueing behind it; the request deadline covers planning, not only the queue; /health names no
absolute path of the host. Over a stub engine whose device call and planning the tests hold."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from lev_jax.server import ServerConfig, create_app
from lev_jax.server.testing import ThreadServer

NOUL = {"type": "noul", "instructions": "Is the customer asking for money back?"}


class HeldEngine:
    """Plans at once (or, with `hold_plan`, waits for `release_plan`); each device call waits for `gate`."""

    model_name = "stub"
    supports_images = False

    def __init__(self, *, hold_plan: bool = False, info: dict | None = None):
        self.gate = threading.Event()
        self.gate.set()
        self.in_call = threading.Event()
        self.hold_plan = hold_plan
        self.planning = threading.Event()
        self.release_plan = threading.Event()
        self.planned = threading.Event()
        self.plans = 0
        self._info = info or {}

    def plan(self, state, questions, images=None):
        self.plans += 1
        if self.hold_plan:
            self.planning.set()
            self.release_plan.wait(30)
            self.planned.set()
        return SimpleNamespace(
            questions=[SimpleNamespace(qid=q, route="mode_a") for q in questions],
            token_counts=lambda: {"input_tokens": 10},
            questions_by_id=questions,
        )

    def predict_many(self, requests, *, with_usage=False):
        self.in_call.set()
        self.gate.wait(30)
        self.in_call.clear()
        return [({q.qid: {"type": "noul", "noul": 0.5} for q in plan.questions}, {}) for plan, _ in requests]

    def info(self):
        return self._info


def request():
    return {"model": "jev-latest", "state": "I was charged twice.", "questions": {"q": NOUL}}


def post(s, timeout=30):
    return httpx.post(s.url + "/v1/systemone", json=request(), timeout=timeout)


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_health_is_503_while_a_device_call_is_past_the_watchdog():
    engine = HeldEngine()
    with ThreadServer(create_app(engine, ServerConfig(watchdog_s=0.3, timeout_s=60))) as s:
        assert post(s).status_code == 200
        engine.gate.clear()
        first = {}
        t = threading.Thread(target=lambda: first.setdefault("r", post(s)))
        t.start()
        wait_for(engine.in_call.is_set)
        wait_for(lambda: httpx.get(s.url + "/health").status_code == 503)
        health = httpx.get(s.url + "/health")
        assert health.json()["status"] == "stuck" and "watchdog" in health.json()["unavailable"]
        # nothing admitted now would be answered: refused at once, not queued behind the stuck call
        refused = post(s)
        assert refused.status_code == 503 and refused.json()["detail"]["error_type"] == "overloaded_error"
        assert "watchdog" in refused.json()["detail"]["message"] and refused.headers["retry-after"] == "30"
        engine.gate.set()  # the device answers again
        t.join(30)
        assert first["r"].status_code == 200
        health = httpx.get(s.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ready"
        assert post(s).status_code == 200


def test_health_is_503_when_the_worker_died():
    engine = HeldEngine()
    app = create_app(engine, ServerConfig())
    with ThreadServer(app) as s:
        assert httpx.get(s.url + "/health").status_code == 200

        def broken():
            raise RuntimeError("worker bug")

        app.state.scheduler._take = broken  # the worker's next step fails: it dies
        r = post(s)
        assert r.status_code == 503, r.text
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503
        assert health.json()["status"] == "dead" and "worker bug" in health.json()["unavailable"]
        assert post(s).status_code == 503


def test_the_deadline_covers_planning():
    """A request whose planning outlasts the deadline gets its 504 when the deadline passes, while the
    planning is still going on, not after it (when the queue's own wait would start)."""
    engine = HeldEngine(hold_plan=True)
    with ThreadServer(create_app(engine, ServerConfig(timeout_s=0.5))) as s:
        try:
            r = post(s)
            assert r.status_code == 504 and r.json()["detail"]["error_type"] == "timeout_error"
            assert engine.planning.is_set() and not engine.planned.is_set()
        finally:
            engine.release_plan.set()
        engine.hold_plan = False
        assert httpx.get(s.url + "/health").status_code == 200
        assert post(s).status_code == 200


def test_a_full_server_refuses_before_planning():
    """Admission comes first: with every slot taken, a request is answered 429 without being parsed
    further or planned (the engine sees no plan call for it)."""
    engine = HeldEngine()
    with ThreadServer(create_app(engine, ServerConfig(max_pending=1))) as s:
        engine.gate.clear()
        first = {}
        t = threading.Thread(target=lambda: first.setdefault("r", post(s)))
        t.start()
        try:
            wait_for(engine.in_call.is_set)
            assert engine.plans == 1
            r = post(s)
            assert r.status_code == 429 and r.json()["detail"]["error_type"] == "rate_limit_error"
            assert int(r.headers["retry-after"]) >= 1 and engine.plans == 1  # refused before planning
        finally:
            engine.gate.set()
            t.join(30)
        assert first["r"].status_code == 200
        # the slot a refused or failed request took is given back: the server takes requests again
        bad = httpx.post(s.url + "/v1/systemone", json={**request(), "model": "unknown"}, timeout=30)
        assert bad.status_code == 400
        assert post(s).status_code == 200 and httpx.get(s.url + "/health").json()["in_flight"] == 0


@pytest.mark.parametrize(
    "info",
    [
        {
            "checkpoint": "/srv/private/runs/r7@step 24",
            "compilation_cache": "/home/alice/.cache/lev_jax/xla",
            "release": {"name": "rel", "step": 3, "card": "release rel (/opt/models/rel)"},
        }
    ],
)
def test_health_names_no_absolute_path(info):
    with ThreadServer(create_app(HeldEngine(info=info), ServerConfig())) as s:
        health = httpx.get(s.url + "/health").json()
    text = json.dumps(health)
    assert "/srv" not in text and "/home" not in text and "/opt" not in text
    assert health["checkpoint"] == ".../r7@step 24" and health["compilation_cache"] is True
    assert health["release"]["card"] == "release rel (.../rel)"
