"""The contamination guard: aliases, eval-data files, content copies, row overlap, and that it runs first."""

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lev_jax.data import sources as sources_mod
from lev_jax.data.build import BuildConfig, assemble
from lev_jax.data.cli import EXIT_CONTAMINATION, main
from lev_jax.data.guard import (
    EVAL_SUBSETS,
    ContaminationError,
    Guard,
    check_sources_file,
    default_eval_data_dir,
    resolve_eval_subset,
)
from lev_jax.data.registry import REGISTRY, get_spec
from lev_jax.data.sources import LocalSource, local_from_arg

REPO = Path(__file__).resolve().parents[1]
EVAL = default_eval_data_dir()
needs_eval_data = pytest.mark.needs_shared(EVAL / "banking77-test.csv")  # skips without it; fails in CI

ISSUE_ALIASES = ["tals/vitaminc", "paws-x", "google/boolq", "nvidia/HelpSteer2", "rajpurkar/squad_v2"]
MORE_ALIASES = {
    "vitaminc": ["VitaminC", "tals/vitaminc:v1"],
    "massive": ["AmazonScience/massive", "massive:en-US", "massive/de-DE", "mteb/amazon_massive_intent", "slurp"],
    "boolq": ["super_glue:boolq", "aps/super_glue/boolq", "BoolQ"],
    "helpsteer2": ["HelpSteer2", "helpsteer-2"],
    "aegis2": ["nvidia/Aegis-AI-Content-Safety-Dataset-2.0", "aegis2"],
    "paws": ["google-research-datasets/paws:labeled_final", "PAWS-X", "paws_x"],
    "squad2": ["squad_v2", "SQuAD2.0", "squad"],
    "multinli": ["nyu-mll/multi_nli", "nyu-mll/glue:mnli", "MultiNLI", "glue/mnli_matched"],
    "civil_comments": ["google/civil_comments", "jigsaw_unintended_bias"],
    "summeval": ["mteb/summeval", "SummEval:relevance", "summeval:consistency"],
    "pubmedqa": ["qiaojin/PubMedQA", "pubmed_qa", "bigbio/pubmed_qa"],
    "hwu64": ["hwu64", "DeepPavlov/hwu_intent_classification", "HWU64"],
}


@pytest.mark.parametrize("alias", ISSUE_ALIASES)
def test_guard_catches_issue_aliases(alias):
    with pytest.raises(ContaminationError) as e:
        Guard().enforce(Guard().check_line(alias))
    assert alias in str(e.value)


@pytest.mark.parametrize("subset,aliases", sorted(MORE_ALIASES.items()))
def test_every_eval_subset_resolves(subset, aliases):
    assert subset in EVAL_SUBSETS
    for a in aliases:
        assert resolve_eval_subset(a) == subset, a


def test_training_sources_and_lookalikes_pass():
    g = Guard()
    for spec in REGISTRY.values():
        assert g.check_spec(spec) == [], spec.name
    for ok in [
        "facebook/anli",
        "nyu-mll/glue:mrpc",
        "nyu-mll/glue:qqp",
        "massively_multilingual_x",
        "tasksource/parade",
        "pietrolesci/nli_fever",
        "allenai/sciq",
    ]:
        assert resolve_eval_subset(ok) is None, ok
    # a registry spec that points at an evaluation set is refused
    bad = get_spec("snli").__class__(
        **{**get_spec("snli").__dict__, "name": "mnli_copy", "hub_id": "nyu-mll/glue", "config": "mnli"}
    )
    assert g.check_spec(bad)


@needs_eval_data
def test_guard_treats_the_eval_data_test_parts_as_evaluation():
    g = Guard(EVAL)
    refused = [
        EVAL / "banking77-test.csv",
        EVAL / "boolq-dev.jsonl",
        f"{EVAL / 'clinc150-small.json'}#test",
        f"{EVAL / 'clinc150-small.json'}#oos_test",
        f"{EVAL / 'clinc150-small.json'}#train,test",
        EVAL / "clinc150-small.json",
    ]  # no parts named: all parts, test included
    for line in refused:
        assert g.check_line(str(line)), line
    allowed = [
        EVAL / "banking77-train.csv",
        f"{EVAL / 'clinc150-small.json'}#train,oos_train",
        f"{EVAL / 'clinc150-small.json'}#val,oos_val",
    ]
    for line in allowed:
        assert g.check_line(str(line)) == [], line
    # every data file in the folder that the README does not allow is evaluation data
    names = {p.name for p in g.eval_files()}
    assert {"banking77-test.csv", "boolq-dev.jsonl"} <= names
    assert "banking77-train.csv" not in names


