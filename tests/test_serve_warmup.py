"""No compilation on the request path: the compile lane keeps requests that need new programs out of
the way of ready ones, the engine knows which programs it has run, the background warm-up reports
warming -> ready on /health, and the runtime's compilation cache and auto dtype."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

import lev_jax
from lev_jax import buckets, programs, runtime
from lev_jax.readout import shapes
from lev_jax.server import ServerConfig, create_app
from lev_jax.server.scheduler import Scheduler
from lev_jax.server.testing import ThreadServer
from lev_jax.server.warmup import ShapeLog, Warmup
from lev_jax.testing import tiny_backbone

REPO = Path(__file__).resolve().parents[1]


class Device:
    """run_batch over string requests: "cold..." ones take `compile_s` the first time their name is
    run (a compile), everything else is instant; `ready` knows what has run."""

    def __init__(self, compile_s: float = 1.0):
        self.compile_s = compile_s
        self.compiled: set = set()
        self.finished: list[str] = []
        self.lock = threading.Lock()

    def key(self, requests) -> frozenset:
        return frozenset(s for s, _ in requests) if len(requests) > 1 else frozenset([requests[0][0]])

    def ready(self, requests) -> bool:
        names = [s for s, _ in requests]
        singles_ok = all(not n.startswith("cold") or frozenset([n]) in self.compiled for n in names)
        return singles_ok and (len(requests) == 1 or self.key(requests) in self.compiled)

    def __call__(self, requests):
        key = self.key(requests)
        if key not in self.compiled and (len(requests) > 1 or requests[0][0].startswith("cold")):
            time.sleep(self.compile_s)
        with self.lock:
            self.compiled.add(key)
            self.finished.extend(s for s, _ in requests)
        return [{"echo": s} for s, _ in requests]


def test_a_request_that_compiles_does_not_stall_ready_ones():
    async def main():
        dev = Device(compile_s=1.5)
        s = Scheduler(dev, ready=dev.ready)
        await s.start()
        t0 = time.perf_counter()
        cold = s.submit("cold-a", {}, 10)
        await asyncio.sleep(0.05)  # the cold one is compiling in its lane
        warm = s.submit("warm-b", {}, 10)
        assert (await warm.future) == {"echo": "warm-b"}
        warm_s = time.perf_counter() - t0
        assert not cold.future.done()  # answered before the compiling request finished
        assert (await cold.future) == {"echo": "cold-a"}
        assert warm_s < 1.0 and s.cold_runs == 1
        # the same shape again is ready now: the main lane serves it
        again = s.submit("cold-a", {}, 10)
        assert (await again.future) == {"echo": "cold-a"} and s.cold_runs == 1
        await s.drain(5)

    asyncio.run(main())


@pytest.mark.parametrize("lanes", [1, 2])
def test_requests_that_each_need_new_programs_compile_side_by_side(lanes):
    class Timed(Device):
        def __call__(self, requests):
            start = time.perf_counter()
            out = super().__call__(requests)
            spans[requests[0][0]] = (start, time.perf_counter())
            return out

    spans: dict[str, tuple[float, float]] = {}

    async def main():
        dev = Timed(compile_s=0.5)
        s = Scheduler(dev, ready=dev.ready, compile_lanes=lanes)
        await s.start()
        cold = [s.submit(f"cold-{i}", {}, 10) for i in range(2)]
        await asyncio.sleep(0.05)
        warm = s.submit("warm", {}, 10)
        assert (await warm.future) == {"echo": "warm"}
        assert not any(t.future.done() for t in cold)  # ready work never waits for the compile lane
        assert [await t.future for t in cold] == [{"echo": "cold-0"}, {"echo": "cold-1"}]
        assert s.cold_runs == 2
        await s.drain(5)

    asyncio.run(main())
    (a0, a1), (b0, b1) = spans["cold-0"], spans["cold-1"]
    overlap = min(a1, b1) > max(a0, b0)
    assert overlap == (lanes == 2)  # two lanes compile side by side; one lane, one after the other


def test_compile_lanes_must_be_positive():
    with pytest.raises(ValueError, match="compile_lanes"):
        Scheduler(Device(), compile_lanes=0)


def test_a_new_combination_of_ready_requests_runs_one_by_one_and_compiles_in_the_background():
    async def main():
        dev = Device(compile_s=0.5)
        s = Scheduler(dev, ready=dev.ready, batch_wait_s=0.05)
        await s.start()
        tickets = [s.submit(f"r{i}", {}, 10) for i in range(3)]
        assert [await t.future for t in tickets] == [{"echo": f"r{i}"} for i in range(3)]
        assert s.split_batches == 1
        for _ in range(100):  # the combination compiles in the compile lane
            if s.background_compiles:
                break
            await asyncio.sleep(0.05)
        assert s.background_compiles == 1 and dev.ready([(f"r{i}", {}) for i in range(3)])
        tickets = [s.submit(f"r{i}", {}, 10) for i in range(3)]
        await asyncio.gather(*(t.future for t in tickets))
        assert s.split_batches == 1  # now it ran stacked
        await s.drain(5)

    asyncio.run(main())


def test_a_failing_ready_predicate_loses_no_request():
    def broken(_requests):
        raise RuntimeError("boom")

    async def main():
        dev = Device()
        s = Scheduler(dev, ready=broken)
        await s.start()
        t = s.submit("x", {}, 1)
        assert (await t.future) == {"echo": "x"}
        await s.drain(5)

    asyncio.run(main())


@pytest.fixture(scope="module")
def engine():
    return lev_jax.load(tiny_backbone("llama", seed=3), calibration=None)


def test_the_engine_knows_what_compiles(engine):
    q = {"n": {"type": "noul", "instructions": "Is this urgent?"}}
    a = ("A state the engine has never seen, about an order.", q)
    b = ("A state the engine has never seen, about a refund.", q)
    assert not engine.ready([a])
    engine.predict_many([a])
    assert engine.ready([a]) and engine.ready([b])  # same buckets: nothing new to compile
    assert engine.ready([a, b])  # two short lanes: a 1-lane call each (cheaper than one of 4 lanes)
    c, d = (("Another unseen state, about a " + w, q) for w in ("parcel.", "card."))
    assert not engine.ready([a, b, c, d])  # the stacked micro-batch shape is new
    engine.predict_many([a, b, c, d])
    assert engine.ready([d, c, b, a])
    longer = ("word " * 200, q)
    assert not engine.ready([longer])  # a new prefix bucket


def test_warmup_reports_warming_then_ready_and_warms_what_it_ran(engine):
    q = {"c": {"type": "choice", "instructions": "Which team?", "criteria": {"A": None, "B": None, "C": None}}}
    batches = [[("Warm this state, please.", q)], [("One", q), ("Two", q)]]
    engine = lev_jax.Engine(engine.backbone)  # one that has run nothing yet (the fixed programs are few)
    assert not engine.ready(batches[0]) or not engine.ready(batches[1])
    cfg = ServerConfig(warmup_budget_s=60)
    app = create_app(engine, cfg)
    app.state.warmup.batches = batches  # a small grid (the default one is minutes of compiling)
    with ThreadServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        states = set()
        for _ in range(600):
            h = client.get("/health").json()
            states.add(h["status"])
            if h["status"] == "ready":
                break
            time.sleep(0.05)
        assert h["status"] == "ready" and "warmup" in h
        assert h["warmup"]["batches_done"] == 2 and h["warmup"]["batches_planned"] == 2
        assert h["warmup"]["failed"] == 0 and not h["warmup"]["stopped_early"]
        # the grid's distinct programs, every one of them run by the time it is ready
        assert h["warmup"]["programs_planned"] == h["warmup"]["programs_ready"] > 0
        assert h["dtype"] == "float32" and "compile_lane" in h
    assert all(engine.ready(b) for b in batches)


def test_a_zero_budget_is_ready_at_once(engine):
    w = Warmup(engine, 0)
    w.start()
    assert w.ready and w.info()["batches_done"] == 0


def test_the_default_grid_spans_the_common_state_sizes(engine):
    from lev_jax.server import warmup

    batches = warmup.default_batches(engine)
    sizes = sorted({len(engine.tokenizer.encode(s)) for batch in batches for s, q in batch[:1]})
    assert len(sizes) >= len(warmup.STATE_TOKENS)
    for target in warmup.STATE_TOKENS:  # each target size is met within a few tokens
        assert min(abs(p - target) for p in sizes) <= 8
    assert max(len(b) for b in batches) == max(warmup.CONCURRENT)


def test_the_grid_shapes_cover_questions_about_a_document_of_any_length():
    """With the schema first every question row carries the state: after the grid shapes (long-row
    tails, prefix prefills) and nothing else, questions the grid never saw, about documents of
    lengths it never saw, compile nothing."""
    from lev_jax.server import warmup

    eng = lev_jax.load(tiny_backbone("llama", seed=3), calibration=None, layout="schema_first", option_averaging=False)
    sigs = warmup.long_row_shapes(eng) + warmup.prefill_shapes(eng)
    assert len(sigs) <= 50  # the point: a bounded grid, not every bucket
    for sig in sigs:
        eng.warm(sig)
    questions = {"t": TEAMS, "u": URGENT, "l": LEVEL}
    for n in (530, 611, 777, 903, 1000, 1400):
        state = warmup.state_of(eng, n)
        assert all(len(r.tokens) > 2 * buckets.PREFILL_CHUNK for r in eng.plan(state, questions).rows)
        assert eng.ready([(state, questions)]), n
    assert not eng.ready([(warmup.state_of(eng, 2200), questions)])  # a larger cache than the shapes reached


TEAMS = {"type": "choice", "instructions": "Which team?", "criteria": {"Billing": "money", "Tech": None, "Sales": None}}
URGENT = {"type": "noul", "instructions": "Is this urgent?"}
LEVEL = {"type": "score", "instructions": "How angry?", "criteria": ["calm", "annoyed", "furious"]}


@pytest.mark.parametrize("layout", ["state_first", "schema_first"])
def test_a_shape_signature_rebuilds_to_the_same_programs_without_the_content(layout):
    eng = lev_jax.load(tiny_backbone("llama", seed=3), calibration=None, layout=layout)
    batches = [
        [("My parcel never arrived.", {"t": TEAMS})],  # a choice: two orders sharing a header segment
        [("My parcel never arrived and I was charged twice. " * 6, {"t": TEAMS, "u": URGENT, "l": LEVEL})],
        [("Short one.", {"u": URGENT}), ("A longer state about a refund. " * 4, {"t": TEAMS, "l": LEVEL})],
        [(f"Ticket {i}: the app crashes on start.", {"t": TEAMS, "u": URGENT}) for i in range(3)],
    ]
    for batch in batches:
        entries = [(p.prefix_ids, p.rows) for p in (eng.plan(s, q) for s, q in batch)]
        sig = shapes.signature(entries)
        rebuilt = shapes.synthesize(json.loads(json.dumps(sig)), eng.backbone.config.vocab_size)
        assert eng.executor.batch_programs(rebuilt) == eng.executor.batch_programs(entries)
        assert [len(p) for p, _ in rebuilt] == [len(p) for p, _ in entries]
        real = {t for p, rows in entries for t in [*p, *(x for r in rows for x in r.tokens)]}
        made_up = {t for p, rows in rebuilt for t in [*p, *(x for r in rows for x in r.tokens)]}
        assert all(t >= shapes.FIRST_ID for t in made_up) and made_up != real
    with pytest.raises(ValueError):
        shapes.synthesize({**sig, "version": 0}, eng.backbone.config.vocab_size)
    with pytest.raises(ValueError):  # made-up ids past the vocabulary
        shapes.synthesize(sig, shapes.FIRST_ID + 10)


def test_the_shape_log_keeps_the_most_used_and_survives_a_bad_file(tmp_path):
    path = tmp_path / "log" / "m.json"
    log = ShapeLog(path, limit=2)
    a, b, c = ({"version": 1, "n": i} for i in range(3))
    for sig in (a, a, b, c):  # past the limit the least recorded of the others goes
        log.add(sig)
    assert ShapeLog(path).signatures() == [a, c]
    log.add(c)  # a: 2, c: 2
    log.add(b)  # a newcomer is not evicted by its own count of 1: the least used of the others goes
    assert ShapeLog(path).signatures() == [c, b]
    log.discard(c)
    assert ShapeLog(path).signatures() == [b]  # a discard is on disk too
    path.write_text("{not json")
    assert ShapeLog(path).signatures() == []  # ignored (and replaced at the next add)
    assert not list(path.parent.glob(".shapes-*"))  # no temporary file left behind


def test_a_restarted_server_warms_the_shapes_traffic_compiled_before_it_is_ready(tmp_path):
    backbone = tiny_backbone("llama", seed=3)
    request = ("I was charged twice for my order and want a refund.", {"t": TEAMS, "u": URGENT})
    body = {"model": "jev-latest", "state": request[0], "questions": request[1]}
    first = lev_jax.load(backbone, calibration=None)
    app = create_app(first, ServerConfig(shape_log_dir=str(tmp_path)))
    with ThreadServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.post("/v1/systemone", json=body).status_code == 200
        assert client.post("/v1/systemone", json=body).status_code == 200  # compiles nothing: not logged
    (log_file,) = (tmp_path / "lev_jax_shapes").glob("*.json")
    assert len(json.loads(log_file.read_text())["shapes"]) == 1

    second = lev_jax.load(backbone, calibration=None)  # a new engine: nothing run yet
    assert not second.ready([request])
    app = create_app(second, ServerConfig(shape_log_dir=str(tmp_path), warmup_budget_s=60))
    app.state.warmup.batches = [[("Another state, warmed by the grid.", {"l": LEVEL})]]
    with ThreadServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(1200):
            h = client.get("/health").json()
            if h["status"] == "ready":
                break
            time.sleep(0.05)
        assert h["warmup"]["recorded_shapes_done"] == h["warmup"]["recorded_shapes_planned"] == 1
        assert second.ready([request])  # the logged shape is compiled before ready
        assert client.post("/v1/systemone", json=body).status_code == 200
    assert len(json.loads(log_file.read_text())["shapes"]) == 1  # the warm-up's own batches are not logged


# -- runtime -------------------------------------------------------------------------------------------


def test_auto_dtype_follows_native_bf16(monkeypatch):
    monkeypatch.delenv(runtime.DTYPE_ENV, raising=False)
    assert runtime.resolve_dtype("auto", "cpu", {"avx2", "fma"}) == "float32"
    assert runtime.resolve_dtype("auto", "cpu", {"avx512f", "avx512_bf16"}) == "bfloat16"
    assert runtime.resolve_dtype("auto", "cpu", {"amx_bf16", "amx_tile"}) == "bfloat16"
    assert runtime.resolve_dtype("auto", "gpu", set()) == "bfloat16"
    assert runtime.resolve_dtype("float32", "gpu", set()) == "float32"
    monkeypatch.setenv(runtime.DTYPE_ENV, "float32")
    assert runtime.resolve_dtype("auto", "gpu", set()) == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        runtime.resolve_dtype("float16")


def test_cache_dir_setting(monkeypatch, tmp_path):
    monkeypatch.delenv(runtime.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert runtime.cache_dir_setting() == str(tmp_path / "lev_jax" / "xla")
    monkeypatch.setenv(runtime.CACHE_ENV, str(tmp_path / "mine"))
    assert runtime.cache_dir_setting() == str(tmp_path / "mine")
    monkeypatch.setenv(runtime.CACHE_ENV, "")
    assert runtime.cache_dir_setting() == ""  # off
    assert runtime.cache_dir_setting("/explicit") == "/explicit"


PROGRAM = textwrap.dedent(
    """
    import jax, lev_jax
    from lev_jax import runtime
    from lev_jax.testing import tiny_backbone
    hits = []
    jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e.endswith("cache_hits") else None)
    engine = lev_jax.load(tiny_backbone("llama"), calibration=None)
    engine.predict("A state.", {"n": {"type": "noul", "instructions": "Yes?"}})
    from lev_jax import programs
    print("CACHE", runtime.compilation_cache_dir(), "HITS", len(hits), "LOADED", programs.stats()["loaded"],
          "COMPILED", programs.stats()["compiled"])
    """
)


def test_a_new_process_reuses_compiled_programs_from_the_default_cache(tmp_path):
    """The persistent cache is on by default (here: XDG_CACHE_HOME moved into tmp_path): a second
    process loads the programs the first one compiled, and compiles none."""
    env = {k: v for k, v in os.environ.items() if k not in (runtime.CACHE_ENV, programs.STORE_ENV)}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    runs = [
        subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (r.stdout.split() for r in runs)
    assert first[1] == str(tmp_path / "lev_jax" / "xla") and int(first[3]) == 0 and int(first[7]) >= 2
    # the model's programs (prefill, rows) from the program store, without tracing them; the small
    # programs of eager array operations from JAX's own cache
    assert int(second[5]) == int(first[7]) and int(second[7]) == 0
    assert int(second[3]) >= 1
    assert any((tmp_path / "lev_jax" / "xla").iterdir())
