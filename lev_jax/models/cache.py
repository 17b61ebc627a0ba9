"""The state cache: one pytree for a computed prefix, forkable to B rows and extendable in place.

    cache = {
        "offset": int32[]         next slot to write (all rows share it: suffixes are right-padded),
        "valid":  bool[Bc, S]     which slots hold a real token (bucket padding and suffix padding don't),
        "pos":    int32[Bc]       position of the next real token per row (= real tokens seen so far; after
                                  a prefix with images, its largest M-RoPE position + 1),
        "layers": tuple           per layer: {"k": [Bc, K, D, S], "v": [Bc, K, S, D]} for attention layers
                                  (keys stored transposed: scores are then plain [R, D] x [D, S] matmuls),
                                  {"conv": [Bc, Kconv-1, C], "state": f32[Bc, H, Dk, Dv]} for DeltaNet layers,
    }

A cache with Bc = 1 can be extended by B > 1 rows directly: attention reads the shared prefix in
place and DeltaNet states broadcast, so forking costs nothing until a row's slots are written.

A segment is a second, per-row level over a shared 1-row cache (`with_segment`): the question header
that both option orders of a question continue. Attention layers keep the shared "k"/"v" and add
"seg_k" [B, K, D, Sg] / "seg_v" [B, K, Sg, D]; DeltaNet layers hold their state after the segment;
"seg_valid" [B, Sg] marks real segment tokens and "pos" counts prefix + segment. Rows continuing a
segment read it (`select_rows` picks each row's) and never write it.

Several requests' prefixes stack into one cache of Bc rows (one per prefix), which B rows read in
place by index (`index_rows`): attention layers carry "rows" int32 [B], the stacked row each reads
(attention takes a row's keys and values per KV head, as it needs them: no per-row copy of the whole
cache), while "pos" and the DeltaNet entries, small, are taken per row. A segment over such a cache
keeps "rows" per segment row, so rows continuing a segment read their own prefix through it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lev_jax.models.layers import write_slots

SLOT_AXIS = {"k": 3, "v": 2}  # the slot axis of each attention cache entry (DeltaNet entries have none)


def empty_cache(batch: int, slots: int, layer_caches: tuple) -> dict:
    return {
        "offset": jnp.zeros((), jnp.int32),
        "valid": jnp.zeros((batch, slots), bool),
        "pos": jnp.zeros((batch,), jnp.int32),
        "layers": tuple(layer_caches),
    }


def fork(cache: dict, batch: int) -> dict:
    """Materialise B copies of a 1-row cache (only needed when the rows will be extended separately
    and kept; `forward` accepts the 1-row cache with B-row tokens directly)."""
    return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.broadcast_to(x, (batch,) + x.shape[1:]), cache)


def grow(cache: dict, slots: int) -> dict:
    """Return the cache with room for `slots` slots (zero K/V, invalid), keeping what it holds."""
    have = cache["valid"].shape[1]
    if slots <= have:
        return cache
    extra = slots - have

    def pad(x, axis):
        if axis is None:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths)

    layers = tuple({name: pad(arr, SLOT_AXIS.get(name)) for name, arr in layer.items()} for layer in cache["layers"])
    return {**cache, "valid": pad(cache["valid"], 1), "layers": layers}


def positions_for(cache: dict | None, valid_BT):
    """Positions of new tokens: each row continues from its own count of real tokens."""
    counts_BT = jnp.cumsum(valid_BT.astype(jnp.int32), axis=1) - 1
    if cache is not None:
        counts_BT = cache["pos"][:, None] + counts_BT
    return jnp.maximum(counts_BT, 0)


def advance(cache: dict | None, batch: int, valid_BT, layers: tuple) -> dict:
    """The cache after T new tokens (layers already updated by the model). Without a previous
    cache the result holds exactly the T new slots."""
    if cache is None:
        T = valid_BT.shape[1]
        return {
            "offset": jnp.asarray(T, jnp.int32),
            "valid": valid_BT,
            "pos": valid_BT.sum(axis=1).astype(jnp.int32),
            "layers": tuple(layers),
        }
    valid = write_slots(cache["valid"], valid_BT, cache["offset"], batch)
    pos = jnp.broadcast_to(cache["pos"], (batch,)) + valid_BT.sum(axis=1).astype(jnp.int32)
    return {"offset": cache["offset"] + valid_BT.shape[1], "valid": valid, "pos": pos, "layers": tuple(layers)}


# per-row entries of a segment cache's layers ("rows": the stacked prefix row a segment continues)
SEGMENT_ROW_KEYS = ("seg_k", "seg_v", "conv", "state", "rows")
DELTANET_KEYS = ("conv", "state")


def with_segment(cache: dict, valid_BT, layers: tuple) -> dict:
    """The shared `cache` plus B rows of T segment tokens (layers already computed by the model)."""
    B = valid_BT.shape[0]
    pos = jnp.broadcast_to(cache["pos"], (B,)) + valid_BT.sum(axis=1).astype(jnp.int32)
    return {
        "offset": cache["offset"],
        "valid": cache["valid"],
        "pos": pos,
        "seg_valid": valid_BT,
        "layers": tuple(layers),
    }


def index_rows(cache: dict, rows_B) -> dict:
    """A stacked cache as read by B rows, row b continuing stacked row `rows_B[b]` (int32 [B]):
    attention entries stay stacked and are read by index ("rows"), the small per-row entries ("pos",
    DeltaNet states) are taken per row. Read-only (a readout or a segment continues it)."""
    take = lambda x: jnp.take(x, rows_B, axis=0)

    def layer(entries):
        if "k" in entries:
            return {**entries, "rows": rows_B}
        return {k: take(v) if k in DELTANET_KEYS else v for k, v in entries.items()}

    return {**cache, "pos": take(cache["pos"]), "layers": tuple(map(layer, cache["layers"]))}


def take_row(cache: dict, i: int) -> dict:
    """Row i of a several-row cache, as a 1-row cache."""
    return jax.tree.map(lambda x: x if x.ndim == 0 else x[i : i + 1], cache)


def select_rows(cache: dict, rows_B) -> dict:
    """Each of B rows' own segment out of a segment cache (shared entries stay shared; over a
    stacked cache, each row's segment keeps the index of the prefix it continues)."""
    take = lambda x: jnp.take(x, rows_B, axis=0)
    layers = tuple({k: take(v) if k in SEGMENT_ROW_KEYS else v for k, v in layer.items()} for layer in cache["layers"])
    return {**cache, "pos": take(cache["pos"]), "seg_valid": take(cache["seg_valid"]), "layers": layers}


def concat_segments(parts: list[dict], rows: int | None = None) -> dict:
    """Segment caches of several calls over the same shared cache, as one (rows stacked in order),
    padded to `rows` rows (a shape bucket) with empty segments nothing reads."""
    have = sum(p["pos"].shape[0] for p in parts)
    if len(parts) == 1 and (rows is None or rows == have):
        return parts[0]

    def cat(*xs):
        if rows is not None and rows > have:
            xs = (*xs, jnp.zeros((rows - have,) + xs[0].shape[1:], xs[0].dtype))
        return jnp.concatenate(xs, axis=0)

    first = parts[0]
    layers = tuple(
        {k: cat(*(p["layers"][i][k] for p in parts)) if k in SEGMENT_ROW_KEYS else v for k, v in layer.items()}
        for i, layer in enumerate(first["layers"])
    )
    return {
        **first,
        "pos": cat(*(p["pos"] for p in parts)),
        "seg_valid": cat(*(p["seg_valid"] for p in parts)),
        "layers": layers,
    }
