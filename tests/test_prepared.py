"""lev_jax/loaders/prepared.py: a GGUF read once is loaded on later starts from its prepared copy
(safetensors + tokenizer.json) -- the same parameters, the same tokenizer, without reading the GGUF --
and never when the copy is stale (the file changed), damaged, or not this user's own."""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest

from lev_jax import backbone
from lev_jax.loaders import gguf, prepared

TEXTS = [
    "Hi, my card was charged twice for the same coffee and I want my money back now!",
    "<|im_start|>user\nDigits 12345 and   spaces\t\u00e9\u00e8 \U0001f600<|im_end|>",
]


@pytest.fixture
def copy(tmp_path, gguf_path, monkeypatch):
    """A copy of the embedded GGUF, prepared copies kept under tmp_path, and a count of GGUF reads."""
    path = tmp_path / "model.gguf"
    shutil.copyfile(gguf_path, path)
    monkeypatch.setattr(prepared, "root", lambda: tmp_path / "models")
    reads = []
    real = gguf.read_gguf
    monkeypatch.setattr(gguf, "read_gguf", lambda p: reads.append(p) or real(p))
    return path, reads


def _same(a, b):
    assert a.config == b.config and a.name == b.name
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ta, tb = a.tokenizer, b.tokenizer
    assert (ta.name, ta.bos_id, ta.eos_id, ta.pad_id, ta.unk_id, ta.add_bos, ta.vocab_size) == (
        tb.name,
        tb.bos_id,
        tb.eos_id,
        tb.pad_id,
        tb.unk_id,
        tb.add_bos,
        tb.vocab_size,
    )
    assert ta.special_ids == tb.special_ids and ta.chat_template == tb.chat_template
    assert [ta.encode(t) for t in TEXTS] == [tb.encode(t) for t in TEXTS]


def test_a_gguf_read_once_loads_from_its_prepared_copy_and_a_changed_one_is_read_again(copy):
    path, reads = copy
    first = backbone.load_backbone(path, "bfloat16")
    assert len(reads) == 1
    where = prepared.directory(path, "bfloat16")
    assert (where / prepared.KEY).is_file() and (where / prepared.PARAMS).is_file()
    assert oct(where.parent.stat().st_mode & 0o777) == "0o700"
    second = backbone.load_backbone(path, "bfloat16")
    assert len(reads) == 1  # the GGUF was not read
    _same(first, second)
    fp32 = backbone.load_backbone(path, "float32")  # one copy per dtype
    assert fp32.params["embed_tokens"]["embedding"].dtype == np.float32
    assert len(reads) == 2

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the file changed: read it again
    third = backbone.load_backbone(path, "bfloat16")
    assert len(reads) == 3
    _same(first, third)
    backbone.load_backbone(path, "bfloat16")
    assert len(reads) == 3  # ... and its new copy is the one kept


def test_a_damaged_or_foreign_copy_is_never_loaded(copy, caplog):
    path, reads = copy
    first = backbone.load_backbone(path, "bfloat16")
    where = prepared.directory(path, "bfloat16")
    params = where / prepared.PARAMS
    params.write_bytes(params.read_bytes()[: params.stat().st_size // 2])  # truncated
    again = backbone.load_backbone(path, "bfloat16")
    assert len(reads) == 2 and "ignoring the prepared model" in caplog.text
    _same(first, again)
    backbone.load_backbone(path, "bfloat16")
    assert len(reads) == 2  # made again, whole

    os.chmod(where, 0o777)  # writable by others: what is in it may be planted
    backbone.load_backbone(path, "bfloat16")
    assert len(reads) == 3 and "not using the prepared model" in caplog.text


def test_no_cache_no_copy(tmp_path, gguf_path, monkeypatch):
    monkeypatch.setenv(prepared.ENV, "0")
    assert prepared.root() is None
    assert prepared.save(gguf_path, "bfloat16", {}, {}, None) is None
