"""Serving at an exit (elastic depth): `predict(depth=d)` runs the backbone truncated at a trained exit
(`Backbone.at_depth`, `models.exit_view`): its first d layers for prefix and rows, d layers of cache,
the exit adapter and the shared final norm and head; `depth="auto"` is the confidence cascade over the
exits; bucketed like the rest (no recompiles in steady state across exits); the server takes the
depth in a request header and says per question which depth answered."""

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lev_jax
from lev_jax import models, testing
from lev_jax.elastic import serving as elastic_serving
from lev_jax.errors import RequestError
from lev_jax.readout import exits as exits_lib
from lev_jax.server import ServerConfig, create_app
from lev_jax.server.testing import ThreadServer

STATE = "My parcel never arrived and I was charged twice for it. Please send my money back."
QUESTIONS = {
    "intent": {
        "type": "choice",
        "instructions": "What does the customer want?",
        "criteria": {"refund": "money back", "track": None, "other": None},
    },
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high"]},
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
}


def with_exits(bb, depths, seed=0):
    """`bb` with trained-looking exit adapters (nonzero `b`, a gain off one: every part of an exit matters)."""
    adapters = exits_lib.init_exits(bb.config, depths, rank=4, seed=seed)
    bb.exits = {
        d: {
            **a,
            "b": 0.3 * jax.random.normal(jax.random.key(int(d)), a["b"].shape),
            "scale": a["scale"] * 1.2,
            "gain": 0.5 + jax.random.uniform(jax.random.key(10 + int(d)), a["gain"].shape),
        }
        for d, a in adapters.items()
    }
    return bb


@pytest.fixture(scope="module")
def engine():
    return lev_jax.Engine(with_exits(testing.tiny_backbone("llama", seed=4, layers=4), (1, 2, 3)))


def probs(answers):
    return {q: a["probabilities"] if "probabilities" in a else {"yes": a["noul"]} for q, a in answers.items()}


def assert_close(a, b, tol=1e-5):
    pa, pb = probs(a), probs(b)
    assert pa.keys() == pb.keys()
    for q in pa:
        assert pa[q].keys() == pb[q].keys(), q
        for k in pa[q]:
            assert pa[q][k] == pytest.approx(pb[q][k], abs=tol), (q, k)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_view_at_an_exit_is_the_truncated_model_plus_adapter_and_head(family):
    bb = testing.tiny_backbone(family, seed=2, **({"layers": 4} if family == "llama" else {}))
    bb = with_exits(bb, (1, 3))
    ids = np.random.default_rng(0).integers(1, 5000, (1, 13))
    for d in (1, 3):
        view = bb.at_depth(d)
        assert view.depth == d and models.num_layers(view.config) == d
        assert models.cache_depth(models.init_cache(view.config, 1, 8)) == d  # its cache holds d layers
        small = {**bb.hf_config, "num_hidden_layers": d}
        if "layer_types" in small:
            small["layer_types"] = small["layer_types"][:d]
        cfg = models.config_from_hf(small)
        per_layer = models.layer_view(bb.params)
        per_layer["layers"] = {i: per_layer["layers"][i] for i in range(d)}
        params = models.stacked_view(per_layer, cfg)
        x, _ = models.forward(params, jnp.asarray(ids), None, cfg, final_norm=False)
        x = exits_lib.apply_exit(bb.exits[str(d)], x[:, -1])
        want = models.head_logits(params, models.final_norm(params, x, cfg) * bb.exits[str(d)]["gain"], cfg)
        got = view.logits(ids)[:, -1]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert bb.at_depth(bb.depth) is bb
    with pytest.raises(ValueError, match=r"depth 2 is not an exit .*depths: 1, 3, 4"):
        bb.at_depth(2)


def test_predict_at_an_exit_equals_its_reference_and_differs_from_full_depth(engine):
    full = engine.predict(STATE, QUESTIONS)
    assert_close(engine.predict(STATE, QUESTIONS, depth="full"), full, tol=0)
    assert_close(engine.predict(STATE, QUESTIONS, depth=4), full, tol=0)
    for d in (1, 2):
        fast, usage = engine.predict_with_usage(STATE, QUESTIONS, depth=d)
        assert usage["depths"] == {q: d for q in QUESTIONS}
        assert_close(fast, engine.predict(STATE, QUESTIONS, depth=d, reference=True))
        gap = max(abs(p - full["intent"]["probabilities"][k]) for k, p in fast["intent"]["probabilities"].items())
        assert gap > 1e-3  # a shallower model answers differently: the depth is really used
    # the exit's prefix cache holds d layers only
    [(cache, _, _)] = list(engine.executor_at(2).prefixes.values())
    assert models.cache_depth(cache) == 2


