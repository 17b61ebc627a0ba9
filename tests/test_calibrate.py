"""lev_jax.calibrate: buckets, lookup, the split guard, fitting, and the profile files."""

import datetime as dt
import json
import math

import numpy as np
import pytest

from lev_jax import calibrate as C
from lev_jax import metrics as M
from lev_jax.domain import band_of

DATE1 = dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
DATE2 = dt.datetime(2025, 2, 3, 4, 5, 6, tzinfo=dt.UTC)


def choice_rows(rng, n, t_true, k=4, families=("f0", "f1", "f2", "f3"), scale=1.5, mode="letter"):
    """Gold ~ softmax(z); the model reports z * t_true, so the right temperature is t_true."""
    z = rng.normal(0.0, scale, size=(n, k))
    p = C.softmax(z)
    gold = [int(rng.choice(k, p=pi)) for pi in p]
    return [C.CalibrationRow(z[i] * t_true, gold[i], "choice", mode, families[i % len(families)], k) for i in range(n)]


def binary_rows(rng, n, t_true, families=("a", "b", "c")):
    z = rng.normal(0.0, 2.0, size=n)
    y = rng.random(n) < 1.0 / (1.0 + np.exp(-z))
    return [
        C.CalibrationRow(
            [t_true * z[i] / 2, -t_true * z[i] / 2], bool(y[i]), "noul", "binary", families[i % len(families)]
        )
        for i in range(n)
    ]


def bucket(cal, key):
    return next(b for b in cal.buckets if b["key"] == key)


# --------------------------------------------------------------------------- bands / names


def test_option_bands():
    assert [band_of(n) for n in (1, 8, 9, 26, 27, 500)] == ["small", "small", "mid", "mid", "large", "large"]
    with pytest.raises(ValueError):
        band_of(0)


@pytest.mark.parametrize(
    "name",
    [
        "test",
        "banking77-test",
        "clinc_eval",
        "holdout-2",
        "TestSet",
        "BankingTest",
        "mix.heldout",
        "held_out",
        "test2",
        "evaluation",
        "MMLU eval split",
    ],
)
def test_forbidden_split_names(name):
    assert C.forbidden_split_reason(name) is not None
    with pytest.raises(ValueError, match="held-out"):
        C.check_split_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "banking77-train",
        "clinc150-val",
        "validation",
        "calibration",
        "mix-calib",
        "contest",
        "attestation",
        "medieval",
        "dev",
    ],
)
def test_allowed_split_names(name):
    assert C.forbidden_split_reason(name) is None


def test_fit_refuses_test_split_from_argument_or_rows():
    rows = choice_rows(np.random.default_rng(0), 60, 2.0)
    with pytest.raises(ValueError, match="'test'"):
        C.fit(rows, splits=["test"], model_id="m")
    with pytest.raises(ValueError, match="banking77-test"):
        C.fit(rows, splits=["banking77-train", "banking77-test"], model_id="m")
    tagged = [C.CalibrationRow(r.logits, r.gold, r.qtype, r.mode, r.family, split="clinc_eval") for r in rows]
    with pytest.raises(ValueError, match="clinc_eval"):
        C.fit(tagged, splits=["banking77-train"], model_id="m")
    with pytest.raises(ValueError):
        C.fit(rows, splits=[], model_id="m")  # must say what it was fitted on


# --------------------------------------------------------------------------- readout maths


def test_readout_binary_rating_and_order_average():
    assert C.readout([2.0, 0.0], "noul", "binary") == pytest.approx(1 / (1 + math.exp(-2)))
    assert C.readout([2.0, 0.0], "noul", "binary", temperature=2.0) == pytest.approx(1 / (1 + math.exp(-1)))
    assert C.readout(np.zeros(9), "noul", "rating") == pytest.approx(0.5)  # mean of i/8
    # equal mass on codes 4 and 8: (4/8 + 8/8) / 2
    assert C.readout([-50.0] * 4 + [0.0] + [-50.0] * 3 + [0.0], "noul", "rating") == pytest.approx(0.75)
    assert C.rating_p_yes(np.eye(9)[8]) == 1.0
    # two orderings, T = 2: softmax([1, 0]) and softmax([0, .5]) averaged
    a = np.array([math.e, 1.0]) / (math.e + 1)
    b = np.array([1.0, math.exp(0.5)]) / (1 + math.exp(0.5))
    np.testing.assert_allclose(C.readout([[2.0, 0.0], [0.0, 1.0]], "choice", "letter", 2.0), (a + b) / 2)
    np.testing.assert_allclose(C.readout(np.array([[2.0, 0.0], [0.0, 1.0]]), "choice", "letter", 2.0), (a + b) / 2)
    with pytest.raises(ValueError):
        C.readout([1.0, 2.0, 3.0], "noul", "binary")
    with pytest.raises(ValueError):
        C.readout([1.0, 2.0], "noul", "letter")


