"""Every error the server answers, in the two shapes of the wire contract.

- 422 validation failures: `{"detail": [{"loc": ["body", ...], "msg", "type", ...}]}`, exactly as FastAPI
  produces them (raised as `fastapi.exceptions.RequestValidationError`).
- everything else: `{"detail": {"error_type": ..., "message": ...}}` (raised as `ApiError`).

Clients retry 5xx, so a 5xx means the server is at fault; bad input never gets one.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError

API_USAGE = "api_usage_error"
AUTHENTICATION = "authentication_error"
TOO_LARGE = "request_too_large"
RATE_LIMIT = "rate_limit_error"
OVERLOADED = "overloaded_error"
TIMEOUT = "timeout_error"
NOT_FOUND = "not_found_error"
INTERNAL = "internal_error"

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