def test_auto_stops_each_question_at_the_first_sure_exit(engine):
    at = {d: engine.predict(STATE, QUESTIONS, depth=d) for d in engine.depths}
    try:
        engine.depth_threshold = 0.0  # every exit is sure: all at the first
        answers, usage = engine.predict_with_usage(STATE, QUESTIONS, depth="auto")
        assert usage["depths"] == {q: 1 for q in QUESTIONS}
        assert_close(answers, at[1])
        engine.depth_threshold = 1.01  # none is: all at full depth, the full model's answers
        answers, usage = engine.predict_with_usage(STATE, QUESTIONS, depth="auto")
        assert usage["depths"] == {q: 4 for q in QUESTIONS}
        assert_close(answers, at[4])
        # in between: each question is answered by the first exit sure enough, as its own depth answers it
        tops = {d: {q: lev_jax.elastic.policy.top_probability(a) for q, a in ans.items()} for d, ans in at.items()}
        engine.depth_threshold = float(np.median([t for d in (1, 2, 3) for t in tops[d].values()]))
        answers, usage = engine.predict_with_usage(STATE, QUESTIONS, depth="auto")
        for q, d in usage["depths"].items():
            want = next((x for x in engine.depths if x == 4 or tops[x][q] >= engine.depth_threshold), 4)
            assert d == want, (q, d, want)
            assert_close({q: answers[q]}, {q: at[d][q]})
    finally:
        engine.depth_threshold = lev_jax.engine.DEPTH_THRESHOLD


@pytest.fixture
def trails(monkeypatch):
    """Every elastic.serving.Trail the engine makes while the test runs (one per auto request)."""
    made = []

    class Recording(elastic_serving.Trail):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(elastic_serving, "Trail", Recording)
    return made


def test_auto_continues_each_row_from_its_last_exit_never_running_a_layer_twice(engine, trails):
    full = engine.predict(STATE, QUESTIONS)
    try:
        engine.depth_threshold = 1.01  # no exit is sure: every question goes through every exit
        answers, usage = engine.predict_with_usage(STATE, QUESTIONS, depth="auto")
    finally:
        engine.depth_threshold = lev_jax.engine.DEPTH_THRESHOLD
    assert usage["depths"] == {q: 4 for q in QUESTIONS}
    assert_close(answers, full)  # through the cascade, the full model's answers
    [trail] = trails
    calls = sorted({c for c, _, _ in trail.reads})
    assert calls and all(c < len(trail.calls) for c in calls)
    for c in calls:  # each call's rows ran layers [0, 1), [1, 2), [2, 3), [3, 4): each layer once
        assert [(s, d) for k, s, d in trail.reads if k == c] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_schema_first_rows_whose_long_question_lead_joins_the_prefix_go_through_the_cascade(engine, trails):
    """With the schema first a question's options lead its row and join the prefix (cached across
    states): a row is long for the cascade only by what follows that lead."""
    schema = lev_jax.Engine(engine.backbone, layout="schema_first")
    options = {f"team {i}": f"tickets about the part of the order numbered {i} and its delivery" for i in range(24)}
    long_q = {"team": {"type": "choice", "instructions": "Which team?", "criteria": options}}
    plan = schema.plan(STATE, long_q, depth="auto")
    assert any(len(r.tokens) > lev_jax.buckets.PREFILL_CHUNK for r in plan.rows)
    assert all(r.stateless for r in plan.rows) and elastic_serving.Cascade.serves(plan)
    full = schema.predict(STATE, long_q)
    try:
        schema.depth_threshold = 1.01
        answers, usage = schema.predict_with_usage(STATE, long_q, depth="auto")
    finally:
        schema.depth_threshold = lev_jax.engine.DEPTH_THRESHOLD
    assert usage["depths"] == {"team": 4}
    assert_close(answers, full)
    [trail] = trails
    calls = sorted({c for c, _, _ in trail.reads})
    assert len(calls) == len({r.tokens[: r.stateless].__repr__() for r in plan.rows})  # a call per lead
    for c in calls:
        assert [(s, d) for k, s, d in trail.reads if k == c] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_a_request_the_cascade_cannot_read_goes_through_each_exits_executor(engine):
    plan = engine.plan(STATE, QUESTIONS, depth="auto")
    assert elastic_serving.Cascade.serves(plan)
    # a prefix the cascade would compute in one call past its bound (the executors chunk it)
    plan = engine.plan(" ".join(["word"] * (elastic_serving.PREFIX_MAX + 10)), QUESTIONS, depth="auto")
    assert len(plan.prefix_ids) > elastic_serving.PREFIX_MAX and not elastic_serving.Cascade.serves(plan)
    # a question whose options make its rows longer than a prefill chunk (read chunk by chunk)
    options = {f"team {i}": f"tickets about the part of the order numbered {i} and its delivery" for i in range(24)}
    long_q = {"team": {"type": "choice", "instructions": "Which team?", "criteria": options}}
    plan = engine.plan(STATE, long_q, depth="auto")
    assert any(len(r.tokens) > lev_jax.buckets.PREFILL_CHUNK for r in plan.rows)
    assert not elastic_serving.Cascade.serves(plan)
    at = {d: engine.predict(STATE, long_q, depth=d) for d in engine.depths}
    try:
        engine.depth_threshold = 1.01
        answers, usage = engine.predict_with_usage(STATE, long_q, depth="auto")
    finally:
        engine.depth_threshold = lev_jax.engine.DEPTH_THRESHOLD
    assert usage["depths"] == {"team": 4}
    assert_close(answers, at[4])


