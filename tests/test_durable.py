"""Writes that survive a crash (issue 45): each file that publishes a checkpoint's history, a run's
config or a calibration is fsynced before the rename that puts it in place, and its directory after."""

from __future__ import annotations

import json
import os

import pytest

from lev_jax import calibrate, durable
from lev_jax.training import checkpoint


@pytest.fixture
def io_log(monkeypatch):
    """The order of fsyncs (by the path of the file or directory) and renames in this process."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", os.path.realpath(dst)))
        events.append(("from", os.path.realpath(src)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def assert_durable(events, target):
    """`target` was renamed into place after its data was fsynced, and its directory fsynced after."""
    target = os.path.realpath(target)
    i = events.index(("replace", target))
    tmp = events[i + 1][1]
    assert ("fsync", tmp) in events[:i], events  # the data first (fsynced under its temporary name)
    assert ("fsync", os.path.dirname(target)) in events[i:], events  # then the rename itself


def test_history_and_json_writes_fsync_before_the_rename(tmp_path, io_log):
    checkpoint.write_history(tmp_path, [{"event": "checkpoint", "step": 4}])
    assert_durable(io_log, tmp_path / checkpoint.HISTORY)
    assert checkpoint.read_history(tmp_path) == [{"event": "checkpoint", "step": 4}]


def test_calibration_saves_fsync_before_the_rename(tmp_path, io_log):
    calibrate.Calibration.identity("m").save(tmp_path)
    assert_durable(io_log, tmp_path / calibrate.CALIBRATION_FILE)
    assert json.loads((tmp_path / calibrate.CALIBRATION_FILE).read_text())["model_id"] == "m"


def test_fsync_tree_reaches_every_file_and_directory(tmp_path, io_log):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("x", "a/y", "a/b/z"):
        (tmp_path / name).write_text(name)
    durable.fsync_tree(tmp_path)
    synced = {p for kind, p in io_log if kind == "fsync"}
    want = {"x", "a/y", "a/b/z", "a", "a/b"}
    assert {os.path.realpath(tmp_path / n) for n in want} | {os.path.realpath(tmp_path)} <= synced


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "history.json"
    target.write_text("old")

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError):
        durable.write_text(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["history.json"]
