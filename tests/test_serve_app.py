"""The HTTP server over a real (tiny, random) model, served by uvicorn on loopback: every error of
docs/API.md, compression, multipart and images, auth, request ids, the token budget, 429/504,
client disconnects, /health, /metrics and the OpenAPI document."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json

import httpx
import pytest
import zstandard
from prometheus_client.parser import text_string_to_metric_families

import lev_jax
from lev_jax.server import ServerConfig, create_app
from lev_jax.server.testing import ThreadServer
from lev_jax.testing import save_tiny_checkpoint

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
KEY = "sk-test-key"
NOUL = {"type": "noul", "instructions": "Is the customer asking for money back?"}
CHOICE = {
    "type": "choice",
    "instructions": "Which team?",
    "criteria": {"Billing": "Payments", "Technical": None, "Sales": ["x"]},
}
SCORE = {"type": "score", "instructions": "How angry?", "criteria": ["Calm", {"label": "Angry"}, "Furious"]}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return lev_jax.load(model=str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))))


@pytest.fixture(scope="module")
def server(engine):
    with ThreadServer(create_app(engine, ServerConfig(max_pending=64, max_body_bytes=1 << 20))) as s:
        yield s


@pytest.fixture(scope="module")
def authed(engine):
    with ThreadServer(create_app(engine, ServerConfig(api_keys=frozenset({KEY, "second-key"})))) as s:
        yield s


def body(questions=None, state="I was charged twice for order #4471.", **extra):
    return {"model": "jev-latest", "state": state, "questions": questions or {"refund": NOUL}, **extra}


def post(s, payload, headers=None, **kw):
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    h = {"content-type": "application/json", **(headers or {})}
    return httpx.post(s.url + "/v1/systemone", content=data, headers=h, timeout=60, **kw)


def metric_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """/metrics text -> {(sample name, label set): value}, read by prometheus-client's own parser."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def assert_error(r, status, error_type, fragment=""):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    d = r.json()["detail"]
    assert d["error_type"] == error_type and isinstance(d["message"], str)
    assert fragment in d["message"], d["message"]
    assert r.headers["x-typesafe-request-id"].startswith("req_")


# ---------------------------------------------------------------- answers


def test_answers_every_type(server, engine):
    state = "A state no other test sends."
    r = post(server, body({"refund": NOUL, "team": CHOICE, "anger": SCORE}, state=state, seed=1, x_extra={"a": 1}))
    assert r.status_code == 200, r.text
    d = r.json()
    assert set(d) == {"model", "answers", "usage", "x_cached_input_tokens", "x_readout"}  # no exits: no x_depth
    assert d["x_readout"] == {"refund": "mode_a", "team": "mode_a", "anger": "mode_a"}  # no head: Mode A
    assert d["model"] == engine.model_name
    assert list(d["answers"]) == ["refund", "team", "anger"]
    assert 0 <= d["answers"]["refund"]["noul"] <= 1
    assert set(d["answers"]["team"]["probabilities"]) == {"Billing", "Technical", "Sales"}
    assert d["answers"]["anger"]["legend"] == {"0": "Calm", "1": {"label": "Angry"}, "2": "Furious"}
    assert isinstance(d["usage"]["input_tokens"], int) and d["usage"]["input_tokens"] > 0
    assert d["usage"]["output_tokens"] == 3
    assert d["x_cached_input_tokens"] == 0
    again = post(server, body({"refund": NOUL}, state=state)).json()  # same state: its prefix comes from the cache
    assert 0 < again["x_cached_input_tokens"] < again["usage"]["input_tokens"]
    assert r.headers["x-typesafe-request-id"].startswith("req_")


