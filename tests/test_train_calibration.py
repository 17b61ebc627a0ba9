"""The calibration sampler asks large fixed taxonomies in the served shape (the whole canonical set)
when the run trains them that way."""

from lev_jax import domain
from lev_jax.data.registry import REGISTRY
from lev_jax.training import calibration


def _record(keys, target):
    return {
        "uid": "u1",
        "source": "banking77",
        "state": "Where is my new card?",
        "question": {"type": "choice", "instructions": "Which intent?", "criteria": {k: None for k in keys}},
        "target": target,
        "target_dist": [float(k == target) for k in keys],
        "readout": "choice",
        "band": domain.band_of(len(keys)),
    }


def test_large_subsets_become_the_canonical_full_set_and_small_ones_stay():
    canonical = [o.key for o in REGISTRY["banking77"].options]
    subset = list(reversed(canonical[:40]))  # a large-band subset in another order
    full = calibration.full_set(_record(subset, subset[3]))
    assert list(full["question"]["criteria"]) == canonical
    assert full["band"] == "large" and full["target"] == subset[3]
    assert full["target_dist"][canonical.index(subset[3])] == 1.0 and sum(full["target_dist"]) == 1.0
    assert full["question"]["instructions"] == "Which intent?"
    small = _record(canonical[:5], canonical[0])
    assert calibration.full_set(small) is small  # a small choice is served as asked
    other = {**_record(subset, subset[0]), "source": "no-such-source"}
    assert calibration.full_set(other) is other  # no fixed taxonomy known: as is


def test_choices_are_calibrated_without_descriptions_as_often_as_the_build_trains_them():
    """The build drops option descriptions from a fraction of its train choices only; a run trained on
    bare option names (the smollm2 preset drops them all) is calibrated on bare names too."""
    keys = [o.key for o in REGISTRY["banking77"].options][:5]
    records = []
    for i in range(200):
        r = _record(keys, keys[1])
        r["uid"] = f"u{i}"
        r["question"]["criteria"] = {k: f"about {k}" for k in keys}
        records.append(r)
    assert all(calibration.stripped(r, 0.0) is r for r in records)
    bare = [calibration.stripped(r, 1.0) for r in records]
    assert all(list(b["question"]["criteria"].items()) == [(k, None) for k in keys] for b in bare)
    assert all(b["target"] == keys[1] and b["question"]["instructions"] == "Which intent?" for b in bare)
    assert records[0]["question"]["criteria"][keys[0]] == f"about {keys[0]}"  # the record itself is untouched
    some = [calibration.stripped(r, 0.3) for r in records]
    share = sum(s is not r for s, r in zip(some, records)) / len(records)
    assert 0.2 < share < 0.4 and some == [calibration.stripped(r, 0.3) for r in records]  # seeded per record
    mcq = {**records[0], "source": next(n for n, s in REGISTRY.items() if not s.strip_descriptions)}
    assert calibration.stripped(mcq, 1.0) is mcq  # descriptions that are the answers stay