def test_row_validation():
    with pytest.raises(ValueError):
        C.CalibrationRow([1.0, 2.0], 1, "noul", "binary", "f")  # noul gold must be bool
    with pytest.raises(ValueError):
        C.CalibrationRow([1.0, 2.0], True, "choice", "letter", "f")  # choice gold must be an index
    with pytest.raises(ValueError):
        C.CalibrationRow([1.0, 2.0], 2, "choice", "letter", "f")
    with pytest.raises(ValueError):
        C.CalibrationRow([1.0, 2.0], 0, "choice", "letter", "f", n_options=3)
    with pytest.raises(ValueError):
        C.CalibrationRow([[1.0, 2.0], [1.0, 2.0, 3.0]], 0, "choice", "letter", "f")
    with pytest.raises(ValueError):
        C.CalibrationRow(np.zeros(8), True, "noul", "rating", "f")
    r = C.CalibrationRow([[1.0, 2.0, 3.0]] * 2, 0, "choice", "letter", "f")
    assert r.n_options == 3 and len(r.logits) == 2 and r.band == "small"


# --------------------------------------------------------------------------- lookup


def profile_doc():
    def b(qtype, mode, band, t, status="fitted"):
        return {
            "key": C.bucket_key(qtype, mode, band),
            "qtype": qtype,
            "mode": mode,
            "band": band,
            "temperature": t,
            "status": status,
            "n_rows": 100,
        }

    return {
        "format": C.FORMAT,
        "version": C.FORMAT_VERSION,
        "model_id": "m",
        "fit_date": "2025-01-02T03:04:05Z",
        "buckets": [
            b("choice", "letter", None, 1.5),
            b("choice", "letter", "small", 2.0),
            b("choice", "letter", "mid", 1.0, "too_few_rows"),
            b("noul", "binary", None, 0.8),
        ],
    }


def test_lookup_band_then_unbanded_then_identity():
    cal = C.Calibration(profile_doc())
    assert cal.resolve("choice", "letter", 4) == ("choice/letter/small", 2.0)
    # mid was seen but had < 50 rows: it stays at 1 and does not borrow the unbanded 1.5
    assert cal.resolve("choice", "letter", 20) == ("choice/letter/mid", 1.0)
    # large was never seen: falls back to the unbanded (choice, letter) bucket
    assert cal.resolve("choice", "letter", 40) == ("choice/letter", 1.5)
    assert cal.temperature("noul", "binary") == 0.8
    assert cal.resolve("noul", "rating") == (None, 1.0)  # binary and rating are separate buckets
    assert cal.temperature("choice", "cloze", 4) == 1.0
    with pytest.raises(ValueError):
        cal.temperature("choice", "letter")  # band needs the option count
    assert not cal.is_identity
    assert C.Calibration.identity().is_identity


def test_apply_divides_each_ordering_and_readout_uses_it():
    cal = C.Calibration(profile_doc())
    x = np.array([2.0, 1.0, 0.0, -1.0])
    np.testing.assert_allclose(cal.apply(x, "choice", "letter"), x / 2.0)  # 4 options -> small, T = 2
    np.testing.assert_allclose(cal.apply(np.arange(30.0), "choice", "letter"), np.arange(30.0) / 1.5)
    assert cal.apply(x, "choice", "cloze", 4) is x  # T = 1 returns the input untouched
    orderings = [x, x[::-1]]
    np.testing.assert_allclose(
        cal.readout(orderings, "choice", "letter"),
        np.mean([C.softmax(cal.apply(o, "choice", "letter")) for o in orderings], axis=0),
    )
    jnp = pytest.importorskip("jax.numpy")
    y = cal.apply(jnp.asarray(x, dtype=jnp.float32), "choice", "letter")
    assert isinstance(y, type(jnp.zeros(1))) and np.allclose(np.asarray(y), x / 2.0)


# --------------------------------------------------------------------------- fitting


def test_fit_recovers_known_temperature_and_lowers_ece():
    rows = choice_rows(np.random.default_rng(1), 3000, 2.5)
    cal = C.fit(rows, splits=["synthetic-train"], model_id="m", fit_date=DATE1)
    small = bucket(cal, "choice/letter/small")
    assert small["status"] == "fitted" and small["n_rows"] == 3000 and small["n_families"] == 4
    assert small["temperature"] == pytest.approx(2.5, rel=0.08)
    assert small["ece_after"] < 0.03 < small["ece_before"]
    assert small["nll_after"] < small["nll_before"]
    assert small["selection"] == "lofo_ece" and set(small["lofo_ece"]) == {"row", "family"}
    assert small["temperature"] == small[f"temperature_{small['weighting']}"]
    # the unbanded bucket holds the same rows here, so the same temperature
    assert bucket(cal, "choice/letter")["temperature"] == pytest.approx(small["temperature"])
    assert cal.temperature("choice", "letter", 5) == small["temperature"]


