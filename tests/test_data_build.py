"""Building the mixture offline from real local files: splits, questions, abstain rows, coverage,
mixture shares, determinism, length statistics and the eval export."""

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from lev_jax.data.build import BuildConfig, CoverageError, assemble, check_coverage, export_eval, read_split, write
from lev_jax.data.cli import main
from lev_jax.data.guard import default_eval_data_dir
from lev_jax.data.lengths import length_text, qwen_encode
from lev_jax.data.questions import make_question
from lev_jax.data.registry import LETTERS, REGISTRY, get_spec
from lev_jax.data.sources import SourceUnavailable, local_from_arg
from lev_jax.data.splits import HashRng
from lev_jax.data.testing import write_rotten_tomatoes_wheel

REPO = Path(__file__).resolve().parents[1]
EVAL = default_eval_data_dir()
pytestmark = pytest.mark.needs_shared(EVAL / "banking77-train.csv")  # skips without it; fails in CI
SOURCES = ["banking77", "clinc_oos", "rotten_tomatoes"]
LIMIT = 2500


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return write_rotten_tomatoes_wheel(tmp_path_factory.mktemp("wheels"), n=3000)


def _assemble(wheel, **cfg):
    local = {"rotten_tomatoes": local_from_arg(get_spec("rotten_tomatoes"), str(wheel))}
    return assemble(
        SOURCES, cfg=BuildConfig(limit_per_source=LIMIT, **cfg), local=local, use_hub=False, eval_data_dir=EVAL
    )


