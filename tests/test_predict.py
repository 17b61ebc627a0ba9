"""predict(): equivalence with independent full forwards, invariance, bounded compilation, every type."""

import math

import numpy as np
import pytest

import lev_jax
from lev_jax import RequestError, TokenLimitError, buckets, runtime
from lev_jax.readout import compose
from lev_jax.testing import tiny_backbone

STATE = {
    "customer": "Ann Lee",
    "message": "My parcel never arrived and I was charged twice. Fix it now!",
    "history": [{"date": "2026-11-30", "note": "asked for tracking"}],
    "vip": True,
}


def _questions():
    return {
        "intent": {
            "type": "choice",
            "instructions": "What does the customer want?",
            "criteria": {
                "refund": "money back",
                "delivery": "a late or missing parcel",
                "billing": {"examples": ["double charge"], "team": "finance"},
                "other": None,
            },
        },
        "urgency": {
            "type": "score",
            "instructions": "How urgent is this ticket?",
            "criteria": ["not urgent", "somewhat urgent", "urgent", "critical"],
        },
        "angry": {
            "type": "noul",
            "instructions": "Is the customer angry?",
            "criteria": {"true": "insults, threats, exclamation", "false": "calm"},
        },
        "vip": {"type": "noul", "instructions": "Is this a VIP customer?"},
    }


def _many_questions(n):
    """n variants of every question in _questions(): enough shared question headers (the text before
    the options, common to both option orders) that the engine computes them as cache segments."""
    return {
        f"{k}{i}": {**v, "instructions": f"{v['instructions']} (variant {i})"}
        for i in range(n)
        for k, v in _questions().items()
    }


