"""Mode B's pieces (lev_jax/readout/modeb.py): the reserved marker of each tokenizer, the marked row,
the pointer head over the marker and answer hidden states read after a shared state prefix, against one full
forward of the whole sequence; 151 and 255 options in one row each."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lev_jax import models, prompt
from lev_jax.errors import ReservedTextError
from lev_jax.readout import logits as logits_lib
from lev_jax.readout import modeb
from lev_jax.testing import tiny_backbone


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def tiny(request):
    return tiny_backbone(request.param, seed=2)


def test_each_tokenizer_has_a_one_id_marker_and_text_with_it_is_refused(tiny):
    text, mid = modeb.marker_token(tiny.tokenizer)
    assert tiny.tokenizer.encode(text) == [mid] and mid in tiny.tokenizer.special_ids
    assert text == ("<empty_output>" if tiny.name == "tiny-llama" else "<|object_ref_end|>")
    with pytest.raises(ReservedTextError, match="reserves"):
        modeb.check_text(f"refund {text}", text, "option 'refund'")
    modeb.check_text("a plain option", text, "option 'x'")


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _options(n):
    return [(f"Queue {i:03d}", f"tickets routed to queue {i}") for i in range(n)]


@pytest.mark.parametrize("n", [7, 151, 255])
def test_marker_scores_after_a_shared_prefix_equal_one_full_forward(tiny, n):
    bb = tiny
    fmt = prompt.PromptFormat(bb.tokenizer, "chat")
    _, mid = modeb.marker_token(bb.tokenizer)
    head = modeb.init_head(bb.config.hidden_size, width=32, seed=1)
    prefix = fmt.encode_prefix(fmt.build("A customer writes: my parcel is late.", "").prefix)
    rows = [modeb.marked_row(fmt, mid, "Which queue?", opts) for opts in (_options(n), _options(n)[::-1])]
    assert all(len(m) == n and all(t[p] == mid for p in m) for t, m in rows)  # one row per order, n markers
    T = max(len(t) for t, _ in rows)
    tokens = np.zeros((2, T), np.int32)
    valid = np.zeros((2, T), bool)
    markers = np.zeros((2, n), np.int32)
    for b, (t, m) in enumerate(rows):
        tokens[b, : len(t)], valid[b, : len(t)], markers[b] = t, True, m
    cache = bb.prefill(prefix)
    answer = np.asarray([len(t) - 1 for t, _ in rows], np.int32)
    fast = np.asarray(
        logits_lib.read_rows(
            bb.params,
            head,
            cache,
            None,
            *map(jnp.asarray, (tokens, valid, answer, np.zeros((2, n), np.int32), markers, np.ones(2, bool))),
            bb.config,
        )
    )
    for b, (t, m) in enumerate(rows):
        hidden, _ = models.forward(bb.params, jnp.asarray([prefix + t]), None, bb.config)
        answer_hidden = hidden[:, len(prefix) + len(t) - 1]
        want = np.asarray(modeb.head_scores(head, answer_hidden, hidden[:, np.asarray(m) + len(prefix)]))[0]
        # the question's distribution (as predict() answers it) to 1e-5; the raw scores of a 2k-token
        # row differ by fp32 rounding through the layers (<= 3.3e-4 on these deliberately large-weight models)
        np.testing.assert_allclose(_softmax(fast[b]), _softmax(want), atol=1e-5, rtol=0)
        np.testing.assert_allclose(fast[b], want, atol=5e-4, rtol=0)
    assert np.abs(fast[0] - fast[1][::-1]).max() > 1e-4  # the two orders are different rows


def test_head_round_trips_through_named_tensors():
    head = modeb.init_head(48, width=16, seed=3)
    back = modeb.head_from_tensors(modeb.head_tensors(head))
    for k in head:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(head[k]))
    bad = modeb.head_tensors(head)
    del bad["mode_b_head.wk"]
    with pytest.raises(ValueError, match="mode_b_head.wk"):
        modeb.head_from_tensors(bad)
    wrong = {**modeb.head_tensors(head), "mode_b_head.wp": np.zeros(47, np.float32)}
    with pytest.raises(ValueError, match="width-16 pointer"):
        modeb.head_from_tensors(wrong)


# ------------------------------------------------------------------ predict(): the router and Mode B rows
STATE = "A customer writes: my parcel from order #4471 is three days late and nobody answers."


def _choice(n, instructions="Which queue should handle this?"):
    return {"type": "choice", "instructions": instructions, "criteria": dict(_options(n))}


def _probs(answer):
    return np.asarray(list(answer["probabilities"].values()))


@pytest.fixture(scope="module")
def engine_b():
    """A tiny Llama (SmolLM2 vocabulary) carrying a random Mode B head: large choices route to it."""
    from lev_jax.engine import Engine

    bb = tiny_backbone("llama", seed=2)
    bb.mode_b_head = modeb.init_head(bb.config.hidden_size, width=32, seed=1)
    return Engine(bb)


def test_router_one_function():
    from lev_jax.readout import MODE_A, MODE_A_GROUPED, MODE_B, route

    assert route(4, 26, head=True) == MODE_A  # small: every option has a code
    assert route(27, 702, head=True) == MODE_B  # large (the threshold) with a head
    assert route(30, 26, head=True, min_options=100) == MODE_B  # codes split: the head reads it in one row
    assert route(30, 26, head=False) == MODE_A_GROUPED  # codes split, no head: groups + round 2
    assert route(151, 702, head=False) == MODE_A  # no head: never fails, Mode A reads it


def test_large_choices_answer_through_mode_b_in_one_row_and_equal_full_forwards(engine_b):
    qs = {"q151": _choice(151), "q255": _choice(255), "small": _choice(3, "Which of these?")}
    plan = engine_b.plan(STATE, qs)
    routes = {qp.qid: qp.route for qp in plan.questions}
    assert routes == {"q151": "mode_b", "q255": "mode_b", "small": "mode_a"}
    for qp in plan.questions[:2]:
        [row] = qp.rows  # one row, whatever the option count
        assert row.label_ids == [] and len(row.markers) == len(qp.question["criteria"])
    fast = engine_b.predict(STATE, qs)
    ref = engine_b.predict(STATE, qs, reference=True)  # one independent full forward per row
    for q in qs:
        p = _probs(fast[q])
        assert abs(p.sum() - 1) < 1e-9 and fast[q]["choice"] == ref[q]["choice"]
        np.testing.assert_allclose(p, _probs(ref[q]), atol=1e-5, rtol=0)
    assert _probs(fast["q255"]).max() > 2.0 / 255  # a real (random-head) distribution, not uniform
    # invariant to the other questions of the request
    alone = engine_b.predict(STATE, {"q255": _choice(255)})
    np.testing.assert_allclose(_probs(alone["q255"]), _probs(fast["q255"]), atol=1e-5, rtol=0)
    # another state moves the answer
    other = engine_b.predict("The invoice shows a double charge.", {"q255": _choice(255)})
    assert np.abs(_probs(other["q255"]) - _probs(alone["q255"])).max() > 1e-4


def test_mode_b_rows_of_a_stacked_micro_batch_equal_full_forwards(engine_b):
    """Two requests in one micro-batch (stacked prefixes): each long marked row reads its own prefix,
    chunk by chunk, markers scored inside the chunks."""
    reqs = [(STATE, {"q": _choice(151)}), ("Please cancel my subscription today.", {"q": _choice(60), "s": _choice(2)})]
    fast = engine_b.predict_many(reqs)
    for (state, qs), got in zip(reqs, fast):
        ref = engine_b.predict(state, qs, reference=True)
        for q in qs:
            np.testing.assert_allclose(_probs(got[q]), _probs(ref[q]), atol=1e-5, rtol=0)


def test_schema_first_mode_b_row_lists_the_options_then_the_state():
    from lev_jax.engine import Engine

    bb = tiny_backbone("llama", seed=2)
    bb.mode_b_head = modeb.init_head(bb.config.hidden_size, width=32, seed=1)
    eng = Engine(bb, layout="schema_first", option_averaging=False)
    qs = {"q": _choice(40)}
    [row] = eng.plan(STATE, qs).questions[0].rows
    text = bb.tokenizer.decode(row.tokens)
    # as in Mode A's schema-first rows: the answer position (the pointer's query) reads the state
    # right after the options it points into
    assert text.index("Which queue") < text.index("Queue 000") < text.index("Queue 039") < text.index("nobody answers")
    assert bb.tokenizer.decode(row.tokens[row.markers[-1] :]).count("nobody answers") == 1
    fast, ref = eng.predict(STATE, qs), eng.predict(STATE, qs, reference=True)
    np.testing.assert_allclose(_probs(fast["q"]), _probs(ref["q"]), atol=1e-5, rtol=0)


def test_schema_first_mode_b_options_are_computed_once_and_cached_across_requests():
    """Schema first, a large choice's options block (markers and all) is the same for every state:
    the executor keeps it with the prefix, its markers' keys read once, and each state is a short row
    scoring its answer against them -- equal to one full forward per row, whatever the state's length,
    alone or in a micro-batch, and a second request counts the options block as cached."""
    from lev_jax.engine import Engine
    from lev_jax.readout import Usage

    bb = tiny_backbone("qwen3_5", seed=2)
    bb.mode_b_head = modeb.init_head(bb.config.hidden_size, width=32, seed=1)
    eng = Engine(bb, layout="schema_first", option_averaging=False)
    qs = {"big": _choice(151), "small": _choice(3, "Which of these?")}
    [row] = eng.plan(STATE, qs).questions[0].rows
    assert row.stateless == row.markers[-1] + 1  # every marker in the state-independent lead
    [(lead, _, [rest])] = eng.executor.stateless_groups([], [row])
    assert list(lead.markers) == row.markers and rest.markers == [] and rest.keys_before == rest.width == 151
    long_state = " ".join(f"Line {i}: the parcel is late again and support does not answer." for i in range(60))
    states = [STATE, "Please cancel my subscription today.", long_state]
    assert len(eng.plan(long_state, qs).questions[0].rows[0].after(row.stateless).tokens) > 512  # read in chunks
    first = eng.predict(STATE, qs)
    again = eng.predict_many([(s, qs) for s in states])
    for state, got in zip(states, again):
        ref = eng.predict(state, qs, reference=True)
        for q in qs:
            np.testing.assert_allclose(_probs(got[q]), _probs(ref[q]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(_probs(again[0]["big"]), _probs(first["big"]), atol=1e-6, rtol=0)
    # the state moves it (a random head moves little: by more than the fast path's error vs the reference)
    for other in again[1:]:
        assert np.abs(_probs(other["big"]) - _probs(again[0]["big"])).max() > 5e-5
    # the second request about another state computes only its own tokens: the options block is cached
    plan = eng.plan("Where is my refund?", {"big": _choice(151)})
    usage = Usage()
    eng.executor.read([(plan.prefix_ids, plan.rows)], [usage])
    assert usage.cached == len(plan.prefix_ids) + row.stateless
    assert usage.processed - usage.cached == len(plan.rows[0].tokens) - row.stateless
    # its rows are read alone by the Mode B tail program (scoring the lead's keys); another short state
    # of the same buckets compiles nothing
    assert any(k[0] == "tail" for k in eng.executor.programs(plan.prefix_ids, plan.rows))
    before = eng.compiled_programs
    eng.predict("Where is my money?", {"big": _choice(151)})
    assert eng.compiled_programs == before


def test_without_a_head_large_and_split_choices_use_mode_a(engine_b):
    from lev_jax.engine import Engine

    plain = Engine(engine_b.backbone, mode_b=False)
    assert plain.info()["mode_b"] is None and engine_b.info()["mode_b"]["marker"] == "<empty_output>"
    assert [qp.route for qp in plain.plan(STATE, {"q": _choice(151)}).questions] == ["mode_a"]
    plain.planner.group_size = 26  # as with a tokenizer that has only single letters: codes split
    qp = plain.plan(STATE, {"q": _choice(60)}).questions[0]
    assert qp.route == "mode_a_grouped" and len(qp.groups) == 3
    p = _probs(plain.predict(STATE, {"q": _choice(60)})["q"])
    assert abs(p.sum() - 1) < 1e-9
    # with the head, the split codes route to Mode B below the size threshold too
    engine_b.planner.group_size, saved = 26, engine_b.planner.group_size
    try:
        engine_b.planner.mode_b_min_options, saved_min = 100, engine_b.planner.mode_b_min_options
        assert engine_b.plan(STATE, {"q": _choice(30)}).questions[0].route == "mode_b"
    finally:
        engine_b.planner.group_size, engine_b.planner.mode_b_min_options = saved, saved_min


def test_request_text_holding_the_marker_is_refused_and_the_server_says_422(engine_b):
    import httpx

    from lev_jax.server import ServerConfig, create_app
    from lev_jax.server.testing import ThreadServer

    marker = "<empty_output>"
    bad_option = {"type": "choice", "criteria": {**dict(_options(30)), f"x{marker}": None}}
    with pytest.raises(ReservedTextError, match="reserves"):
        engine_b.plan(STATE, {"q": bad_option})
    with pytest.raises(ReservedTextError, match="the state"):
        engine_b.plan(f"{STATE} {marker}", {"q": _choice(30)})
    # a small (Mode A) question does not reserve the marker: its text is read as text
    assert engine_b.plan(f"{STATE} {marker}", {"q": _choice(3)}).questions[0].route == "mode_a"
    with ThreadServer(create_app(engine_b, ServerConfig(max_pending=8))) as s:

        def post(questions, state=STATE):
            body = {"model": "jev-latest", "state": state, "questions": questions}
            return httpx.post(s.url + "/v1/systemone", json=body, timeout=120)

        r = post({"q": bad_option})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][:3] == ["body", "questions", "q"]
        r = post({"q": _choice(30)}, state=f"{STATE} {marker}")
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "state"]
        r = post({"big": _choice(40), "small": _choice(2)})
        assert r.status_code == 200 and r.json()["x_readout"] == {"big": "mode_b", "small": "mode_a"}
        assert abs(sum(r.json()["answers"]["big"]["probabilities"].values()) - 1) < 1e-6
        assert httpx.get(s.url + "/health").json()["mode_b"]["min_options"] == 27


def test_a_mode_b_batch_shape_is_recorded_and_rebuilt_with_the_same_programs(engine_b):
    """Warm-up replays recorded shapes (readout.shapes): a Mode B row keeps its markers, so the
    rebuilt batch runs the same Mode B programs."""
    from lev_jax.readout import shapes

    plan = engine_b.plan(STATE, {"big": _choice(151), "small": _choice(3)})
    entries = [(plan.prefix_ids, plan.rows)]
    sig = shapes.signature(entries)
    rebuilt = shapes.synthesize(sig, engine_b.backbone.config.vocab_size)
    assert [r.markers for r in rebuilt[0][1]] == [r.markers for r in plan.rows]
    keys = engine_b.executor.batch_programs(entries)
    assert keys == engine_b.executor.batch_programs(rebuilt)
    assert any(k[0] == "chunk-marked" for k in keys) and any(k[0] == "tail" for k in keys)