def test_questions_reach_the_engine_in_the_wire_shape(server, engine):
    """A question copied from the HTTP request works in Python unchanged, and reads the same rows as
    the engine-side shape the server used to translate it into (instructions and levels rendered as
    sorted-key JSON, noul criteria keyed yes/no): the answers are the ones served before."""
    state = {"ticket": "Charged twice, no refund yet.", "plan": "pro"}
    wire_questions = {
        "refund": {
            "type": "noul",
            "instructions": {"ask": "money back?", "lang": "en"},
            "criteria": {"true": {"means": ["refund", "chargeback"]}, "false": None},
        },
        "angry": {"type": "noul", "instructions": "Angry?", "criteria": {"false": "calm"}},
        "team": {"type": "choice", "instructions": ["route", "it"], "criteria": {"Billing": {"k": 1}, "Other": None}},
        "level": {"type": "score", "instructions": "How urgent?", "criteria": ["low", {"label": "high"}]},
    }
    translated = {  # what the server handed the engine before questions kept the wire shape
        "refund": {
            "type": "noul",
            "instructions": '{"ask": "money back?", "lang": "en"}',
            "criteria": {"yes": {"means": ["refund", "chargeback"]}},
        },
        "angry": {"type": "noul", "instructions": "Angry?", "criteria": {"no": "calm"}},
        "team": {"type": "choice", "instructions": '["route", "it"]', "criteria": {"Billing": {"k": 1}, "Other": None}},
        "level": {"type": "score", "instructions": "How urgent?", "criteria": ["low", '{"label": "high"}']},
    }
    rows = lambda questions: [r.tokens for r in engine.plan(state, questions).rows]
    assert rows(wire_questions) == rows(translated)
    served = post(server, body(wire_questions, state=state))
    assert served.status_code == 200, served.text
    direct = engine.predict(state, wire_questions)
    for qid, a in served.json()["answers"].items():
        b = direct[qid]
        if a["type"] == "noul":
            assert abs(a["noul"] - b["noul"]) < 1e-5
        else:
            assert a["probabilities"].keys() == b["probabilities"].keys()
            assert all(abs(a["probabilities"][k] - b["probabilities"][k]) < 1e-5 for k in a["probabilities"])


def test_served_model_name_is_accepted_too(server, engine):
    assert post(server, {**body(), "model": engine.model_name}).status_code == 200


def test_answers_do_not_depend_on_batching(server):
    """Concurrent requests share device calls; each must get the answer it gets alone."""
    reqs = [
        body({"refund": NOUL, "team": CHOICE, "anger": SCORE}, state=f"Ticket {i}: " + "please help " * i)
        for i in range(8)
    ]
    alone = [post(server, r).json()["answers"] for r in reqs]

    async def together():
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(server.url + "/v1/systemone", json=r) for r in reqs))
        return [r.json()["answers"] for r in rs]

    for a, b in zip(alone, asyncio.run(together()), strict=True):
        assert a.keys() == b.keys()
        for qid in a:
            assert a[qid]["type"] == b[qid]["type"]
            va = a[qid].get("probabilities") or {"p": a[qid]["noul"]}
            vb = b[qid].get("probabilities") or {"p": b[qid]["noul"]}
            assert va.keys() == vb.keys()
            assert all(abs(va[k] - vb[k]) < 1e-5 for k in va), (va, vb)


# ---------------------------------------------------------------- errors


def test_unknown_model(server):
    r = post(server, {**body(), "model": "gpt-7"})
    assert r.status_code == 400 and r.json() == {
        "detail": {"error_type": "api_usage_error", "message": "Unknown model: gpt-7"}
    }


def test_box_questions_are_400(server):
    assert_error(
        post(server, body({"dog": {"type": "box", "instructions": "The dog"}})),
        400,
        "api_usage_error",
        "cannot locate boxes",
    )


def test_validation_errors_are_fastapi_shaped(server):
    r = post(server, body({"anger": {"type": "score", "criteria": {"0": "a", "1": "b"}}}))
    assert r.status_code == 422
    (e,) = r.json()["detail"]
    assert e["loc"] == ["body", "questions", "anger", "score", "criteria"] and e["type"] == "list_type" and e["msg"]
    r = post(server, b'{"model": "jev-latest", "state": ')
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"
    r = post(server, b"")
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"]
    assert r.headers["x-typesafe-request-id"].startswith("req_")


def test_json_is_read_only_as_application_json(server):
    """A web page may post text/plain (or a form) to a loopback server without a CORS preflight: such a
    body is refused with 415 before it is read, and so is one without a Content-Type."""
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"content-type": ctype} if ctype else {}
        r = httpx.post(server.url + "/v1/systemone", content=json.dumps(body()), headers=headers)
        assert_error(r, 415, "api_usage_error", "Content-Type")
    for ctype in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.jev+json"):
        r = httpx.post(server.url + "/v1/systemone", content=json.dumps(body()), headers={"content-type": ctype})
        assert r.status_code == 200, (ctype, r.text)


def test_unknown_routes_and_methods_use_the_error_shape(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404, "not_found_error")
    r = httpx.get(server.url + "/v1/systemone")
    assert_error(r, 405, "api_usage_error")


