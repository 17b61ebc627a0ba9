"""HF checkpoints: a directory with config.json and safetensors (single file or sharded index),
or a hub id (downloaded where the hub is reachable)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
from safetensors import safe_open

from lev_jax.errors import CheckpointError
from lev_jax.loaders import name_map
from lev_jax.models import stack


def resolve_dir(path_or_hub_id: str) -> Path:
    """A local checkpoint directory; a hub id is downloaded (safetensors, configs, tokenizer only)."""
    path = Path(os.path.expanduser(str(path_or_hub_id)))
    if path.exists():
        return path
    if str(path_or_hub_id).count("/") != 1 or str(path_or_hub_id).startswith(("/", ".", "~")):
        raise CheckpointError(f"no such checkpoint directory: {path_or_hub_id}")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            str(path_or_hub_id),
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"],
        )
    except Exception as e:  # offline, unknown repo, gated repo: all mean "give me a local path"
        raise CheckpointError(
            f"could not fetch {path_or_hub_id!r} from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); download it elsewhere and pass the local directory"
        ) from None
    return Path(local)


def read_config(ckpt_dir: Path) -> dict:
    cfg_path = ckpt_dir / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{ckpt_dir} has no config.json")
    try:
        return json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from None


def shard_files(ckpt_dir: Path) -> list[Path]:
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a safetensors index: {e}") from None
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (ckpt_dir / f).is_file()]
        if absent:
            raise CheckpointError(f"{index} names shards that are not there: {', '.join(absent)}")
        return [ckpt_dir / f for f in files]
    single = ckpt_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(ckpt_dir.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{ckpt_dir} holds no .safetensors weights")
    return found


def iter_tensors(files):
    """(name, array) for every tensor, one shard open at a time (peak host memory ~ one tensor)."""
    for f in files:
        try:
            handle = safe_open(str(f), framework="flax")
        except Exception as e:
            raise CheckpointError(f"{f} is not a readable safetensors file (corrupt or truncated?): {e}") from None
        with handle as sf:
            for name in sf.keys():
                try:
                    arr = sf.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{f}: tensor {name} cannot be read (corrupt or truncated?): {e}") from None
                yield name, arr


def load_params(ckpt_dir: Path, cfg, abstract: dict, *, source: str | None = None) -> dict:
    """Stream every shard into the parameter tree of `cfg`, cast to the tree's dtypes."""
    view = stack.layer_view(abstract)  # the tensors come layer by layer (name_map.assemble)
    cast = lambda path, arr: jnp.asarray(arr, dtype=_at(view, path).dtype)
    return name_map.assemble(
        iter_tensors(shard_files(ckpt_dir)),
        abstract,
        cast,
        tied=cfg.tie_word_embeddings,
        source=source or str(ckpt_dir),
    )


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree
