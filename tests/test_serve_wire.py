"""The wire layer without a model: request validation, the questions the engine gets, body decoding
(zstd / gzip / deflate, size limits), strict JSON, multipart parsing, assets and placeholders."""

from __future__ import annotations

import base64
import gzip
import json
import zlib

import pytest
import zstandard
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from lev_jax.server import body, wire
from lev_jax.server.errors import ApiError, from_pydantic

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32
JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 32


def req(**questions):
    return {"model": "jev-latest", "state": "s", "questions": questions}


def errors(doc) -> list[dict]:
    with pytest.raises(ValidationError) as ei:
        wire.SystemOneRequest.model_validate(doc)
    return from_pydantic(ei.value).errors()


# ---------------------------------------------------------------- validation


def test_accepts_every_documented_shape():
    doc = {
        "model": "jev-latest",
        "state": {"a": [1, 2]},
        "seed": 7,
        "x_trace": "t",
        "questions": {
            "n0": {"type": "noul", "instructions": "Q?"},
            "n1": {"type": "noul", "instructions": "Q?", "criteria": None},
            "n2": {"type": "noul", "instructions": "Q?", "criteria": {"true": "y"}},
            "n3": {"type": "noul", "instructions": "Q?", "criteria": {"false": ["n"]}},
            "n4": {"type": "noul", "criteria": {"true": {"k": 1}, "false": None}},
            "c": {"type": "choice", "instructions": ["a", "b"], "criteria": {"A": None, "B": {"x": 1}, "C": ["d"]}},
            "s": {"type": "score", "instructions": {"k": "v"}, "criteria": ["lo", {"label": "mid"}, ["hi"]]},
            "🎯 with space.": {"type": "box", "instructions": "dog"},
        },
    }
    r = wire.SystemOneRequest.model_validate(doc)
    assert list(r.questions) == list(doc["questions"])
    assert r.state == {"a": [1, 2]}


@pytest.mark.parametrize("state", ["", "text", {"k": None}, [1, "a"], []])
def test_state_forms(state):
    assert wire.SystemOneRequest.model_validate({**req(q={"type": "noul", "instructions": "?"}), "state": state})


@pytest.mark.parametrize("state", [None, 3, 2.5, True])
def test_bad_state_is_422_at_body_state(state):
    errs = errors({**req(q={"type": "noul", "instructions": "?"}), "state": state})
    assert all(e["loc"][:2] == ("body", "state") for e in errs)


@pytest.mark.parametrize("n,ok", [(1, False), (2, True), (255, True), (256, False)])
def test_choice_option_range(n, ok):
    q = {"type": "choice", "instructions": "?", "criteria": {f"o{i}": None for i in range(n)}}
    if ok:
        wire.SystemOneRequest.model_validate(req(q=q))
    else:
        assert errors(req(q=q))[0]["type"] in ("too_short", "too_long")


@pytest.mark.parametrize("n,ok", [(1, False), (2, True), (10, True), (11, False)])
def test_score_level_range(n, ok):
    q = {"type": "score", "instructions": "?", "criteria": [f"l{i}" for i in range(n)]}
    if ok:
        wire.SystemOneRequest.model_validate(req(q=q))
    else:
        assert errors(req(q=q))[0]["type"] in ("too_short", "too_long")


