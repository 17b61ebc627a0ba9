"""depth="auto" on the serving path as a vertical cascade: no layer runs twice.

The confidence cascade (`Engine.answer_auto`, `elastic.policy.threshold`) reads every question at the
shallowest exit and reads again, at the next exit, each question its reading is not sure of. Read
through per-depth executors, a question that goes deeper runs its shallower layers again. Here each
reading continues the last one instead (`elastic.cascade`): a prefix is computed to the depth asked
and deepened later from its kept residual stream (one entry per prefix in an LRU shared by
requests), and a row read at exit d1 keeps its residual stream after layer d1 in the request's
`Trail`, so reading it at d2 runs layers [d1, d2) only.

What it serves: text prefixes (with a schema-first row's question lead) up to `PREFIX_MAX` tokens and
Mode A rows up to a prefill chunk after that lead (`Cascade.serves`). A request with images, Mode B
rows, rows read chunk by chunk or a longer prefix goes through the per-depth executors instead
(correct, but it re-runs the shallower layers). Attention here is the exact softmax of
`elastic.cascade`; the answers equal each depth's own readout (tests/test_elastic_serving.py).
"""

from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np

from lev_jax import buckets, programs
from lev_jax.elastic import cascade
from lev_jax.readout import logits as logits_lib
from lev_jax.readout.execute import Executor, is_long, prefill_program

# A prefix (with a row's question lead) is computed here in one call, not chunk by chunk as the
# executors do: past this many tokens its attention scores would grow quadratically in one block, so
# such a request is read by the per-exit executors instead.
PREFIX_MAX = 4 * buckets.PREFILL_CHUNK


class Trail:
    """One request's rows as far as they were read: id(row) -> (its call, residual stream [T, E] of
    its tokens after that call's depth), and each call's shape and depth. Rows are the plan's own
    objects, alive while the request is. A row read again continues in the shape of the call that
    first read it (the rows that stopped leave padding): the programs a request can run are known
    before it runs (`Cascade.programs`), whichever of its questions go deeper."""

    def __init__(self):
        # the row object is kept too: an id is unique only while its object lives (a second round's
        # rows are made anew at each depth and must not inherit a freed row's id and stream)
        self.rows: dict[int, tuple[int, jax.Array, object]] = {}
        self.calls: list[list] = []  # [readout.execute.Call, depth it was last read at]
        self.reads: list[tuple[int, int, int]] = []  # (call, from depth, to depth) in the order run

    def seen(self, row) -> bool:
        got = self.rows.get(id(row))
        return got is not None and got[2] is row


