"""scripts/bench_options.py, bench_cold_start.py, bench_microbatch.py and bench_slab.py: argument parsing and the pure
helpers (no timings asserted), and bench_options and bench_microbatch end to end on a tiny random
checkpoint."""

import json

import pytest

from scripts import bench_cold_start as C
from scripts import bench_microbatch as M
from scripts import bench_options as O

# --------------------------------------------------------------------------- bench_options


def test_option_question_has_n_named_options():
    q = O.option_question(255)["queue"]
    assert q["type"] == "choice"
    names = list(q["criteria"])
    assert len(names) == 255 and names[0] == "Queue 001" and names[-1] == "Queue 255"
    assert q["criteria"]["Queue 001"] == "Tickets routed to queue 1"
    assert list(O.option_question(2)["queue"]["criteria"]) == ["Queue 001", "Queue 002"]
    other = O.option_question(3, word="Group")["queue"]["criteria"]
    assert other == {f"Group 00{i}": f"Tickets routed to group {i}" for i in (1, 2, 3)}
    for bad in (1, 256):
        with pytest.raises(ValueError):
            O.option_question(bad)


def test_state_is_about_two_kilobytes():
    assert 1900 <= len(O.STATE.encode()) <= 2200


def test_bench_options_arguments():
    a = O.build_parser().parse_args([])
    assert a.ns == [2, 8, 32, 64, 128, 255] and a.dtypes == ["float32", "bfloat16"] and a.repeats == 3
    assert a.model is None and a.json is None and not a.markdown
    a = O.build_parser().parse_args(
        ["--ns", "2,8", "--dtypes", "float32", "--repeats", "1", "--model", "m", "--json", "o.json", "--markdown"]
    )
    assert (a.ns, a.dtypes, a.repeats, a.model, a.json, a.markdown) == ([2, 8], ["float32"], 1, "m", "o.json", True)
    for bad in (["--ns", "1,8"], ["--ns", "256"], ["--ns", "x"], ["--dtypes", "float16"]):
        with pytest.raises(SystemExit):
            O.build_parser().parse_args(bad)


def test_baseline_ids_cycle_prefix_and_rows():
    class Row:
        def __init__(self, tokens):
            self.tokens = tokens

    assert O.baseline_ids([1, 2], [Row([3]), Row([4, 5])], 7) == [1, 2, 3, 4, 5, 1, 2]
    assert O.baseline_ids([1, 2, 3], [], 2) == [1, 2]
    with pytest.raises(ValueError):
        O.baseline_ids([], [], 3)


def test_timed_returns_first_and_median():
    calls = []
    first, median, samples = O.timed(lambda: calls.append(1), 3)
    assert len(calls) == 4 and len(samples) == 3 and first >= 0 and median in samples


def _result(n, **kw):
    r = {
        "dtype": "float32",
        "n": n,
        "rows": 2,
        "row_tokens_min": 60,
        "row_tokens_max": 61,
        "row_tokens_mean": 60.5,
        "processed_tokens": 121,
        "first_s": 3.2,
        "compile_s": 3.0,
        "warm_s": 0.2,
        "ms_per_token": 1.65,
        "prefill_tokens": 121,
        "prefill_bucket": 128,
        "prefill_first_s": 1.0,
        "prefill_s": 0.05,
        "prefill_ms_per_token": 0.41,
        "ratio": 4.0,
        "new_question_s": 1.5,
        "new_question_tokens": 140,
        "new_question_programs": 0,
    }
    r.update(kw)
    return r


def test_bench_options_markdown_and_lines():
    report = {
        "state_chars": 2023,
        "repeats": 3,
        "prefix_tokens": {"float32": 572},
        "prefix_first_s": {"float32": 5.5},
        "results": [_result(2), _result(255, prefill_s=None, prefill_ms_per_token=None, ratio=None)],
    }
    md = O.markdown(report)
    rows = [ln for ln in md.splitlines() if ln.startswith("| float32")]
    assert len(rows) == 2
    assert "| 2 |" in rows[0] and "**4.00×**" in rows[0] and "| 1.500 (140, 0) |" in rows[0]
    assert "| 255 |" in rows[1] and "**–×**" in rows[1]
    assert "row / prefill" in md and "float32 5.50 s" in md
    assert "row / prefill at equal tokens 4.00x" in O.line(_result(2))
    assert "new question 1.500 s (140 tok, 0 programs compiled)" in O.line(_result(2))
    assert "n/a" in O.line(_result(255, prefill_s=None))


