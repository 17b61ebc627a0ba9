"""A micro-batch's shape without its content: what a server records of the batches that made it
compile, so that its next start can compile the same programs before it reports ready.

The programs a batch runs (`Executor.batch_programs`) depend on token counts and on which token runs
are equal (rows sharing a question header become one cache segment, rows sharing a state-independent
lead join the prefix), never on the tokens themselves. A signature keeps exactly that: per prefix and
per row its length and the longest run it shares with an earlier one; `synthesize` rebuilds entries with
made-up token ids that have the same lengths and the same shared runs, hence the same programs. No text,
no token id of a request is kept."""

from __future__ import annotations

import os

from lev_jax.readout.plan import Row

VERSION = 1
FIRST_ID = 1000  # made-up ids start past the special tokens every vocabulary puts first


def _tree(seqs: list[list[int]]) -> list[list[int]]:
    """Per sequence [parent, shared]: the earlier sequence sharing the longest leading run with it (-1
    for none) and that run's length. Equal-length runs form a tree (leading-run lengths are an
    ultrametric), so rebuilding each from its parent restores every pair's shared run."""
    out = []
    for i, s in enumerate(seqs):
        best, shared = -1, 0
        for j in range(i):
            n = len(os.path.commonprefix([s, seqs[j]]))
            if n > shared:
                best, shared = j, n
        out.append([best, shared])
    return out


def signature(entries) -> dict:
    """The shape of a micro-batch of (prefix_ids, rows) entries (JSON-able)."""
    prefixes = [list(p) for p, _ in entries]
    rows = [r for _, rs in entries for r in rs]
    row_tree = _tree([r.tokens for r in rows])
    return {
        "version": VERSION,
        "prefixes": [[len(p), *t] for p, t in zip(prefixes, _tree(prefixes))],
        # a Mode B row also keeps its marker positions (which calls read markers depends on them)
        "rows": [
            [len(r.tokens), *t, r.header, r.stateless, len(r.label_ids)] + ([list(r.markers)] if r.markers else [])
            for r, t in zip(rows, row_tree)
        ],
        "rows_per_entry": [len(rs) for _, rs in entries],
    }


def _rebuild(spec: list[list[int]], next_id: int) -> tuple[list[list[int]], int]:
    out = []
    for length, parent, shared, *_ in spec:
        head = out[parent][:shared] if parent >= 0 else []
        fresh = list(range(next_id, next_id + length - len(head)))
        next_id += len(fresh)
        out.append(head + fresh)
    return out, next_id


def synthesize(sig: dict, vocab_size: int) -> list[tuple[list[int], list[Row]]]:
    """Entries with the signature's shape, made-up token ids; ValueError for a signature this version
    cannot rebuild or whose made-up ids would not fit the vocabulary."""
    if sig.get("version") != VERSION:
        raise ValueError(f"shape signature version {sig.get('version')!r}, expected {VERSION}")
    prefixes, next_id = _rebuild(sig["prefixes"], FIRST_ID)
    tokens, next_id = _rebuild(sig["rows"], next_id)
    labels = max((spec[5] for spec in sig["rows"]), default=0)
    if next_id + labels > vocab_size or len(prefixes) != len(sig["rows_per_entry"]):
        raise ValueError("shape signature does not fit this model")
    rows = [
        Row(
            t,
            list(range(next_id, next_id + spec[5])),
            header=spec[3],
            stateless=spec[4],
            markers=list(spec[6]) if len(spec) > 6 else None,
        )
        for t, spec in zip(tokens, sig["rows"])
    ]
    if any(r.markers and max(r.markers) >= len(r.tokens) for r in rows):
        raise ValueError("shape signature does not fit this model")
    entries, k = [], 0
    for p, n in zip(prefixes, sig["rows_per_entry"]):
        entries.append((p, rows[k : k + n]))
        k += n
    return entries
