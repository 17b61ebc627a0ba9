"""The decoder as a scan over its layer stacks (models.stack).

One scan step runs P consecutive layers (one entry of each stack), so a program holds one copy of
the layer body whatever the depth: compiling a 30-layer model costs about what a 1-layer one does.
Layers outside whole steps (a layer range that does not start or end on a multiple of P: an
elastic exit, the first adapted layer) run unrolled around the scan.

What goes through the scan as its per-step inputs (`xs`): each layer's weights, adapter slots and
cache, sliced to the range run (a whole stack passes as it is; a part of one is a copy). The base
weights are xs rather than closed over because a closed-over array that is differentiated (a full
fine-tune) would accumulate its gradient as a full-size carry in every step. New caches come back
as the scan's outputs (`ys`); a cache entry a layer passes through unchanged (the shared keys
under a segment) is left out of them and taken from the input instead of being copied per layer.

On XLA:CPU a bf16 input sliced per step costs a whole-stack conversion: float normalisation runs the
step's dynamic-slice in fp32 and loop-invariant code motion hoists the convert of the entire stack
out of the loop (every call writes an fp32 copy of all the weights, then slices it), ~30 % of a
SmolLM2 prefill. The inputs the config marks frozen (`scan_frozen`: FROZEN's kinds no gradient
flows into) therefore enter the scan as their raw 16-bit patterns, reinterpreted inside the step:
free, bit-exact, and a gradient that would flow into one is a clear error (`as_bits`), never a
silent zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lev_jax.models import stack
from lev_jax.models.context import CacheWrite, Context


def split_lora(tree: dict, path=()) -> tuple[dict, dict, tuple[tuple[str, int], ...]]:
    """(base tree, adapter-slot tree, slots) of a stack: the slots as (module path, rank)."""
    base, lora, slots = {}, {}, []
    for k, v in tree.items():
        if isinstance(v, dict):
            b, lo, s = split_lora(v, path + (k,))
            base[k] = b
            if lo:
                lora[k] = lo
            slots += s
        elif k in stack.LORA_LEAVES:
            lora[k] = v
            if k == "lora_a":
                slots.append((".".join(map(str, path)), int(v.shape[-1])))
        else:
            base[k] = v
    return base, lora, tuple(sorted(slots))


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and k in out else v
    return out


def _slice(tree, j0: int, n: int, have: int):
    if j0 == 0 and n == have:
        return tree
    return jax.tree.map(lambda a: jax.lax.slice_in_dim(a, j0, j0 + n, axis=0), tree)


# what a config's `scan_frozen` may name: the base weights, the adapter slots, the cache continued
FROZEN = ("weights", "adapters", "caches")
_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16): jnp.uint16}


@jax.custom_jvp
def as_bits(a):
    """A 16-bit float array as its raw bit patterns (uint16)."""
    return jax.lax.bitcast_convert_type(a, _BITS[a.dtype])


@as_bits.defjvp
def _as_bits_jvp(primals, tangents):
    # reached only when a tangent is not a symbolic zero: something differentiates a frozen input
    raise TypeError(
        "a scan input marked frozen (the model config's scan_frozen) is being differentiated; "
        "leave its kind out of scan_frozen for this program"
    )


def _packed(tree, frozen: bool):
    """(tree with its 16-bit float leaves as bits when `frozen` on a CPU backend, their dtypes)."""
    if tree is None or not frozen or jax.default_backend() != "cpu":
        return tree, None
    dtypes = jax.tree.map(lambda a: a.dtype, tree)
    return jax.tree.map(lambda a: as_bits(a) if a.dtype in _BITS else a, tree), dtypes


def _unpacked(tree, dtypes):
    if dtypes is None:
        return tree
    return jax.tree.map(lambda a, d: jax.lax.bitcast_convert_type(a, d) if a.dtype != d else a, tree, dtypes)


def _lora_entries(lora: dict) -> int:
    return int(jax.tree.leaves(lora)[0].shape[0]) if lora else 0


def _call(graphdef, weights, x, ctx: Context, layer_cache):
    return nnx.merge(graphdef, weights)(x, ctx, layer_cache)


def run(
    layer_graph,
    blocks,
    layer_types,
    x,
    ctx: Context,
    cache_blocks,
    layer_range,
    policy,
    *,
    unroll: int = 1,
    frozen: tuple[str, ...] = FROZEN,
):
    """(x after layers [start, stop), their new cache stacks or None): `layer_graph(kind, slots)` is
    one layer's graph; `cache_blocks` the stacks of the cache continued (None: no context);
    `frozen` the FROZEN kinds no gradient flows into."""
    unknown = set(frozen) - set(FROZEN)
    if unknown:
        raise ValueError(f"scan_frozen names {sorted(unknown)}; known: {', '.join(FROZEN)}")
    start, stop = layer_range
    P = len(blocks)
    write = ctx.cache_write
    if write is CacheWrite.SEGMENT and start > 0:
        raise ValueError("a segment is computed from layer 0 (layer_range must start at 0)")
    stacks = {}
    adapted_from = None
    for p, tree in blocks.items():
        base, lora, slots = split_lora(tree)
        n, m = stack.entries(base), _lora_entries(lora)
        stacks[p] = (base, lora, slots, n, m)
        if m:
            first = stack.layer_at(p, n - m, P)
            adapted_from = first if adapted_from is None else min(adapted_from, first)
    full = sum(s[3] for s in stacks.values())
    if adapted_from is not None:
        for g in range(adapted_from, full):
            p, j = stack.where(g, P)
            if j < stacks[p][3] - stacks[p][4]:
                raise ValueError(
                    f"adapter slots must cover the model's last layers: layer {g} has none, layer {adapted_from} has"
                )
    bound = full if adapted_from is None else adapted_from
    runs = [(a, c, lo) for a, c, lo in ((start, min(stop, bound), False), (max(start, bound), stop, True)) if a < c]

    def rematted(in_scan: bool):
        # inside a scan XLA cannot merge a step's recomputation with its forward, so CSE may stay on
        if policy is None:
            return _call
        return jax.checkpoint(_call, policy=policy, prevent_cse=not in_scan, static_argnums=0)

    passthrough: dict[int, set[str]] = {p: set() for p in blocks}  # per stack: entries passed through

    def layer(p: int, lora_on: bool, weights, lora_w, x, layer_cache, in_scan: bool = True):
        slots = stacks[p][2]
        graphdef = layer_graph(layer_types[p], slots if lora_on else ())
        w = _merge(weights, lora_w) if lora_on else weights
        x, new = rematted(in_scan)(graphdef, w, x, ctx, layer_cache)
        if write is CacheWrite.NONE:
            return x, None
        if layer_cache is not None:  # entries passed through unchanged are not copied per layer
            same = {k for k, v in new.items() if k in layer_cache and v is layer_cache[k]}
            passthrough[p].update(same)
            new = {k: v for k, v in new.items() if k not in same}
        return x, new

    pieces: dict[int, list] = {p: [] for p in blocks}  # p -> [(first entry, stacked cache part)]
    if cache_blocks is not None and start > 0 and write is not CacheWrite.NONE:
        for p in blocks:
            below = len(range(p, start, P))
            if below:
                pieces[p].append((0, _slice(cache_blocks[p], 0, below, stack.entries(cache_blocks[p]))))
    for a, c, lora_on in runs:
        steps = (c - a) // P
        if steps:
            xs, dtypes = {}, {}
            for q in range(P):
                p, j0 = stack.where(a + q, P)
                base, lora, slots, n, m = stacks[p]
                parts = (
                    _slice(base, j0, steps, n),
                    _slice(lora, j0 - (n - m), steps, m) if lora_on else None,
                    None
                    if cache_blocks is None
                    else _slice(cache_blocks[p], j0, steps, stack.entries(cache_blocks[p])),
                )
                packed = [_packed(t, kind in frozen) for t, kind in zip(parts, FROZEN)]
                xs[q] = tuple(t for t, _ in packed)
                dtypes[q] = tuple(d for _, d in packed)

            out_dtypes = {}  # the new caches' dtypes, seen when the step is traced

            def body(x, xs_step, a=a, lora_on=lora_on, dtypes=dtypes, out_dtypes=out_dtypes):
                out = {}
                for q in range(P):
                    weights, lora_w, layer_cache = map(_unpacked, xs_step[q], dtypes[q])
                    x, new = layer(stack.where(a + q, P)[0], lora_on, weights, lora_w, x, layer_cache)
                    # stacked as bits too: a bf16 output stack is otherwise converted whole every step
                    out[q], out_dtypes[q] = _packed(new, "caches" in frozen)
                return x, out

            x, ys = jax.lax.scan(body, x, xs, length=steps, unroll=min(unroll, steps))
            for q in range(P):
                if ys[q] is not None:
                    p, j0 = stack.where(a + q, P)
                    pieces[p].append((j0, _unpacked(ys[q], out_dtypes[q])))
        for g in range(a + steps * P, c):  # the layers outside whole steps, one by one
            p, j = stack.where(g, P)
            base, lora, slots, n, m = stacks[p]
            take = lambda t, j=j: jax.tree.map(lambda v: v[j], t)
            layer_cache = None if cache_blocks is None else take(cache_blocks[p])
            lora_w = jax.tree.map(lambda v, i=j - (n - m): v[i], lora) if lora_on else None
            x, new = layer(p, lora_on, take(base), lora_w, x, layer_cache, in_scan=False)
            if new is not None:
                pieces[p].append((j, jax.tree.map(lambda v: v[None], new)))
    if write is CacheWrite.NONE:
        return x, None
    new_blocks = {}
    for p, parts in pieces.items():
        if not parts:
            continue
        parts = [t for _, t in sorted(parts, key=lambda e: e[0])]
        merged = parts[0] if len(parts) == 1 else jax.tree.map(lambda *v: jnp.concatenate(v, axis=0), *parts)
        if passthrough[p]:
            kept = len(range(p, stop, P))
            have = stack.entries(cache_blocks[p])
            merged = {**merged, **{k: _slice(cache_blocks[p][k], 0, kept, have) for k in passthrough[p]}}
        new_blocks[p] = merged
    return x, new_blocks
