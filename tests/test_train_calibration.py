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
