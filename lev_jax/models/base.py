"""The decoder-only LM shell every backbone shares: embed -> layers -> final norm -> (head on demand).

Subclasses build `self.layers` (an nnx.List of layers with the call signature
`layer(x, ctx, layer_cache) -> (x, new_layer_cache)`) and say how big the rotary slice is.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from lev_jax.models import cache as cache_lib
from lev_jax.models.layers import dense, rope_cos_sin


class CausalLM(nnx.Module):
    rot_dim: int
    rope_theta: float

    def _init_shell(self, cfg, norm, *, dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.norm = norm
        if not cfg.tie_word_embeddings:
            self.lm_head = dense(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)
        self.tied = cfg.tie_word_embeddings

    def __call__(self, tokens_BT, cache=None, valid_BT=None, positions_BT=None, readout_BR=None,
                 update_cache: bool | str = True, anchored_softmax: bool = False):
        """Run T new tokens after `cache` (None: no context). Returns (hidden, new_cache) where hidden
        is the final-normed state at `readout_BR` ([B, R, E], indices into the T new tokens) or at
        every new token ([B, T, E]). With `update_cache=False` nothing is written (new_cache is None):
        a readout over a shared prefix never needs B copies of it, nor room in its buffer.
        `update_cache="segment"`: the new tokens become a per-row second cache level over a shared
        `cache` (cache.with_segment), which later rows read without copying the shared part.
        `anchored_softmax`: attention against a shared cache uses the faster anchored stabiliser
        (layers.attend); a row it cannot serve comes out NaN and must be rerun without it."""
        B, T = tokens_BT.shape
        if valid_BT is None:
            valid_BT = jnp.ones((B, T), bool)
        if positions_BT is None:
            positions_BT = cache_lib.positions_for(cache, valid_BT)
        cos, sin = rope_cos_sin(positions_BT, self.rot_dim, self.rope_theta)
        ctx = {
            "cos": cos, "sin": sin, "valid": valid_BT,
            "cache_valid": None if cache is None else cache["valid"],
            "offset": None if cache is None else cache["offset"],
            "update_cache": update_cache, "anchored_softmax": anchored_softmax,
            "seg_valid": None if cache is None else cache.get("seg_valid"),
        }
        x = self.embed_tokens(tokens_BT).astype(jnp.float32)  # the residual stream is fp32 (layers.py)
        new_layers = []
        for i, layer in enumerate(self.layers):
            x, layer_cache = layer(x, ctx, None if cache is None else cache["layers"][i])
            new_layers.append(layer_cache)
        if readout_BR is not None:  # the final norm (and later the head) only where a readout needs it
            x = jnp.take_along_axis(x, readout_BR[..., None].astype(jnp.int32), axis=1)
        if update_cache == "segment":
            new_cache = cache_lib.with_segment(cache, valid_BT, tuple(new_layers))
        else:
            new_cache = cache_lib.advance(cache, B, valid_BT, tuple(new_layers)) if update_cache else None
        return self.norm(x), new_cache

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
