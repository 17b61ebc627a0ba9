"""The train-data folder's sources (issue 43): each local spec reads its dataset's exact file format,
the test parts are refused, the general mixture holds every primitive, band and layout, and the
training renderer's per-example layout mix is a pure function of (seed, epoch, record), so a resumed
run renders exactly what the interrupted one would have.

Every file is a tiny fixture written in the dataset's own format (`LEV_TRAIN_DATA` points at it), so
nothing here needs ../shared."""

import csv
import json

import numpy as np
import pytest

from lev_jax.data import build as build_lib
from lev_jax.data.build import BuildConfig, assemble, write
from lev_jax.data.guard import ContaminationError
from lev_jax.data.registry import BANKING77_LABELS, REGISTRY, build_examples, get_spec
from lev_jax.data.sources import discover_local, iter_local, local_from_arg
from lev_jax.domain import band_of
from lev_jax.training.config import GENERAL_SOURCES

# the general preset's sources that read ../shared/train-data (the other two read ../shared/eval-data)
TRAIN_DATA_SOURCES = tuple(s for s in GENERAL_SOURCES if s not in ("banking77", "clinc_oos"))
WORDS = ["amber", "brisk", "cedar", "dune", "ember", "fjord", "grove", "haze", "iris", "jade", "kelp", "lark"]


def _w(i: int, k: int = 3) -> str:
    return " ".join(WORDS[(i * 7 + j * 5) % len(WORDS)] + str(i) for j in range(k))


def _choices(labels, texts):
    return [{"text": t, "label": lab} for lab, t in zip(labels, texts)]


def write_train_data(root):
    """A train-data folder in the published formats (and one test part, for the guard)."""
    (root / "sst2").mkdir(parents=True)
    quote = '"'  # GLUE's TSVs are unquoted: a sentence may open with a quote character
    rows = ["sentence\tlabel"] + [f"{quote if i % 9 == 0 else ''}{_w(i)} , fine film \t{i % 2}" for i in range(60)]
    (root / "sst2/train.tsv").write_text("\n".join(rows) + "\n")
    (root / "sst2/dev.tsv").write_text("sentence\tlabel\nheld out sentence \t1\n")
    (root / "sst5").mkdir()
    (root / "sst5/stsa.fine.train").write_text("".join(f"{i % 5} {_w(i)} review text\n" for i in range(80)))
    (root / "snips/train").mkdir(parents=True)
    intents = [o.key for o in get_spec("snips").options]
    (root / "snips/train/seq.in").write_text("".join(f"please {_w(i)} now \n" for i in range(70)))
    (root / "snips/train/label").write_text("".join(f"{intents[i % 7]}\n" for i in range(70)))
    for d in ("commonsenseqa", "arc", "openbookqa", "strategyqa", "qnli", "dbpedia_subset", "copa"):
        (root / d).mkdir()
    with open(root / "commonsenseqa/train_rand_split.jsonl", "w") as f:
        for i in range(40):
            q = {"question_concept": "x", "choices": _choices("ABCDE", [f"{_w(i + j, 1)} opt{j}" for j in range(5)])}
            f.write(
                json.dumps({"answerKey": "ABCDE"[i % 5], "id": f"c{i}", "question": {**q, "stem": f"Why {_w(i)}?"}})
            )
            f.write("\n")
    for name, labels in (("ARC-Easy-Train", "ABCD"), ("ARC-Challenge-Train", "1234")):
        with open(root / f"arc/{name}.jsonl", "w") as f:
            for i in range(30):
                q = {"stem": f"Which {_w(i)}?", "choices": _choices(labels, [f"{_w(i + j, 1)} a{j}" for j in range(4)])}
                f.write(json.dumps({"id": f"{name}{i}", "question": q, "answerKey": labels[i % 4]}) + "\n")
    with open(root / "openbookqa/train.jsonl", "w") as f:
        for i in range(40):
            q = {"stem": f"The {_w(i)} is", "choices": _choices("ABCD", [f"{_w(i + j, 1)} b{j}" for j in range(4)])}
            f.write(json.dumps({"id": f"o{i}", "question": q, "answerKey": "ABCD"[i % 4]}) + "\n")
    (root / "strategyqa/train.json").write_text(
        json.dumps(
            [
                {"qid": f"s{i}", "question": f"Is {_w(i)} true?", "answer": i % 2 == 0, "facts": ["f"]}
                for i in range(40)
            ],
            indent=4,
        )
    )
    rows = ["index\tquestion\tsentence\tlabel"] + [
        f"{i}\tWhat is {_w(i)}?\t{_w(i + 1)} is a thing.\t{'entailment' if i % 2 else 'not_entailment'}"
        for i in range(60)
    ]
    (root / "qnli/dev.tsv").write_text("\n".join(rows) + "\n")
    with open(root / "dbpedia_subset/train.csv", "w", newline="") as f:  # no header, 0-based classes
        csv.writer(f).writerows([[i % 14, f"{_w(i)} is an entry .\tsecond, sentence ."] for i in range(14 * 8)])
    with open(root / "copa/train.jsonl", "w") as f:
        for i in range(32):
            rec = {"premise": f"The {_w(i)} fell.", "choice1": f"{_w(i, 1)} one", "choice2": f"{_w(i, 1)} two"}
            f.write(json.dumps({**rec, "question": ("cause", "effect")[i % 2], "label": i % 2, "idx": i}) + "\n")
    return root


