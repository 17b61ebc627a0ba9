"""The source registry and the record -> example builders (on hub-shaped records, offline)."""

from collections import Counter
from dataclasses import replace

import pytest

from lev_jax.data.guard import resolve_eval_subset
from lev_jax.data.questions import QuestionConfig, make_question
from lev_jax.data.registry import (
    LETTERS,
    REGISTRY,
    LabelError,
    LocalSpec,
    Option,
    SourceSpec,
    SpecError,
    build_examples,
    canonical_label,
    get_spec,
    summary,
)
from lev_jax.data.sources import map_roles
from lev_jax.data.splits import HashRng
from lev_jax.domain import BAND_RANGES, RATING_NO, RATING_YES

ISSUE_CHOICE = {
    "ag_news",
    "emotion",
    "dbpedia_14",
    "race",
    "commonsense_qa",
    "sciq",
    "openbookqa",
    "ai2_arc",
    "snli",
    "anli",
    "nli_fever",
    "snips",
    "banking77",
    "clinc_oos",
}
ISSUE_SCORE = {"sst5", "yelp_review_full", "ultrafeedback"}
# issue 43: the train-data folder's sources the registry lacked (recasts beside their base)
TRAIN_DATA_CHOICE = {"sst2", "dbpedia_subset", "arc_challenge", "copa"}
TRAIN_DATA_SCORE = {"sst5_3"}
TRAIN_DATA_NOUL = {"sst2_positive", "qnli"}
ISSUE_NOUL = {
    "imdb",
    "rotten_tomatoes",
    "mrpc",
    "qqp",
    "parade",
    "strategyqa",
    "race_correct",
    "sciq_correct",
    "openbookqa_correct",
    "toxic_chat",
    "toxigen",
    "beavertails",
}


def test_registry_has_36_sources_over_31_datasets():
    assert summary() == {"sources": 36, "datasets": 31, "by_primitive": {"choice": 18, "score": 4, "noul": 14}}
    by = {p: {s.name for s in REGISTRY.values() if s.primitive == p} for p in ("choice", "score", "noul")}
    assert by == {
        "choice": ISSUE_CHOICE | TRAIN_DATA_CHOICE,
        "score": ISSUE_SCORE | TRAIN_DATA_SCORE,
        "noul": ISSUE_NOUL | TRAIN_DATA_NOUL,
    }
    assert len(get_spec("banking77").options) == 77
    assert len(get_spec("clinc_oos").options) == 151
    assert get_spec("ai2_arc").config == "ARC-Easy"
    assert {s.bucket for s in REGISTRY.values() if s.name in ("banking77", "clinc_oos")} == {"intent"}
    # recast sources share their base dataset (and with it the split of every underlying item)
    assert get_spec("race_correct").dataset == "race" and get_spec("sciq_correct").dataset == "sciq"


def test_every_source_has_paraphrases_and_every_noul_a_negation():
    for s in REGISTRY.values():
        if s.aspect_instructions:
            assert all(len(v) >= 3 for v in s.aspect_instructions.values())
        else:
            assert len(set(s.instructions)) >= 3, s.name
        if s.primitive == "noul":
            assert s.negations and not set(s.negations) & set(s.instructions), s.name
            assert s.yes_no and s.yes_no[0] != s.yes_no[1]
        assert resolve_eval_subset(s.name) is None and resolve_eval_subset(s.hub_id) is None, s.name


def _one(spec_name, hub_records, **kw):
    """Hub-shaped records through the spec's column map, as the hub loader does."""
    spec = get_spec(spec_name)
    return list(build_examples(spec, [map_roles(r, spec.columns) for r in hub_records], **kw))


def test_classify_maps_hub_label_names_and_rejects_unknown_labels():
    exs = _one("ag_news", [{"text": "Stocks rally", "label": "Business"}, {"text": "Cup final", "label": 1}])
    assert [e["label"] for e in exs] == ["business", "sports"]
    with pytest.raises(LabelError):
        _one("banking77", [{"text": "hi", "label": "not_an_intent"}])
    nli = _one(
        "snli",
        [
            {"premise": "A man sleeps.", "hypothesis": "A man is awake.", "label": 2},
            {"premise": "x y", "hypothesis": "z w", "label": -1},
        ],
    )
    assert [e["label"] for e in nli] == ["contradiction"]  # -1 (no gold) dropped
    assert nli[0]["state"] == {"premise": "A man sleeps.", "hypothesis": "A man is awake."}


