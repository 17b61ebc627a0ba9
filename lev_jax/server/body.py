"""Request bodies: size limits, Content-Encoding (zstd, gzip, deflate), JSON, multipart/form-data,
and image assets with their placeholders.

FastAPI parses JSON bodies itself only when they arrive uncompressed and as application/json; the
official SDK zstd-compresses every body of 1 KiB or more and sends images as multipart, so the
server reads the raw bytes and does every step here. Validation errors keep FastAPI's shape.
"""

from __future__ import annotations

import base64
import binascii
import email.message
import io
import json
import zlib
from dataclasses import dataclass, field
from typing import Any

import zstandard

from lev_jax import domain
from lev_jax.server.errors import ApiError, too_large, usage_error, validation_error

MAX_DEPTH = 64  # nesting of JSON containers in a body


# ---------------------------------------------------------------- raw bytes


async def read_body(request, max_bytes: int) -> bytes:
    """The raw (possibly compressed) body, refusing more than `max_bytes` with 413."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(f"Request body of {int(declared)} bytes exceeds the limit of {max_bytes} bytes")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise too_large(f"Request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_content(data: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """Undo Content-Encoding: one coding at most (besides identity). Every layer would be decompressed
    up to the size limit again, so a stack of them multiplies the work one small body asks for."""
    if not content_encoding:
        return data
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    if len(codings) > 1:
        raise ApiError(
            415, "api_usage_error", f"Content-Encoding {content_encoding!r} stacks {len(codings)} codings; send one"
        )
    for coding in codings:
        if coding == "zstd":
            data = _unzstd(data, max_bytes)
        elif coding in ("gzip", "x-gzip"):
            data = _unzlib(data, max_bytes, 16 + zlib.MAX_WBITS, "gzip")
        elif coding == "deflate":
            try:
                data = _unzlib(data, max_bytes, zlib.MAX_WBITS, "deflate")
            except ApiError as e:
                if e.status == 413:
                    raise
                data = _unzlib(data, max_bytes, -zlib.MAX_WBITS, "deflate")  # raw deflate, as some clients send
        else:
            raise ApiError(
                415, "api_usage_error", f"Unsupported Content-Encoding {coding!r}; use zstd, gzip, deflate or identity"
            )
    return data


def _over(max_bytes: int) -> ApiError:
    return too_large(f"Decompressed request body exceeds the limit of {max_bytes} bytes")


def _unzstd(data: bytes, max_bytes: int) -> bytes:
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as reader:
            while True:
                chunk = reader.read(1 << 16)
                if not chunk:
                    break
                out += chunk
                if len(out) > max_bytes:
                    raise _over(max_bytes)
    except zstandard.ZstdError as e:
        raise usage_error(f"Request body is not valid zstd data ({e})") from None
    if data and not out and not data.startswith(b"\x28\xb5\x2f\xfd"):
        raise usage_error("Request body is not valid zstd data (no zstd frame)")
    return bytes(out)


def _unzlib(data: bytes, max_bytes: int, wbits: int, name: str) -> bytes:
    out = bytearray()
    rest = data
    try:
        while rest:
            d = zlib.decompressobj(wbits)
            out += d.decompress(rest, max_bytes + 1 - len(out))
            if len(out) > max_bytes or d.unconsumed_tail:
                raise _over(max_bytes)
            out += d.flush()
            if not d.eof:
                raise usage_error(f"Request body is truncated {name} data")
            rest = d.unused_data if wbits > 16 else b""  # gzip allows concatenated members
    except zlib.error as e:
        raise usage_error(f"Request body is not valid {name} data ({e})") from None
    if len(out) > max_bytes:
        raise _over(max_bytes)
    return bytes(out)


# ---------------------------------------------------------------- JSON


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(data: bytes) -> Any:
    """JSON as FastAPI reads it, but strict: NaN/Infinity and invalid UTF-8 are decode errors too."""
    if not data:
        raise validation_error((), "Field required", "missing", None)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise validation_error(
            (e.start,), "JSON decode error", "json_invalid", {}, {"error": "Invalid UTF-8"}
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    # Before parsing: a body of many tiny values costs far more as Python objects than as bytes.
    # Values are separated by commas, so more commas than values allowed plus characters allowed
    # (commas inside strings are characters of the request) cannot be a request within the caps.
    if data.count(b",") > domain.MAX_REQUEST_VALUES + domain.MAX_REQUEST_CHARS:
        raise _too_many_values(())
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise validation_error((e.pos,), "JSON decode error", "json_invalid", {}, {"error": e.msg}) from None
    except ValueError as e:
        raise validation_error((0,), "JSON decode error", "json_invalid", {}, {"error": str(e)}) from None
    except RecursionError:
        raise validation_error((0,), "JSON decode error", "json_invalid", {}, {"error": "nested too deeply"}) from None
    check_value(value)
    return value


def _too_many_values(path: tuple):
    return validation_error(
        path,
        f"The request has more than {domain.MAX_REQUEST_VALUES} JSON values",
        "too_long",
        None,
        {"max_values": domain.MAX_REQUEST_VALUES},
    )


def check_value(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Limits the schema cannot state: the number of values, container nesting and unpaired
    surrogates (\\ud800 escapes), which no tokenizer or UTF-8 encoder accepts. One cheap pass (no
    paths); only a body that breaks a limit is walked again to say where."""
    n, stack = 0, [(value, 0)]
    while stack:
        v, depth = stack.pop()
        n += 1
        if n > domain.MAX_REQUEST_VALUES:
            raise _too_many_values(())
        if isinstance(v, str):
            if not _encodes(v):
                return _locate(value, max_depth)
        elif isinstance(v, dict):
            if depth >= max_depth or not all(_encodes(k) for k in v if isinstance(k, str)):
                return _locate(value, max_depth)
            stack.extend((item, depth + 1) for item in v.values())
        elif isinstance(v, list):
            if depth >= max_depth:
                return _locate(value, max_depth)
            stack.extend((item, depth + 1) for item in v)
    return None


