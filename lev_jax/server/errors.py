"""Every error the server answers, in the two shapes of the wire contract.

- 422 validation failures: `{"detail": [{"loc": ["body", ...], "msg", "type", ...}]}`, exactly as FastAPI
  produces them (raised as `fastapi.exceptions.RequestValidationError`).
- everything else: `{"detail": {"error_type": ..., "message": ...}}` (raised as `ApiError`).

Clients retry 5xx, so a 5xx means the server is at fault; bad input never gets one.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError

API_USAGE = "api_usage_error"
AUTHENTICATION = "authentication_error"
TOO_LARGE = "request_too_large"
RATE_LIMIT = "rate_limit_error"
OVERLOADED = "overloaded_error"
TIMEOUT = "timeout_error"
NOT_FOUND = "not_found_error"
INTERNAL = "internal_error"

# A 422 answers in proportion to what was wrong, not to what was sent: a body of many small errors
# (or one huge value) would otherwise come back many times its size (17.5 KB of request -> 9 MB).
MAX_VALIDATION_ERRORS = 20  # errors listed; one more item says how many were left out
MAX_ERROR_MSG_CHARS = 500  # a message (or a string in ctx) past this is cut
MAX_ERROR_INPUT_CHARS = 200  # an input whose JSON is longer than this is not echoed (null)

# error_type for the HTTP errors Starlette raises itself (unknown route, wrong method, ...)
STATUS_ERROR_TYPES = {404: NOT_FOUND, 405: API_USAGE, 413: TOO_LARGE, 415: API_USAGE}


class ApiError(Exception):
    def __init__(self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"detail": {"error_type": self.error_type, "message": self.message}}


def usage_error(message: str) -> ApiError:
    return ApiError(400, API_USAGE, message)


def too_large(message: str) -> ApiError:
    return ApiError(413, TOO_LARGE, message)


def validation_error(
    loc: tuple | list, msg: str, type_: str, input_: Any = None, ctx: dict | None = None
) -> RequestValidationError:
    """One FastAPI-shaped validation error; `loc` is given without the leading "body"."""
    err: dict[str, Any] = {"type": type_, "loc": ("body", *loc), "msg": msg, "input": input_}
    if ctx is not None:
        err["ctx"] = ctx
    return RequestValidationError([err])


def from_pydantic(exc) -> RequestValidationError:
    """A pydantic ValidationError on the request body, as FastAPI reports it."""
    return RequestValidationError([{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False)])


def _cut(text: str, limit: int = MAX_ERROR_MSG_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def _small(value: Any) -> Any:
    """`value` as JSON when that is short, else None: an error does not echo a large input."""
    try:
        value = jsonable_encoder(value)
        return value if len(json.dumps(value, ensure_ascii=False)) <= MAX_ERROR_INPUT_CHARS else None
    except (TypeError, ValueError):
        return None


def bounded_errors(errors: list[dict]) -> list[dict]:
    """A 422's `detail`: at most MAX_VALIDATION_ERRORS items of FastAPI's shape, messages cut and large
    inputs not echoed, and a last item counting the errors left out."""
    out = []
    for e in errors[:MAX_VALIDATION_ERRORS]:
        item = {
            "type": str(e.get("type", "value_error")),
            "loc": list(e.get("loc", ())),
            "msg": _cut(str(e.get("msg"))),
        }
        item["loc"] = [x if isinstance(x, int) else _cut(str(x), MAX_ERROR_INPUT_CHARS) for x in item["loc"]]
        item["input"] = _small(e.get("input"))
        if e.get("ctx") is not None:
            item["ctx"] = {str(k): _small(v) if not isinstance(v, str) else _cut(v) for k, v in e["ctx"].items()}
        out.append(item)
    if len(errors) > MAX_VALIDATION_ERRORS:
        left = len(errors) - MAX_VALIDATION_ERRORS
        out.append({"type": "too_many_errors", "loc": ["body"], "msg": f"... and {left} more error(s)", "input": None})
    return out
