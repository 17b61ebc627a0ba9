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
    calls = execute.Executor.long_row_calls(96, 96, row)
    assert [c[0] for c in calls] == ["chunk", "chunk", "chunk", "tail"]
    # each chunk's cache is grown just past it, to a multiple of LONG_ROW_SLOTS: prefixes of lengths
    # within one multiple share programs, and a chunk scores fewer than LONG_ROW_SLOTS empty slots
    step = buckets.LONG_ROW_SLOTS
    chunk_slots = [size for kind, size, *_ in calls if kind == "chunk"]
    assert chunk_slots == [-(-(96 + k * buckets.PREFILL_CHUNK) // step) * step for k in (1, 2, 3)]
    assert all(size % step == 0 for size in chunk_slots)
    # the tail's program: its length bucket and its label-codes bucket
    assert calls[-1][2:] == (buckets.fit(10, buckets.TAIL, "tail"), buckets.fit(2, buckets.CODES, "codes"))
    assert execute.Executor.long_row_calls(step - 8, step - 8, row) == calls
    assert execute.Executor.long_row_calls(step + 8, step + 8, row)[0][1] == chunk_slots[0] + step
    # wherever a row's text ends, its tail is one of a few programs (the warm-up compiles them all)
    tails = {execute.Executor.long_row_calls(96, 96, plan.Row(list(range(n)), [1, 2]))[-1] for n in range(513, 1025)}
    assert len(tails) <= len(buckets.TAIL) <= 10


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
    assert int(cache["offset"]) == 5 * 256 and cache["valid"].shape[1] == 5 * 256
    hidden, _ = bb.extend(cache, [[7, 8]], readout_BR=[[1]])
    got = np.asarray(bb.head(hidden[:, 0]))[0]
    want = np.asarray(bb.logits([ids + [7, 8]]))[0, -1]
    assert np.abs(got - want).max() < 1e-4
