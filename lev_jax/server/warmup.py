"""Start-up warm-up: compile, in the background, the device programs ordinary requests hit.

Every device call runs one of a small fixed set of programs (lev_jax/buckets.py: prefill and
long-row chunks per cache capacity, slab shapes, tails); on a 2-core CPU each costs a second or
two to compile. The warm-up runs a grid of representative requests through the engine while the
server already answers (`/health` says "warming", then "ready"): states at the common sizes x the
common question mixes (a yes/no, a small choice, a score, and all three together), single, and
with a Mode B head large choices of 32 to 255 options; then rows of one to three chunks and their
tails and the prefill of the first-chunk sizes (shape signatures: `long_row_shapes`,
`prefill_shapes`), which with the schema first is what a question about a document needs whatever
its exact length; then concurrent micro-batches; smallest first, within a time budget. With the
persistent compilation cache (lev_jax/runtime.py) a restarted server loads these programs from disk
instead of compiling them, so its warm-up takes a fraction of the first. The grid's requests
compute nothing (`programs.compile_only`): each program call builds its executable and returns
zeros, so a warm-up costs its compiles (or loads) alone.

What the grid cannot guess is the shapes of the traffic a deployment really gets. A server with a
compilation cache records the shape (no content: `readout.shapes`) of every batch that made it compile
in a shape log next to the cache, and warms those shapes first, most used first, at its next start.

The server's scheduler keeps requests that still need a new program out of the way of those whose
programs are ready (lev_jax/server/scheduler.py), so warm-up order only decides what is fast first.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from lev_jax import programs

log = logging.getLogger("lev_jax.server")

# Target state sizes in prompt tokens: a chat message, a short ticket, a ~1 KB document, a ~2 KB one.
STATE_TOKENS = (40, 120, 250, 560)
NOUL = {"type": "noul", "instructions": "Is the customer asking for money back?", "criteria": None}
CHOICE = {
    "type": "choice",
    "instructions": "Which team should handle this ticket?",
    "criteria": {
        "Billing": "Payments, invoices, refunds",
        "Technical": "Bugs, outages, integrations",
        "Sales": "Pricing, upgrades, new contracts",
        "Other": None,
    },
}
SCORE = {"type": "score", "instructions": "How urgent is this ticket?", "criteria": ["low", "medium", "high"]}
MIXES = ({"noul": NOUL}, {"choice": CHOICE}, {"score": SCORE}, {"noul": NOUL, "choice": CHOICE, "score": SCORE})
# large choices a model with a Mode B head reads with it: each options block is a prefix of its own
# size (its chunks and its answer's read after the state, per cache capacity)
LARGE_CHOICES = (32, 64, 128, 255)
CONCURRENT = (2, 4, 8)  # micro-batch sizes warmed for the all-three mix
CONCURRENT_MAX_TOKENS = 250  # ... on states up to this size (8 larger states are compute, not compiles)
DEFAULT_BUDGET_S = 600.0  # the whole grid on an empty cache on a 2-core CPU (BENCHMARKS.md)
SHAPE_LOG_DIR = "lev_jax_shapes"  # inside the compilation cache directory
SHAPE_LOG_LIMIT = 64  # recorded shapes kept per model and dtype (the least used are dropped)
WORDS = "the customer wrote about an order a refund and a late delivery again".split()


def state_of(engine, tokens: int) -> str:
    """A state text of about `tokens` tokens (binary search over words). Counted by the tokenizer, not
    by the plan's prefix: with the schema first the state is read inside every question's row."""
    lo, hi = 1, max(2, tokens * 2)
    while lo < hi:
        mid = (lo + hi) // 2
        text = " ".join(WORDS[i % len(WORDS)] for i in range(mid))
        if len(engine.tokenizer.encode(text)) < tokens:
            lo = mid + 1
        else:
            hi = mid
    return " ".join(WORDS[i % len(WORDS)] for i in range(lo))


def default_batches(engine) -> list[list[tuple]]:
    """The warm-up grid as micro-batches of (state, questions), in the order they run."""
    states = [state_of(engine, n) for n in STATE_TOKENS]
    batches = [[(state, mix)] for state in states for mix in MIXES]
    everything = MIXES[-1]
    if engine.info().get("mode_b"):
        for n in LARGE_CHOICES:
            large = {
                "type": "choice",
                "instructions": "Which queue should this ticket go to?",
                "criteria": {f"Queue {i:03d}": f"Tickets routed to queue {i}" for i in range(1, n + 1)},
            }
            batches.append([(states[0], {"queue": large})])
    for n in CONCURRENT:
        for state in states[: sum(t <= CONCURRENT_MAX_TOKENS for t in STATE_TOKENS)]:
            batches.append([(f"{state} ({i})", everything) for i in range(n)])
    return batches


def long_row_shapes(engine) -> list[dict]:
    """Shape signatures (`readout.shapes`) of the all-three mix with every row longer than a prefill
    chunk: one to four chunks and a tail. A row past a chunk is read chunk by chunk (each into the
    cache grown to the capacity that holds it) and then its tail, one program each per capacity
    wherever the row's text ends (readout.execute.tail_start): with the schema first every question
    about a state of more than a few hundred tokens is such a row, so these few programs are what a
    request about a document of up to ~1,500 tokens needs, whatever its exact length."""
    from lev_jax import buckets
    from lev_jax.readout import shapes

    plan = engine.plan(state_of(engine, STATE_TOKENS[0]), MIXES[-1])  # a short prefix: the common cache size
    base = shapes.signature([(plan.prefix_ids, plan.rows)])
    out = []
    for chunks in (1, 2, 3, 4):
        sig = json.loads(json.dumps(base))
        for spec in sig["rows"]:
            # [length, parent, shared, header, stateless, labels, ...]: a lead of `stateless` tokens
            # joins the prefix; the rest is whole chunks and the tail
            spec[0] = spec[4] + chunks * buckets.PREFILL_CHUNK + buckets.TAIL[0]
        out.append(sig)
    return out


def prefill_shapes(engine) -> list[dict]:
    """Shape signatures that compile the prefill of every prefix bucket up to one chunk, smallest
    first, and nothing else (a one-chunk row whose tail `long_row_shapes` warms). With the schema first
    a prefix is the header and a question's own text, so its length is the question's, not the
    state's: every new question length would otherwise compile on the request path."""
    from lev_jax import buckets
    from lev_jax.readout import shapes

    # [length, parent, shared, header, stateless, labels]
    row = [buckets.PREFILL_CHUNK + buckets.TAIL[0], -1, 0, 0, 0, 2]
    return [
        {"version": shapes.VERSION, "prefixes": [[size, -1, 0]], "rows": [row], "rows_per_entry": [1]}
        for size in buckets.PREFIX[1:]
        if size <= buckets.PREFILL_CHUNK
    ]


