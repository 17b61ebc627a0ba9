"""The grain input pipeline over a built split.

Batches are planned per epoch from the split's index (readout mode and token length of every row):

1. the rows are permuted with blake2b keyed by (seed, epoch);
2. rows are grouped by readout mode, so every batch is one readout mode;
3. within each mode, consecutive windows of ``window_batches * batch_size`` rows are sorted by
   length and cut into batches (length bucketing with little padding, but still random);
4. the order of all batches is shuffled, again keyed by (seed, epoch).

The plan is a random-access ``grain.MapDataset`` (element i = batch i, epochs laid end to end),
mapped to read the rows from the ArrayRecord file. Its iterator's ``get_state()`` / ``set_state()``
checkpoint and resume at exactly the next batch. Same data and seed, same batches, on any machine.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np

from lev_jax.data.build import decode_row
from lev_jax.data.splits import blake2b_digest


def _perm(n: int, *key: Any) -> np.ndarray:
    keys = np.frombuffer(b"".join(blake2b_digest("perm", *key, i, size=8) for i in range(n)), dtype=">u8")
    return np.argsort(keys, kind="stable").astype(np.int64)


class BatchPlan:
    """Deterministic length-bucketed, single-readout batches of record indices, per epoch."""

    def __init__(
        self,
        readouts: Sequence[str],
        lengths: Sequence[int],
        batch_size: int,
        *,
        seed: int = 0,
        window_batches: int = 16,
        drop_remainder: bool = True,
        shard_index: int = 0,
        shard_count: int = 1,
    ):
        if batch_size <= 0:
            raise ValueError("batch_size must be positive")
        if len(readouts) != len(lengths):
            raise ValueError("readouts and lengths differ in length")
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"shard_index {shard_index} outside [0, {shard_count})")
        self.readouts = np.asarray(readouts)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.seed = seed
        self.window = max(1, window_batches) * batch_size
        self.drop_remainder = drop_remainder
        self.shard_index, self.shard_count = shard_index, shard_count
        self.modes = sorted(set(self.readouts.tolist()))
        self._cache: dict[int, tuple[np.ndarray, ...]] = {}
        self.batches_per_epoch = len(self.epoch(0))
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"no full batch of {batch_size} rows in any readout mode "
                f"({', '.join(f'{m}: {int((self.readouts == m).sum())}' for m in self.modes)})"
            )

    def epoch(self, epoch: int) -> tuple[np.ndarray, ...]:
        """The batches of one epoch (computed once, the two most recent epochs kept)."""
        if epoch not in self._cache:
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = self._plan(epoch)
        return self._cache[epoch]

    def _plan(self, epoch: int) -> tuple[np.ndarray, ...]:
        perm = _perm(len(self.lengths), self.seed, epoch)
        batches: list[np.ndarray] = []
        for mode in self.modes:
            idx = perm[self.readouts[perm] == mode]
            for start in range(0, len(idx), self.window):
                win = idx[start : start + self.window]
                win = win[np.argsort(self.lengths[win], kind="stable")]
                for b in range(0, len(win), self.batch_size):
                    chunk = win[b : b + self.batch_size]
                    if len(chunk) == self.batch_size or (not self.drop_remainder and len(chunk)):
                        batches.append(chunk)
        order = _perm(len(batches), self.seed, epoch, "batches")
        planned = [batches[i] for i in order]
        if self.shard_count > 1:
            usable = len(planned) - len(planned) % self.shard_count
            planned = planned[self.shard_index : usable : self.shard_count]
        return tuple(planned)

    def batch(self, i: int) -> tuple[int, int, np.ndarray]:
        e, b = divmod(i, self.batches_per_epoch)
        return e, b, self.epoch(e)[b]


class _PlanSource:
    """Random-access view of the plan for ``grain.MapDataset.source``."""

    def __init__(self, plan: BatchPlan, num_epochs: int | None):
        self.plan = plan
        self._len = sys.maxsize if num_epochs is None else plan.batches_per_epoch * num_epochs

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[int, int, np.ndarray]:
        if not 0 <= i < self._len:
            raise IndexError(i)
        return self.plan.batch(int(i))


class _ReadBatch(grain.transforms.Map):
    def __init__(self, path: str, readouts: np.ndarray, transform: Callable[[dict[str, Any]], Any] | None):
        self.path = path
        self.readouts = readouts
        self.transform = transform
        self._source = None

    def map(self, element: tuple[int, int, np.ndarray]) -> Any:
        if self._source is None:
            self._source = grain.sources.ArrayRecordDataSource(self.path)
        epoch, step, idx = element
        rows = [decode_row(self._source[int(i)]) for i in idx]
        batch = {
            "readout": str(self.readouts[idx[0]]),
            "rows": rows,
            "index": idx.copy(),
            "length": np.asarray([r["length"] for r in rows], dtype=np.int32),
            "epoch": epoch,
            "step": step,
        }
        return self.transform(batch) if self.transform is not None else batch


def load_index(data_dir: str | Path, split: str) -> dict[str, list[Any]]:
    path = Path(data_dir) / f"{split}.index.json"
    if not path.is_file():
        raise FileNotFoundError(f"no index for split {split!r} at {path}")
    return json.loads(path.read_text(encoding="utf-8"))


def make_dataset(
    data_dir: str | Path,
    split: str = "train",
    *,
    batch_size: int,
    seed: int = 0,
    num_epochs: int | None = 1,
    window_batches: int = 16,
    drop_remainder: bool = True,
    readouts: Sequence[str] | None = None,
    transform: Callable[[dict[str, Any]], Any] | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
) -> grain.MapDataset:
    """A ``grain.MapDataset`` of batches: {"readout", "rows", "index", "length", "epoch", "step"}.

    ``transform`` (e.g. prompt rendering + tokenization + padding) is applied to each batch.
    ``readouts`` keeps only those readout modes. ``num_epochs=None`` repeats forever.
    """
    index = load_index(data_dir, split)
    ro = np.asarray(index["readout"])
    lengths = np.asarray(index["length"], dtype=np.int64)
    if readouts is not None:
        keep = np.isin(ro, list(readouts))
        positions = np.nonzero(keep)[0]
        plan_ro, plan_len = ro[positions], lengths[positions]
    else:
        positions, plan_ro, plan_len = None, ro, lengths
    plan = BatchPlan(
        plan_ro.tolist(),
        plan_len.tolist(),
        batch_size,
        seed=seed,
        window_batches=window_batches,
        drop_remainder=drop_remainder,
        shard_index=shard_index,
        shard_count=shard_count,
    )
    ds = grain.MapDataset.source(_PlanSource(plan, num_epochs))
    if positions is not None:
        ds = ds.map(lambda el: (el[0], el[1], positions[el[2]]))
    return ds.map(_ReadBatch(str(Path(data_dir) / f"{split}.array_record"), ro, transform))


def make_iterator(
    data_dir: str | Path,
    split: str = "train",
    *,
    state: Mapping[str, Any] | None = None,
    read_options: grain.ReadOptions | None = None,
    **kw: Any,
) -> grain.DatasetIterator:
    """A checkpointable iterator (``get_state()`` / ``set_state()``) over ``make_dataset``'s batches.

    Reading (and ``transform``) runs on ``read_options.num_threads`` threads with prefetch; the state
    still counts consumed batches only, so a restore resumes at exactly the next batch.
    """
    ds = make_dataset(data_dir, split, **kw)
    it = ds.to_iter_dataset(read_options or grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)).__iter__()
    if state is not None:
        it.set_state(dict(state))
    return it
