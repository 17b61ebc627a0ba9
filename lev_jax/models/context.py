"""What every decoder layer of one forward call shares: the `Context` pytree and the `CacheWrite` mode.

`Context` is a frozen dataclass registered as a JAX pytree: its arrays are data (they trace, shard
and pass through `jax.checkpoint` as leaves), its modes are static metadata (part of the treedef,
so a layer can branch on them in Python). A new per-call input (a sharding spec, a LoRA scale) is
one more field here, not another string key.
"""

from __future__ import annotations

import dataclasses
import enum

import jax


class CacheWrite(enum.Enum):
    """What a forward call does with the cache it continues."""

    APPEND = "append"  # write the new tokens' slots into the cache (a prefill or an extension)
    NONE = "none"  # write nothing, return no cache: a readout over a shared prefix needs neither
    # B copies of it nor room in its buffer
    SEGMENT = "segment"  # keep the shared cache as it is and return the new tokens beside it, per row:
    # a second cache level (cache.with_segment) that later rows read without copying the shared part


def _static():
    return dataclasses.field(metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """Per-call inputs of every layer (shapes: B rows, T new tokens, S cached slots, Sg segment slots,
    F rotary frequencies).

    cos, sin      f32[B, T, F]   rotary tables at the new tokens' positions
    valid         bool[B, T]     real new tokens (suffix padding is not)
    cache_valid   bool[Bc, S]    real cached slots; None without a cache
    offset        int32[]        the cache slot the new tokens are written at; None without a cache
    seg_valid     bool[B, Sg]    real segment slots; None unless the cache carries a segment
    mask          bool[B, T, T]  which new tokens each new token sees (several rows packed into one
                                 lane: each sees its own row's earlier tokens and its header's);
                                 None: every earlier valid token (causal)
    cache_write   CacheWrite     (static) what the call writes into the cache
    anchored_softmax  bool       (static) attention against a shared cache uses the anchored
                                 stabiliser (layers.attend); rows it cannot serve come out NaN
    """

    cos: jax.Array
    sin: jax.Array
    valid: jax.Array
    cache_valid: jax.Array | None
    offset: jax.Array | None
    seg_valid: jax.Array | None
    mask: jax.Array | None
    cache_write: CacheWrite = _static()
    anchored_softmax: bool = _static()