def _assert_close(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    for qid in a:
        x, y = a[qid], b[qid]
        assert x["type"] == y["type"]
        if x["type"] == "noul":
            assert abs(x["noul"] - y["noul"]) <= tol, qid
        else:
            assert x["probabilities"].keys() == y["probabilities"].keys()
            for k in x["probabilities"]:
                assert abs(x["probabilities"][k] - y["probabilities"][k]) <= tol, (qid, k)


def _check_well_formed(ans):
    for a in ans.values():
        if a["type"] == "noul":
            assert 0.0 <= a["noul"] <= 1.0
            continue
        p = np.array(list(a["probabilities"].values()))
        assert np.all(np.isfinite(p)) and np.all(p > 0) and abs(p.sum() - 1) < 1e-9
        assert 0.0 <= a["confidence"] <= 1.0


@pytest.fixture(scope="module")
def tiny():
    return lev_jax.Engine(tiny_backbone("llama", seed=1))


@pytest.fixture(scope="module")
def tiny_qwen():
    return lev_jax.Engine(tiny_backbone("qwen3_5", seed=2))


@pytest.mark.parametrize("engine_name", ["tiny_qwen", "tiny"])
def test_equals_independent_full_forwards(engine_name, request):
    engine = request.getfixturevalue(engine_name)
    fast = engine.predict(STATE, _questions())
    _check_well_formed(fast)
    _assert_close(fast, engine.predict(STATE, _questions(), reference=True))


def test_equals_reference_on_the_embedded_model(embedded):
    engine = lev_jax.load(embedded, calibration=None)
    qs = _questions()
    fast = engine.predict(STATE, qs)
    # the real model, tokenizer and label codes through the shared-prefix path; question headers as
    # cache segments and the rating readout take the same programs on the tiny models (below)
    _assert_close(fast, engine.predict(STATE, qs, reference=True))
    # bf16 weights (matmuls at the bf16 rate, fp32 accumulation and residual stream) answer within ~1
    # point of fp32 on the real model; that the bf16 shared-prefix path equals bf16 independent forwards
    # is test_bfloat16_engine_equals_its_reference's (tiny models: the same programs, a fraction of the
    # emulated-bf16 CPU time)
    bf16 = lev_jax.load(base_only=True, calibration=None, dtype="bfloat16")  # the raw embedded model
    fast16 = bf16.predict(STATE, qs)
    _check_well_formed(fast16)
    _assert_close(fast16, fast, tol=runtime.ANSWER_TOLERANCE["bfloat16"])


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_bfloat16_engine_equals_its_reference(family):
    engine = lev_jax.Engine(tiny_backbone(family, seed=3, dtype="bfloat16"))
    fast = engine.predict(STATE, _questions())
    _check_well_formed(fast)
    _assert_close(fast, engine.predict(STATE, _questions(), reference=True), tol=5e-3)


@pytest.mark.parametrize(
    "layout,style", [("schema_first", "chat"), ("state_first", "plain"), ("schema_first", "plain")]
)
def test_other_layouts_and_styles(tiny, layout, style):
    engine = lev_jax.Engine(tiny.backbone, layout=layout, prompt_style=style, noul_readout="rating")
    fast = engine.predict(STATE, _questions())
    _check_well_formed(fast)
    _assert_close(fast, engine.predict(STATE, _questions(), reference=True))


def test_answer_is_invariant_to_other_questions(tiny):
    qs = _questions()
    alone = {k: tiny.predict(STATE, {k: q})[k] for k, q in qs.items()}
    together = tiny.predict(STATE, qs)
    reordered = tiny.predict(STATE, dict(reversed(list(qs.items()))))
    renamed = tiny.predict(STATE, {f"q{i}": q for i, q in enumerate(qs.values())})
    extra = tiny.predict(
        STATE,
        {
            **qs,
            "more": {"type": "choice", "instructions": "Language?", "criteria": {f"lang{i}": None for i in range(30)}},
        },
    )
    for i, k in enumerate(qs):
        for other in (together[k], reordered[k], renamed[f"q{i}"], extra[k]):
            _assert_close({k: alone[k]}, {k: other})


def test_no_recompilation_in_steady_state(tiny):
    rng = np.random.default_rng(0)
    words = "order parcel refund invoice late broken card account address phone".split()

    def request():
        state = " ".join(rng.choice(words, int(rng.integers(40, 120))))
        qs = {
            f"q{i}": {
                "type": "choice",
                "instructions": f"Topic {i}?",
                "criteria": {w: None for w in rng.choice(words, int(rng.integers(2, 6)), replace=False)},
            }
            for i in range(int(rng.integers(1, 5)))
        }
        return state, qs

    warm = [request() for _ in range(40)]  # the traffic that defines the bucket set
    for r in warm:
        tiny.predict(*r)
    seen = set().union(*(tiny.programs(*r) for r in warm))
    before = tiny.compiled_programs
    fresh = [r for r in (request() for _ in range(400)) if tiny.programs(*r) <= seen][:30]
    assert len(fresh) == 30
    for r in fresh:  # new requests, new lengths, all inside the bucket set
        tiny.predict(*r)
    assert tiny.compiled_programs == before


@pytest.mark.parametrize("k", [2, 26, 64, 255])
def test_choice_sizes(tiny, k):
    qs = {"c": {"type": "choice", "instructions": "Which code?", "criteria": {f"opt-{i}": None for i in range(k)}}}
    ans = tiny.predict("ticket 42", qs)["c"]
    assert list(ans["probabilities"]) == [f"opt-{i}" for i in range(k)]
    p = np.array(list(ans["probabilities"].values()))
    assert abs(p.sum() - 1) < 1e-9 and p.min() > 0
    assert ans["choice"] == f"opt-{int(np.argmax(p))}"
    assert ans["confidence"] == pytest.approx((k * p.max() - 1) / (k - 1))


def test_more_options_than_codes_are_grouped_and_composed(tiny):
    engine = lev_jax.Engine(tiny.backbone)
    engine.planner.group_size = 26  # as with a tokenizer that has only single letters
    qs = {"c": {"type": "choice", "instructions": "Which?", "criteria": {f"o{i}": None for i in range(100)}}}
    fast = engine.predict("state", qs)
    _check_well_formed(fast)
    _assert_close(fast, engine.predict("state", qs, reference=True))


@pytest.mark.parametrize("levels", [2, 10])
def test_score_levels(tiny, levels):
    crit = [f"level {i}" for i in range(levels)]
    ans = tiny.predict("x", {"s": {"type": "score", "instructions": "Rate", "criteria": crit}})["s"]
    p = np.array([ans["probabilities"][str(i)] for i in range(levels)])
    assert ans["legend"] == {str(i): c for i, c in enumerate(crit)}
    assert ans["score"] == pytest.approx(float((np.arange(levels) * p).sum()))
    mode = int(np.argmax(p))
    spread = np.abs(np.arange(levels) - (levels - 1) / 2).mean()
    assert ans["confidence"] == pytest.approx(
        max(0.0, 1 - float((p * np.abs(np.arange(levels) - mode)).sum()) / spread)
    )


@pytest.mark.parametrize(
    "criteria",
    [
        None,
        {"true": "it is"},
        {"false": "it is not"},
        {"true": "a", "false": "b"},
        {"yes": "a", "no": "b"},
        {"true": {"k": ["structured"]}, "false": None},
    ],
)
def test_noul_criteria_forms(tiny, criteria):
    q = {"type": "noul", "instructions": "Is it raining?"}
    if criteria is not None:
        q["criteria"] = criteria
    ans = tiny.predict("weather report", {"n": q})["n"]
    assert set(ans) == {"type", "noul"} and 0 < ans["noul"] < 1


def test_unicode_option_names_round_trip(tiny):
    names = ["café ☕", "naïve", "日本語", "emoji 🚀", "Ωmega", "ü-umlaut", "x\ny"]
    ans = tiny.predict(
        {"städte": ["Zürich", "Kraków"]},
        {"ü": {"type": "choice", "instructions": "Wähle", "criteria": {n: None for n in names}}},
    )
    assert list(ans["ü"]["probabilities"]) == names and ans["ü"]["choice"] in names


def test_token_limits_are_checked_before_any_work(tiny):
    before = tiny.compiled_programs
    huge_state = "word " * 33000
    with pytest.raises(TokenLimitError, match="state \\+ longest question"):
        tiny.predict(huge_state, {"n": {"type": "noul", "instructions": "?"}})
    many = {
        f"q{i}": {"type": "choice", "instructions": "pick " * 300, "criteria": {"a": None, "b": None}}
        for i in range(110)
    }
    with pytest.raises(TokenLimitError, match="the request is"):
        tiny.predict("short", many)
    assert tiny.compiled_programs == before


def test_a_state_over_the_budget_is_refused_before_any_row_is_built(tiny, monkeypatch):
    """Schema first, each question row repeats the state: a state that, once per question, is over
    the token budget is refused from one tokenizing of the state, before any row tokenizes it again;
    state first, a prefix that leaves no room for a question is refused before the questions' rows."""
    from lev_jax.readout import plan as plan_lib

    engine = lev_jax.Engine(tiny.backbone, layout="schema_first")
    rows = []
    real_row = plan_lib.Planner._row
    monkeypatch.setattr(plan_lib.Planner, "_row", lambda self, *a, **k: rows.append(1) or real_row(self, *a, **k))
    state = "word " * 2000  # ~2k tokens: one question fits, 40 of them (80k tokens) do not
    noul = {"type": "noul", "instructions": "?"}
    with pytest.raises(TokenLimitError, match="40 questions each reading the"):
        engine.plan(state, {f"q{i}": noul for i in range(40)})
    with pytest.raises(TokenLimitError, match="the state alone is at least"):
        engine.plan("word " * 33000, {"n": noul})
    assert rows == []  # refused before any row was built
    engine.plan(state, {"q0": noul, "q1": noul})  # within the budget: planned as before
    assert rows
    rows.clear()  # state first, a prefix that leaves no room for a question is refused from itself
    with pytest.raises(TokenLimitError, match="state \\+ longest question is at least"):
        tiny.plan("word " * 33000, {f"q{i}": noul for i in range(100)})
    assert rows == []


@pytest.mark.parametrize(
    "questions,message",
    [
        ({}, "non-empty"),
        ({"b": {"type": "box", "instructions": "find the cat"}}, "cannot locate boxes"),
        ({"x": {"type": "rank", "instructions": ""}}, "unknown type"),
        ({"c": {"type": "choice", "instructions": "", "criteria": {"only": None}}}, "2-255"),
        ({"c": {"type": "choice", "instructions": "", "criteria": {str(i): None for i in range(256)}}}, "2-255"),
        ({"s": {"type": "score", "instructions": "", "criteria": {"low": 0, "high": 1}}}, "list of 2-10"),
        ({"s": {"type": "score", "instructions": "", "criteria": [str(i) for i in range(11)]}}, "list of 2-10"),
        ({"n": {"type": "noul", "instructions": "", "criteria": {"maybe": "x"}}}, "'true' and/or 'false'"),
        ({"n": {"type": "noul", "instructions": "", "criteria": {"yes": "x", "true": "y"}}}, "'true' and/or 'false'"),
        ({"n": {"type": "noul", "instructions": 5}}, "instructions must be a string, an object or an array"),
    ],
)
def test_bad_questions_are_clear_errors(tiny, questions, message):
    with pytest.raises(RequestError, match=message):
        tiny.predict("s", questions)


def test_buckets_cover_the_limits():
    assert buckets.PREFIX[-1] >= 32768 and buckets.SUFFIX[-1] >= 32768
    # prefix caches come in a few capacities: a short lead's, then whole chunks doubling
    chunk = buckets.PREFILL_CHUNK
    assert buckets.fit(65, buckets.PREFIX, "x") == chunk
    assert buckets.fit(2 * chunk + 1, buckets.PREFIX, "x") == 4 * chunk
    assert len(buckets.PREFIX) <= 12
    with pytest.raises(ValueError):
        buckets.fit(10**6, buckets.PREFIX, "prefix")
    assert math.isclose(compose.choice_confidence(np.array([1.0])), 1.0)


def _lanes(engine, state, qs):
    """The slab lanes (readout.slab) the short rows of one request are packed into."""
    p = engine.plan(state, qs)
    slots = buckets.prefilled(len(p.prefix_ids))[1]
    return engine.executor.read_plan([p.rows], [slots]).packed


def test_state_prefix_is_reused_across_requests(tiny):
    engine = lev_jax.Engine(tiny.backbone)
    qs = _questions()
    first, u1 = engine.predict_with_usage(STATE, qs)
    second, u2 = engine.predict_with_usage(STATE, {"angry": qs["angry"]})
    assert u1["cached_input_tokens"] == 0 and u2["cached_input_tokens"] > 0
    assert u1["input_tokens"] == engine.count_tokens(STATE, qs)["input_tokens"]
    _assert_close({"angry": first["angry"]}, second, tol=1e-6)
    uncached = lev_jax.Engine(tiny.backbone, prefix_cache_bytes=0)
    uncached.predict(STATE, qs)
    assert uncached.predict_with_usage(STATE, qs)[1]["cached_input_tokens"] == 0


def test_a_micro_batch_of_requests_equals_each_request_alone(tiny):
    qs = _questions()
    requests = [
        (STATE, qs),
        ("a short state", {"n": qs["angry"]}),
        (["x", 1], {"bad": {"type": "box"}}),
        ({"k": "another state entirely, somewhat longer than the short one"}, qs),
    ]
    batch = tiny.predict_many(requests, with_usage=True)
    assert isinstance(batch[2], RequestError)
    for (state, q), got in zip(requests, batch):
        if isinstance(got, RequestError):
            continue
        answers, usage = got
        alone, alone_usage = lev_jax.Engine(tiny.backbone, prefix_cache_bytes=0).predict_with_usage(state, q)
        _assert_close(alone, answers)
        assert usage["input_tokens"] == alone_usage["input_tokens"]


def test_more_rows_than_the_largest_row_bucket(tiny):
    qs = {f"n{i}": {"type": "noul", "instructions": f"Is fact {i} true?"} for i in range(300)}  # 600 rows
    ans = tiny.predict("facts", qs)
    assert len(ans) == 300 and all(0 < a["noul"] < 1 for a in ans.values())
    assert ans["n7"]["noul"] == pytest.approx(tiny.predict("facts", {"n7": qs["n7"]})["n7"]["noul"], abs=1e-5)


def test_rows_are_split_into_even_calls_within_the_per_call_budget(tiny, monkeypatch):
    qs = {f"n{i}": {"type": "noul", "instructions": f"Is fact number {i} true?"} for i in range(10)}  # 20 rows
    whole = tiny.predict("facts", qs)
    monkeypatch.setitem(buckets.ROW_TOKENS_PER_CALL, tiny.platform, 128)
    rows = tiny.plan("facts", qs).rows
    calls = tiny.executor.calls(rows)
    assert len(calls) > 1
    assert sorted(i for c in calls for i in c.rows) == list(range(len(rows)))
    assert all(c.batch * c.length <= 128 and len(c.rows) <= c.batch for c in calls)
    sizes = [len(c.rows) for c in calls]
    assert max(sizes) - min(sizes) <= 1  # spread evenly, not a full call and a remainder
    _assert_close(tiny.predict("facts", qs), whole)


@pytest.mark.parametrize("variants", [0, 4])
def test_rows_the_anchored_softmax_cannot_serve_are_rerun_exactly(variants):
    """Attention logits in the thousands (q and k projections scaled up): the fast readout's anchored
    softmax overflows on some rows (and, with shared headers, in the header segments); the engine
    sees the NaN, reruns those calls with the exact stabiliser, and the answers still equal
    independent full forwards."""
    import jax

    bb = tiny_backbone("llama", seed=1)
    scale = lambda path, x: x * 12.0 if any(getattr(p, "key", None) in ("q_proj", "k_proj") for p in path) else x
    bb.params = jax.tree_util.tree_map_with_path(scale, bb.params)
    engine = lev_jax.Engine(bb)
    qs = _many_questions(variants) if variants else _questions()
    assert any(k[0] == "slab" for k in engine.programs(STATE, qs))
    fast = engine.predict(STATE, qs)
    assert engine.exact_reruns > 0
    _check_well_formed(fast)
    _assert_close(fast, engine.predict(STATE, qs, reference=True), tol=1e-4)


@pytest.mark.parametrize("engine_name,tol", [("tiny", 1e-5), ("tiny_qwen", 5e-5)])
def test_packed_rows_equal_independent_full_forwards(engine_name, tol, request, monkeypatch):
    """Short rows are packed into slab lanes (readout.slab): with an attention-only model several
    rows to a lane, each question's header once with both option orders continuing it; with a
    recurrent model one row to a lane. Either way (and over several calls, under a small per-call
    budget) the answers equal one independent full forward per row. (Tiny Qwen3.5 at 5e-5: its fp32
    rounding moves with where a sequence is split into cached pieces.)"""
    engine = request.getfixturevalue(engine_name)
    qs = _many_questions(4)
    lanes = _lanes(engine, STATE, qs)
    n_rows = len(engine.plan(STATE, qs).rows)
    assert sum(len(ln.reads) for ln in lanes) == n_rows
    if engine.executor.packable:
        assert len(lanes) < n_rows / 4 and any(max(ln.parents) >= 0 for ln in lanes)  # headers shared
    else:
        assert all(len(ln.reads) == 1 and max(ln.parents) < 0 for ln in lanes)
    fast = engine.predict(STATE, qs)
    _check_well_formed(fast)
    _assert_close(fast, engine.predict(STATE, qs, reference=True), tol=tol)
    monkeypatch.setitem(buckets.ROW_TOKENS_PER_CALL, engine.platform, 160)
    p = engine.plan(STATE, qs)
    assert len(engine.executor.read_plan([p.rows], [buckets.prefilled(len(p.prefix_ids))[1]]).calls) >= 2
    _assert_close(engine.predict(STATE, qs), fast, tol=tol)


def test_schema_first_computes_a_question_once_across_states(tiny):
    """With the question before the state, a stream of states asked one question reuses the question
    from the cross-request cache: the second state costs only its own tokens, answers unchanged."""
    engine = lev_jax.Engine(tiny.backbone, layout="schema_first", option_averaging=False)
    q = {"intent": _questions()["intent"]}
    first, u1 = engine.predict_with_usage("The match ended in a draw.", q)
    second, u2 = engine.predict_with_usage("Shares fell sharply on Monday.", q)
    question = engine.plan("x", q).rows[0].stateless
    assert question > 20 and u1["cached_input_tokens"] == 0
    assert u2["cached_input_tokens"] >= question and u2["input_tokens"] - u2["cached_input_tokens"] < 40
    _assert_close(second, engine.predict("Shares fell sharply on Monday.", q, reference=True))
    _assert_close(first, engine.predict("The match ended in a draw.", q, reference=True))


def test_calls_of_several_rows_take_the_coarse_stacked_buckets(tiny):
    """Which rows meet in a call is chance (a micro-batch's requests): several rows take
    `buckets.STACKED_ROWS` / `STACKED_SUFFIX`, so few programs serve the combinations; a row alone
    keeps its exact `SUFFIX` bucket."""
    qs = {f"n{i}": {"type": "noul", "instructions": f"Is fact number {i} true?"} for i in range(3)}
    rows = tiny.plan("facts", qs).rows
    (call,) = tiny.executor.calls(rows)
    assert len(call.rows) == len(rows) >= 3
    assert call.batch == buckets.fit(len(rows), buckets.STACKED_ROWS, "rows")
    assert call.length == buckets.fit(max(len(r.tokens) for r in rows), buckets.STACKED_SUFFIX, "length")
    (alone,) = tiny.executor.calls(rows[:1])
    assert (alone.batch, alone.length) == (1, buckets.fit(len(rows[0].tokens), buckets.SUFFIX, "length"))