class ShapeLog:
    """The shapes (readout.shapes signatures) of batches that made a server compile, with how often
    each was recorded, kept in one JSON file per model and dtype; written atomically, so a crash never
    leaves half a log (an unreadable log is ignored and replaced)."""

    def __init__(self, path: str | os.PathLike, limit: int = SHAPE_LOG_LIMIT):
        self.path = Path(path)
        self.limit = limit
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        try:
            doc = json.loads(self.path.read_text())
            self.counts = {str(k): int(v) for k, v in doc["shapes"].items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("ignoring the unreadable shape log %s (%s)", self.path, e)

    @classmethod
    def for_engine(cls, cache_dir: str | os.PathLike, engine) -> ShapeLog:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{engine.model_name}-{engine.backbone.dtype}")
        return cls(Path(cache_dir) / SHAPE_LOG_DIR / f"{name}.json")

    def signatures(self) -> list[dict]:
        """Most recorded first."""
        with self.lock:
            keys = sorted(self.counts, key=lambda k: -self.counts[k])
        return [json.loads(k) for k in keys]

    @staticmethod
    def key(signature: dict) -> str:
        return json.dumps(signature, separators=(",", ":"), sort_keys=True)

    def add(self, signature: dict) -> None:
        key = self.key(signature)
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if len(self.counts) > self.limit:  # the least used of the others: a new shape gets its chance
                del self.counts[min((k for k in self.counts if k != key), key=lambda k: self.counts[k])]
        self.save()

    def discard(self, signature: dict) -> None:
        with self.lock:
            self.counts.pop(self.key(signature), None)
        self.save()

    def save(self) -> None:
        with self.lock:
            doc = json.dumps({"shapes": self.counts})
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".shapes-")
            with os.fdopen(fd, "w") as f:
                f.write(doc)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only cache must not fail a request
            log.warning("cannot write the shape log %s (%s)", self.path, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


class Warmup:
    """Runs the recorded shapes (`shape_log`), then the warm-up grid, in a background thread;
    `info()` is what /health reports."""

    def __init__(
        self,
        engine,
        budget_s: float = DEFAULT_BUDGET_S,
        batches: list[list[tuple]] | None = None,
        shape_log: ShapeLog | None = None,
    ):
        self.engine = engine
        self.budget_s = budget_s
        self.batches = batches
        # long-row tails and prefix prefills (`long_row_shapes`, `prefill_shapes`), warmed between the
        # single requests and the concurrent ones of the default grid; a caller's `batches` come without
        self.shapes: list[dict] | None = None
        self.shapes_planned = 0
        self.shapes_done = 0
        self.shape_log = shape_log
        self.programs: set | None = None  # the grid's program keys, once planned
        self.planned = 0 if batches is None else len(batches)
        self.recorded_planned = 0
        self.recorded_done = 0
        self.done = 0
        self.failed = 0
        self.seconds = 0.0
        self.state = "warming" if budget_s > 0 else "ready"
        self.stopped_early = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start(self) -> None:
        if self.state == "ready" or self._thread is not None:
            return
        self._thread = threading.Thread(target=self.run, name="lev-warmup", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        # compute nothing (programs.compile_only): the grid's answers are dropped, and on a restart
        # whose programs are all stored, computing them was most of the time; and step aside at
        # every program call while a request is in flight (programs.background)
        with programs.compile_only(), programs.background():
            self._run()

    def _run(self) -> None:
        t0 = time.perf_counter()
        compiled0 = self._compiled()
        try:
            self.warm_recorded(t0)
            batches = self.batches if self.batches is not None else default_batches(self.engine)
            sigs = self.shapes
            if sigs is None:
                sigs = [] if self.batches is not None else long_row_shapes(self.engine) + prefill_shapes(self.engine)
            self.planned, self.shapes_planned = len(batches), len(sigs)
            self.programs = self.plan_programs(batches, sigs)
            singles = [b for b in batches if len(b) == 1]
            jobs = [(True, b) for b in singles] + [(False, s) for s in sigs]
            jobs += [(True, b) for b in batches if len(b) != 1]
            for is_batch, job in jobs:
                if self._over(t0):
                    self.stopped_early = True
                    break
                if is_batch:
                    # a batch whose programs an earlier one built has nothing left to build
                    if not self._built(job):
                        results = self.engine.predict_many(job)
                        self.failed += sum(isinstance(r, Exception) for r in results)
                    self.done += 1
                else:
                    try:
                        self.engine.warm(job)
                    except ValueError as e:  # a shape past this configuration's limits
                        log.info("skipping a warm-up shape (%s)", e)
                        self.failed += 1
                    self.shapes_done += 1
                self.seconds = time.perf_counter() - t0
        except Exception:  # noqa: BLE001 — a failed warm-up must not take the server down
            log.exception("warm-up failed after %d of %d batches", self.done, self.planned)
            self.failed += 1
        self.seconds = time.perf_counter() - t0
        self.state = "ready"
        log.info(
            "warm-up: %d of %d recorded shapes, %d of %d batches and %d of %d grid shapes in %.1fs, "
            "%s programs compiled%s",
            self.recorded_done,
            self.recorded_planned,
            self.done,
            self.planned,
            self.shapes_done,
            self.shapes_planned,
            self.seconds,
            self._compiled() - compiled0 if compiled0 is not None else "?",
            " (budget reached)" if self.stopped_early else "",
        )

    def record(self, signature: dict) -> None:
        """Engine.on_compile: log what traffic compiled (not what the warm-up itself runs)."""
        if self.shape_log is not None and threading.current_thread() is not self._thread:
            self.shape_log.add(signature)

    def _over(self, t0: float) -> bool:
        return self._stop.is_set() or time.perf_counter() - t0 > self.budget_s

    def warm_recorded(self, t0: float) -> None:
        """The shapes this deployment compiled before, most used first; one that no longer fits the
        model (another tokenizer, new limits) is dropped from the log."""
        if self.shape_log is None:
            return
        shapes = self.shape_log.signatures()
        self.recorded_planned = len(shapes)
        for sig in shapes:
            if self._over(t0):
                self.stopped_early = True
                return
            try:
                self.engine.warm(sig)
            except (ValueError, KeyError, TypeError, IndexError) as e:
                log.info("dropping a recorded shape this model cannot run (%s)", e)
                self.shape_log.discard(sig)
                self.failed += 1
            self.recorded_done += 1
            self.seconds = time.perf_counter() - t0

    def plan_programs(self, batches, sigs) -> set | None:
        """The program keys the grid runs (`/health` reports how many exist and how many are ready);
        None for an engine that cannot name them."""
        from lev_jax.readout import shapes

        try:
            keys = set()
            for batch in batches:
                keys |= self.engine.batch_programs([self.engine.plan(s, q) for s, q in batch])
            for sig in sigs:
                keys |= self.engine.executor.batch_programs(
                    shapes.synthesize(sig, self.engine.backbone.config.vocab_size)
                )
            return keys
        except Exception:  # noqa: BLE001 — a report, never a reason to fail the warm-up
            log.info("warm-up: the grid's programs could not be listed", exc_info=True)
            return None

    def _built(self, batch) -> bool:
        """Whether every program `batch` runs is built already (False for an engine that cannot say)."""
        try:
            return bool(self.engine.ready(batch))
        except Exception:  # noqa: BLE001 — an engine without the predicate: run the batch
            return False

    def _compiled(self):
        try:
            return int(self.engine.info().get("compiled_programs"))
        except Exception:  # noqa: BLE001 — an engine without a program count
            return None

    def info(self) -> dict:
        return {
            "state": self.state,
            "batches_done": self.done,
            "batches_planned": self.planned,
            "recorded_shapes_done": self.recorded_done,
            "recorded_shapes_planned": self.recorded_planned,
            "grid_shapes_done": self.shapes_done,
            "grid_shapes_planned": self.shapes_planned,
            "failed": self.failed,
            "seconds": round(self.seconds if self.state == "ready" else self.seconds, 3),
            "budget_s": self.budget_s,
            "stopped_early": self.stopped_early,
            # the distinct device programs the grid needs, and how many of them this process has run
            "programs_planned": None if self.programs is None else len(self.programs),
            "programs_ready": None if self.programs is None else len(self.programs & self._ready_keys()),
        }

    def _ready_keys(self) -> set:
        for _ in range(3):  # the engine's set grows under other threads; a copy may meet a resize
            try:
                return set(getattr(self.engine, "compiled_keys", ()))
            except RuntimeError:
                continue
        return set()
