"""A bounded load test on loopback (lev_jax.bench.loadtest) against the server over a tiny real model:
200 concurrent requests against max_pending=16. Every request gets 200 or 429 with Retry-After,
none is lost or hangs, answers under load equal answers alone, clients that honour Retry-After all
get their answers, and concurrency does not cost throughput."""

from __future__ import annotations

import asyncio

import pytest

import lev_jax
from lev_jax.bench.loadtest import check_loopback, markdown, run_load, same_answers
from lev_jax.server import ServerConfig, create_app
from lev_jax.server.testing import ThreadServer
from lev_jax.testing import save_tiny_checkpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = lev_jax.load(model=str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))))
    with ThreadServer(create_app(engine, ServerConfig(max_pending=16))) as s:
        yield s


def test_bounded_overload(server):
    report = asyncio.run(run_load(server.url, burst=200, distinct=8, requests=48, timeout=120, budget_s=240))
    print(markdown(report))
    assert report["failures"] == [], report["failures"]
    burst = report["burst"]
    assert sum(burst["statuses"].values()) == 200
    assert burst["statuses"].get("429", 0) > 0  # max_pending really overflowed
    assert set(burst["statuses"]) <= {"200", "429", "503"}
    assert report["retry"]["statuses"] == {"200": 200}
    # The tiny model's batches cost about as much per request as single calls on CPU, so the gain
    # of concurrency here is the overlap of HTTP work with the device: it must at least not lose.
    assert report["speedup_8_vs_1"] >= 0.9, report


def test_loopback_only():
    check_loopback("http://127.0.0.1:1")
    check_loopback("http://127.5.5.5:1")
    check_loopback("http://localhost:1")
    check_loopback("http://[::1]:1")
    for url in ("http://10.0.0.1:8000", "http://192.168.1.2", "http://example.com"):
        with pytest.raises(SystemExit):
            check_loopback(url)


def test_answer_comparison():
    a = {"q": {"type": "choice", "choice": "A", "probabilities": {"A": 0.6, "B": 0.4}, "confidence": 0.2}}
    assert same_answers(a, a)
    b = {"q": {**a["q"], "probabilities": {"A": 0.59, "B": 0.41}}}
    assert not same_answers(a, b)
    assert not same_answers(a, {"r": a["q"]})
