"""A GGUF model kept ready to load: its parameters as safetensors in the served dtype, its config and
its tokenizer as files, next to the compilation cache.

Loading a GGUF costs seconds on every start that have nothing to do with the weights being new: the
`gguf` reader walks every metadata entry one by one (the embedded default's tokenizer holds ~100k
strings: most of the load), the tensors are dequantised, permuted and stacked into the layer layout,
then cast. The result depends only on the file and on this package's loaders, so it is written once
(`save`) and read back on the next start (`load`): a safetensors file the `safetensors` library maps
in, a `tokenizer.json` the `tokenizers` library reads, and the HF config.

One directory per (GGUF file, dtype) under `DIR` inside the compilation cache (`LEV_JAX_CACHE` moves
both, empty turns both off); `key.json` names what it was made from (the file's path, size and
modification time, the dtype, this package's source), and a directory whose key does not match is
made again, so a changed GGUF or another lev-jax version never loads a stale copy. A directory is
written whole under another name and renamed into place; one that cannot be read in full is ignored
(and made again). Like the program store it is read only when it is this user's own alone
(`runtime.untrusted`): weights planted by another user would change every answer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

log = logging.getLogger("lev_jax")

DIR = "lev_jax_models"  # inside the persistent compilation cache's directory
ENV = "LEV_JAX_PREPARED"  # "0": always read the GGUF itself
PARAMS = "params.safetensors"
CONFIG = "config.json"
KEY = "key.json"  # written last: a directory without it is incomplete


def root() -> Path | None:
    """Where prepared models live; None when the compilation cache is off or $LEV_JAX_PREPARED is "0"."""
    from lev_jax import runtime

    if os.environ.get(ENV, "1") == "0":
        return None
    cache = runtime.compilation_cache_dir()
    return Path(cache) / DIR if cache else None


def key_of(path: Path, dtype: str) -> dict:
    """What a prepared copy of `path` in `dtype` is made from."""
    from lev_jax import programs

    st = path.stat()
    return {
        "gguf": str(path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "dtype": dtype,
        "lev_jax": programs.fingerprint(),  # this package's source (its loaders, the layer layout)
    }


def directory(path: Path, dtype: str) -> Path | None:
    base = root()
    if base is None:
        return None
    ident = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return base / f"{path.stem}-{ident}-{dtype}"


def load(path: Path, dtype: str, abstract_of):
    """(hf_config, params shaped like `abstract_of(hf_config)`, tokenizer) from the prepared copy of
    `path`, or None when there is none that matches it (or it cannot be read: then it is made again
    on `save`)."""
    from lev_jax import runtime
    from lev_jax.tokenizer import Tokenizer

    where = directory(path, dtype)
    if where is None or not (where / KEY).is_file():
        return None
    if why := runtime.untrusted(where):
        log.warning("not using the prepared model %s: it %s; reading the GGUF", where, why)
        return None
    try:
        if json.loads((where / KEY).read_text()) != key_of(path, dtype):
            return None
        from safetensors.flax import load_file

        hf_config = json.loads((where / CONFIG).read_text())
        tensors = load_file(str(where / PARAMS))
        leaves, tree = jax.tree_util.tree_flatten_with_path(abstract_of(hf_config))
        params = []
        for p, spec in leaves:
            arr = tensors[jax.tree_util.keystr(p)]
            if arr.shape != spec.shape or arr.dtype != spec.dtype:
                raise ValueError(f"{jax.tree_util.keystr(p)} is {arr.dtype}{arr.shape}, not {spec.dtype}{spec.shape}")
            params.append(arr)
        tokenizer = Tokenizer.from_tokenizer_json(where)
    except Exception as e:  # noqa: BLE001 — a damaged or partial copy: read the GGUF, then write it again
        log.warning("ignoring the prepared model %s (%s: %s)", where, type(e).__name__, e)
        return None
    tokenizer.name = path.stem  # as the GGUF's own tokenizer is named
    return hf_config, jax.tree_util.tree_unflatten(tree, params), tokenizer


def save(path: Path, dtype: str, hf_config: dict, params, tokenizer) -> Path | None:
    """Write the prepared copy of `path` (whole, then renamed into place); None when there is no place
    for it or it cannot be written (the model still loads, from the GGUF, next time too)."""
    from lev_jax import runtime

    where = directory(path, dtype)
    if where is None or tokenizer is None:
        return None
    tmp = old = None
    try:
        runtime.private_dir(where.parent)
        if why := runtime.untrusted(where.parent):
            log.warning("not writing a prepared model into %s: it %s", where.parent, why)
            return None
        from safetensors.flax import save_file

        tmp = Path(tempfile.mkdtemp(dir=where.parent, prefix=".prepared-"))
        flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        save_file(flat, str(tmp / PARAMS))
        (tmp / CONFIG).write_text(json.dumps(hf_config, default=_plain))
        tokenizer.save(tmp)
        (tmp / KEY).write_text(json.dumps(key_of(path, dtype)))
        if where.exists():  # an older copy (another GGUF version, another lev-jax): out of the way first
            old = Path(tempfile.mkdtemp(dir=where.parent, prefix=".stale-"))
            os.rename(where, old / "copy")
        os.rename(tmp, where)
        tmp = None
        return where
    except Exception as e:  # noqa: BLE001 — a read-only or full cache: the GGUF stays the source
        log.warning("cannot keep a prepared copy of %s (%s: %s)", path, type(e).__name__, e)
        return None
    finally:
        for leftover in (tmp, old):
            if leftover is not None:
                shutil.rmtree(leftover, ignore_errors=True)


def _plain(x):
    """JSON for numpy scalars in a GGUF's config."""
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON")
