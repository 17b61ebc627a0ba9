"""Who answers the harness's questions: an engine in this process, or any Jev-compatible URL.

Both return an :class:`Asked`: the answers (Jev shapes), token usage and the wall-clock latency
of the call. The in-process client can also replay the same label logits under a second
calibration profile (the uncalibrated baseline) and hand back each readout's raw logits, so one
pass over a set gives calibrated and uncalibrated metrics, or calibration rows, without reading
the model twice.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lev_jax.bench.evalset import to_wire
from lev_jax.engine import Engine
from lev_jax.readout import Usage

API_KEY_ENV = "LEV_API_KEY"
DEFAULT_MODEL = "jev-latest"


@dataclass
class Readout:
    """One question's raw label logits, per presentation order, in canonical candidate order."""

    qtype: str
    mode: str
    n: int
    logits: list[np.ndarray]


@dataclass
class Asked:
    answers: dict[str, dict]
    latency_s: float
    input_tokens: int | None = None
    state_tokens: int | None = None
    cached_input_tokens: int | None = None  # of input_tokens, state-prefix tokens served from a cache
    baseline: dict[str, dict] | None = None  # answers under the baseline (uncalibrated) profile
    readouts: dict[str, Readout] = field(default_factory=dict)


class ClientError(RuntimeError):
    """A request the other side refused or could not answer."""


class HttpClient:
    """``POST {url}/v1/systemone`` (or the URL itself when it already ends in ``/v1/systemone``).

    The API key comes from ``api_key`` or ``$LEV_API_KEY`` (sent as a bearer token when set).
    429 and 503 answers are retried after their ``Retry-After`` (at most ``retries`` times)."""

    max_concurrency = 64

    def __init__(
        self, url: str, model: str = DEFAULT_MODEL, api_key: str | None = None, timeout: float = 300.0, retries: int = 5
    ):
        url = url.rstrip("/")
        self.endpoint = url if url.endswith("/v1/systemone") else url + "/v1/systemone"
        self.base = self.endpoint[: -len("/v1/systemone")]
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.timeout = timeout
        self.retries = retries

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": "url", "endpoint": self.endpoint, "model": self.model}
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=10) as r:
                health = json.loads(r.read())
            out["server"] = {
                k: health.get(k)
                for k in ("model", "calibrated", "prompt_style", "noul_readout", "version")
                if k in health
            }
        except (OSError, ValueError):
            pass
        return out

    def ask(self, state, questions: Mapping[str, dict]) -> Asked:
        body = json.dumps(
            {"model": self.model, "state": state, "questions": {k: to_wire(q) for k, q in questions.items()}}
        ).encode("utf-8")
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.endpoint, data=body, headers=headers, method="POST")
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    doc = json.loads(r.read())
                latency = time.perf_counter() - t0
                break
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", "replace")[:500]
                if e.code in (429, 503) and attempt < self.retries:
                    time.sleep(min(30.0, float(e.headers.get("retry-after") or 1)))
                    continue
                raise ClientError(f"HTTP {e.code}: {detail}") from None
            except urllib.error.URLError as e:
                raise ClientError(f"{self.endpoint}: {e.reason}") from None
        usage = doc.get("usage") or {}
        return Asked(
            doc["answers"],
            latency,
            usage.get("input_tokens"),
            doc.get("x_state_tokens"),
            doc.get("x_cached_input_tokens"),
        )


class InProcessClient:
    """A :class:`lev_jax.Engine` in this process (calls are serialised: one engine, one device).

    With ``baseline`` (a :class:`lev_jax.calibrate.Calibration`, e.g. the identity), every call
    also returns the answers the same label logits give under that profile. With
    ``readouts=True`` it returns each question's raw label logits (see :class:`Readout`).

    It plans through ``engine.plan`` and answers through ``engine.answer`` with a reader that keeps
    every row's label logits, so the answers are exactly what ``engine.predict`` returns and a
    second calibration costs no device work.
    """

    max_concurrency = 1

    def __init__(self, engine: Engine, *, baseline=None, readouts: bool = False):
        self.engine = engine
        self.baseline = baseline
        self.want_readouts = readouts

    def describe(self) -> dict[str, Any]:
        e = self.engine
        info = e.info()
        cal_info = e.calibration.describe()
        if cal_info.get("path"):
            cal_info["path"] = _relative(cal_info["path"])
        return {
            "kind": "in-process",
            "model": e.model_name,
            "calibration": cal_info,
            "baseline": self.baseline.describe() if self.baseline is not None else None,
            **{k: info.get(k) for k in ("prompt_style", "layout", "noul_readout", "option_averaging")},
        }

    def ask(self, state, questions: Mapping[str, dict]) -> Asked:
        eq = {k: to_wire(q) for k, q in questions.items()}
        e = self.engine
        t0 = time.perf_counter()
        plan = e.plan(state, eq)
        cache: dict[tuple, np.ndarray] = {}

        def reader(entries, usages):
            # [(prefix_ids, rows)] -> per entry, one logits array per row; rows already read (by an
            # earlier pass over the same plan) come from `cache`
            out = []
            for (prefix_ids, rows), usage in zip(entries, usages):
                keys = [(tuple(r.tokens), tuple(r.label_ids)) for r in rows]
                missing = [i for i, k in enumerate(keys) if k not in cache]
                if missing:
                    got = e.executor.read([(prefix_ids, [rows[i] for i in missing])], [usage])[0]
                    for i, logits in zip(missing, got):
                        cache[keys[i]] = np.asarray(logits)
                out.append([cache[k] for k in keys])
            return out

        usage = Usage()
        answers = e.answer([plan], [usage], reader=reader)[0]
        latency = time.perf_counter() - t0
        out = Asked(answers, latency, usage.processed, len(plan.prefix_ids), usage.cached)
        if self.baseline is not None:
            out.baseline = e.answer([plan], [Usage()], reader=reader, calibration=self.baseline)[0]
        if self.want_readouts:
            for qp in plan.questions:
                if qp.groups is not None:  # grouped large choice: composed from two rounds, not one readout
                    continue
                ro = qp.readouts[0]
                arrs = []
                # the engine reads code position j of a row as candidate maps[row][j]; undo that
                for logits, m in zip(reader([(plan.prefix_ids, ro.rows)], [Usage()])[0], ro.maps):
                    canon = np.empty(ro.n, dtype=np.float64)
                    canon[np.asarray(m)] = np.asarray(logits[: len(m)], dtype=np.float64)
                    arrs.append(canon)
                out.readouts[qp.qid] = Readout(ro.qtype, ro.mode, ro.n, arrs)
        return out


def _relative(path: str) -> str:
    """A path relative to the working directory when it lies under it (reports carry no machine paths)."""
    from pathlib import Path

    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