def _encodes(s: str) -> bool:
    """Whether `s` encodes as UTF-8 (no unpaired surrogate); an ASCII string costs no encode."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _locate(value: Any, max_depth: int) -> None:
    """The walk that names where a limit is broken (raises the error for it)."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            _check_str(v, path)
        elif isinstance(v, (dict, list)):
            if depth >= max_depth:
                raise validation_error(
                    path,
                    f"Value error, JSON nested deeper than {max_depth} levels",
                    "value_error",
                    None,
                    {"error": "too deep"},
                )
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, item in items:
                if isinstance(k, str):
                    _check_str(k, path)
                stack.append((item, (*path, k), depth + 1))


def _check_str(s: str, path: tuple) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise validation_error(path, "String should not contain unpaired surrogates", "string_unicode", None) from None


# ---------------------------------------------------------------- multipart/form-data


@dataclass
class Part:
    name: str
    content_type: str | None
    data: bytes
    filename: str | None = None


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def is_multipart(content_type: str | None) -> bool:
    return media_type(content_type) == "multipart/form-data"


def check_content_type(content_type: str | None) -> None:
    """415 unless the body says it is JSON (application/json, or a +json type) or multipart/form-data.
    A web page may post text/plain to any address without asking (no CORS preflight): reading that
    as JSON would let any site a user visits drive a server on their loopback with auth off."""
    kind = media_type(content_type)
    if kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json")):
        return
    if kind == "multipart/form-data":
        return
    raise ApiError(
        415,
        "api_usage_error",
        f"Content-Type {content_type!r} is not accepted: send JSON as application/json "
        "(or a request with images as multipart/form-data)"
        if content_type
        else "Content-Type is missing: send JSON as application/json (or images as multipart/form-data)",
    )


def _params(header_name: str, value: str) -> email.message.Message:
    m = email.message.Message()
    m[header_name] = value
    return m


def parse_multipart(data: bytes, content_type: str) -> dict[str, Part]:
    """RFC 7578 parts by name. The whole body is already in memory (and size-limited)."""
    boundary = _params("content-type", content_type).get_param("boundary")
    if not isinstance(boundary, str) or not boundary or len(boundary) > 200:
        raise usage_error("multipart/form-data body without a valid boundary parameter")
    delim = b"\r\n--" + boundary.encode("latin-1", "replace")
    segments = (b"\r\n" + data).split(delim)
    parts: dict[str, Part] = {}
    closed = False
    for seg in segments[1:]:  # segments[0] is the preamble
        if seg.startswith(b"--"):
            closed = True
            break
        head_end = seg.find(b"\r\n\r\n")
        if head_end < 0:
            raise usage_error("malformed multipart/form-data body: a part has no header block")
        head = seg[:head_end].decode("utf-8", "replace")
        content = seg[head_end + 4 :]
        headers: dict[str, str] = {}
        for line in head.split("\r\n")[1:]:  # first line is the rest of the delimiter line
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        disposition = headers.get("content-disposition")
        if not disposition:
            raise usage_error("malformed multipart/form-data body: a part has no Content-Disposition")
        m = _params("content-disposition", disposition)
        name = m.get_param("name", header="content-disposition")
        if not isinstance(name, str) or not name:
            raise usage_error("malformed multipart/form-data body: a part has no name")
        if name in parts:
            raise usage_error(f"multipart/form-data body has two parts named {name!r}")
        filename = m.get_param("filename", header="content-disposition")
        parts[name] = Part(name, headers.get("content-type"), content, filename if isinstance(filename, str) else None)
    if not closed:
        raise usage_error("malformed multipart/form-data body: no closing boundary")
    return parts