@needs_eval_data
def test_guard_catches_renamed_copies_by_content(tmp_path):
    g = Guard(EVAL)
    copy = tmp_path / "my_banking_data.csv"
    shutil.copy(EVAL / "banking77-test.csv", copy)
    assert any("banking77-test.csv" in v.reason for v in g.check_path(copy))
    clinc = tmp_path / "intents.json"
    shutil.copy(EVAL / "clinc150-small.json", clinc)
    assert g.check_path(clinc, ("test",)) and g.check_path(clinc, ("train",)) == []


@needs_eval_data
def test_sources_file_check_command(tmp_path, capsys):
    clean = tmp_path / "clean.txt"
    clean.write_text("# training sources\nbanking77\nfacebook/anli\n" + f"{EVAL / 'banking77-train.csv'}\n")
    assert check_sources_file(clean, Guard(EVAL)) == ["banking77", "facebook/anli", str(EVAL / "banking77-train.csv")]
    assert main(["check", str(clean), "--eval-data", str(EVAL)]) == 0
    dirty = tmp_path / "sources.txt"
    dirty.write_text("ag_news\ntals/vitaminc\n" + f"{EVAL / 'boolq-dev.jsonl'}\n")
    assert main(["check", str(dirty), "--eval-data", str(EVAL)]) == EXIT_CONTAMINATION
    err = capsys.readouterr().err
    assert "tals/vitaminc" in err and "boolq-dev.jsonl" in err and "ag_news" not in err
    # the real entry point
    r = subprocess.run(
        [sys.executable, "-m", "data", "check", str(dirty), "--eval-data", str(EVAL)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == EXIT_CONTAMINATION and "vitaminc" in r.stderr


@needs_eval_data
def test_guard_runs_before_anything_loads(monkeypatch):
    loaded = []
    monkeypatch.setattr(sources_mod, "iter_local", lambda src: loaded.append(src) or iter(()))
    monkeypatch.setattr(sources_mod, "iter_hub", lambda spec: loaded.append(spec) or iter(()))
    test_file = local_from_arg(get_spec("banking77"), str(EVAL / "banking77-test.csv"))
    with pytest.raises(ContaminationError) as e:
        assemble(
            ["rotten_tomatoes", "clinc_oos", "banking77"],
            local={"banking77": test_file},
            use_hub=False,
            eval_data_dir=EVAL,
        )
    assert "banking77-test.csv" in str(e.value)
    assert loaded == []
    clinc_test = LocalSource(str(EVAL / "clinc150-small.json"), {"text": 0, "label": 1}, parts=("train", "oos_test"))
    with pytest.raises(ContaminationError, match="oos_test"):
        assemble(["clinc_oos"], local={"clinc_oos": clinc_test}, use_hub=False, eval_data_dir=EVAL)
    assert loaded == []


@needs_eval_data
def test_row_level_decontamination(tmp_path):
    with open(EVAL / "banking77-test.csv", newline="") as f:
        test_rows = list(csv.DictReader(f))
    with open(EVAL / "banking77-train.csv", newline="") as f:
        train_rows = list(csv.DictReader(f))[::6]  # the file is sorted by label

    def write(name, rows):
        p = tmp_path / name
        with open(p, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["text", "category"])
            w.writeheader()
            w.writerows(rows)
        return p

    # a re-encoded copy of the test set (different bytes, same rows) is refused outright
    disguised = write("banking77-train.csv", [dict(r, text=r["text"].upper() + " ") for r in test_rows[:600]])
    with pytest.raises(ContaminationError, match="rows of the evaluation sets"):
        assemble(
            ["banking77"],
            local={"banking77": local_from_arg(get_spec("banking77"), str(disguised))},
            use_hub=False,
            eval_data_dir=EVAL,
            cfg=BuildConfig(tokenizer="chars"),
        )
    # a few leaked test rows in a training file are dropped and counted
    leaky = write("banking77-train.csv", train_rows + test_rows[:10])
    res = assemble(
        ["banking77"],
        local={"banking77": local_from_arg(get_spec("banking77"), str(leaky))},
        use_hub=False,
        eval_data_dir=EVAL,
        cfg=BuildConfig(tokenizer="chars", abstain_fraction=0.0),
    )
    assert res.sources["banking77"].decontaminated >= 10
    states = {r["state"] for rows in res.rows.values() for r in rows}
    assert not states & {r["text"] for r in test_rows[:10]}


def test_an_unreadable_eval_file_stops_decontamination_instead_of_being_skipped(tmp_path):
    (tmp_path / "broken-dev.jsonl").write_text('{"question": "fine"}\n{not json\n')
    with pytest.raises(ValueError, match="broken-dev.jsonl cannot be read for decontamination"):
        Guard(tmp_path).eval_texts()