class Cascade:
    """Reads rows at an exit, continuing what a shallower exit read (see the module docstring)."""

    def __init__(self, backbone, executor: Executor, *, prefix_cache_bytes: int = 256 << 20):
        self.backbone = backbone  # the full model, with its exit adapters
        self.executor = executor  # the full depth's: its call grouping and stateless leads
        self.prefix_cache_bytes = prefix_cache_bytes
        self.prefixes: collections.OrderedDict[tuple, tuple[cascade.Prefix, int]] = collections.OrderedDict()
        self.lock = threading.Lock()

    @staticmethod
    def serves(plan) -> bool:
        """A text prefix and Mode A rows that fit a prefill chunk after their state-independent lead
        (which joins the prefix): what this path reads."""
        return (
            bool(plan.prefix_ids)
            and not getattr(plan.prefix_ids, "images", ())
            and len(plan.prefix_ids) + max(r.stateless for r in plan.rows) <= PREFIX_MAX
            and all(r.markers is None and not is_long(r.after(r.stateless)) for r in plan.rows)
        )

    # -- prefixes ---------------------------------------------------------------------------------
    def prefix(self, prefix_ids, depth: int) -> tuple[cascade.Prefix, bool]:
        """(the prefix computed to at least `depth` layers, whether its first layers were cached)."""
        key = tuple(prefix_ids)
        with self.lock:
            got = self.prefixes.get(key)
            if got is not None:
                self.prefixes.move_to_end(key)
        bb = self.backbone
        if got is not None and got[0].depth >= depth:
            return got[0], True
        if got is None:
            pb = buckets.fit(len(key), buckets.PREFIX[1:], "prefix length")
            tokens, valid = logits_lib.pack_prefixes([list(key)], 1, pb)
            pre = cascade.prefill(bb.params, jnp.asarray(tokens), jnp.asarray(valid), bb.config, depth)
        else:
            pre = cascade.deepen(bb.params, got[0], bb.config, depth)
        size = sum(x.nbytes for x in jax.tree.leaves(pre))
        if size <= self.prefix_cache_bytes and programs.computing():  # never a compile-only run's zeros
            with self.lock:
                self.prefixes[key] = (pre, size)
                self.prefixes.move_to_end(key)
                while sum(n for _, n in self.prefixes.values()) > self.prefix_cache_bytes:
                    self.prefixes.popitem(last=False)
        return pre, got is not None

    # -- rows -------------------------------------------------------------------------------------
    def read(self, entries, usages, *, depth: int, trail: Trail) -> list[list[np.ndarray]]:
        """Label logits of every row of every (prefix_ids, rows) entry at exit `depth` (a
        `readout.run` reader): a row `trail` has seen continues from the depth it was read at, in its
        first call's shape; a new row starts at layer 0 in the executor's bucketed calls."""
        out = []
        for (prefix_ids, rows), usage in zip(entries, usages):
            got: list = [None] * len(rows)
            for key, idx, rest in self.groups(prefix_ids, rows):
                pre, hit = self.prefix(key, depth)
                if not usage.prefix_seen:
                    usage.processed += len(key)
                    usage.cached += len(key) if hit else 0
                new = [j for j, i in enumerate(idx) if not trail.seen(rows[i])]
                usage.processed += sum(len(rest[j].tokens) for j in new)
                work = []
                for call in self.executor.calls([rest[j] for j in new]) if new else ():
                    trail.calls.append([call, 0])
                    work.append((len(trail.calls) - 1, [new[k] for k in call.rows]))
                again = collections.defaultdict(list)
                for j, i in enumerate(idx):
                    if trail.seen(rows[i]) and j not in new:
                        again[trail.rows[id(rows[i])][0]].append(j)
                work += sorted(again.items())
                for cid, js in work:
                    originals = [rows[idx[j]] for j in js]
                    for j, logits in zip(js, self.read_call(pre, cid, [rest[j] for j in js], originals, depth, trail)):
                        got[idx[j]] = logits
            usage.prefix_seen = True
            out.append(got)
        return out

    def groups(self, prefix_ids, rows):
        if any(r.stateless for r in rows):
            return self.executor.stateless_groups(list(prefix_ids), rows)
        return [(list(prefix_ids), list(range(len(rows))), rows)]

    def read_call(self, pre, cid: int, rest, originals, depth: int, trail: Trail) -> list[np.ndarray]:
        """`rest` (rows after the prefix, some of call `cid`'s) read at `depth` in that call's shape,
        continuing their residual streams in `trail` from the depth the call was last read at."""
        bb, E = self.backbone, int(self.backbone.config.hidden_size)
        call, start = trail.calls[cid]
        if start >= depth:
            raise ValueError(f"rows read at depth {start} cannot be read again at {depth}")
        batch = logits_lib.pack_rows(rest, call.batch, call.length, call.codes)
        rows_in = None
        if start > 0:  # the kept streams padded to the call's shape on the device (no host round trip)
            saved = [trail.rows[id(r)][1] for r in originals]
            resid = [jnp.pad(x, ((0, call.length - x.shape[0]), (0, 0))) for x in saved]
            resid += [jnp.zeros((call.length, E), saved[0].dtype)] * (call.batch - len(saved))
            rows_in = cascade.Rows(jnp.zeros((call.batch, call.codes), jnp.float32), jnp.stack(resid), start)
        args = map(jnp.asarray, (batch.tokens_BT, batch.valid_BT, batch.answer_B, batch.label_ids_BC))
        at = cascade.truncated(pre, depth)  # the program's shape follows `depth`, not what is cached
        got = cascade.read(bb.params, bb.exits, at, *args, bb.config, depth=depth, start=start, rows=rows_in)
        trail.calls[cid][1] = depth
        trail.reads.append((cid, start, depth))
        logits = np.asarray(got.logits_BC)
        for j, (r, orig) in enumerate(zip(rest, originals)):
            trail.rows[id(orig)] = (cid, got.resid_BTE[j, : len(r.tokens)], orig)
        return [logits[j, : r.width] for j, r in enumerate(rest)]

    # -- programs ---------------------------------------------------------------------------------
    def programs(self, plan, depths) -> set[tuple]:
        """The program keys a plan read through `depths` in turn may run: each prefix's prefill to
        the first and deepening to each next, every row call at the first exit and continued to
        each next (which rows go on is known only after reading)."""
        keys = set()
        for key, _, rest in self.groups(plan.prefix_ids, plan.rows):
            pb = buckets.fit(len(key), buckets.PREFIX[1:], "prefix length")
            keys.add(("cascade-prefill", prefill_program(key), pb, depths[0]))
            calls = [c.key for c in self.executor.calls(rest)]
            for start, depth in zip((0, *depths), depths):
                if start:
                    keys.add(("cascade-deepen", pb, start, depth))
                keys |= {("cascade-rows", pb, start, depth, *c) for c in calls}  # a call goes on whole
        return keys


def compiled_programs() -> int:
    """The cascade's programs compiled so far in this process."""
    return sum(f.count() for f in (cascade.prefill, cascade.deepen, cascade.read))