@pytest.fixture(scope="module")
def built(wheel, tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    res = _assemble(wheel)
    write(res, out)
    return res, out


@pytest.fixture(scope="module")
def layouts(wheel):
    return _assemble(wheel, schema_first_fraction=0.0), _assemble(wheel, schema_first_fraction=1.0)


def _all(res):
    return [r for rows in res.rows.values() for r in rows]


def test_split_disjointness_under_two_layouts(layouts):
    a, b = layouts
    assert {r["layout"] for r in _all(a)} == {"state_first"}
    assert {r["layout"] for r in _all(b)} == {"schema_first"}
    item_split = {}
    for res in (a, b):
        for split, rows in res.rows.items():
            for r in rows:
                for item in (r["item"], r.get("question_item")):
                    if item is not None:
                        assert item_split.setdefault(item, split) == split, "an underlying row is in two splits"
    for s in ("train", "calibration", "test"):  # layouts change no row's membership
        assert {r["uid"] for r in a.rows[s] if not r["abstain"]} == {r["uid"] for r in b.rows[s] if not r["abstain"]}
    # the split shares are the blake2b 80/10/10 within each source
    for name in SOURCES:
        sp = a.sources[name].split
        total = sum(sp.values())
        assert abs(sp["train"] / total - 0.8) < 0.04 and abs(sp["test"] / total - 0.1) < 0.03


def test_test_split_keeps_the_canonical_question(built):
    res, _ = built
    for r in res.rows["test"]:
        spec = REGISTRY[r["source"]]
        q = r["question"]
        assert r["canonical"] and not r["negated"] and not r["abstain"]
        assert q["instructions"] == spec.instructions[0]
        if spec.primitive == "choice":
            assert list(q["criteria"].items()) == [(o.key, o.description) for o in spec.options]
        else:
            assert q["criteria"] == {"true": spec.yes_no[0], "false": spec.yes_no[1]}


def test_calibration_varies_option_sets_not_wording(built):
    res, _ = built
    cal = res.rows["calibration"]
    bands = Counter((r["source"], r["band"]) for r in cal)
    for name in ("banking77", "clinc_oos"):
        for band in ("small", "mid", "large"):
            assert bands[(name, band)] > 0, (name, band)
    for r in cal:
        spec = REGISTRY[r["source"]]
        assert r["question"]["instructions"] == spec.instructions[0]
        if spec.primitive == "choice":
            assert r["target"] in r["question"]["criteria"]
            canon = {o.key: o.description for o in spec.options}
            assert all(canon[k] == d for k, d in r["question"]["criteria"].items())
    assert len({len(r["question"]["criteria"]) for r in cal if r["source"] == "clinc_oos"}) > 20


def test_train_option_sets(built):
    res, _ = built
    train = [r for r in res.rows["train"] if not r["abstain"]]
    for name in ("banking77", "clinc_oos"):
        spec = REGISTRY[name]
        rows = [r for r in train if r["source"] == name]
        full = [r for r in rows if r["full_options"]]
        assert 0.4 < len(full) / len(rows) < 0.6  # Mode B half the time
        for r in full:
            assert list(r["question"]["criteria"]) == list(spec.option_keys)
        for r in rows:
            assert r["target"] == r["label"] and r["target"] in r["question"]["criteria"]  # gold kept
            if not r["full_options"]:
                assert 15 <= r["n_options"] < len(spec.options)
        stripped = [r for r in rows if all(v is None for v in r["question"]["criteria"].values())]
        assert 0.2 < len(stripped) / len(rows) < 0.4
        assert len({r["question"]["instructions"] for r in rows}) == len(spec.instructions)
        cut = [list(r["question"]["criteria"]) for r in rows if not r["full_options"]]
        assert any(k != sorted(k, key=spec.option_keys.index) for k in cut)  # shuffled


def test_small_taxonomy_subsampling_keeps_gold_and_relabels_mcq():
    spec = get_spec("race")
    ex = {"label": "C", "options": ["w", "x", "y", "z"], "state": {"question": "?"}}
    sizes = Counter()
    for i in range(300):
        q = make_question(spec, ex, "train", HashRng("mcq", i))
        crit = q["question"]["criteria"]
        assert list(crit) == list(LETTERS[: len(crit)])
        assert crit[q["target"]] == "y"
        sizes[len(crit)] += 1
    assert set(sizes) == {2, 3, 4}


def test_negation_flips_targets(built):
    res, _ = built
    spec = get_spec("rotten_tomatoes")
    ex = {"label": True, "state": "A warm, witty film."}
    plain = make_question(spec, ex, "train", HashRng("n"), negate=False)
    negated = make_question(spec, ex, "train", HashRng("n"), negate=True)
    assert (plain["target"], negated["target"]) == (8, 0)
    assert negated["question"]["instructions"] in spec.negations
    if negated["question"]["criteria"] is not None:
        assert negated["question"]["criteria"] == {"true": spec.yes_no[1], "false": spec.yes_no[0]}
    noul = [r for r in res.rows["train"] if r["primitive"] == "noul" and not r["abstain"]]
    assert {r["target"] for r in noul} == {0, 8}
    for r in noul:
        assert r["target"] == (8 if r["label"] != r["negated"] else 0)
        assert (r["question"]["instructions"] in spec.negations) == r["negated"]
    share = sum(r["negated"] for r in noul) / len(noul)
    assert abs(share - spec.negation_fraction) < 0.04
    assert not any(r["negated"] for s in ("calibration", "test") for r in res.rows[s])


def test_abstain_rows_are_uniform_and_unrelated(built):
    res, _ = built
    train = res.rows["train"]
    abstain = [r for r in train if r["abstain"]]
    assert abs(len(abstain) / len(train) - 0.1) < 0.005
    states = defaultdict(set)
    for r in train:
        if not r["abstain"]:
            states[r["source"]].add(json.dumps(r["state"]))
    for r in abstain:
        n = len(r["target_dist"])
        assert r["target"] is None and r["label"] is None
        assert n == (9 if r["primitive"] == "noul" else len(r["question"]["criteria"]))
        assert len(set(r["target_dist"])) == 1 and abs(sum(r["target_dist"]) - 1.0) < 1e-9
        assert REGISTRY[r["state_source"]].topic != REGISTRY[r["source"]].topic
        assert json.dumps(r["state"]) in states[r["state_source"]]
    assert {r["source"] for r in abstain} == set(SOURCES)
    assert not any(r["abstain"] for s in ("calibration", "test") for r in res.rows[s])


def test_mixture_shares(built):
    res, _ = built
    regular = [r for r in res.rows["train"] if not r["abstain"]]
    intent = sum(r["source"] in ("banking77", "clinc_oos") for r in regular)
    assert abs(intent / len(regular) - 0.25) < 0.002
    per = Counter(r["source"] for r in regular)
    assert abs(per["banking77"] - per["clinc_oos"]) <= 1
    assert res.mixture["weights"] == {"intent": 0.25, "noul": 0.75}
    assert len({r["uid"] for r in regular}) == len(regular)  # no repeats without --n-examples


def test_n_examples_and_repeats(wheel):
    res = _assemble(wheel, n_examples=4000)
    train = res.rows["train"]
    assert len(train) == 4000 and sum(r["abstain"] for r in train) == 400
    assert res.mixture["repeat"] is True  # the synthetic Noul source is smaller than its share
    regular = [r for r in train if not r["abstain"]]
    assert len({r["uid"] for r in regular}) == len(regular)
    rt = [r for r in regular if r["source"] == "rotten_tomatoes"]
    assert max(r["repeat"] for r in rt) >= 1 and len(rt) == 2700


def test_coverage_catches_an_undersampled_taxonomy():
    with pytest.raises(CoverageError, match="banking77: .* never observed"):
        assemble(
            ["banking77"], cfg=BuildConfig(limit_per_source=60, tokenizer="chars"), use_hub=False, eval_data_dir=EVAL
        )
    row = lambda split, label: {
        "source": "rotten_tomatoes",
        "label": label,
        "abstain": False,  # noqa: E731
        "band": "small",
        "n_options": 2,
    }
    with pytest.raises(CoverageError, match="observed but not in train"):
        check_coverage(
            {"train": [row("train", True)], "calibration": [], "test": [row("test", False)]}, ["rotten_tomatoes"]
        )
    check_coverage(
        {"train": [row("train", True), row("train", False)], "calibration": [], "test": []}, ["rotten_tomatoes"]
    )  # Noul is exempt from the offered-label check


def test_unavailable_sources_are_skipped_or_required(wheel):
    res = assemble(
        ["rotten_tomatoes", "imdb"],
        cfg=BuildConfig(limit_per_source=300, tokenizer="chars"),
        local={"rotten_tomatoes": local_from_arg(get_spec("rotten_tomatoes"), str(wheel))},
        use_hub=False,
        eval_data_dir=EVAL,
    )
    assert "imdb" in res.skipped and "--offline" in res.skipped["imdb"]
    with pytest.raises(SourceUnavailable, match="imdb"):
        assemble(["imdb"], require=["imdb"], use_hub=False, eval_data_dir=EVAL)


def test_files_manifest_and_length_stats(built):
    res, out = built
    manifest = json.loads((out / "manifest.json").read_text())
    stats = json.loads((out / "length_stats.json").read_text())
    for s in ("train", "calibration", "test"):
        rows = read_split(out, s)
        assert rows == json.loads(json.dumps(res.rows[s]))
        assert manifest["splits"][s]["rows"] == len(rows)
        index = json.loads((out / f"{s}.index.json").read_text())
        assert index["readout"] == [r["readout"] for r in rows] and index["length"] == [r["length"] for r in rows]
        for name in SOURCES:
            st = stats[s][name]
            lens = sorted(r["length"] for r in rows if r["source"] == name and not r["abstain"])
            assert st["n"] == len(lens) and st["max"] == lens[-1] and lens[0] <= st["p95"] <= st["max"]
            assert abs(st["mean"] - sum(lens) / len(lens)) < 0.01
    enc = qwen_encode()
    for r in res.rows["train"][:50]:
        assert r["length"] == len(enc(length_text(r)))
    assert stats["train"]["clinc_oos"]["mean"] > stats["train"]["rotten_tomatoes"]["mean"]
    assert manifest["sources"]["banking77"]["origin"] == "local:banking77-train.csv"
    assert set(manifest["skipped"]) == set()


def test_byte_identical_rebuild_in_another_process(built, wheel, tmp_path):
    _, out = built
    env = dict(os.environ, PYTHONHASHSEED="4242", LEV_EVAL_DATA=str(EVAL))
    cmd = [
        sys.executable,
        "-m",
        "data",
        "build",
        "--out",
        str(tmp_path / "again"),
        "--offline",
        "--sources",
        ",".join(SOURCES),
        "--limit-per-source",
        str(LIMIT),
        "--local",
        f"rotten_tomatoes={wheel}",
    ]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "train:" in r.stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "again").iterdir())
    assert "train.array_record" in files and "length_stats.json" in files
    for name in files:
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_eval_export(built, tmp_path, capsys):
    res, out = built
    counts = export_eval(out, tmp_path / "eval")
    assert main(["eval", "--data", str(out), "--out", str(tmp_path / "eval2")]) == 0
    assert "wrote 3 task file(s)" in capsys.readouterr().out
    for name in SOURCES:
        assert (tmp_path / "eval" / f"{name}.json").read_bytes() == (tmp_path / "eval2" / f"{name}.json").read_bytes()
    test = res.rows["test"]
    assert counts == dict(Counter(r["source"] for r in test))
    for name in SOURCES:
        doc = json.loads((tmp_path / "eval" / f"{name}.json").read_text())
        assert list(doc) == ["questions", "items"] and list(doc["questions"]) == [name]
        q = doc["questions"][name]
        for item in doc["items"]:
            assert set(item) == {"state", "labels"}
            label = item["labels"][name]
            if q["type"] == "noul":
                assert isinstance(label, bool)
            else:
                assert isinstance(label, str) and label in q["criteria"]
    rt = json.loads((tmp_path / "eval" / "rotten_tomatoes.json").read_text())
    by_state = {r["state"]: r["label"] for r in test if r["source"] == "rotten_tomatoes"}
    assert all(by_state[i["state"]] == i["labels"]["rotten_tomatoes"] for i in rt["items"])
