"""A micro-batch of several requests (`Executor.read` with several entries): their short rows share
slab calls (readout.slab: lanes of several prefixes, stacked, each lane reading its own; question
headers shared within a lane) with the anchored softmax, as for one request; every request's answers
equal the same request alone and independent full forwards; `batch_programs` names exactly the
programs a micro-batch compiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lev_jax
from lev_jax.models import layers
from lev_jax.readout import logits as logits_lib
from lev_jax.testing import tiny_backbone

STATE = {"customer": "Ann Lee", "message": "My parcel never arrived and I was charged twice. Fix it now!", "vip": True}


def _questions(variant: str = "") -> dict:
    return {
        f"intent{variant}": {
            "type": "choice",
            "instructions": f"What does the customer want?{variant}",
            "criteria": {"refund": "money back", "delivery": "a late or missing parcel", "other": None},
        },
        f"urgency{variant}": {
            "type": "score",
            "instructions": f"How urgent is this ticket?{variant}",
            "criteria": ["not urgent", "somewhat urgent", "urgent", "critical"],
        },
        f"angry{variant}": {"type": "noul", "instructions": f"Is the customer angry?{variant}"},
    }


def _many_questions(n: int) -> dict:
    """n variants of every question: enough shared question headers (the text before the options,
    common to both option orders) that they pay as cache segments."""
    return {k: v for i in range(n) for k, v in _questions(f" (variant {i})").items()}


# states of one length (each request alone and the reference forwards then share their programs); the
# last request alone has too few questions for segments to pay, in the micro-batch its headers join
REQUESTS = [
    (STATE, _many_questions(2)),
    ({**STATE, "message": "The app crashes whenever I open my settings page. Please fix it!"}, _many_questions(2)),
    ({**STATE, "customer": "Bob Ray"}, _questions(" (variant 0)")),
]


def _assert_close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for qid in a:
        if a[qid]["type"] == "noul":
            assert abs(a[qid]["noul"] - b[qid]["noul"]) <= tol, qid
            continue
        pa, pb = a[qid]["probabilities"], b[qid]["probabilities"]
        assert pa.keys() == pb.keys() and max(abs(pa[k] - pb[k]) for k in pa) <= tol, qid


def _check_well_formed(answers: dict) -> None:
    for a in answers.values():
        p = np.array([a["noul"]] if a["type"] == "noul" else list(a["probabilities"].values()))
        assert np.isfinite(p).all() and (p > 0).all() and (p < 1).all()


def _spy_slabs(monkeypatch) -> list:
    """(stacked, lanes, anchored) of every slab call."""
    seen, fn = [], logits_lib.read_slab

    def spy(*args, anchored=True, **kwargs):
        seen.append((args[2] is not None, args[3].shape[0], anchored))
        return fn(*args, anchored=anchored, **kwargs)

    spy.count = fn.count  # engine.compiled_programs still counts the real program
    monkeypatch.setattr(logits_lib, "read_slab", spy)
    return seen


@pytest.mark.parametrize("family,tol", [("llama", 1e-5), ("qwen3_5", 5e-5)])
def test_a_micro_batch_in_stacked_slabs_equals_each_request_alone(family, tol, monkeypatch):
    """The rows of all requests in stacked slab calls (each lane reading its own request's prefix),
    with the anchored softmax. (Tiny Qwen3.5 at 5e-5, as in test_predict.py: its fp32 rounding
    moves with where a sequence is split into cached pieces.)"""
    bb = tiny_backbone(family, seed=1)
    engine = lev_jax.Engine(bb, prefix_cache_bytes=0)
    slabs = _spy_slabs(monkeypatch)
    batch = engine.predict_many(REQUESTS)
    assert any(stacked for stacked, _, _ in slabs)  # lanes of several requests in one call
    assert all(a for _, _, a in slabs) and engine.exact_reruns == 0
    monkeypatch.undo()
    for (state, questions), answers in zip(REQUESTS, batch):
        _check_well_formed(answers)
        _assert_close(answers, lev_jax.Engine(bb, prefix_cache_bytes=0).predict(state, questions), tol=tol)
        _assert_close(answers, engine.predict(state, questions, reference=True), tol=tol)


def test_small_requests_of_a_micro_batch_share_one_slab_call():
    """Four requests of a few short questions each: one call, lanes of every prefix (stacked), where
    each alone is one shared-prefix call of its own. (On a CPU two would take two 1-lane calls: they
    compute less than one 4-lane call, readout.slab.calls.)"""
    engine = lev_jax.Engine(tiny_backbone("llama", seed=1))
    plans = [engine.plan(s, _questions()) for s in ("first state", "second state", "third state", "fourth state")]
    keys = engine.executor.batch_programs([(p.prefix_ids, p.rows) for p in plans])
    slabs = [k for k in keys if k[0] == "slab"]
    assert len(slabs) == 1 and slabs[0][-1] == "stacked"
    alone = [k for k in engine.executor.programs(plans[0].prefix_ids, plans[0].rows) if k[0] == "slab"]
    assert len(alone) == 1 and alone[0][-1] == "shared"


def test_stacked_rows_the_anchored_softmax_cannot_serve_are_rerun_exactly(monkeypatch):
    """Attention logits in the thousands (q and k projections scaled up, as in test_predict.py): the
    anchored softmax overflows on some stacked slab calls; those are rerun exact and the answers
    still equal independent full forwards."""
    bb = tiny_backbone("llama", seed=1)
    scale = lambda path, x: x * 12.0 if any(getattr(p, "key", None) in ("q_proj", "k_proj") for p in path) else x
    bb.params = jax.tree_util.tree_map_with_path(scale, bb.params)
    engine = lev_jax.Engine(bb)
    slabs = _spy_slabs(monkeypatch)
    batch = engine.predict_many(REQUESTS)
    assert any(stacked for stacked, _, _ in slabs)
    reruns = [a for _, _, a in slabs if not a]
    assert engine.exact_reruns == len(reruns) > 0
    monkeypatch.undo()
    for (state, questions), answers in zip(REQUESTS, batch):
        _check_well_formed(answers)
        _assert_close(answers, engine.predict(state, questions, reference=True), tol=1e-4)


def _fresh_programs(family):
    """An engine whose config no other test uses: its jitted programs start uncompiled."""
    bb = tiny_backbone(family, seed=1)
    bb.config = dataclasses.replace(bb.config, rope_theta=bb.config.rope_theta + 0.25)
    return lev_jax.Engine(bb, prefix_cache_bytes=0)


def test_batch_programs_are_exactly_the_programs_a_micro_batch_compiles():
    engine = _fresh_programs("llama")
    long_choice = {
        "type": "choice",
        "instructions": "Which queue?",
        "criteria": {f"Queue {i:03d}": f"Tickets routed to queue {i}" for i in range(1, 37)},
    }
    requests = [*REQUESTS, ("one more state", {"queue": long_choice, **_many_questions(1)})]
    plans = [engine.plan(*r) for r in requests]
    assert any(len(r.tokens) > 512 for r in plans[-1].rows)  # a long row too (read chunk by chunk)
    keys = engine.executor.batch_programs([(p.prefix_ids, p.rows) for p in plans])
    assert {k[0] for k in keys} >= {"prefill", "slab", "chunk", "tail"}
    assert any(k[0] == "slab" and k[-1] == "stacked" for k in keys)
    before = engine.compiled_programs
    engine.predict_many(requests)
    assert engine.compiled_programs - before == len(keys)
    before = engine.compiled_programs
    engine.predict_many(requests)  # the same micro-batch again: nothing new
    shuffled = requests[::-1]  # other prefix indices, the same shapes
    assert engine.executor.batch_programs([(p.prefix_ids, p.rows) for p in plans[::-1]]) == keys
    engine.predict_many(shuffled)
    assert engine.compiled_programs == before
    # one request alone: `programs`, exactly (its prefill was compiled with the micro-batch)
    state, questions = REQUESTS[0]
    single = engine.programs(state, questions)
    assert any(k[0] == "slab" for k in single)
    new = single - engine.compiled_keys  # what the micro-batches did not run (its prefill they did)
    assert len(new) < len(single)
    before = engine.compiled_programs
    engine.predict(state, questions)
    assert engine.compiled_programs - before == len(new)


def test_attend_reads_a_stacked_cache_by_row_index():
    """`cache_rows_B`: each query row reads its own row of a stacked cache, in place; exact and
    anchored both equal attention over per-row copies, and the anchored one fails loudly (NaN) where
    a cached score dwarfs the row's own ones."""
    B, T, H, K, D, S, N = 5, 6, 4, 2, 16, 20, 3
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (B, T, H, D))
    k = jax.random.normal(ks[1], (B, T, K, D))
    v = jax.random.normal(ks[2], (B, T, K, D))
    ck = jax.random.normal(ks[3], (N, K, D, S))
    cv = jax.random.normal(ks[4], (N, K, S, D))
    valid = jnp.arange(T)[None, :] < jnp.array([6, 6, 3, 1, 0])[:, None]
    cache_valid = jnp.arange(S)[None, :] < jnp.array([20, 13, 7])[:, None]  # prefixes of different lengths
    rows = jnp.array([2, 0, 1, 0, 2], jnp.int32)
    fn = jax.jit(layers.attend, static_argnames=("scale", "anchored"))
    copies = fn(q, k, v, valid, ck[rows], cv[rows], cache_valid[rows], scale=D**-0.5, anchored=False)
    real = np.asarray(valid)
    for anchored in (False, True):
        got = fn(q, k, v, valid, ck, cv, cache_valid, scale=D**-0.5, anchored=anchored, cache_rows_B=rows)
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(copies)[real], atol=2e-6)
    loud = np.asarray(fn(q, k, v, valid, 60.0 * ck, cv, cache_valid, scale=1.0, anchored=True, cache_rows_B=rows))
    assert (~np.isfinite(loud).all(axis=(2, 3)) & real).any()


