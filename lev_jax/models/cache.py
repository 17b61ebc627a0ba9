"""The state cache: one pytree for a computed prefix, forkable to B rows and extendable in place.

    cache = {
        "offset": int32[]         next slot to write (all rows share it: suffixes are right-padded),
        "valid":  bool[Bc, S]     which slots hold a real token (bucket padding and suffix padding don't),
        "pos":    int32[Bc]       position of the next real token per row (= real tokens seen so far; after
                                  a prefix with images, its largest M-RoPE position + 1),
        "blocks": {p: stack}      the layer caches as stacks (models.stack: layer i is entry i // P of
                                  stack i % P), each entry with a leading layer axis [n, ...]:
                                  {"k": [n, Bc, K, D, S], "v": [n, Bc, K, S, D]} for attention layers
                                  (keys stored transposed: scores are then plain [R, D] x [D, S] matmuls),
                                  {"conv": [n, Bc, Kconv-1, C], "state": f32[n, Bc, H, Dk, Dv]} for DeltaNet,
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
from lev_jax.models.stack import BLOCKS

# The layer entries are stacks (models.stack): axis 0 is the layer, axis 1 the row. The slot axis of
# each attention cache entry (DeltaNet entries have none), counted in a stacked entry.
SLOT_AXIS = {"k": 4, "v": 3}
ROW_AXIS = 1  # of a stacked layer entry ("valid" and "pos" have their rows on axis 0)


def empty_cache(batch: int, slots: int, blocks: dict) -> dict:
    return {
        "offset": jnp.zeros((), jnp.int32),
        "valid": jnp.zeros((batch, slots), bool),
        "pos": jnp.zeros((batch,), jnp.int32),
        BLOCKS: dict(blocks),
    }


def row_axes(cache: dict):
    """The row axis of every leaf of `cache` (None for the 0-d "offset"): a tree like `cache`, for
    vmapping over rows or picking them."""

    def top(x):
        return None if jnp.ndim(x) == 0 else 0

    out = {k: jax.tree.map(top, v) for k, v in cache.items() if k != BLOCKS}
    out[BLOCKS] = jax.tree.map(lambda x: ROW_AXIS, cache[BLOCKS])
    return out


def map_rows(fn, cache: dict) -> dict:
    """`fn(leaf, row_axis)` over every leaf that has rows (the 0-d "offset" is kept)."""
    return jax.tree.map(lambda x, ax: x if ax is None else fn(x, ax), cache, row_axes(cache))


def fork(cache: dict, batch: int) -> dict:
    """Materialise B copies of a 1-row cache (only needed when the rows will be extended separately
    and kept; `forward` accepts the 1-row cache with B-row tokens directly)."""

    def bcast(x, ax):
        return jnp.broadcast_to(x, x.shape[:ax] + (batch,) + x.shape[ax + 1 :])

    return map_rows(bcast, cache)


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

    blocks = {p: {name: pad(arr, SLOT_AXIS.get(name)) for name, arr in stk.items()} for p, stk in cache[BLOCKS].items()}
    return {**cache, "valid": pad(cache["valid"], 1), BLOCKS: blocks}


def positions_for(cache: dict | None, valid_BT):
    """Positions of new tokens: each row continues from its own count of real tokens."""
    counts_BT = jnp.cumsum(valid_BT.astype(jnp.int32), axis=1) - 1
    if cache is not None:
        counts_BT = cache["pos"][:, None] + counts_BT
    return jnp.maximum(counts_BT, 0)


def advance(cache: dict | None, batch: int, valid_BT, blocks: dict) -> dict:
    """The cache after T new tokens (layer stacks already updated by the model). Without a previous
    cache the result holds exactly the T new slots."""
    if cache is None:
        T = valid_BT.shape[1]
        return {
            "offset": jnp.asarray(T, jnp.int32),
            "valid": valid_BT,
            "pos": valid_BT.sum(axis=1).astype(jnp.int32),
            BLOCKS: dict(blocks),
        }
    valid = write_slots(cache["valid"], valid_BT, cache["offset"], batch)
    pos = jnp.broadcast_to(cache["pos"], (batch,)) + valid_BT.sum(axis=1).astype(jnp.int32)
    return {"offset": cache["offset"] + valid_BT.shape[1], "valid": valid, "pos": pos, BLOCKS: dict(blocks)}


# per-row entries of a segment cache's layers ("rows": the stacked prefix row a segment continues)
SEGMENT_ROW_KEYS = ("seg_k", "seg_v", "conv", "state", "rows")
DELTANET_KEYS = ("conv", "state")


def with_segment(cache: dict, valid_BT, blocks: dict) -> dict:
    """The shared `cache` plus B rows of T segment tokens (layer stacks already computed by the model)."""
    B = valid_BT.shape[0]
    pos = jnp.broadcast_to(cache["pos"], (B,)) + valid_BT.sum(axis=1).astype(jnp.int32)
    return {
        "offset": cache["offset"],
        "valid": cache["valid"],
        "pos": pos,
        "seg_valid": valid_BT,
        BLOCKS: dict(blocks),
    }


def index_rows(cache: dict, rows_B) -> dict:
    """A stacked cache as read by B rows, row b continuing stacked row `rows_B[b]` (int32 [B]):
    attention entries stay stacked and are read by index ("rows", one copy per layer of the stack),
    the small per-row entries ("pos", DeltaNet states) are taken per row. Read-only (a readout or a
    segment continues it)."""
    take = lambda x, ax: jnp.take(x, rows_B, axis=ax)

    def entries(stk):
        if "k" in stk:
            n = stk["k"].shape[0]
            return {**stk, "rows": jnp.broadcast_to(rows_B, (n,) + rows_B.shape)}
        return {k: take(v, ROW_AXIS) if k in DELTANET_KEYS else v for k, v in stk.items()}

    blocks = {p: entries(stk) for p, stk in cache[BLOCKS].items()}
    return {**cache, "pos": take(cache["pos"], 0), BLOCKS: blocks}


def take_row(cache: dict, i: int) -> dict:
    """Row i of a several-row cache, as a 1-row cache."""
    return map_rows(lambda x, ax: jax.lax.slice_in_dim(x, i, i + 1, axis=ax), cache)


def select_rows(cache: dict, rows_B) -> dict:
    """Each of B rows' own segment out of a segment cache (shared entries stay shared; over a
    stacked cache, each row's segment keeps the index of the prefix it continues)."""
    take = lambda x, ax: jnp.take(x, rows_B, axis=ax)
    blocks = {
        p: {k: take(v, ROW_AXIS) if k in SEGMENT_ROW_KEYS else v for k, v in stk.items()}
        for p, stk in cache[BLOCKS].items()
    }
    return {**cache, "pos": take(cache["pos"], 0), "seg_valid": take(cache["seg_valid"], 0), BLOCKS: blocks}


