"""Long rows (a question longer than a prefill chunk) are read chunk by chunk: the same answers as an
independent full forward, for attention-only and hybrid (DeltaNet) models, alone and in a micro-batch;
a listing too long for option averaging is read in one order."""

import numpy as np
import pytest

import lev_jax
from lev_jax import buckets
from lev_jax.readout import execute, plan
from lev_jax.testing import tiny_backbone

STATE = {"ticket": "The invoice for March was charged twice and the refund has not arrived yet."}


def _queues(n: int) -> dict:
    return {f"Queue {i:03d}": f"Tickets routed to queue {i}" for i in range(1, n + 1)}


def _question(n: int) -> dict:
    return {"type": "choice", "instructions": "Which queue should take this ticket?", "criteria": _queues(n)}


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for qid in a:
        if a[qid]["type"] == "noul":
            assert abs(a[qid]["noul"] - b[qid]["noul"]) <= tol, qid
            continue
        pa, pb = a[qid]["probabilities"], b[qid]["probabilities"]
        assert pa.keys() == pb.keys()
        assert max(abs(pa[k] - pb[k]) for k in pa) <= tol, qid


@pytest.fixture(scope="module")
def engine():
    return lev_jax.load(tiny_backbone("llama"), calibration=None)


# Tiny Qwen3.5 at 5e-5: its fp32 rounding moves with where a sequence is split into cached pieces
# (DeltaNet chunks), as in test_predict.py's header-segment test.
@pytest.mark.parametrize("family,options,chunks,tol", [("llama", 70, 2, 1e-5), ("qwen3_5", 34, 1, 5e-5)])
def test_long_rows_equal_independent_full_forwards(family, options, chunks, tol):
    engine = lev_jax.load(tiny_backbone(family), calibration=None)
    questions = {"queue": _question(options), "short": _question(3)}
    p = engine.plan(STATE, questions)
    lengths = [len(r.tokens) for r in p.questions[0].rows]
    assert min(lengths) > chunks * buckets.PREFILL_CHUNK  # leading chunks and a tail
    assert len(p.questions[0].rows) == 2  # both orders: within AVERAGING_MAX_ROW_TOKENS
    fast = engine.predict(STATE, questions)
    _close(fast, engine.predict(STATE, questions, reference=True), tol)
    assert abs(sum(fast["queue"]["probabilities"].values()) - 1) < 1e-9


def test_long_rows_in_a_micro_batch_equal_each_request_alone(engine):
    requests = [
        ({"ticket": "Charged twice in March."}, {"queue": _question(35)}),
        (
            {"ticket": "The app crashes on start, every time, since the update to version 4.2 last night."},
            {"q": _question(4)},
        ),
        ({"ticket": "Parcel lost."}, {"queue": _question(36), "n": {"type": "noul", "instructions": "Angry?"}}),
    ]
    together = engine.predict_many(requests)
    for (state, questions), answers in zip(requests, together):
        _close(answers, engine.predict(state, questions))


def test_a_long_row_does_not_depend_on_the_prefix_bucket_padding(engine):
    """The same question after states of different lengths (different prefix buckets, so different
    cache offsets and slot counts for the chunked row) still equals the full forward."""
    for state in ("x", "word " * 300):
        q = {"queue": _question(34)}
        _close(engine.predict(state, q), engine.predict(state, q, reference=True))


def test_long_row_calls_are_bounded_and_shared_across_prefixes():
    row = plan.Row(list(range(3 * buckets.PREFILL_CHUNK + 10)), [1, 2])
    offset, slots = buckets.prefilled(96)  # a 96-token prefix: one first chunk
    calls = execute.Executor.long_row_calls(offset, slots, row)
    assert [c[0] for c in calls] == ["chunk", "chunk", "chunk", "tail"]
    # each chunk's cache is grown to the capacity that holds it: the programs of a prefill's later
    # chunks, one per capacity, whatever the prefix's or the row's length
    chunk_slots = [size for kind, size, *_ in calls if kind == "chunk"]
    assert chunk_slots == [buckets.fit(offset + k * buckets.PREFILL_CHUNK, buckets.CAPACITY, "x") for k in (1, 2, 3)]
    assert set(chunk_slots) <= set(buckets.CAPACITY)
    # the tail's program: the last capacity, its length bucket and its label-codes bucket
    assert calls[-1][1:] == (chunk_slots[-1], buckets.fit(10, buckets.TAIL, "tail"), buckets.READ_CODES[0])
    # every prefix that ends in the same chunk shares them
    assert execute.Executor.long_row_calls(*buckets.prefilled(200), row) == calls
    assert {c[:3] for c in calls[:-1]} <= {("chunk", cap, buckets.PREFILL_CHUNK) for cap in buckets.CAPACITY}
    # wherever rows' text ends, and whatever prefix they follow, the chunks and tails are a few
    # programs per capacity (the warm-up compiles them)
    keys = set()
    for p in (10, 64, 65, 300, 700):
        for n in range(buckets.PREFILL_CHUNK + 1, 3 * buckets.PREFILL_CHUNK, 7):
            keys |= set(execute.Executor.long_row_calls(*buckets.prefilled(p), plan.Row(list(range(n)), [1, 2])))
    caps = {k[1] for k in keys}
    assert len(caps) <= 4 and len(keys) <= len(caps) * (1 + len(buckets.TAIL))


def test_a_prefix_runs_in_a_few_programs_whatever_its_length():
    """A prefix is computed in `buckets.chunks` calls (its first chunk at one of two sizes, then
    chunks into capacity-sized caches): every prefix up to 4,096 tokens needs a handful of programs
    in all, not one per length bucket."""
    keys = set().union(*(execute.prefill_programs(list(range(n))) for n in range(1, 4097, 3)))
    assert keys == {("prefill", 0, s) for s in buckets.FIRST_CHUNKS} | {
        ("chunk", cap, buckets.PREFILL_CHUNK) for cap in buckets.CAPACITY if buckets.PREFILL_CHUNK < cap <= 4096
    }


def test_a_listing_past_the_averaging_limit_is_read_in_one_order(engine, monkeypatch):
    monkeypatch.setattr(plan, "AVERAGING_MAX_ROW_TOKENS", 300)
    q = {"queue": _question(30)}
    p = engine.plan(STATE, q)
    assert len(p.questions[0].readouts[0].rows) == 1
    small = engine.plan(STATE, {"q": _question(4)})
    assert len(small.questions[0].readouts[0].rows) == 2
    ans = engine.predict(STATE, q)
    _close(ans, engine.predict(STATE, q, reference=True))
    probs = np.array(list(ans["queue"]["probabilities"].values()))
    assert np.isclose(probs.sum(), 1.0)


def test_chunked_prefill_equals_one_forward():
    bb = tiny_backbone("qwen3_5")
    ids = list(np.random.RandomState(0).randint(10, 5000, 1100))
    cache = bb.prefill(ids, chunk=256)
    # chunks of 256 tokens (the last padded) into a cache grown to the capacity that holds them
    assert int(cache["offset"]) == 5 * 256 and cache["valid"].shape[1] == buckets.fit(1100, buckets.CAPACITY, "x")
    hidden, _ = bb.extend(cache, [[7, 8]], readout_BR=[[1]])
    got = np.asarray(bb.head(hidden[:, 0]))[0]
    want = np.asarray(bb.logits([ids + [7, 8]]))[0, -1]
    assert np.abs(got - want).max() < 1e-4