@pytest.mark.parametrize("depth", [0, 5, 2.5, "2.0", "deep", True])
def test_an_unknown_depth_is_a_clear_error_before_any_work(engine, depth):
    before = engine.compiled_programs
    with pytest.raises(RequestError, match=r"depth must be 'auto', 'full' or one of this model's exits \(1, 2, 3, 4\)"):
        engine.predict(STATE, QUESTIONS, depth=depth)
    assert engine.compiled_programs == before


def test_a_model_without_exits_serves_auto_at_full_depth():
    plain = lev_jax.Engine(testing.tiny_backbone("llama", seed=4))
    answers, usage = plain.predict_with_usage(STATE, QUESTIONS, depth="auto")
    # every answer is the full model's: the usage stays as it always was (no "depths")
    assert "depths" not in usage and plain.depths == (2,)
    assert answers == plain.predict(STATE, QUESTIONS)
    with pytest.raises(RequestError, match=r"exits \(2\)"):
        plain.predict(STATE, QUESTIONS, depth=1)


def test_no_recompilation_in_steady_state_across_exits(engine):
    rng = np.random.default_rng(1)
    words = "order parcel refund invoice late broken card account address phone".split()

    def request():
        state = " ".join(rng.choice(words, int(rng.integers(30, 90))))
        k = int(rng.integers(2, 5))
        return state, {
            "q": {"type": "choice", "instructions": "Topic?", "criteria": dict.fromkeys(rng.choice(words, k, False))}
        }

    warm = [(r, d) for r in [request() for _ in range(6)] for d in (1, 2, 3, "full", "auto")]  # each at every depth
    try:
        engine.depth_threshold = 1.01  # warming "auto": every question through every exit
        for (state, qs), d in warm:
            engine.predict(state, qs, depth=d)
    finally:
        engine.depth_threshold = lev_jax.engine.DEPTH_THRESHOLD
    seen = set().union(*(engine.programs(s, q, depth=d) for (s, q), d in warm))
    assert any(k[0] == "depth" for k in seen)  # an exit's programs are its own
    assert any(k[0] == "cascade-rows" and k[2] > 0 for k in seen)  # "auto" continued rows deeper
    before = engine.compiled_programs
    fresh = []
    for _ in range(300):
        (s, q), d = request(), ("auto", 1, 3, "full")[len(fresh) % 4]
        if engine.programs(s, q, depth=d) <= seen:
            fresh.append((s, q, d))
        if len(fresh) == 6:
            break
    assert len(fresh) == 6
    for s, q, d in fresh:  # new requests, new lengths, every depth and auto: inside the bucket set
        engine.predict(s, q, depth=d)
    assert engine.compiled_programs == before


def test_the_server_reads_the_depth_header_and_says_which_depth_answered(engine):
    body = {"model": "jev-latest", "state": STATE, "questions": QUESTIONS}
    with ThreadServer(create_app(engine, ServerConfig(max_pending=8))) as s:
        health = httpx.get(s.url + "/health").json()
        r1 = httpx.post(s.url + "/v1/systemone", json=body, headers={"x-lev-depth": "1"}, timeout=120)
        r_full = httpx.post(s.url + "/v1/systemone", json=body, timeout=120)
        bad = httpx.post(s.url + "/v1/systemone", json=body, headers={"x-lev-depth": "7"}, timeout=120)
    assert health["depth"]["exits"] == [1, 2, 3, 4] and health["depth"]["layers"] == 4
    assert r1.status_code == 200, r1.text
    assert r1.json()["x_depth"] == {q: 1 for q in QUESTIONS}
    assert r_full.status_code == 200 and r_full.json()["x_depth"] == {q: 4 for q in QUESTIONS}
    assert r1.json()["answers"]["intent"] != r_full.json()["answers"]["intent"]
    assert bad.status_code == 400 and bad.json()["detail"]["error_type"] == "api_usage_error"
    assert "exits (1, 2, 3, 4)" in bad.json()["detail"]["message"]
