"""predict() on the embedded model answers a fixed request set exactly as the engine did before the
readout package (tests/data/predict_golden.json, written by the engine at the commit it names).

Everything but the probabilities must match exactly (choices, keys, legends, usage); probabilities to
5e-5. Bit-for-bit equality cannot be asked across hosts: XLA:CPU's generated code depends on the CPU's
vector extensions and thread count, which a "model name" does not tell apart (two hosts both reporting
"AMD EPYC" differed by up to 4.7e-6 on this request set: fp32 rounding through 30 layers). A readout
change that matters (a prompt token, a label code, a calibration temperature) moves them by 1e-3 or more."""

import json
from pathlib import Path

import pytest

import lev_jax

GOLDEN = json.loads((Path(__file__).parent / "data" / "predict_golden.json").read_text())

STATES = [
    "My parcel never arrived and I was charged twice! I want my money back now.",
    {"customer": "Ann", "message": "The app crashes every time I open the settings page.", "plan": "pro"},
    [{"user": "Bo", "text": "Loved the concert, best night ever"}, {"user": "Cy", "text": "meh"}],
]


def _questions(yes_key, no_key):
    return {
        "intent": {
            "type": "choice",
            "instructions": "What does the customer want?",
            "criteria": {"refund": "money back", "delivery": "a late parcel", "other": None},
        },
        "topic": {
            "type": "choice",
            "instructions": "Which team should handle this?",
            "criteria": {f"team_{i}": f"handles area {i}" for i in range(12)},
        },
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high", "critical"]},
        "angry": {"type": "noul", "instructions": "Is the customer angry?"},
        "bug": {
            "type": "noul",
            "instructions": "Is this a bug report?",
            "criteria": {yes_key: "the software misbehaves", no_key: "anything else"},
        },
    }


TOL = 5e-5


def _compare(got, want):
    assert got["usage"] == want["usage"]
    for qid, a in want["answers"].items():
        b = got["answers"][qid]
        assert b.keys() == a.keys() and b.get("choice") == a.get("choice")
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, abs=TOL)
            elif k == "probabilities":
                assert b[k].keys() == v.keys() and all(b[k][o] == pytest.approx(p, abs=TOL) for o, p in v.items())
            else:
                assert b[k] == v, (qid, k)


@pytest.mark.parametrize("noul_readout", ["binary", "rating"])
def test_embedded_answers_are_unchanged(embedded, noul_readout):
    engine = lev_jax.load(embedded, noul_readout=noul_readout)  # the shipped calibration profile, as load() picks it
    for keys in (("true", "false"), ("yes", "no")):  # the wire's shape, and its accepted alias
        for state, want in zip(STATES, GOLDEN[noul_readout]):
            answers, usage = engine.predict_with_usage(state, _questions(*keys))
            # a fresh engine state per shape: the second pass hits the prefix cache (cached tokens differ)
            if keys == ("yes", "no"):
                usage = {**usage, "cached_input_tokens": 0}
            _compare(json.loads(json.dumps({"answers": answers, "usage": usage})), want)
