"""Rebuild a model's tokenizer from a GGUF file's ``tokenizer.*`` metadata.

    tok = tokenizer_from_gguf("model.gguf")   # or a gguf.GGUFReader, or a GGUFCheckpoint

The vocabulary and merges become a ``tokenizers`` byte-level BPE whose pre-tokenizer follows
``tokenizer.ggml.pre`` as llama.cpp does, wrapped in :class:`lev_jax.tokenizer.Tokenizer`. This lives with
the loaders (not in :mod:`lev_jax.tokenizer`) so that the tokenizer module never imports the loaders:
the dependency runs one way, loaders -> tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lev_jax.errors import CheckpointError
from lev_jax.loaders.gguf_reader import field_value, open_reader, reader_path
from lev_jax.tokenizer import Tokenizer, bytes_to_unicode, spell_bytes

__all__ = ["tokenizer_from_gguf"]


# --------------------------------------------------------------------------------------------------
# Pre-tokenizer splits (llama.cpp `tokenizer.ggml.pre` names -> how the text is cut before BPE).
# --------------------------------------------------------------------------------------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# kind -> (split regex or None for the GPT-2 ByteLevel regex, individual digits first, NFC, ignore_merges)
_PRE_KINDS: dict[str, tuple[str | None, bool, bool, bool]] = {
    "gpt2": (None, False, False, False),
    "starcoder": (None, True, False, False),
    "llama3": (_LLAMA3_SPLIT, False, False, True),
    "qwen2": (_QWEN2_SPLIT, False, True, False),
    "qwen35": (_QWEN35_SPLIT, False, True, False),
    "gpt-4o": (_GPT4O_SPLIT, False, False, False),
}
_GGUF_PRE_TYPES: dict[str, str] = {
    **{name: "gpt2" for name in ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")},
    # llama.cpp: `\p{N}` first, then the GPT-2 regex -- what HF's Digits(individual)+ByteLevel does.
    **{name: "starcoder" for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")},
    **{name: "llama3" for name in ("llama3", "llama-bpe", "llama-v3", "falcon3", "smaug-bpe", "dbrx")},
    **{name: "qwen2" for name in ("qwen2", "deepseek-r1-qwen")},
    "qwen35": "qwen35",
    **{name: "gpt-4o" for name in ("gpt-4o", "llama4")},
}

# llama.cpp token types
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_MISSING = object()


def tokenizer_from_gguf(reader_or_path: Any) -> Tokenizer:
    """From a GGUF file's ``tokenizer.*`` metadata (a path, a ``gguf.GGUFReader`` or a GGUFCheckpoint).

    Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) and honours ``tokenizer.ggml.pre``
    (e.g. SmolLM2's ``"smollm"``: every digit is its own pre-token, as in the model's original
    ``tokenizer.json`` and in llama.cpp).
    """
    reader = getattr(reader_or_path, "reader", reader_or_path)
    if isinstance(reader, (str, os.PathLike)):
        reader = open_reader(reader)
    where = reader_path(reader)

    def get(key: str, default: Any = _MISSING) -> Any:
        value = field_value(reader, key)
        if value is None:
            if default is _MISSING:
                raise CheckpointError(f"{where}: GGUF metadata field {key!r} is missing")
            return default
        return value

    model = get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"{where}: tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported")
    tokens = get("tokenizer.ggml.tokens")
    merges = get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{where}: GGUF metadata field 'tokenizer.ggml.tokens' is not a token list")
    if not isinstance(merges, list):
        raise CheckpointError(f"{where}: GGUF metadata field 'tokenizer.ggml.merges' is not a list")
    token_types = get("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise CheckpointError(
            f"{where}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )
    pre = get("tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRE_TYPES:
        raise CheckpointError(f"{where}: tokenizer.ggml.pre {pre!r} is not supported; known: {sorted(_GGUF_PRE_TYPES)}")

    def token_id(key: str) -> int | None:
        value = get(key, None)
        if value is None:
            return None
        value = int(value)
        if not 0 <= value < len(tokens):
            raise CheckpointError(f"{where}: {key} = {value} is outside the vocabulary (0..{len(tokens) - 1})")
        return value

    tk = _byte_level_bpe(tokens, merges, token_types, _GGUF_PRE_TYPES[pre], where)
    special_ids = {i for i, t in enumerate(token_types) if t == _TOKEN_CONTROL}
    ids = {k: token_id(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding", "unknown")}
    special_ids.update(i for i in ids.values() if i is not None)
    chat_template = get("tokenizer.chat_template", None)
    name = Path(where).stem if where else "gguf"
    return Tokenizer.from_hf_tokenizer(
        tk,
        name=name,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["padding"],
        unk_id=ids["unknown"],
        special_ids=special_ids,
        chat_template=chat_template if isinstance(chat_template, str) else None,
        add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
    )


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int], kind: str, where: str):
    """A ``tokenizers`` byte-level BPE from GGUF vocab/merges, with control and user-defined tokens whole."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    split, individual_digits, nfc, ignore_merges = _PRE_KINDS[kind]
    alphabet = set(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for i, (token, token_type) in enumerate(zip(tokens, token_types)):
        # Control / user-defined tokens keep their spelling: they are matched whole in the text.
        if token_type not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and not set(token) <= alphabet:
            token = spell_bytes(token.encode("utf-8"))
        vocab.setdefault(token, i)
    pairs = []
    for n, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{where}: tokenizer.ggml.merges[{n}] = {merge!r} is not 'left right'")
        pairs.append((parts[0], parts[1]))
    try:
        tk = HFTokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False))
    except Exception as e:
        raise CheckpointError(f"{where}: GGUF vocabulary/merges do not form a BPE model ({e})") from e
    if nfc:
        tk.normalizer = normalizers.NFC()
    if split is None:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if individual_digits
            else byte_level
        )
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tk.decoder = decoders.ByteLevel()
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, tt in zip(tokens, token_types)
        if tt == _TOKEN_CONTROL and t
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, tt in zip(tokens, token_types)
        if tt == _TOKEN_USER_DEFINED and t
    ]
    if control:
        tk.add_special_tokens(control)
    if user:
        tk.add_tokens(user)
    # Adding must not have grown the vocabulary: every added token is one the file already numbers.
    if tk.get_vocab_size(with_added_tokens=True) != len(vocab):
        raise CheckpointError(
            f"{where}: control/user-defined tokens of tokenizer.ggml.tokens are missing from the vocabulary"
        )
    return tk