def test_token_budget_is_413(server):
    long_state = "word " * 40000  # > 32k tokens of state
    assert_error(post(server, body(state=long_state)), 413, "request_too_large")


def test_body_size_limit_is_413(server):
    assert_error(post(server, body(state="x" * (2 << 20))), 413, "request_too_large")
    bomb = zstandard.ZstdCompressor().compress(json.dumps(body(state="x" * (4 << 20))).encode())
    assert_error(post(server, bomb, {"content-encoding": "zstd"}), 413, "request_too_large")


def test_timeout_is_504(engine):
    with ThreadServer(create_app(engine, ServerConfig(timeout_s=1e-6))) as s:
        assert_error(post(s, body()), 504, "timeout_error")
        h = httpx.get(s.url + "/health").json()
        assert h["in_flight"] == 0


def test_full_queue_is_429_with_retry_after(engine):
    with ThreadServer(create_app(engine, ServerConfig(max_pending=2, batch_wait_ms=20))) as s:

        async def burst():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(
                    *(c.post(s.url + "/v1/systemone", json=body(state=f"s{i}")) for i in range(24))
                )

        rs = asyncio.run(burst())
        codes = [r.status_code for r in rs]
        assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
        for r in rs:
            if r.status_code == 429:
                assert_error(r, 429, "rate_limit_error")
                assert int(r.headers["retry-after"]) >= 1 and int(r.headers["retry-after-ms"]) >= 50


# ---------------------------------------------------------------- encodings, multipart, images


@pytest.mark.parametrize(
    "encoding,encode", [("zstd", lambda b: zstandard.ZstdCompressor().compress(b)), ("gzip", gzip.compress)]
)
def test_compressed_bodies(server, encoding, encode):
    payload = body({"team": CHOICE}, state="A long ticket. " * 200)
    plain = post(server, payload).json()
    raw = json.dumps(payload).encode()
    r = post(server, encode(raw), {"content-encoding": encoding})
    assert r.status_code == 200 and r.json()["answers"] == plain["answers"]


def test_bad_compression_is_400_and_unknown_encoding_415(server):
    assert_error(post(server, b"not zstd", {"content-encoding": "zstd"}), 400, "api_usage_error", "zstd")
    assert_error(
        post(server, gzip.compress(b"{}"), {"content-encoding": "br"}), 415, "api_usage_error", "Content-Encoding"
    )


def test_inline_images_are_refused_by_a_text_only_model(server, engine):
    payload = body(
        {"q": {"type": "noul", "instructions": "Is <image:1> damaged?"}},
        state="Photo: <image:1>",
        assets={"<image:1>": {"type": "image", "format": "png", "data_base64": base64.b64encode(PNG).decode()}},
    )
    assert_error(post(server, payload), 400, "api_usage_error", "text-only")
    r = post(server, payload)
    assert "state" in r.json()["detail"]["message"] and "questions.q.instructions" in r.json()["detail"]["message"]
    bad = body(assets={"a": {"format": "png", "data_base64": "%%%"}})
    assert_error(post(server, bad), 400, "api_usage_error", "base64")


def test_multipart_images_via_the_sdk(server):
    from typesafe_sdk import Image, Noul, TypeSafeClient
    from typesafe_sdk._core.errors import TypeSafeBadRequestError

    img = Image(PNG)
    with TypeSafeClient(api_key="unused", base_url=server.url) as c:
        with c.attach_assets(img), pytest.raises(TypeSafeBadRequestError) as ei:  # zstd-compressed multipart
            c.system_one(state=f"Look: {img} " + "padding " * 300, questions={"damaged": Noul(instructions="Damaged?")})
    assert ei.value.status == 400 and "text-only" in str(ei.value)
    assert ei.value.request_id.startswith("req_")


def test_multipart_without_assets_is_400(server):
    boundary = "xyz"
    data = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\nContent-Type: application/json\r\n\r\n'
            + json.dumps(body())
            + f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="asset-0"; filename="a"\r\n'
            f"Content-Type: image/png\r\n\r\n"
        ).encode()
        + PNG
        + f"\r\n--{boundary}--\r\n".encode()
    )
    r = post(server, data, {"content-type": f"multipart/form-data; boundary={boundary}"})
    assert_error(r, 400, "api_usage_error", "not claimed")
    # a multipart body without images is just a request
    data = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\n\r\n'
        + json.dumps(body())
        + f"\r\n--{boundary}--\r\n"
    ).encode()
    assert post(server, data, {"content-type": f"multipart/form-data; boundary={boundary}"}).status_code == 200


