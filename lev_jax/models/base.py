"""The decoder-only LM shell every backbone shares: embed -> layers -> final norm -> (head on demand).

Subclasses say how big the rotary slice is; their config builds one decoder layer of a kind
(`cfg.layer_module(kind, dtype)`, called as `layer(x, ctx: Context, layer_cache) -> (x, new_layer_cache)`).
The layers are not children of the shell: their weights are stacks (models.stack) that the call
takes as its first argument and runs under `jax.lax.scan` (models.scan), each step merging one
layer's slice into that layer's graph.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from flax import nnx

from lev_jax.models import cache as cache_lib
from lev_jax.models import scan, stack
from lev_jax.models.context import CacheWrite, Context
from lev_jax.models.layers import ExitMap, dense, rope_cos_sin

# Rematerialisation, per decoder layer: name -> the jax.checkpoint policy each layer's call runs
# under (None: no checkpoint, the plain call). Under a policy the backward pass keeps only each
# layer's inputs and what the policy saves, and recomputes the rest of that layer: activation
# memory of a training step then grows with one layer's intermediates, not all of them.
REMAT_POLICIES = types.MappingProxyType(
    {
        "none": None,
        "full": jax.checkpoint_policies.nothing_saveable,  # save nothing: least memory, ~1 extra forward
        "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep the weight matmuls' outputs
    }
)


def remat_policy(name: str):
    """The checkpoint policy of a REMAT_POLICIES name (None for "none")."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"unknown remat {name!r}; known: {', '.join(REMAT_POLICIES)}")
    return REMAT_POLICIES[name]


def _layer_dtype(blocks) -> str:
    for path, leaf in jax.tree_util.tree_flatten_with_path(blocks)[0]:
        if getattr(path[-1], "key", None) == "kernel":
            return str(leaf.dtype)
    return "float32"


@functools.cache
def _layer_graph(cfg, dtype: str, kind: str, lora: tuple[tuple[str, int], ...] = ()):
    """The graph of one decoder layer of `kind` (its weights come per step from the stacks), with
    adapter slots on the `lora` (module path, rank) pairs (`layers.Dense.add_lora`)."""

    def build():
        layer = cfg.layer_module(kind, jnp.dtype(dtype))
        for path, rank in lora:
            module = layer
            for part in path.split("."):
                module = getattr(module, part)
            module.add_lora(rank)
        return layer

    return nnx.split(nnx.eval_shape(build))[0]