def concat_segments(parts: list[dict], rows: int | None = None) -> dict:
    """Segment caches of several calls over the same shared cache, as one (rows stacked in order),
    padded to `rows` rows (a shape bucket) with empty segments nothing reads."""
    have = sum(p["pos"].shape[0] for p in parts)
    if len(parts) == 1 and (rows is None or rows == have):
        return parts[0]

    def cat(axis, *xs):
        if rows is not None and rows > have:
            shape = list(xs[0].shape)
            shape[axis] = rows - have
            xs = (*xs, jnp.zeros(shape, xs[0].dtype))
        return jnp.concatenate(xs, axis=axis)

    first = parts[0]
    blocks = {
        p: {
            k: cat(ROW_AXIS, *(part[BLOCKS][p][k] for part in parts)) if k in SEGMENT_ROW_KEYS else v
            for k, v in stk.items()
        }
        for p, stk in first[BLOCKS].items()
    }
    return {
        **first,
        "pos": cat(0, *(p["pos"] for p in parts)),
        "seg_valid": cat(0, *(p["seg_valid"] for p in parts)),
        BLOCKS: blocks,
    }


def concat_rows(caches: list[dict]) -> dict:
    """Caches of the same slots as one cache of all their rows (the largest "offset")."""
    axes = row_axes(caches[0])
    return jax.tree.map(
        lambda ax, *xs: jnp.max(jnp.stack(xs)) if ax is None else jnp.concatenate(xs, axis=ax),
        axes,
        *caches,
        is_leaf=lambda x: x is None,
    )


def truncate(cache: dict, depth: int) -> dict:
    """The cache of a model's first `depth` layers out of a deeper one's. (A cache deeper than its
    period holds every stack, so their count is the period; a shallower one's entries are one per
    stack, the same under any period.)"""
    period = len(cache[BLOCKS])
    blocks = {}
    for p, stk in cache[BLOCKS].items():
        keep = len(range(p, depth, period))
        if keep:
            blocks[p] = jax.tree.map(lambda x, keep=keep: x[:keep], stk)
    return {**cache, BLOCKS: blocks}


def stack_on(cache: dict, upper: dict) -> dict:
    """`cache` (layers [0, d)) with `upper`'s layers [d, d') stacked on, stack by stack."""
    blocks = dict(cache[BLOCKS])
    for p, stk in upper[BLOCKS].items():
        blocks[p] = stk if p not in blocks else jax.tree.map(lambda a, b: jnp.concatenate([a, b]), blocks[p], stk)
    return {**cache, BLOCKS: blocks}
