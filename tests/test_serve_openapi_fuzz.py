"""An independent fuzzer against the served OpenAPI document: schemathesis reads /openapi.json from a
live server (uvicorn over a tiny random model) and runs every one of its checks on every operation.

tests/test_serve_fuzz.py generates bodies with this project's own reading of the schema; here a third
party reads it, so the document is held to what any client generator or fuzzer would take it to mean:

- no 5xx, and only the statuses, content types, headers and response bodies the document declares;
- schema-violating data (negative mode) is refused with a 4xx;
- schema-valid data (positive mode) is answered 2xx, or refused for a reason the document declares
  in words because JSON Schema cannot state it (the 400 description: an unknown model, a box question,
  images for a text-only model, a multipart part no asset names, ...; a 413 over the token budget);
- every answer arrives within RESPONSE_TIME_S (the tiny model compiles each new shape on first use).

Examples, coverage (boundary values, unexpected methods and content types) and fuzzing phases, run by
the engine that `st run` drives (schemathesis' pytest plugin cannot take a schema from a fixture under
pytest 9.2: its lazy loader writes `Node._nodeid`, which pytest 9.2 no longer has). Generation is
derandomized, so a CI run sends the same requests every time. $LEV_FUZZ_EXAMPLES sets the fuzzing
budget per operation (default 200) for a longer run.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import httpx
import pytest
import schemathesis
from schemathesis.engine import Status, events, from_schema

import lev_jax
from lev_jax.server import ServerConfig, create_app
from lev_jax.server.testing import ThreadServer
from lev_jax.testing import save_tiny_checkpoint

# fuzzing-phase cases per operation (positive and negative together); $LEV_FUZZ_EXAMPLES runs longer
MAX_EXAMPLES = int(os.environ.get("LEV_FUZZ_EXAMPLES") or 200)
MAX_BODY_BYTES = 2048  # generated bodies larger than this (serialized) are not sent: few shape buckets
RESPONSE_TIME_S = 30.0  # per request; a first-use compile of the tiny model takes about a second

CONFIG = {
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
    "phases": {"stateful": {"enabled": False}},  # no links between operations: nothing to chain
    "checks": {
        # every built-in check is on by default; these two have settings
        "max_response_time": RESPONSE_TIME_S,
        # Schema-valid requests may get a documented 400/413 (see DOCUMENTED_REFUSALS, which narrows the
        # 400s to their documented reasons); 5xx stays allowed here only so that not_a_server_error,
        # not this check, is the one that reports it.
        "positive_data_acceptance": {"expected-statuses": ["2xx", "400", "413", "5xx"]},
    },
    "request-timeout": 2 * RESPONSE_TIME_S,
    "workers": 1,
    "suppress-health-check": ["too_slow", "filter_too_much", "data_too_large"],
    "output": {"truncation": {"enabled": False}},
}

# 400 messages for schema-valid requests, one per reason the 400 description names (app._ERROR_RESPONSES)
DOCUMENTED_REFUSALS = re.compile(
    "|".join(
        [
            r"Unknown model: ",
            r"Model .* cannot locate boxes: ",
            r"Model .* is text-only and cannot read images",
            r"Asset .* names part .*, which the request does not have",
            r"Part .* is claimed by two assets",
            r"Multipart part\(s\) .* are not claimed by any asset",
            r"Asset .*: data_base64 is not valid base64",
            r"Asset .* is empty",
            r"Asset .* is not a PNG or JPEG image",
            r"\d+ options exceed what this tokenizer's \d+ label codes can read",
        ]
    ),
    re.DOTALL,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = lev_jax.load(model=str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))))
    with ThreadServer(create_app(engine, ServerConfig(max_pending=8, max_body_bytes=1 << 20))) as s:
        yield s
        assert s.thread.is_alive()


def _size(value) -> int:
    """Bytes of a generated body as JSON (raw parts of a multipart body by their length)."""
    return len(json.dumps(value, default=lambda v: "." * len(v) if isinstance(v, bytes) else repr(v)))


@schemathesis.check  # (registered for the process; only this module runs schemathesis)
def documented_refusals_only(ctx, response, case) -> bool | None:
    """A schema-valid (positive-mode) request answered 400 must be refused for a reason the 400
    description declares (api_usage_error)."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    try:
        detail = json.loads(response.content)["detail"]
        error_type, message = detail["error_type"], detail["message"]
    except (ValueError, KeyError, TypeError):
        error_type, message = None, response.text[:300]
    assert error_type == "api_usage_error" and DOCUMENTED_REFUSALS.match(message), (
        f"schema-valid request refused for a reason the document does not declare: 400 {error_type}: {message}"
    )
    return None


@pytest.fixture(scope="module")
def run(server):
    """One schemathesis run over every operation of the live document: (failures, errors, statuses)."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=schemathesis.Config.from_dict(CONFIG))

    @schema.hook
    def filter_body(context, body) -> bool:
        return _size(body) <= MAX_BODY_BYTES

    failures: list[str] = []
    errors: list[str] = []
    statuses: Counter = Counter()  # (operation, generation mode, status)
    finished = None
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            rec = event.recorder
            for case_id, interaction in rec.interactions.items():
                if interaction.response is not None:
                    meta = rec.cases[case_id].value.meta
                    mode = meta.generation.mode.value if meta is not None else "?"
                    statuses[rec.label, mode, interaction.response.status_code] += 1
            for checks in rec.checks.values():
                for check in checks:
                    if check.status == Status.FAILURE and check.failure_info is not None:
                        info = check.failure_info
                        failures.append(f"[{check.name}] {rec.label}: {info.failure}\n{info.code_sample}")
        elif isinstance(event, events.NonFatalError):
            errors.append(f"{event.label}: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            errors.append(f"fatal: {event.exception!r}")
        elif isinstance(event, events.EngineFinished):
            finished = event
            failures.extend(f"[after run] {f}" for f in event.failures)
    assert finished is not None and finished.stop_reason == "completed", finished
    return sorted(set(failures)), errors, statuses


def test_every_check_passes_on_every_operation(run):
    failures, errors, _ = run
    assert not errors, "\n\n".join(errors)
    assert not failures, f"{len(failures)} schemathesis failure(s):\n\n" + "\n\n".join(failures)


def test_the_fuzzer_reached_every_operation_and_the_model(run, server):
    _, _, statuses = run
    print("schemathesis:", dict(statuses))
    operations = {op for op, _, _ in statuses}
    assert operations >= {"POST /v1/systemone", "GET /v1/models", "GET /health", "GET /metrics"}, operations
    count = lambda mode, ok: sum(
        n for (op, m, s), n in statuses.items() if op == "POST /v1/systemone" and m == mode and ok(s)
    )
    assert count("positive", lambda s: s == 200) >= 20, statuses  # the model really answered
    assert count("negative", lambda s: 400 <= s < 500) >= 20, statuses  # and invalid data was really sent
    h = httpx.get(server.url + "/health", timeout=30).json()
    assert h["status"] == "ready" and h["in_flight"] == 0
    assert not re.search(r'status="5\d\d"', httpx.get(server.url + "/metrics", timeout=30).text)