def test_bench_options_end_to_end_on_a_tiny_model(tmp_path, capsys, monkeypatch):
    from lev_jax.testing import save_tiny_checkpoint

    monkeypatch.setattr(O, "STATE", "Ticket: I was charged twice and want a refund.")  # small shapes compile fast

    model = save_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "options.json"
    rc = O.main(["--model", str(model), "--ns", "2", "--dtypes", "float32", "--repeats", "1", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    (r,) = report["results"]
    assert r["n"] == 2 and r["dtype"] == "float32" and r["rows"] >= 1
    assert r["processed_tokens"] == r["input_tokens"] - r["cached_input_tokens"] > 0
    assert r["prefill_tokens"] == r["processed_tokens"] and r["prefill_bucket"] >= r["prefill_tokens"]
    assert r["choice"] in ("Queue 001", "Queue 002")
    # another question of the same shape: measured, with what it compiled (a count, not a timing)
    assert r["new_question_s"] > 0 and r["new_question_tokens"] > 0 and r["new_question_programs"] >= 0
    assert "N=  2" in capsys.readouterr().out


# --------------------------------------------------------------------------- bench_microbatch


def test_bench_microbatch_end_to_end_on_a_tiny_model(tmp_path, capsys):
    from lev_jax.testing import save_tiny_checkpoint

    model = save_tiny_checkpoint(tmp_path / "tiny")
    assert M.main(["--model", str(model), "--sizes", "2", "--dtypes", "float32", "--repeats", "1"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| float32 |")]
    (cells,) = [[c.strip() for c in line.strip("|").split("|")] for line in row]
    assert cells[1] == "2" and float(cells[2]) > 0 and float(cells[3]) > 0 and cells[4].endswith("x")
    assert float(cells[5]) <= 1e-5  # fp32: the micro-batch answers as the requests alone do
    with pytest.raises(SystemExit):
        M.main(["--sizes", "9"])  # more requests than the load test has tickets


# --------------------------------------------------------------------------- bench_cold_start


def test_cold_start_arguments():
    a = C.build_parser().parse_args([])
    assert a.scenarios == list(C.SCENARIOS) and a.poll_interval == 0.05 and a.first_request_target == 2.0
    assert a.dtype == "auto"  # what a new user's `make serve` computes in
    assert C.build_parser().parse_args(["--dtype", "float32"]).dtype == "float32"
    assert C.build_parser().parse_args(["--scenarios", "cold"]).scenarios == ["cold"]
    # the second start needs the first; order and duplicates are normalised
    assert C.parse_scenarios("cache-second") == ["cache-first", "cache-second"]
    assert C.parse_scenarios("warmup,cold,cold") == ["cold", "warmup"]
    for bad in ("", "hot", "cold,hot"):
        with pytest.raises(SystemExit):
            C.build_parser().parse_args(["--scenarios", bad])


def test_scenario_flags():
    assert C.scenario_flags("cold", None, True) == ["--no-compilation-cache", "--no-warmup"]
    assert C.scenario_flags("cold", None, False) == ["--no-warmup"]
    assert C.scenario_flags("warmup", None, True) == ["--no-compilation-cache"]
    assert C.scenario_flags("warmup", None, False) == []
    for name in ("cache-first", "cache-second"):
        assert C.scenario_flags(name, "/tmp/c", True) == ["--compilation-cache", "/tmp/c"]
    with pytest.raises(ValueError):
        C.scenario_flags("cache-first", None, True)
    with pytest.raises(ValueError):
        C.scenario_flags("hot", None, True)


def test_health_state():
    assert C.health_state(503, b'{"status": "warming"}') == (False, False)
    assert C.health_state(200, b'{"status": "warming"}') == (True, False)
    assert C.health_state(200, b'{"status": "draining"}') == (True, False)
    assert C.health_state(200, b'{"status": "ready"}') == (True, True)
    assert C.health_state(200, b'{"status": "ok", "model": "m"}') == (True, True)
    assert C.health_state(200, b'{"model": "m"}') == (True, True)  # no status field: up means ready
    assert C.health_state(200, b"not json") == (True, True)


def _decompress(body: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj().decompress(body)


def test_sdk_request_compresses_large_bodies_like_the_sdk():
    headers, body = C.sdk_request(C.STATE, C.FIRST_QUESTIONS, api_key="sk-x")
    assert headers["Content-Encoding"] == "zstd" and headers["Authorization"] == "Bearer sk-x"
    assert headers["Content-Type"] == "application/json" and headers["User-Agent"].startswith("typesafe-sdk/")
    doc = json.loads(_decompress(body))
    assert doc == {"state": C.STATE, "model": "jev-latest", "questions": C.FIRST_QUESTIONS}
    q = doc["questions"]
    assert [x["type"] for x in q.values()] == ["noul", "choice", "score"]
    assert len(q["team"]["criteria"]) == 4 and len(q["urgency"]["criteria"]) == 3
    assert len(C.SECOND_QUESTIONS["topic"]["criteria"]) == 6
    small_headers, small = C.sdk_request("short", {"a": {"type": "noul", "instructions": "?"}}, api_key="k")
    assert "Content-Encoding" not in small_headers and json.loads(small)["state"] == "short"


def test_sdk_request_matches_what_the_official_sdk_prepares():
    pytest.importorskip("typesafe_sdk")
    from typesafe_sdk._core.config import Config
    from typesafe_sdk._core.endpoints import prepare_system_one
    from typesafe_sdk._core.response_types import SystemOneResponse

    config = Config.resolve("sk-x", "http://127.0.0.1:1", None, None, None, None)
    req, _ = prepare_system_one(config, C.STATE, C.FIRST_QUESTIONS, None, None, None, None, SystemOneResponse)
    headers, body = C.sdk_request(C.STATE, C.FIRST_QUESTIONS, api_key="sk-x")
    assert _decompress(body) == req.content  # the same JSON bytes before compression
    theirs = {k.lower(): v for k, v in req.headers.items()}
    assert {k.lower(): v for k, v in headers.items() if k != "Content-Encoding"} == theirs


def _scen(ready=None, first=None, second=None):
    return {"up_s": ready, "ready_s": ready, "first_request_s": first, "second_request_s": second, "flags": []}


def test_checks():
    verdicts = C.checks({"cold": _scen(10, 5.0, 1.0)}, 2.0, 0.5)
    assert [v for v, _ in verdicts] == ["SKIP", "SKIP"]  # cold alone is reference only
    res = {"warmup": _scen(20, 0.5), "cache-first": _scen(20, 0.4), "cache-second": _scen(6, 0.3)}
    assert [v for v, _ in C.checks(res, 2.0, 0.5)] == ["PASS", "PASS", "PASS", "PASS"]
    res["cache-second"] = _scen(15, 2.5)
    got = C.checks(res, 2.0, 0.5)
    assert [v for v, _ in got] == ["PASS", "PASS", "FAIL", "FAIL"]
    assert "ratio 0.75" in got[-1][1]
    res["cache-first"] = _scen(None, None)  # failed to start
    assert [v for v, _ in C.checks(res, 2.0, 0.5)][-1] == "FAIL"
    assert C.ratio(5, 10) == 0.5 and C.ratio(None, 10) is None and C.ratio(5, 0) is None


def test_at_up_request_check_and_program_report():
    res = {"warmup": {**_scen(20, 0.5), "at_up_request": {"status": 200, "s": 4.0}, "at_up_request_s": 4.0}}
    assert ("PASS", "warmup: request sent at /health up 4.000 s < 5 s") in C.checks(res, 2.0, 0.5, 5.0)
    res["warmup"].update(at_up_request={"status": 503, "s": 0.1}, at_up_request_s=None)
    assert ("FAIL", "warmup: request sent at /health up no answer < 5 s") in C.checks(res, 2.0, 0.5, 5.0)
    assert "answered in – s (HTTP 503)" in C.markdown({"results": res})
    assert C.build_parser().parse_args(["--at-up"]).at_up and C.build_parser().parse_args([]).at_up_target == 5.0
    health = {
        "programs": {
            "compiled": 2,
            "loaded": 1,
            "build_seconds": 3.5,
            "builds": [
                {"program": "extend", "how": "compiled", "seconds": 1.0},
                {"program": "read_rows", "how": "loaded", "seconds": 0.5},
                {"program": "read_rows", "how": "compiled", "seconds": 2.0},
            ],
            "other": "x",
        }
    }
    progs = C.programs_of(health)
    assert "other" not in progs and C.programs_of({}) is None and C.programs_of(None) is None
    lines = C.programs_lines("warmup", progs)
    assert lines[0] == "warmup: 2 programs compiled, 1 loaded, 3.5 s in all (the last 3 below, slowest first)"
    assert [line.split()[0] for line in lines[1:]] == ["2.000", "1.000", "0.500"]  # slowest first


def test_cold_start_table_and_markdown():
    res = {
        "cold": {**_scen(12.5, 4.25, 0.75), "flags": ["--no-warmup"], "health": {"dtype": "bfloat16"}},
        "warmup": {**_scen(None), "error": "boom"},
    }
    text = C.table(res)
    assert "cold" in text and "12.50" in text and "4.250" in text and "ERROR: boom" in text
    md = C.markdown({"results": res, "cache_second_vs_first": 0.25, "checks": [("PASS", "x")]})
    assert "| cold | `--no-warmup` | bfloat16 | 12.50 | 12.50 | 4.250 | 0.750 |" in md
    assert "| warmup | `(defaults)` | ? | – | – | – | – |" in md
    assert "**0.25**" in md and "- PASS: x" in md


def test_bench_images_arguments():
    from scripts import bench_images as B

    args = B.parse_args(["--size", "64", "--repeats", "2"])
    assert (args.size, args.repeats, args.model) == (64, 2, None)
    with pytest.raises(SystemExit):
        B.parse_args(["--size", "8"])


# --------------------------------------------------------------------------- bench_slab


def test_bench_slab_times_every_slab_shape_and_fits_the_call_cost(tmp_path, capsys):
    from lev_jax import buckets
    from lev_jax.testing import save_tiny_checkpoint
    from scripts import bench_slab

    model = save_tiny_checkpoint(tmp_path / "tiny")
    assert bench_slab.main(["--model", str(model), "--dtype", "float32", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line.split("|")[1].strip()[:1].isdigit()]
    shapes = [tuple(int(x) for x in line.split("|")[1].split(" x ")) for line in rows]
    assert shapes == list(buckets.slab_shapes("cpu"))
    assert all(float(line.split("|")[2]) > 0 for line in rows)
    assert "tokens per call" in out
