"""Fuzzing against the served OpenAPI document: at least 2,000 generated bodies, no 5xx, and the
document matches the behaviour.

- Bodies generated from the request schema in /openapi.json (sizes capped so the tiny model stays
  quick) must never get a 422: they are answered (200, each answer checked by jevcompat's own
  validators) or refused for a documented non-schema reason (400 unknown model / box / images, 413).
- The same bodies with one mutation that breaks the schema must get a FastAPI-shaped 422.
- Arbitrary bytes and JSON must get a 4xx (or an answer), never a 5xx.
The server (uvicorn over a real tiny model) must still be healthy at the end.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import lev_jax
from lev_jax.server import ServerConfig, create_app, wire
from lev_jax.server.testing import ThreadServer
from lev_jax.testing import save_tiny_checkpoint

VALID_EXAMPLES = 700
INVALID_EXAMPLES = 1100
RANDOM_EXAMPLES = 300
COUNTS = {"valid": 0, "invalid": 0, "random": 0, "statuses": {}}

SETTINGS = dict(
    deadline=None, database=None, derandomize=True, print_blob=True, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = lev_jax.load(model=str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))))
    with ThreadServer(create_app(engine, ServerConfig(max_pending=8, max_body_bytes=1 << 20))) as s:
        s.model_name = engine.model_name
        s.engine = engine
        s.programs = set()
        with httpx.Client(base_url=s.url, timeout=120) as client:
            s.client = client
            s.openapi = client.get("/openapi.json").json()
            s.schema_strategy = None
            yield s
        assert s.thread.is_alive()


# ---------------------------------------------------------------- JSON Schema -> strategies

SMALL_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-1000, 1000)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=3,
)
# Size caps (within the schema's ranges) that keep the tiny model's shape buckets few: every new
# bucket is a device-program compile (about a second on CPU), every known one a few milliseconds.
CAP_PROPERTIES = 3  # free-form object keys, assets
CAP_BY_TITLE = {"Questions": 2, "Criteria": 3}  # questions per request; options per choice / levels per score
CAP_STRING = 10
MAX_PROGRAMS = 12  # distinct device programs the valid bodies may need (bodies needing more are not drawn)


class Schema:
    """Strategies for the subset of JSON Schema that FastAPI/pydantic emit for the request model."""

    def __init__(self, doc: dict):
        self.schemas = doc["components"]["schemas"]
        self._memo: dict = {}

    def deref(self, node: dict) -> dict:
        while "$ref" in node:
            node = self.schemas[node["$ref"].rsplit("/", 1)[1]]
        return node

    def strategy(self, node: dict, optional_weight: dict[str, float] | None = None) -> st.SearchStrategy:
        key = (id(node), tuple(sorted((optional_weight or {}).items())))
        if key not in self._memo:
            self._memo[key] = self._strategy(node, optional_weight)
        return self._memo[key]

    def _strategy(self, node: dict, optional_weight: dict[str, float] | None) -> st.SearchStrategy:
        node = self.deref(node)
        if "const" in node:
            return st.just(node["const"])
        if "enum" in node:
            return st.sampled_from(node["enum"])
        alts = node.get("oneOf") or (node.get("anyOf") if "properties" not in node else None)
        if alts:
            return st.one_of([self.strategy(a) for a in alts])
        t = node.get("type")
        if t == "string":
            return st.text(min_size=node.get("minLength", 0), max_size=max(node.get("minLength", 0), CAP_STRING))
        if t == "null":
            return st.none()
        if t == "boolean":
            return st.booleans()
        if t == "integer":
            return st.integers(-1000, 1000)
        if t == "number":
            return st.floats(allow_nan=False, allow_infinity=False)
        if t == "array":
            lo = node.get("minItems", 0)
            hi = max(lo, min(node.get("maxItems", lo + 3), CAP_BY_TITLE.get(node.get("title"), CAP_PROPERTIES)))
            return st.lists(self.strategy(node.get("items", {})), min_size=lo, max_size=hi)
        if t == "object":
            return self._object(node, optional_weight or {})
        return SMALL_JSON  # {}: any JSON value

    def _object(self, node: dict, weights: dict[str, float]) -> st.SearchStrategy:
        props = node.get("properties", {})
        required = set(node.get("required", []))
        one_of_required = [set(a["required"]) for a in node.get("anyOf", []) if set(a) == {"required"}]
        extra = node.get("additionalProperties", True if not props else None)
        key_min = node.get("propertyNames", {}).get("minLength", 0)

        subs = {name: self.strategy(sub) for name, sub in props.items()}
        free_keys = st.text(min_size=key_min, max_size=12).filter(lambda k: k not in props)
        free_values = self.strategy(extra if isinstance(extra, dict) else {}) if extra else None

        @st.composite
        def build(draw):
            req = set(required)
            if one_of_required:
                req |= draw(st.sampled_from(one_of_required))
            out = {}
            for name in props:
                # (hypothesis favours small integers: an optional property is left out at 0)
                if name in req or draw(st.integers(0, 99)) >= 100 - 100 * weights.get(name, 0.5):
                    out[name] = draw(subs[name])
            if extra:
                lo = node.get("minProperties", 0)
                hi = max(
                    lo,
                    min(node.get("maxProperties", CAP_PROPERTIES), CAP_BY_TITLE.get(node.get("title"), CAP_PROPERTIES)),
                )
                out.update(draw(st.dictionaries(free_keys, free_values, min_size=max(0, lo - len(out)), max_size=hi)))
            return out

        return build()


ROOT = {"$ref": "#/components/schemas/SystemOneRequest"}


@st.composite
def valid_bodies(draw, server):
    if getattr(server, "schema_strategy", None) is None:
        server.schema_strategy = Schema(server.openapi).strategy(ROOT, optional_weight={"assets": 0.05})
    doc = draw(server.schema_strategy)
    # The schema allows any model name and box questions, both answered 400 (documented): keep a few
    # of each, and send mostly what the model answers.
    doc["model"] = draw(st.sampled_from(["jev-latest"] * 8 + [server.model_name, doc["model"]]))
    for qid, q in list(doc["questions"].items()):
        if q["type"] == "box" and draw(st.integers(0, 9)) < 9:
            doc["questions"][qid] = {"type": "noul", "instructions": q.get("instructions")}
    return doc


# ---------------------------------------------------------------- schema-breaking mutations

NOT_TEXT = st.one_of(st.integers(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False))
NOT_OBJECT = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2))


@st.composite
def invalid_bodies(draw, server):
    doc = draw(valid_bodies(server))
    qid = draw(st.sampled_from(sorted(doc["questions"])))
    kind = draw(
        st.sampled_from(
            [
                "not-object",
                "drop-model",
                "drop-state",
                "drop-questions",
                "model-type",
                "state-type",
                "questions-empty",
                "questions-type",
                "question-type",
                "question-no-type",
                "question-bad-type",
                "question-extra",
                "instructions-type",
                "choice-few",
                "choice-many",
                "choice-type",
                "choice-empty-key",
                "choice-description",
                "score-map",
                "score-few",
                "score-many",
                "score-null",
                "score-number",
                "noul-criteria-type",
                "noul-criteria-key",
                "noul-criteria-value",
                "empty-id",
                "assets-empty",
                "asset-type",
                "asset-format",
                "asset-nothing",
                "asset-extra",
            ]
        )
    )
    q = {"type": "noul", "instructions": "Q?"}
    if kind == "not-object":
        return draw(st.one_of(st.lists(SMALL_JSON, max_size=2), NOT_TEXT, st.text(max_size=5), st.none()))
    if kind.startswith("drop-"):
        del doc[kind[5:]]
    elif kind == "model-type":
        doc["model"] = draw(st.one_of(NOT_TEXT, st.none(), st.lists(st.text(max_size=3), max_size=2)))
    elif kind == "state-type":
        doc["state"] = draw(st.one_of(NOT_TEXT, st.none()))
    elif kind == "questions-empty":
        doc["questions"] = {}
    elif kind == "questions-type":
        doc["questions"] = draw(NOT_OBJECT)
    elif kind == "question-type":
        doc["questions"][qid] = draw(NOT_OBJECT)
    elif kind == "question-no-type":
        doc["questions"][qid] = {k: v for k, v in doc["questions"][qid].items() if k != "type"}
    elif kind == "question-bad-type":
        doc["questions"][qid] = {
            **doc["questions"][qid],
            "type": draw(
                st.one_of(
                    st.text(max_size=8).filter(lambda t: t not in ("noul", "choice", "score", "box")),
                    NOT_TEXT,
                    st.none(),
                )
            ),
        }
    elif kind == "question-extra":
        doc["questions"][qid] = {
            **doc["questions"][qid],
            draw(st.sampled_from(["instruction", "options", "x", "criterion"])): 1,
        }
    elif kind == "instructions-type":
        doc["questions"][qid] = {**q, "instructions": draw(NOT_TEXT)}
    elif kind.startswith("choice-"):
        crit = {"A": None, "B": "b"}
        if kind == "choice-few":
            crit = {"A": None}
        elif kind == "choice-many":
            crit = {f"o{i}": None for i in range(256)}
        elif kind == "choice-type":
            crit = draw(st.one_of(st.lists(st.text(max_size=3), min_size=2, max_size=3), NOT_TEXT, st.none()))
        elif kind == "choice-empty-key":
            crit = {"": None, "A": None, "B": None}
        elif kind == "choice-description":
            crit = {"A": draw(NOT_TEXT), "B": None}
        doc["questions"][qid] = {"type": "choice", "instructions": "Which?", "criteria": crit}
    elif kind.startswith("score-"):
        crit = {
            "score-map": {"0": "lo", "1": "hi"},
            "score-few": ["only"],
            "score-many": [f"l{i}" for i in range(11)],
            "score-null": ["lo", None, "hi"],
            "score-number": ["lo", draw(NOT_TEXT)],
        }[kind]
        doc["questions"][qid] = {"type": "score", "instructions": "How?", "criteria": crit}
    elif kind == "noul-criteria-type":
        doc["questions"][qid] = {
            **q,
            "criteria": draw(st.one_of(NOT_TEXT, st.text(max_size=4), st.lists(st.none(), max_size=2))),
        }
    elif kind == "noul-criteria-key":
        doc["questions"][qid] = {**q, "criteria": {draw(st.sampled_from(["yes", "no", "True", "maybe"])): "x"}}
    elif kind == "noul-criteria-value":
        doc["questions"][qid] = {**q, "criteria": {draw(st.sampled_from(["true", "false"])): draw(NOT_TEXT)}}
    elif kind == "empty-id":
        doc["questions"][""] = q
    elif kind == "assets-empty":
        doc["assets"] = {}
    else:
        asset = {
            "asset-type": draw(NOT_OBJECT),
            "asset-format": {"format": "gif", "data_base64": "AA=="},
            "asset-nothing": {"type": "image"},
            "asset-extra": {"part": "asset-0", "url": "http://x"},
        }[kind]
        doc["assets"] = {"img": asset}
    return doc


# ---------------------------------------------------------------- the checks


def send(server, payload) -> httpx.Response:
    data = payload if isinstance(payload, bytes) else json.dumps(payload, ensure_ascii=False).encode()
    r = server.client.post("/v1/systemone", content=data, headers={"content-type": "application/json"})
    COUNTS["statuses"][r.status_code] = COUNTS["statuses"].get(r.status_code, 0) + 1
    assert r.status_code < 500, (r.status_code, r.text[:500], data[:500])
    assert r.headers["x-typesafe-request-id"].startswith("req_")
    return r


def assert_validation_error(r: httpx.Response, doc) -> None:
    assert r.status_code == 422, (r.status_code, r.text[:300], json.dumps(doc)[:300])
    detail = r.json()["detail"]
    assert isinstance(detail, list) and detail
    for e in detail:
        assert e["loc"][0] == "body" and isinstance(e["msg"], str) and isinstance(e["type"], str)


def assert_error_shape(r: httpx.Response) -> None:
    d = r.json()["detail"]
    assert isinstance(d["error_type"], str) and isinstance(d["message"], str)


def within_compile_budget(server, doc) -> bool:
    """False for a body that would make the engine compile past MAX_PROGRAMS device programs."""
    programs = getattr(server.engine, "programs", None)
    if programs is None:
        return True
    try:
        req = wire.SystemOneRequest.model_validate(doc)
        keys = programs(req.state, {k: q.model_dump() for k, q in req.questions.items() if q.type != "box"})
    except Exception:  # noqa: BLE001 — not the engine's to answer (400/413): no compile either
        return True
    if keys - server.programs and len(server.programs | keys) > MAX_PROGRAMS:
        return False
    server.programs |= keys
    return True


def test_schema_valid_bodies_are_never_rejected_as_invalid(server):
    from jevcompat.client import Response, parse_json
    from jevcompat.validate import validate_success

    @settings(max_examples=VALID_EXAMPLES, **SETTINGS)
    @given(valid_bodies(server))
    def check(doc):
        assume(within_compile_budget(server, doc))
        COUNTS["valid"] += 1
        r = send(server, doc)
        assert r.status_code != 422, (r.text[:400], json.dumps(doc)[:400])
        if r.status_code == 200:
            data, err, nonfinite = parse_json(r.content)
            resp = Response(200, {k.lower(): v for k, v in r.headers.items()}, r.content, 0.0, data, err, nonfinite)
            problems = validate_success(doc, resp)
            assert not problems, ([str(p) for p in problems], json.dumps(doc)[:400])
        else:
            assert r.status_code in (400, 413), r.text
            assert_error_shape(r)
            if r.status_code == 400:
                msg = r.json()["detail"]["message"]
                known = ("Unknown model", "cannot locate boxes", "Asset", "asset", "part", "image")
                assert any(k in msg for k in known), msg

    check()


def test_schema_breaking_bodies_get_422(server):
    @settings(max_examples=INVALID_EXAMPLES, **SETTINGS)
    @given(invalid_bodies(server))
    def check(doc):
        COUNTS["invalid"] += 1
        assert_validation_error(send(server, doc), doc)

    check()


def test_arbitrary_bytes_and_json_never_get_a_5xx(server):
    raw = st.one_of(
        st.binary(max_size=64),
        SMALL_JSON.map(lambda v: json.dumps(v).encode()),
        st.builds(
            lambda s, cut: json.dumps(
                {"model": "jev-latest", "state": s, "questions": {"q": {"type": "noul"}}}
            ).encode()[:cut],
            st.text(max_size=8),
            st.integers(0, 80),
        ),
        st.sampled_from(
            [
                b'{"model": "jev-latest", "state": NaN, "questions": {}}',
                b"\xff\xfe\x00",
                b"[" * 200,
                b'{"state": "\\ud800"}',
                b"null",
                b"{}",
            ]
        ),
    )

    @settings(max_examples=RANDOM_EXAMPLES, **SETTINGS)
    @given(raw)
    def check(data):
        COUNTS["random"] += 1
        r = send(server, data)
        assert 200 <= r.status_code < 500
        if r.status_code == 422:
            assert all(e["loc"][0] == "body" for e in r.json()["detail"])
        elif r.status_code != 200:
            assert_error_shape(r)

    check()


def test_at_least_2000_bodies_and_the_server_is_still_up(server):
    total = COUNTS["valid"] + COUNTS["invalid"] + COUNTS["random"]
    if total == 0:
        pytest.skip("run with the fuzz tests above")
    print("fuzz:", COUNTS, "device programs:", len(server.programs))
    assert total >= 2000, COUNTS
    assert COUNTS["statuses"].get(200, 0) >= 100, COUNTS  # the model was really exercised
    h = server.client.get("/health").json()
    assert h["status"] == "ready" and h["in_flight"] == 0
    metrics = server.client.get("/metrics").text
    assert 'status="500"' not in metrics and 'status="503"' not in metrics