def test_schema_first_requests_asking_the_same_questions_share_calls(monkeypatch):
    """Schema first (the shipped default's layout), each question before the state is a lead that joins
    the prefix: the requests of a micro-batch asking it are read after one cache of it, their rows in
    the same calls, and every answer equals the request alone and independent full forwards.
    `batch_programs` names exactly what the batch compiles."""
    bb = tiny_backbone("llama", seed=1)
    bb.config = dataclasses.replace(bb.config, rope_theta=bb.config.rope_theta + 0.5)  # programs of its own
    engine = lev_jax.Engine(bb, layout="schema_first", prefix_cache_bytes=0)
    states = [STATE, {**STATE, "customer": "Bob Ray"}, {**STATE, "message": "Where is my parcel?"}]
    requests = [(s, _questions()) for s in states]
    plans = [engine.plan(*r) for r in requests]
    assert all(r.stateless for p in plans for r in p.rows)
    keys = engine.executor.batch_programs([(p.prefix_ids, p.rows) for p in plans])
    slabs = _spy_slabs(monkeypatch)
    before = engine.compiled_programs
    batch = engine.predict_many(requests, with_usage=True)
    assert engine.compiled_programs - before == len(keys)
    # each lead (a question, or one presentation order of a choice) is a prefix computed once, and
    # the rows of all three requests after every lead are read together: the leads' lanes stacked in
    # as few calls as hold them (a lane left over may take a 1-lane call: it computes less)
    leads = {tuple(plans[0].prefix_ids) + tuple(r.tokens[: r.stateless]) for r in plans[0].rows}
    max_lanes = max(n for n, _ in lev_jax.buckets.slab_shapes(engine.platform))
    assert len(leads) >= 3 and len(slabs) == -(-len(leads) // max_lanes) and slabs[0][0]
    monkeypatch.undo()
    leads = [len(lead) for lead in leads]
    usages = [u for _, u in batch]
    assert usages[0]["cached_input_tokens"] == 0  # the first request computed the leads
    assert usages[1]["cached_input_tokens"] == usages[2]["cached_input_tokens"] == sum(leads)
    for (state, questions), (answers, usage) in zip(requests, batch):
        _check_well_formed(answers)
        alone, alone_usage = engine.predict_with_usage(state, questions)
        _assert_close(answers, alone)
        assert usage["input_tokens"] == alone_usage["input_tokens"]
        _assert_close(answers, engine.predict(state, questions, reference=True))