# ---------------------------------------------------------------- auth


def test_auth(authed):
    ok = post(authed, body(), {"authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    assert post(authed, body(), {"authorization": "Bearer second-key"}).status_code == 200
    assert_error(post(authed, body()), 403, "authentication_error")
    assert_error(post(authed, body(), {"authorization": "Basic abc"}), 403, "authentication_error")
    assert_error(post(authed, body(), {"authorization": "Bearer nope"}), 401, "authentication_error")
    assert_error(httpx.get(authed.url + "/v1/models"), 403, "authentication_error")
    assert httpx.get(authed.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(authed.url + "/health").status_code == 200  # operational endpoints stay open
    # auth comes before anything about the body
    assert_error(post(authed, b"garbage", {"authorization": "Bearer nope"}), 401, "authentication_error")


def test_auth_off_ignores_the_header(server):
    assert post(server, body(), {"authorization": "Bearer anything"}).status_code == 200


def test_api_keys_from_env():
    from lev_jax.server import api_keys_from_env

    assert api_keys_from_env({}) == frozenset()
    assert api_keys_from_env({"LEV_API_KEYS": " a, b c ,,"}) == {"a", "b", "c"}


# ---------------------------------------------------------------- client disconnects


def test_requests_whose_client_left_are_cancelled(engine):
    heavy = {
        f"q{i}": {"type": "choice", "instructions": f"Question {i}?", "criteria": {f"opt {j}": None for j in range(12)}}
        for i in range(8)
    }
    with ThreadServer(create_app(engine, ServerConfig(max_batch_rows=1))) as s:
        post(s, body(heavy, state="warm " * 300))  # compile the shapes first

        async def abandon():
            # the clients leave while waiting for their answers; connecting and sending get time enough
            # on a loaded machine (else no request reaches the server and nothing is cancelled)
            async with httpx.AsyncClient(timeout=httpx.Timeout(0.15, connect=10, write=10, pool=10)) as c:
                tasks = [
                    c.post(s.url + "/v1/systemone", json=body(heavy, state=f"{i} " + "words " * 300)) for i in range(12)
                ]
                return await asyncio.gather(*tasks, return_exceptions=True)

        rs = asyncio.run(abandon())
        assert any(isinstance(r, httpx.TimeoutException) for r in rs)
        for _ in range(200):
            h = httpx.get(s.url + "/health").json()
            if h["in_flight"] == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert h["in_flight"] == 0
        m = metric_samples(httpx.get(s.url + "/metrics").text)
        cancelled = m[("lev_cancelled_requests_total", frozenset())]
        rows = m[("lev_batch_rows_sum", frozenset())]
        assert cancelled >= 1
        assert rows < 13  # abandoned requests that had not started never reached the device


# ---------------------------------------------------------------- health, metrics, models, OpenAPI


def test_models(server, engine):
    r = httpx.get(server.url + "/v1/models")
    names = [m["name"] for m in r.json()["models"]]
    assert names == ["jev-latest", engine.model_name]
    for m in r.json()["models"]:
        assert set(m) == {"name", "description", "release_date"}
    assert r.headers["x-typesafe-request-id"].startswith("req_")


def test_health(server, engine):
    h = httpx.get(server.url + "/health").json()
    for k in (
        "model",
        "checkpoint",
        "prompt_style",
        "calibrated",
        "mode_b",
        "noul_readout",
        "option_cap",
        "in_flight",
        "max_pending",
        "compiled_programs",
        "buckets",
        "uptime_s",
    ):
        assert k in h, k
    assert h["status"] == "ready" and h["model"] == engine.model_name and h["max_pending"] == 64
    assert h["option_cap"] == 255


def test_metrics(server):
    post(server, body())
    post(server, {**body(), "model": "nope"})
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    t = r.text
    m = metric_samples(t)
    route = ("route", "/v1/systemone")
    for status in ("200", "400"):
        assert m[("lev_http_requests_total", frozenset({("method", "POST"), route, ("status", status)}))] >= 1
    for name in (
        "lev_http_request_duration_seconds_bucket",
        "lev_queue_depth",
        "lev_batch_rows_bucket",
        "lev_input_tokens_total",
        "lev_in_flight",
        "lev_compiled_programs",
    ):
        assert name in t, name
    assert m[("lev_max_pending", frozenset())] == 64
    assert m[("lev_compiled_programs", frozenset())] >= 1
    assert "_created" not in t  # the 0.0.4 text keeps the series it always had


def test_each_app_counts_its_own_metrics(engine):
    """Every app has its own registry: two servers in one process do not share counters."""
    with ThreadServer(create_app(engine, ServerConfig(max_pending=5))) as a, ThreadServer(create_app(engine)) as b:
        assert post(a, body()).status_code == 200
        ma = metric_samples(httpx.get(a.url + "/metrics").text)
        mb = metric_samples(httpx.get(b.url + "/metrics").text)
    assert ma[("lev_answered_requests_total", frozenset())] == 1
    assert mb[("lev_answered_requests_total", frozenset())] == 0
    assert ma[("lev_max_pending", frozenset())] == 5 and mb[("lev_max_pending", frozenset())] == 64


def test_openapi_document_describes_the_contract(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    op = doc["paths"]["/v1/systemone"]["post"]
    content = op["requestBody"]["content"]
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/SystemOneRequest"}
    assert "multipart/form-data" in content
    assert {"200", "400", "401", "403", "413", "415", "422", "429", "503", "504"} <= set(op["responses"])
    assert all("x-typesafe-request-id" in r["headers"] for r in op["responses"].values())
    assert {"Retry-After", "retry-after-ms"} <= set(op["responses"]["429"]["headers"])
    schemas = doc["components"]["schemas"]
    req = schemas["SystemOneRequest"]
    assert set(req["required"]) == {"model", "state", "questions"}
    choice = schemas["ChoiceQuestion"]["properties"]["criteria"]
    assert (choice["minProperties"], choice["maxProperties"]) == (2, 255)
    score = schemas["ScoreQuestion"]["properties"]["criteria"]
    assert (score["minItems"], score["maxItems"]) == (2, 10)
    assert "/v1/models" in doc["paths"] and "/health" in doc["paths"] and "/metrics" in doc["paths"]
    assert httpx.get(server.url + "/docs").status_code == 200


# ---------------------------------------------------------------- server faults


class FaultyEngine:
    """The real engine, with a fault injected: a state of "explode" breaks planning, and one of
    "explode later" breaks the device call. Server bugs are 500s with a request id and a JSON body."""

    supports_images = False

    def __init__(self, engine):
        self._engine = engine
        self.model_name = engine.model_name

    def plan(self, state, questions):
        if state == "explode":
            raise RuntimeError("injected fault")
        return self._engine.plan(state, questions)

    def predict_many(self, requests, *, with_usage=False):
        if any(plan.state_text == "explode later" for plan, _ in requests):
            raise RuntimeError("injected device fault")
        return self._engine.predict_many(requests, with_usage=with_usage)

    def info(self):
        raise RuntimeError("info is broken too")


def test_server_faults_are_500_with_the_error_shape(engine):
    with ThreadServer(create_app(FaultyEngine(engine), ServerConfig(batch_wait_ms=30))) as s:
        assert_error(post(s, body(state="explode")), 500, "internal_error", "req_")

        async def batch():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(
                    c.post(s.url + "/v1/systemone", json=body(state="explode later")),
                    c.post(s.url + "/v1/systemone", json=body(state="fine")),
                )

        bad, good = asyncio.run(batch())
        assert_error(bad, 500, "internal_error")
        assert good.status_code == 200  # the failing request did not take its batch neighbour down
        h = httpx.get(s.url + "/health")
        assert h.status_code == 200 and h.json()["status"] == "ready"  # health survives a broken info()


def test_a_non_engine_is_refused_at_startup(engine):
    assert isinstance(engine, lev_jax.DecisionEngine) and isinstance(FaultyEngine(engine), lev_jax.DecisionEngine)

    class NoImages:  # an engine from before `supports_images` was part of the protocol
        model_name = "m"
        plan = predict_many = info = staticmethod(lambda *a, **k: None)

    with pytest.raises(TypeError, match=r"DecisionEngine .* NoImages lacks supports_images$"):
        create_app(NoImages())
    with pytest.raises(TypeError, match="lacks model_name, supports_images, plan, predict_many, info"):
        create_app(object())