def request_from_multipart(parts: dict[str, Part]) -> Any:
    """The JSON document of the part named `request`."""
    req = parts.get("request")
    if req is None:
        raise validation_error(
            ("request",), "Field required: a multipart body needs a JSON part named 'request'", "missing", None
        )
    return parse_json(req.data)


# ---------------------------------------------------------------- assets and placeholders

SIGNATURES = {b"\x89PNG\r\n\x1a\n": "png", b"\xff\xd8\xff": "jpeg"}


@dataclass
class Image:
    alias: str
    data: bytes
    format: str | None  # detected from the bytes; None if neither PNG nor JPEG
    references: list[str] = field(
        default_factory=list
    )  # where the placeholder appears ("state", "questions.q.instructions", ...)


def _detect(data: bytes) -> str | None:
    for sig, fmt in SIGNATURES.items():
        if data.startswith(sig):
            return fmt
    return None


def resolve_assets(assets: dict | None, parts: dict[str, Part] | None, state: Any, questions: dict) -> list[Image]:
    """Every asset's bytes (inline base64 or its multipart part) and every place its placeholder
    appears in the state, instructions or criteria. 400 for data that is not there or not an image;
    multipart parts that no asset claims (or that two claim) are refused as the official API does."""
    parts = {k: v for k, v in (parts or {}).items() if k != "request"}
    claimed: dict[str, str] = {}
    images: list[Image] = []
    for alias, asset in (assets or {}).items():
        if asset.part is not None:
            if parts is None or asset.part not in parts:
                raise usage_error(
                    f"Asset {alias!r} names part {asset.part!r}, which the request does not have"
                    + ("" if parts else " (send it as multipart/form-data)")
                )
            if asset.part in claimed:
                raise usage_error(
                    f"Part {asset.part!r} is claimed by two assets ({claimed[asset.part]!r} and {alias!r})"
                )
            claimed[asset.part] = alias
            data = parts[asset.part].data
        else:
            try:
                data = base64.b64decode("".join(asset.data_base64.split()), validate=True)
            except (binascii.Error, ValueError):
                raise usage_error(f"Asset {alias!r}: data_base64 is not valid base64") from None
        if not data:
            raise usage_error(f"Asset {alias!r} is empty")
        fmt = _detect(data)
        if fmt is None:
            raise usage_error(f"Asset {alias!r} is not a PNG or JPEG image")
        images.append(Image(alias, data, fmt))
    unclaimed = sorted(set(parts) - set(claimed))
    if unclaimed:
        raise usage_error(f"Multipart part(s) {', '.join(map(repr, unclaimed))} are not claimed by any asset")
    if images:
        _find_references(images, state, questions)
    return images


def _strings(value: Any, where: str):
    stack = [(value, where)]
    while stack:
        v, w = stack.pop()
        if isinstance(v, str):
            yield v, w
        elif isinstance(v, dict):
            stack.extend((x, f"{w}.{k}") for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, f"{w}[{i}]") for i, x in enumerate(v))


def _find_references(images: list[Image], state: Any, questions: dict) -> None:
    """Each image's `references`: the places its placeholder appears, each once, in one pass over the
    request's strings (a set per image says what is already listed: no scan of the list per string)."""
    sources = [(state, "state")]
    for qid, q in questions.items():
        q = q.model_dump()  # plain data for every question type (a box question has no criteria)
        sources.append((q["instructions"], f"questions.{qid}.instructions"))
        crit = q.get("criteria")
        if crit is not None:
            if isinstance(crit, dict):
                sources.extend((name, f"questions.{qid}.criteria") for name in crit)
            sources.append((crit, f"questions.{qid}.criteria"))
    seen: list[set[str]] = [set(img.references) for img in images]
    for value, where in sources:
        for s, w in _strings(value, where):
            for img, listed in zip(images, seen):
                if w not in listed and img.alias in s:
                    listed.add(w)
                    img.references.append(w)