def test_noul_labels_are_ratings_0_and_8_never_1():
    spec = get_spec("imdb")
    for raw, rating in [(1, RATING_YES), (0, RATING_NO), ("pos", RATING_YES)]:
        ex = _one("imdb", [{"text": "some review text", "label": raw}])[0]
        q = make_question(spec, ex, "test", HashRng("x"))
        assert q["target"] == rating and q["target"] in (0, 8)
        assert q["target_dist"][rating] == 1.0 and len(q["target_dist"]) == 9


def test_mcq_formats():
    race = _one(
        "race",
        [
            {
                "article": "Tom has a red bike.",
                "question": "What colour is the bike?",
                "options": ["blue", "red", "green", "black"],
                "answer": "B",
            }
        ],
    )[0]
    assert race["label"] == "B" and race["options"][1] == "red" and race["state"]["passage"]
    arc = _one(
        "ai2_arc",
        [
            {
                "question": "Which is a metal?",
                "answerKey": "3",
                "choices": {"label": ["1", "2", "3", "4"], "text": ["wood", "glass", "iron", "salt"]},
            }
        ],
    )[0]
    assert arc["options"][LETTERS.index(arc["label"])] == "iron"
    sciq_golds = set()
    for i in range(40):
        ex = _one(
            "sciq",
            [
                {
                    "question": f"q{i}?",
                    "correct_answer": "yes",
                    "distractor1": "a",
                    "distractor2": "b",
                    "distractor3": "c",
                    "support": "",
                }
            ],
        )[0]
        assert ex["options"][LETTERS.index(ex["label"])] == "yes"
        sciq_golds.add(ex["label"])
    assert len(sciq_golds) > 1  # the correct answer is not always in the same place


def test_answer_correct_recast_and_race_split_unit_is_the_article():
    recs = [
        {"article": "Shared article.", "question": f"Q{i}?", "options": ["w", "x", "y", "z"], "answer": "C"}
        for i in range(60)
    ]
    exs = _one("race_correct", recs)
    assert {e["label"] for e in exs} == {True, False}
    for e in exs:
        assert (e["state"]["proposed_answer"] == "y") == e["label"]
    assert {e["unit"] for e in exs} == {(0, "Shared article.")}
    assert {e["unit"] for e in _one("race", recs)} == {(0, "Shared article.")}


def test_qqp_yields_word_swapped_negatives():
    recs = [
        {
            "question1": f"How do I convert dollars into euros number {i}?",
            "question2": f"What is the way to convert dollars into euros quickly {i}?",
            "label": 1,
        }
        for i in range(50)
    ]
    exs = _one("qqp", recs)
    swaps = [e for e in exs if e["variant"] == "swap"]
    assert 5 <= len(swaps) <= 30
    originals = {e["position"]: e for e in exs if e["variant"] == ""}
    for s in swaps:
        o = originals[s["position"]]
        assert s["label"] is False and o["label"] is True and s["unit"] == o["unit"]
        assert s["state"]["question2"] != o["state"]["question2"]
        assert sorted(s["state"]["question2"].split()) == sorted(o["state"]["question2"].split())


def test_ultrafeedback_score_rows_per_completion():
    comp = lambda r: {
        "response": f"answer {r}",
        "annotations": {  # noqa: E731
            a: {"Rating": str(r)} for a in ("helpfulness", "honesty", "instruction_following", "truthfulness")
        },
    }
    rec = {"instruction": "Explain gravity.", "completions": [comp(5), comp(1), comp("N/A"), comp(3)]}
    exs = _one("ultrafeedback", [rec])
    assert [e["label"] for e in exs] == [4, 0, 2]
    assert all(e["aspect"] in get_spec("ultrafeedback").aspect_instructions for e in exs)
    q = make_question(get_spec("ultrafeedback"), exs[0], "test", HashRng("x"))
    assert q["question"]["type"] == "score" and len(q["question"]["criteria"]) == 5


def test_toxigen_thresholds_and_beavertails_polarity():
    spec = get_spec("toxigen")
    assert [canonical_label(spec, v) for v in (4.5, 1.2, 3.0)] == [True, False, None]
    exs = _one("toxigen", [{"text": "t1", "toxicity_human": 4.7}, {"text": "t2", "toxicity_human": 3.0}])
    assert [e["label"] for e in exs] == [True]
    bt = _one("beavertails", [{"prompt": "p", "response": "r", "is_safe": True}])[0]
    assert bt["label"] is True  # yes = safe
    assert get_spec("beavertails").negation_fraction == 0.5