def test_fit_recovers_underconfident_binary_noul():
    rows = binary_rows(np.random.default_rng(2), 2000, 0.5)
    b = bucket(C.fit(rows, splits=["calib"], model_id="m"), "noul/binary")
    assert b["temperature"] == pytest.approx(0.5, rel=0.1)
    assert b["ece_after"] < b["ece_before"]


def test_fitted_nll_matches_per_row_readout():
    """The vectorised fit scores exactly what readout() (predict()'s reference) produces:
    ragged option counts, order-averaged rows, rating noul."""
    rng = np.random.default_rng(3)
    rows = []
    for i in range(80):
        k = int(rng.integers(2, 7))
        n_ord = int(rng.integers(1, 4))
        rows.append(
            C.CalibrationRow(
                [rng.normal(0, 3, k) for _ in range(n_ord)], int(rng.integers(k)), "choice", "letter", f"f{i % 3}"
            )
        )
        rows.append(C.CalibrationRow(rng.normal(0, 3, 9), bool(rng.random() < 0.5), "noul", "rating", f"f{i % 3}"))
    cal = C.fit(rows, splits=["calib"], model_id="m")
    for key, qtype, mode in (("choice/letter/small", "choice", "letter"), ("noul/rating", "noul", "rating")):
        b = bucket(cal, key)
        assert b["status"] == "fitted"
        mine = [r for r in rows if r.qtype == qtype]
        out = [cal.readout(r.logits, qtype, mode) for r in mine]
        if qtype == "noul":
            probs, gold = M.binary_rows(out, [r.gold for r in mine])
        else:
            probs, gold = out, [r.gold for r in mine]
        assert M.nll(probs, gold) == pytest.approx(b["nll_after"], rel=1e-9)
        assert M.ece(probs, gold) == pytest.approx(b["ece_after"], rel=1e-9)
        assert b["nll_after"] <= b["nll_before"] + 1e-12


def test_bucket_under_50_rows_stays_at_one():
    rng = np.random.default_rng(4)
    few = choice_rows(rng, 49, 3.0, k=12)  # mid band, badly overconfident, 49 rows
    many = choice_rows(rng, 60, 3.0, k=4)  # small band, 60 rows
    cal = C.fit(few + many, splits=["calib"], model_id="m")
    mid = bucket(cal, "choice/letter/mid")
    assert mid["status"] == "too_few_rows" and mid["n_rows"] == 49
    assert mid["temperature"] == 1.0 and mid["ece_after"] == mid["ece_before"]
    assert cal.temperature("choice", "letter", 12) == 1.0  # not the unbanded or the small band's T
    assert bucket(cal, "choice/letter/small")["status"] == "fitted"
    assert cal.temperature("choice", "letter", 4) > 1.5
    assert bucket(cal, "choice/letter")["n_rows"] == 109
    # a band never seen in fitting falls back to the unbanded (choice, letter) fit
    assert cal.resolve("choice", "letter", 40) == ("choice/letter", bucket(cal, "choice/letter")["temperature"])
    # exactly 50 rows is enough
    cal50 = C.fit(choice_rows(rng, 50, 3.0, k=12), splits=["calib"], model_id="m")
    assert bucket(cal50, "choice/letter/mid")["status"] == "fitted"
    assert cal50.temperature("choice", "letter", 12) != 1.0
    # everything too small -> identity profile
    assert C.fit(few, splits=["calib"], model_id="m").is_identity


def test_fewer_than_three_families_keeps_row_weighting():
    rng = np.random.default_rng(5)
    rows = choice_rows(rng, 1000, 3.0, families=("big",)) + choice_rows(rng, 100, 1.0, families=("small",))
    b = bucket(C.fit(rows, splits=["calib"], model_id="m"), "choice/letter/small")
    assert b["weighting"] == "row" and b["selection"] == "fewer_than_3_families" and b["lofo_ece"] is None
    # the two weightings really differ: family weighting pulls towards the small family's T = 1
    assert b["temperature_row"] > b["temperature_family"] + 0.3
    assert b["temperature"] == b["temperature_row"]


def test_family_weighting_wins_when_one_family_dominates():
    # One huge family with T = 3 and three small ones with T = 1: a row-weighted fit on the
    # other families transfers badly to each small held-out family.
    rng = np.random.default_rng(6)
    rows = choice_rows(rng, 2000, 3.0, families=("huge",))
    for f in ("s1", "s2", "s3"):
        rows += choice_rows(rng, 120, 1.0, families=(f,))
    b = bucket(C.fit(rows, splits=["calib"], model_id="m"), "choice/letter/small")
    assert b["lofo_ece"]["family"] < b["lofo_ece"]["row"]
    assert b["weighting"] == "family" and b["temperature"] == b["temperature_family"]