@pytest.mark.parametrize(
    "doc,where",
    [
        ({"model": "jev-latest", "state": "s"}, ("body", "questions")),
        ({"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}, ("body", "model")),
        (req(), ("body", "questions")),
        (req(q={"instructions": "?"}), ("body", "questions", "q")),
        (req(q={"type": "boolean", "instructions": "?"}), ("body", "questions", "q")),
        (req(q={"type": "score", "criteria": {"0": "a", "1": "b"}}), ("body", "questions", "q", "score", "criteria")),
        (req(q={"type": "score", "criteria": ["a", None]}), ("body", "questions", "q", "score", "criteria", 1)),
        (
            req(q={"type": "choice", "criteria": {"": None, "b": None}}),
            ("body", "questions", "q", "choice", "criteria"),
        ),
        (
            req(q={"type": "noul", "instructions": "?", "criteria": {"yes": "y"}}),
            ("body", "questions", "q", "noul", "criteria"),
        ),
        (req(q={"type": "noul", "instruction": "typo"}), ("body", "questions", "q", "noul", "instruction")),
        ({**req(q={"type": "noul", "instructions": "?"}), "model": 3}, ("body", "model")),
        (
            {"model": "jev-latest", "state": "s", "questions": {"": {"type": "noul", "instructions": "?"}}},
            ("body", "questions"),
        ),
    ],
)
def test_invalid_bodies_locate_the_problem(doc, where):
    errs = errors(doc)
    assert any(tuple(e["loc"][: len(where)]) == where for e in errs), errs
    for e in errs:
        assert e["loc"][0] == "body" and isinstance(e["msg"], str) and isinstance(e["type"], str)


def test_asset_needs_data_or_part():
    base = req(q={"type": "noul", "instructions": "?"})
    wire.SystemOneRequest.model_validate({**base, "assets": {"a": {"type": "image", "part": "asset-0"}}})
    wire.SystemOneRequest.model_validate({**base, "assets": {"a": {"format": "png", "data_base64": "AA=="}}})
    for bad in ({"format": "png"}, {"data_base64": "AA=="}, {}, {"format": "gif", "data_base64": "AA=="}):
        errors({**base, "assets": {"a": bad}})
    errors({**base, "assets": {}})


# ---------------------------------------------------------------- wire -> engine


def test_wire_questions_are_engine_questions():
    """The server hands the engine each validated question as plain data (`model_dump()`, as app.py
    does): the engine reads it exactly as the old wire translation did (structured instructions and
    levels as sorted-key JSON, option descriptions as sent, noul criteria keyed true/false with a
    null side dropped)."""
    from lev_jax.readout import normalize_question

    r = wire.SystemOneRequest.model_validate(
        req(
            n={"type": "noul", "instructions": {"b": 1, "a": "é"}, "criteria": {"true": "y", "false": None}},
            m={"type": "noul", "instructions": "?", "criteria": {"true": None}},
            f={"type": "noul", "criteria": {"false": ["n", {"k": 1}]}},
            c={"type": "choice", "criteria": {"A": None, "B": {"k": 1}}},
            s={"type": "score", "instructions": "?", "criteria": ["lo", {"label": "hi"}]},
        )
    )
    qs = {k: normalize_question(k, q.model_dump()) for k, q in r.questions.items()}
    assert qs["n"] == {"type": "noul", "instructions": '{"a": "é", "b": 1}', "criteria": {"true": "y"}}
    assert qs["m"]["criteria"] is None
    assert qs["f"] == {"type": "noul", "instructions": "", "criteria": {"false": '["n", {"k": 1}]'}}
    assert qs["c"] == {"type": "choice", "instructions": "", "criteria": {"A": None, "B": {"k": 1}}}
    assert qs["s"]["criteria"] == ["lo", '{"label": "hi"}']


def test_wire_limits_are_the_domain_limits():
    from lev_jax import domain

    assert wire.CHOICE_OPTIONS is domain.CHOICE_OPTIONS and wire.SCORE_LEVELS is domain.SCORE_LEVELS
    schema = wire.SystemOneRequest.model_json_schema()["$defs"]
    choice, score = (
        schema["ChoiceQuestion"]["properties"]["criteria"],
        schema["ScoreQuestion"]["properties"]["criteria"],
    )
    assert (choice["minProperties"], choice["maxProperties"]) == domain.CHOICE_OPTIONS
    assert (score["minItems"], score["maxItems"]) == domain.SCORE_LEVELS


# ---------------------------------------------------------------- content encoding

DOC = json.dumps(req(q={"type": "noul", "instructions": "x" * 3000})).encode()


@pytest.mark.parametrize(
    "encoding,encode",
    [
        ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", lambda b: zlib.compress(b)[2:-4]),  # raw deflate
        ("identity", lambda b: b),
        ("identity, zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
    ],
)
def test_decode_content(encoding, encode):
    assert body.decode_content(encode(DOC), encoding, 1 << 20) == DOC


def test_decode_streamed_zstd_without_content_size():
    cctx = zstandard.ZstdCompressor()
    out = cctx.compressobj()
    data = out.compress(DOC) + out.flush()
    assert body.decode_content(data, "zstd", 1 << 20) == DOC


def test_sdk_compressor_is_understood():
    from backports.zstd import compress  # what typesafe-sdk[zstd] uses before Python 3.14

    assert body.decode_content(compress(DOC), "zstd", 1 << 20) == DOC


@pytest.mark.parametrize("encoding", ["zstd", "gzip", "deflate"])
def test_corrupt_compressed_body_is_400(encoding):
    with pytest.raises(ApiError) as ei:
        body.decode_content(b"definitely not compressed", encoding, 1 << 20)
    assert ei.value.status == 400 and ei.value.error_type == "api_usage_error"


def test_truncated_gzip_is_400():
    with pytest.raises(ApiError) as ei:
        body.decode_content(gzip.compress(DOC)[:-10], "gzip", 1 << 20)
    assert ei.value.status == 400


def test_unknown_encoding_is_415():
    with pytest.raises(ApiError) as ei:
        body.decode_content(DOC, "br", 1 << 20)
    assert ei.value.status == 415


@pytest.mark.parametrize(
    "encoding,encode", [("zstd", lambda b: zstandard.ZstdCompressor().compress(b)), ("gzip", gzip.compress)]
)
def test_decompression_bomb_is_413(encoding, encode):
    bomb = encode(b"\0" * (4 << 20))
    assert len(bomb) < 64 << 10
    with pytest.raises(ApiError) as ei:
        body.decode_content(bomb, encoding, 1 << 20)
    assert ei.value.status == 413 and ei.value.error_type == "request_too_large"


# ---------------------------------------------------------------- JSON


@pytest.mark.parametrize(
    "raw,loc0",
    [
        (b'{"model": "jev-latest", "state": "x", "questions": {', 52),
        (b'{"a": NaN}', 0),
        (b'{"a": Infinity}', 0),
        (b"\xff\xfe{}", 0),
    ],
)
def test_bad_json_is_fastapi_json_invalid(raw, loc0):
    with pytest.raises(RequestValidationError) as ei:
        body.parse_json(raw)
    (e,) = ei.value.errors()
    assert e["type"] == "json_invalid" and e["loc"] == ("body", loc0) and e["msg"] == "JSON decode error"


def test_empty_body_is_missing():
    with pytest.raises(RequestValidationError) as ei:
        body.parse_json(b"")
    assert ei.value.errors() == [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]


def test_json_limits():
    deep = b"[" * 100 + b"]" * 100
    with pytest.raises(RequestValidationError):
        body.parse_json(deep)
    with pytest.raises(RequestValidationError) as ei:
        body.parse_json(b'{"state": "\\ud800"}')
    assert ei.value.errors()[0]["loc"] == ("body", "state")
    with pytest.raises(RequestValidationError):
        body.parse_json(b'{"\\udfff": 1}')
    assert body.parse_json('\ufeff{"a": "😀 \\ud83d\\ude00"}'.encode()) == {"a": "😀 😀"}
    with pytest.raises(RequestValidationError):
        body.parse_json(b"[" * 100000)


# ---------------------------------------------------------------- multipart and assets


def multipart(parts: list[tuple[str, str, bytes, str | None]], boundary="b0undary") -> tuple[str, bytes]:
    chunks = []
    for name, ctype, content, filename in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        chunks.append(
            f"--{boundary}\r\nContent-Disposition: {disp}\r\nContent-Type: {ctype}\r\n\r\n".encode() + content + b"\r\n"
        )
    chunks.append(f"--{boundary}--\r\n".encode())
    return f"multipart/form-data; boundary={boundary}", b"".join(chunks)


def test_multipart_round_trip_like_the_sdk():
    from typesafe_sdk._core.multipart import Part, encode_multipart

    doc = json.dumps(req(q={"type": "noul", "instructions": "<image:ab>?"})).encode()
    ctype, data = encode_multipart(
        [Part("request", "application/json", doc), Part("asset-0", "image/png", PNG, "asset-0")]
    )
    assert body.is_multipart(ctype)
    parts = body.parse_multipart(data, ctype)
    assert set(parts) == {"request", "asset-0"}
    assert parts["asset-0"].data == PNG and parts["asset-0"].filename == "asset-0"
    assert body.request_from_multipart(parts) == json.loads(doc)


def test_multipart_binary_content_with_crlf_survives():
    tricky = PNG + b"\r\n--not-the-boundary\r\n\r\n" + b"\x00\xff"
    ctype, data = multipart([("request", "application/json", b"{}", None), ("asset-0", "image/png", tricky, "a.png")])
    assert body.parse_multipart(data, ctype)["asset-0"].data == tricky


@pytest.mark.parametrize(
    "ctype,data",
    [
        ("multipart/form-data", b"--x\r\n"),
        ("multipart/form-data; boundary=x", b"--x\r\nContent-Type: a\r\n\r\nv\r\n--x--\r\n"),
        ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\nv\r\n'),
        (
            "multipart/form-data; boundary=x",
            b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\nv\r\n'
            b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\nw\r\n--x--',
        ),
        ("multipart/form-data; boundary=x", b"garbage"),
    ],
)
def test_malformed_multipart_is_400(ctype, data):
    with pytest.raises(ApiError) as ei:
        body.parse_multipart(data, ctype)
    assert ei.value.status == 400


def test_multipart_without_request_part_is_422():
    ctype, data = multipart([("asset-0", "image/png", PNG, "a")])
    with pytest.raises(RequestValidationError) as ei:
        body.request_from_multipart(body.parse_multipart(data, ctype))
    assert ei.value.errors()[0]["loc"] == ("body", "request")


def _validated(doc):
    return wire.SystemOneRequest.model_validate(doc)


def test_assets_resolve_with_placeholders():
    r = _validated(
        {
            "model": "jev-latest",
            "state": {"photo": "look: <image:aa>"},
            "questions": {
                "q": {
                    "type": "choice",
                    "instructions": "Which? <image:bb>",
                    "criteria": {"<image:aa>": None, "other": ["x <image:bb>"]},
                }
            },
            "assets": {
                "<image:aa>": {"format": "png", "data_base64": base64.b64encode(PNG).decode()},
                "<image:bb>": {"part": "asset-0"},
                "unused": {"format": "jpg", "data_base64": base64.b64encode(JPEG).decode()},
            },
        }
    )
    ctype, data = multipart([("request", "application/json", b"{}", None), ("asset-0", "image/jpeg", JPEG, "asset-0")])
    images = body.resolve_assets(r.assets, body.parse_multipart(data, ctype), r.state, r.questions)
    by = {i.alias: i for i in images}
    assert by["<image:aa>"].format == "png" and by["<image:bb>"].format == "jpeg"
    assert by["<image:aa>"].references == ["state.photo", "questions.q.criteria"]
    assert sorted(by["<image:bb>"].references) == ["questions.q.criteria.other[0]", "questions.q.instructions"]
    assert by["unused"].references == []


@pytest.mark.parametrize(
    "assets,parts,fragment",
    [
        ({"a": {"part": "asset-0"}}, None, "does not have"),
        ({"a": {"part": "asset-9"}}, {"asset-0": PNG}, "does not have"),
        ({"a": {"part": "asset-0"}, "b": {"part": "asset-0"}}, {"asset-0": PNG}, "claimed by two"),
        ({"a": {"part": "asset-0"}}, {"asset-0": PNG, "asset-1": PNG}, "not claimed"),
        ({"a": {"format": "png", "data_base64": "!!!"}}, None, "not valid base64"),
        ({"a": {"format": "png", "data_base64": ""}}, None, "empty"),
        ({"a": {"format": "png", "data_base64": base64.b64encode(b"GIF89a....").decode()}}, None, "not a PNG or JPEG"),
    ],
)
def test_asset_problems_are_400(assets, parts, fragment):
    r = _validated({**req(q={"type": "noul", "instructions": "?"}), "assets": assets})
    mp = {k: body.Part(k, "image/png", v) for k, v in (parts or {}).items()} if parts is not None else None
    with pytest.raises(ApiError) as ei:
        body.resolve_assets(r.assets, mp, r.state, r.questions)
    assert ei.value.status == 400 and fragment in ei.value.message