class CausalLM(nnx.Module):
    rot_dim: int
    rope_theta: float

    def _init_shell(self, cfg, norm, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg  # static: the layer stacks are built from it (`layer_graph`)
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.norm = norm
        if not cfg.tie_word_embeddings:
            self.lm_head = dense(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)
        self.tied = cfg.tie_word_embeddings
        # a model truncated at an elastic-depth exit (models.exit_view) maps its last layer's output
        # towards the full model's before the shared final norm; the full model has no map
        rank = getattr(cfg, "exit_rank", 0)
        self.exit = ExitMap(cfg.hidden_size, rank, dtype=dtype) if rank else None

    def __call__(
        self,
        blocks,
        tokens_BT,
        cache=None,
        valid_BT=None,
        positions_BT=None,
        readout_BR=None,
        cache_write: CacheWrite = CacheWrite.APPEND,
        anchored_softmax: bool = False,
        remat: str = "none",
        embeds_BTE=None,
        embeds_mask_BT=None,
        hidden_BTE=None,
        layer_range: tuple[int, int] | None = None,
        final_norm: bool = True,
        mask_BTT=None,
    ):
        """Run T new tokens after `cache` (None: no context) through the layer stacks `blocks`
        (models.stack: params["blocks"]). Returns (hidden, new_cache) where hidden
        is the final-normed state at `readout_BR` ([B, R, E], indices into the T new tokens) or at
        every new token ([B, T, E]), and new_cache is as `cache_write` asks (CacheWrite): the cache
        extended by the new slots (APPEND), None (NONE: a readout over a shared prefix never needs
        B copies of it, nor room in its buffer), or the shared `cache` plus the new tokens as a
        per-row second level (SEGMENT, cache.with_segment), which later rows read without copying
        the shared part.
        `anchored_softmax`: attention against a shared cache uses the faster anchored stabiliser
        (layers.attend); a row it cannot serve comes out NaN and must be rerun without it.
        `remat`: a REMAT_POLICIES name, how each decoder layer is rematerialised under jax.grad
        (the forward values are the same under every policy).
        `embeds_BTE` / `embeds_mask_BT`: input embeddings that replace the token embeddings where the
        mask is set (image features at their placeholder tokens); `positions_BT` may then be
        [3, B, T] multimodal positions (layers.rope_cos_sin).
        `layer_range` (start, stop): run only layers [start, stop) (elastic depth: an exit after layer
        `stop` computes and caches nothing deeper). With start > 0 the input is `hidden_BTE`, the
        residual stream after layer `start` (saved by a shallower call), instead of the token
        embeddings; a cache it continues holds at least layers [0, stop) (a prefix computed that
        deep), or it is None and the call computes the cache of layers [start, stop) alone
        (`elastic.cascade.deepen` stacks it on the shallower one). An APPEND or SEGMENT cache comes
        back with layers [0, stop). `final_norm=False` returns the raw
        residual stream (what a deeper call continues, and what an exit adapter reads).
        `mask_BTT`: which new tokens each new token attends (rows packed into one lane, each with
        its own `positions_BT`; readout.slab); attention-only models, since a recurrent layer's
        state runs through every token of a lane.
        The config's `scan_unroll` sets how many scan steps one loop iteration runs; its
        `scan_frozen` which scan inputs no gradient flows into (models.scan)."""
        if mask_BTT is not None and any(kind != "full_attention" for kind in self.cfg.layer_types):
            raise ValueError("packed rows (mask_BTT) need an attention-only model: a recurrent layer reads every token")
        if not isinstance(cache_write, CacheWrite):
            raise ValueError(
                f"cache_write must be a CacheWrite ({', '.join(m.name for m in CacheWrite)}), not {cache_write!r}"
            )
        policy = remat_policy(remat)
        L = int(self.cfg.num_hidden_layers)
        start, stop = (0, L) if layer_range is None else (int(layer_range[0]), int(layer_range[1]))
        if not 0 <= start < stop <= L:
            raise ValueError(f"layer_range must be 0 <= start < stop <= {L}, not {layer_range}")
        if (start > 0) != (hidden_BTE is not None):
            raise ValueError("hidden_BTE (the residual stream after layer start) comes exactly with a start > 0")
        if cache is not None and stack.depth(cache[stack.BLOCKS]) < stop:
            have = stack.depth(cache[stack.BLOCKS])
            raise ValueError(f"the cache holds {have} layers; a call to layer {stop} needs them all")
        B, T = tokens_BT.shape
        if valid_BT is None:
            valid_BT = jnp.ones((B, T), bool)
        if positions_BT is None:
            positions_BT = cache_lib.positions_for(cache, valid_BT)
        cos, sin = rope_cos_sin(positions_BT, self.rot_dim, self.rope_theta, getattr(self, "mrope_axes", None))
        ctx = Context(
            cos=cos,
            sin=sin,
            valid=valid_BT,
            cache_valid=None if cache is None else cache["valid"],
            offset=None if cache is None else cache["offset"],
            seg_valid=None if cache is None else cache.get("seg_valid"),
            mask=mask_BTT,
            cache_write=cache_write,
            anchored_softmax=anchored_softmax,
        )
        if hidden_BTE is not None:
            x = hidden_BTE.astype(jnp.float32)
        else:
            x = self.embed_tokens(tokens_BT).astype(jnp.float32)  # the residual stream is fp32 (layers.py)
            if embeds_BTE is not None:
                x = jnp.where(embeds_mask_BT[..., None], embeds_BTE.astype(jnp.float32), x)
        layer_graph = functools.partial(_layer_graph, self.cfg, _layer_dtype(blocks))
        x, new_blocks = scan.run(
            layer_graph,
            blocks,
            self.cfg.layer_types,
            x,
            ctx,
            None if cache is None else cache[stack.BLOCKS],
            (start, stop),
            policy,
            unroll=max(1, int(getattr(self.cfg, "scan_unroll", 1))),
            frozen=tuple(getattr(self.cfg, "scan_frozen", scan.FROZEN)),
        )
        if readout_BR is not None:  # the final norm (and later the head) only where a readout needs it
            x = jnp.take_along_axis(x, readout_BR[..., None].astype(jnp.int32), axis=1)
        if cache_write is CacheWrite.SEGMENT:
            new_cache = cache_lib.with_segment(cache, valid_BT, new_blocks)
        elif cache_write is CacheWrite.APPEND:
            new_cache = cache_lib.advance(cache, B, valid_BT, new_blocks)
        else:
            new_cache = None
        return (self.final(x) if final_norm else x), new_cache

    def final(self, x):
        """The final norm of a raw residual stream (after the exit map of a model truncated at an
        exit)."""
        if self.exit is None:
            return self.norm(x)
        return self.exit.after_norm(self.norm(self.exit(x)))

    def head(self, hidden_BRE, token_ids=None):
        """Vocabulary logits in fp32, over all rows of the head or only `token_ids` ([N] -> [..., N])."""
        if self.tied:
            w_VE = self.embed_tokens.embedding[...]
            w_NE = w_VE if token_ids is None else jnp.take(w_VE, token_ids, axis=0)
            return jnp.einsum("...e,ne->...n", hidden_BRE.astype(w_NE.dtype), w_NE, preferred_element_type=jnp.float32)
        w_EV = self.lm_head.kernel[...]
        w_EN = w_EV if token_ids is None else jnp.take(w_EV, token_ids, axis=1)
        return jnp.einsum("...e,en->...n", hidden_BRE.astype(w_EN.dtype), w_EN, preferred_element_type=jnp.float32)

    def head_rows(self, hidden_BE, ids_BC):
        """fp32 logits of a different handful of head rows per batch row: [B, E] x [B, C] ids -> [B, C].
        A readout needs only its label tokens, never the whole vocabulary."""
        if self.tied:
            w_BCE = jnp.take(self.embed_tokens.embedding[...], ids_BC, axis=0)
            return jnp.einsum("be,bce->bc", hidden_BE.astype(w_BCE.dtype), w_BCE, preferred_element_type=jnp.float32)
        w_EBC = jnp.take(self.lm_head.kernel[...], ids_BC, axis=1)  # gather columns; no [E, V] transpose
        return jnp.einsum("be,ebc->bc", hidden_BE.astype(w_EBC.dtype), w_EBC, preferred_element_type=jnp.float32)