def test_row_weighting_wins_when_a_small_family_is_an_outlier():
    rng = np.random.default_rng(7)
    rows = []
    for f in ("b1", "b2", "b3"):
        rows += choice_rows(rng, 500, 2.0, families=(f,))
    rows += choice_rows(rng, 60, 0.3, families=("odd",))
    b = bucket(C.fit(rows, splits=["calib"], model_id="m"), "choice/letter/small")
    assert b["lofo_ece"]["row"] < b["lofo_ece"]["family"]
    assert b["weighting"] == "row" and b["temperature"] == b["temperature_row"]


# --------------------------------------------------------------------------- files


def test_save_load_roundtrip_rotation_and_report(tmp_path):
    rng = np.random.default_rng(8)
    rows = choice_rows(rng, 200, 2.0) + binary_rows(rng, 30, 1.0)
    cal = C.fit(rows, splits=["banking77-train", "clinc150-val"], model_id="smollm2-135m", fit_date=DATE1)
    path = cal.save(tmp_path)
    assert path == tmp_path / "calibration.json"
    doc = json.loads(path.read_text())
    assert doc["model_id"] == "smollm2-135m" and doc["fit_date"] == "2025-01-02T03:04:05Z"
    assert doc["fitted_on"]["splits"] == ["banking77-train", "clinc150-val"] and doc["fitted_on"]["n_rows"] == 230
    by_key = {b["key"]: b for b in doc["buckets"]}
    assert set(by_key) == {"choice/letter", "choice/letter/small", "noul/binary"}
    assert by_key["noul/binary"]["n_rows"] == 30 and by_key["noul/binary"]["status"] == "too_few_rows"
    assert by_key["choice/letter/small"]["weighting"] in ("row", "family")
    report = (tmp_path / "calibration_report.md").read_text()
    assert "choice/letter/small" in report and f"{by_key['choice/letter/small']['ece_after']:.4f}" in report

    loaded = C.Calibration.load(tmp_path, model_id="smollm2-135m")
    assert loaded.to_dict() == cal.to_dict() and loaded.path == path
    assert loaded.temperature("choice", "letter", 4) == cal.temperature("choice", "letter", 4)
    assert json.loads(loaded.to_json()) == doc
    with pytest.raises(ValueError, match="other-model"):
        C.Calibration.load(path, model_id="other-model")

    # a second fit rotates the first profile (named by its fit date) instead of overwriting it
    cal2 = C.fit(choice_rows(rng, 100, 1.5), splits=["calib"], model_id="smollm2-135m", fit_date=DATE2)
    cal2.save(tmp_path)
    old = tmp_path / "calibration.20250102T030405Z.json"
    assert json.loads(old.read_text()) == doc
    assert (tmp_path / "calibration_report.20250102T030405Z.md").read_text() == report
    assert json.loads((tmp_path / "calibration.json").read_text())["fit_date"] == "2025-02-03T04:05:06Z"
    # same stamp again -> suffixed, nothing lost
    cal2.save(tmp_path)
    assert (tmp_path / "calibration.20250203T040506Z.json").exists()
    cal2.save(tmp_path)
    assert (tmp_path / "calibration.20250203T040506Z-1.json").exists()
    assert len(list(tmp_path.glob("calibration*.json"))) == 4


def test_load_or_identity_and_describe(tmp_path):
    cal = C.Calibration.load_or_identity(tmp_path, model_id="m")
    assert cal.is_identity and cal.describe()["calibrated"] is False
    assert cal.temperature("choice", "letter", 4) == 1.0
    C.Calibration(profile_doc()).save(tmp_path)
    d = C.Calibration.load_or_identity(tmp_path).describe()
    assert d["calibrated"] is True and d["temperatures"]["choice/letter/small"] == 2.0
    with pytest.raises(ValueError):
        C.Calibration({"format": "something-else", "version": 1})
    bad = profile_doc()
    bad["buckets"][0]["temperature"] = 0.0
    with pytest.raises(ValueError):
        C.Calibration(bad)


def test_a_failed_save_keeps_the_previous_profile(tmp_path, monkeypatch):
    """The old profile stays in place until the new one replaces it whole: a save that fails (a full
    disk) leaves a calibration.json, never none (a run without one is served uncalibrated)."""
    rng = np.random.default_rng(9)
    C.fit(choice_rows(rng, 200, 2.0), splits=["calib"], model_id="m", fit_date=DATE1).save(tmp_path)
    before = (tmp_path / "calibration.json").read_text()
    second = C.fit(choice_rows(rng, 200, 1.5), splits=["calib"], model_id="m", fit_date=DATE2)

    def full_disk(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(C.durable, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        second.save(tmp_path)
    assert (tmp_path / "calibration.json").read_text() == before
