"""Open a GGUF file and read its metadata, with one-line errors for missing, corrupt or truncated files.

The lowest layer of the GGUF loaders: :mod:`lev_jax.loaders.gguf` (weights and config) and
:mod:`lev_jax.loaders.gguf_tokenizer` (the tokenizer) both read through it, so neither imports the other
for it. A bad file raises :class:`lev_jax.errors.CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from lev_jax.errors import CheckpointError

__all__ = ["field_value", "open_reader", "reader_path"]


def reader_path(reader) -> str:
    """The file a ``gguf.GGUFReader`` was opened on ("<GGUF>" if unknown)."""
    return str(getattr(getattr(reader, "data", None), "filename", None) or "<GGUF>")


def open_reader(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` on ``path``, or CheckpointError saying why the file cannot be one."""
    import gguf

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such GGUF file")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the file ({e})") from e
    if len(head) < 8:
        raise CheckpointError(f"{path}: {size} bytes is too short to be a GGUF file (empty or truncated)")
    if head[:4] != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # numpy/gguf errors from reading past the end or garbage counts
        raise CheckpointError(
            f"{path}: corrupt or truncated GGUF file ({size} bytes): {_diagnose(path, size)} [{type(e).__name__}: {e}]"
        ) from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise CheckpointError(
                f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte {end} but the file has {size}"
            )
    return reader


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types


def _diagnose(path: Path, size: int) -> str:
    """Walk the header with plain struct reads to say where a file the gguf reader rejects goes wrong."""
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    blob = np.memmap(path, mode="r", dtype=np.uint8)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from("<" + fmt, blob, pos)
        pos += struct.calcsize("<" + fmt)
        return value if len(value) > 1 else value[0]

    def skip_string():
        nonlocal pos
        n = take("Q")
        if pos + n > size:
            raise EOFError
        pos += n

    def skip_value(vtype: int, depth: int = 0):
        nonlocal pos
        if vtype in _SCALAR_SIZES:
            pos += _SCALAR_SIZES[vtype]
        elif vtype == 8:
            skip_string()
        elif vtype == 9 and depth == 0:
            etype, count = take("IQ")
            if etype in _SCALAR_SIZES:
                pos += count * _SCALAR_SIZES[etype]
            else:
                for _ in range(count):
                    skip_value(etype, 1)
                    if pos > size:
                        raise EOFError
        else:
            raise ValueError(f"an unknown metadata value type {vtype} at byte {pos - 4}")
        if pos > size:
            raise EOFError

    try:
        take("4sI")
        n_tensors, n_kv = take("QQ")
        alignment = 32
        for _ in range(n_kv):
            key_len = take("Q")
            key = bytes(blob[pos : pos + key_len]).decode("utf-8", "replace")
            pos += key_len
            vtype = take("I")
            if key == "general.alignment" and vtype == 4:
                alignment = take("I")
            else:
                skip_value(vtype)
        tensor_end = 0
        for _ in range(n_tensors):
            skip_string()
            n_dims = take("I")
            if n_dims > 8:
                return f"it holds a tensor with {n_dims} dimensions, so its tensor table is corrupt"
            dims = [take("Q") for _ in range(n_dims)]
            ttype, offset = take("IQ")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                return f"it names an unknown tensor type {ttype}, so its tensor table is corrupt"
            tensor_end = max(tensor_end, offset + int(np.prod(dims, dtype=np.uint64)) * type_size // block)
        data_start = -(-pos // max(alignment, 1)) * max(alignment, 1)
        needed = data_start + tensor_end
        if needed > size:
            return f"truncated: its tensors need {needed} bytes but the file has {size}"
        return "its metadata or tensor table is corrupt"
    except (struct.error, EOFError):
        return f"truncated or corrupt: its metadata runs past the end of the file (at byte {pos})"
    except (ValueError, OverflowError, MemoryError) as e:
        return f"its metadata is corrupt ({e})"


def field_value(reader, key: str) -> Any:
    """A metadata value as Python (int/float/bool/str, or a list for arrays); None if absent."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            return field.contents()
        value = field.contents()
    except (UnicodeDecodeError, IndexError, ValueError) as e:
        raise CheckpointError(f"{reader_path(reader)}: metadata field {key!r} is corrupt ({e})") from e
    return value