def test_a_bad_spec_fails_where_it_is_defined():
    base = dict(
        name="x",
        dataset="x",
        hub_id="org/x",
        config=None,
        hub_split="train",
        primitive="choice",
        columns={"text": "text", "label": "label"},
        options=_opts_ab(),
        instructions=("Which?",),
    )
    assert SourceSpec(kind="classify", **base).bucket == "choice"  # the valid spec, for contrast
    with pytest.raises(SpecError, match="source 'x': unknown kind 'clasify'"):
        SourceSpec(kind="clasify", **base)
    with pytest.raises(SpecError, match="kind 'noul' builds noul questions, not choice"):
        SourceSpec(kind="noul", **base)
    with pytest.raises(SpecError, match="columns lack role.*label"):
        SourceSpec(kind="classify", **dict(base, columns={"text": "text"}))
    with pytest.raises(SpecError, match="needs mcq_format"):
        SourceSpec(kind="mcq", **dict(base, options=(), columns={"question": "q", "choices": "c", "answer": "a"}))
    with pytest.raises(SpecError, match="needs negations"):
        replace(get_spec("imdb"), negations=())
    with pytest.raises(SpecError, match="locator"):
        LocalSpec("somewhere:file.csv", {"text": "text", "label": "label"})


def _opts_ab():
    return (Option("a", None), Option("b", None))


def test_unusable_records_are_dropped_and_counted_by_reason():
    spec = get_spec("mrpc")
    dropped = Counter()
    recs = [
        {"sentence1": "A cat sat.", "sentence2": "A cat was sitting.", "label": 1},
        {"sentence1": "No second sentence.", "label": 0},  # a JSONL row without a field
        {"sentence1": "x", "sentence2": "y"},
        {"sentence1": "a", "sentence2": "b", "label": -1},  # no gold label
        {"sentence1": None, "sentence2": "b", "label": 0},
    ]
    exs = list(build_examples(spec, recs, dropped=dropped))
    assert [e["position"] for e in exs] == [0]
    assert dropped == {
        "missing field 'sentence2'": 1,
        "missing field 'label'": 1,
        "no gold label": 1,
        "empty field 'sentence1'": 1,
    }
    mcq = Counter()
    bad = [
        {"question": "Q?", "choices": "not a mapping", "answer": "A"},
        {"question": "Q?", "choices": {"label": ["A", "B"], "text": ["x", "y"]}, "answer": "C"},
    ]
    assert list(build_examples(get_spec("ai2_arc"), bad, dropped=mcq)) == []
    assert mcq == {"malformed field 'choices'": 1, "answer not among the choices": 1}


def test_programmer_errors_propagate_instead_of_dropping_rows():
    def broken(raw):  # a label function with a bug: str + int
        return raw + 1

    spec = replace(get_spec("strategyqa"), label_fn=broken)
    with pytest.raises(TypeError):
        list(build_examples(spec, [{"question": "Is water wet?", "label": "true"}]))


def test_large_taxonomy_subsets_capped_leave_only_full_canonical_sets_in_the_large_band():
    # the general preset's build: a subset of 27+ shuffled options is a question no other record
    # asks (no shared prefix in a question-grouped batch); capped at the mid band, every large-band
    # train question is the full set in canonical order, and "5 of 77" subsets are still drawn
    spec = get_spec("banking77")
    canonical = [o.key for o in spec.options]
    ex = {"text": "my card was charged twice", "label": canonical[40]}
    top = BAND_RANGES["mid"][1]
    capped = QuestionConfig(full_set_fraction=0.5, min_large_options=2, max_subset_options=top)
    sizes = Counter()
    for i in range(300):
        q = make_question(spec, ex, "train", HashRng("cap", i), capped)
        keys = list(q["question"]["criteria"])
        assert q["target"] in keys
        assert len(keys) <= top or keys == canonical
        sizes["full" if keys == canonical else "small" if len(keys) <= 8 else "mid"] += 1
    assert sizes["full"] > 100 and sizes["small"] > 20 and sizes["mid"] > 50
    uncapped = QuestionConfig(full_set_fraction=0.5, min_large_options=2)
    qs = [make_question(spec, ex, "train", HashRng("cap", i), uncapped)["question"] for i in range(300)]
    assert any(top < len(q["criteria"]) < len(canonical) for q in qs)  # what the cap removes