def write_eval_data(root):
    """The eval-data folder's two allowed files, every intent present (tiny, synthetic)."""
    root.mkdir(parents=True)
    with open(root / "banking77-train.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "category"])
        w.writerows([[f"bank {_w(i * 77 + k)} query", lab] for i in range(8) for k, lab in enumerate(BANKING77_LABELS)])
    intents = [o.key for o in get_spec("clinc_oos").options if o.key != "oos"]
    train = [[f"clinc {_w(i * 151 + k)} ask", lab] for i in range(8) for k, lab in enumerate(intents)]
    oos = [[f"oos {_w(i)} thing", "oos"] for i in range(8)]
    (root / "clinc150-small.json").write_text(json.dumps({"train": train, "oos_train": oos, "test": []}))
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("shared")
    return write_train_data(base / "train-data"), write_eval_data(base / "eval-data")


@pytest.fixture(autouse=True)
def _train_data(folders, monkeypatch):
    monkeypatch.setenv("LEV_TRAIN_DATA", str(folders[0]))


def _examples(name):
    spec = get_spec(name)
    found = discover_local(spec)
    assert found is not None, name
    return list(build_examples(spec, iter_local(found), found.label_map))


def test_every_train_data_spec_reads_its_published_format():
    ex = {n: _examples(n) for n in TRAIN_DATA_SOURCES}
    # GLUE TSV: a sentence that opens with a quote stays one row (csv quoting would merge lines)
    assert len(ex["sst2"]) == 60 and ex["sst2"][0]["state"].startswith('"') and ex["sst2"][1]["label"] == "positive"
    assert ex["sst2_positive"][1]["label"] is True and ex["sst2_positive"][0]["label"] is False
    assert [e["label"] for e in ex["sst5"][:5]] == [0, 1, 2, 3, 4] and ex["sst5"][0]["state"].endswith("review text")
    assert [e["label"] for e in ex["sst5_3"][:5]] == [0, 0, 1, 2, 2]
    assert len(ex["snips"]) == 70 and ex["snips"][1]["label"] == "BookRestaurant"
    assert ex["snips"][0]["state"] == f"please {_w(0)} now"
    # nested JSONL questions: the stem, the choices in order, the gold letter
    cqa = ex["commonsense_qa"][2]
    assert cqa["state"] == {"question": f"Why {_w(2)}?"} and cqa["label"] == "C" and len(cqa["options"]) == 5
    assert ex["arc_challenge"][1]["label"] == "B" and len(ex["ai2_arc"]) == 30  # ARC's "1".."4" answer keys too
    assert ex["openbookqa"][3]["label"] == "D" and len(ex["openbookqa_correct"]) == 40
    assert len(ex["strategyqa"]) == 40 and ex["strategyqa"][0]["label"] is True
    assert ex["qnli"][1]["state"] == {"question": f"What is {_w(1)}?", "sentence": f"{_w(2)} is a thing."}
    assert ex["qnli"][1]["label"] is True and ex["qnli"][0]["label"] is False
    assert ex["dbpedia_subset"][2]["label"] == "artist" and "\t" in ex["dbpedia_subset"][2]["state"]  # 0-based
    copa = ex["copa"][1]
    assert copa["state"] == {"passage": f"The {_w(1)} fell.", "question": "What happened as a result?"}
    assert copa["options"] == [f"{_w(1, 1)} one", f"{_w(1, 1)} two"] and copa["label"] == "B"


def test_a_train_data_test_part_is_refused(folders):
    dev = folders[0] / "sst2/dev.tsv"
    local = local_from_arg(get_spec("sst2"), str(dev), {"format": "glue_tsv"})
    with pytest.raises(ContaminationError, match="train-data test part sst2/dev.tsv"):
        assemble(["sst2"], local={"sst2": local}, use_hub=False, eval_data_dir=folders[1])


def test_every_spec_names_its_licence():
    from lev_jax.data.registry import LICENCES

    for name in TRAIN_DATA_SOURCES:
        spec = REGISTRY[name]
        assert spec.local is not None and spec.local.locator.startswith("train-data:"), name
        assert LICENCES.get(spec.dataset), name


@pytest.fixture(scope="module")
def mixture(folders, tmp_path_factory):
    import os

    os.environ["LEV_TRAIN_DATA"] = str(folders[0])  # module scope: monkeypatch is per test
    try:
        res = assemble(
            ["banking77", "clinc_oos", *TRAIN_DATA_SOURCES],
            cfg=BuildConfig(tokenizer="chars", n_examples=3000),  # the intent quota covers every intent
            use_hub=False,
            require=["banking77", "clinc_oos", *TRAIN_DATA_SOURCES],
            eval_data_dir=folders[1],
        )
    finally:
        del os.environ["LEV_TRAIN_DATA"]
    out = tmp_path_factory.mktemp("mix")
    write(res, out)
    return res, out


def test_the_general_mixture_holds_every_primitive_band_layout_and_augmentation(mixture):
    res, _ = mixture
    train = res.rows["train"]
    assert {r["primitive"] for r in train} == {"choice", "score", "noul"}
    assert {r["source"] for r in train} == {"banking77", "clinc_oos", *TRAIN_DATA_SOURCES}
    assert {band_of(r["n_options"]) for r in train if r["primitive"] == "choice"} == {"small", "mid", "large"}
    assert {r["layout"] for r in train} == {"state_first", "schema_first"}
    assert any(r["abstain"] for r in train) and any(r["negated"] for r in train if r["primitive"] == "noul")
    choices = [r for r in train if r["primitive"] == "choice" and not r["abstain"] and REGISTRY[r["source"]].options]
    canon = {n: [o.key for o in REGISTRY[n].options] for n in {r["source"] for r in choices}}
    # option subsets, shuffled orders, descriptions on and off, paraphrased instructions
    assert any(r["n_options"] < len(canon[r["source"]]) for r in choices)
    assert any(
        list(r["question"]["criteria"]) != [k for k in canon[r["source"]] if k in r["question"]["criteria"]]
        for r in choices
    )
    assert {all(d is None for d in r["question"]["criteria"].values()) for r in choices} == {True, False}
    assert len({r["question"]["instructions"] for r in train if r["source"] == "sst2"}) > 1
    cal = res.rows["calibration"]
    assert {r["primitive"] for r in cal} == {"choice", "score", "noul"}


def test_the_layout_mix_is_both_layouts_and_the_same_after_a_resume(mixture):
    from lev_jax import testing
    from lev_jax.readout import Planner
    from lev_jax.training import batches, config, loop

    _, data_dir = mixture
    bb = testing.tiny_backbone("llama")
    cfg = config.resolve(
        "general", {"batch_size": 4, "data": str(data_dir), "question_group_min": 4, "window_batches": 2}
    )
    planners = {
        lay: Planner(bb.tokenizer, layout=lay, option_averaging=False, mode_b=True)
        for lay in ("state_first", "schema_first")
    }

    def renderer():
        return batches.Renderer(
            planners[cfg.layout], planners=planners, mix=cfg.layouts, large_layout=cfg.large_layout, seed=cfg.seed
        )

    def seen(b):
        return [
            (e.layout, e.source, tuple(e.prefix), tuple(map(tuple, (r.tokens for r in e.rows)))) for e in b["examples"]
        ]

    it = loop.data_iterator(cfg, data_dir, renderer())
    first = [seen(next(it)) for _ in range(3)]
    state = it.get_state()
    after = [seen(next(it)) for _ in range(4)]
    resumed = loop.data_iterator(cfg, data_dir, renderer())
    resumed.set_state(state)
    assert [seen(next(resumed)) for _ in range(4)] == after
    layouts = [x[0] for b in first + after for x in b]
    assert set(layouts) == {"state_first", "schema_first"}
    # large taxonomies schema first always (their options block is the batch's shared prefix)
    r = renderer()
    rows = build_lib.read_split(data_dir, "train")
    for i, rec in enumerate(rows[:400]):
        lay = r.layout_of(rec, 0, i)
        if rec["question"]["type"] == "choice" and rec["n_options"] > 26:
            assert lay == "schema_first"
        assert lay == renderer().layout_of(rec, 0, i)  # a pure function of (seed, epoch, record)
    small = [(i, rec) for i, rec in enumerate(rows[:400]) if rec["n_options"] <= 26]
    by_epoch = np.array([[r.layout_of(rec, e, i) == "schema_first" for i, rec in small] for e in range(4)])
    assert 0.3 < by_epoch.mean() < 0.7 and (by_epoch.min(0) != by_epoch.max(0)).any()  # redrawn per epoch
