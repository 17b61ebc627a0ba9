"""Label codes: the single tokens a Mode A readout reads, one per offered candidate.

Letters A, B, C, ... then AA, AB, ... for choice options and score levels; Yes/No for a binary noul;
digits 0-8 for a rating noul (the code sets are in lev_jax.domain). A code counts only if appending it to the
answer context adds exactly one token to the encoding of that context: a code that splits is skipped, never
read.
"""

from __future__ import annotations

import itertools
import string

MAX_LETTER_CODES = 702  # A..Z and AA..ZZ


def _letter_candidates():
    yield from string.ascii_uppercase
    for a, b in itertools.product(string.ascii_uppercase, repeat=2):
        yield a + b


class LabelCodes:
    """Single-token codes of one tokenizer after one answer context (`context` ends where the answer
    starts; `sep` is what goes between context and code: "" after a chat turn opens, " " after
    "Answer:")."""

    def __init__(self, tokenizer, context: str, sep: str):
        self.tokenizer, self.context, self.sep = tokenizer, context, sep
        self._base = tokenizer.encode(context)
        self._letters: list[tuple[str, int]] = []
        self._letter_iter = _letter_candidates()
        self._exhausted = False

    def token_of(self, code: str) -> int | None:
        ids = self.tokenizer.encode(self.context + self.sep + code)
        if len(ids) == len(self._base) + 1 and ids[:-1] == self._base:
            return ids[-1]
        return None

    def letters(self, n: int) -> list[tuple[str, int]]:
        """The first n single-token letter codes (fewer if the tokenizer has fewer)."""
        while len(self._letters) < n and not self._exhausted:
            code = next(self._letter_iter, None)
            if code is None:
                self._exhausted = True
                break
            tok = self.token_of(code)
            if tok is not None and tok not in {t for _, t in self._letters}:
                self._letters.append((code, tok))
        return self._letters[:n]

    def capacity(self) -> int:
        """How many letter codes this tokenizer offers in this context (the group size limit)."""
        return len(self.letters(MAX_LETTER_CODES))

    def fixed(self, codes) -> tuple[str, list[tuple[str, int]]]:
        """Token ids of a fixed code set and the `lead` text the row must end with before them.

        Usually the separator belongs to the code token (" Yes" after "Answer:", lead ""). Tokenizers
        that split a separator from what follows (SmolLM2 splits " 0" into " " + "0") read the bare
        code after a row that already ends with the separator (lead " ")."""
        attempts = (
            [("", self)]
            if not self.sep
            else [("", self), (self.sep, LabelCodes(self.tokenizer, self.context + self.sep, ""))]
        )
        for lead, reader in attempts:
            toks = [reader.token_of(code) for code in codes]
            if all(t is not None for t in toks) and len(set(toks)) == len(toks):
                return lead, list(zip(codes, toks))
        raise ValueError(
            f"the tokenizer has no single token for every code of {tuple(codes)} after {self.context[-20:]!r}"
        )
