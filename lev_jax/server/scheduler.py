"""Micro-batching scheduler: concurrent requests become one device call, up to a token budget.

One worker task owns the device. It takes the oldest queued requests whose input tokens fit in
`max_batch_tokens` (a single larger request still runs, alone), hands them to `run_batch` in a
one-thread executor, and resolves each request's future with its own result: an answer dict or the
exception the engine returned for that request. While a batch runs, new arrivals queue up and form
the next batch, so batches grow with load without a fixed wait.

Admission is bounded: at most `max_pending` requests are admitted (being planned, queued or running);
the next one is refused (`QueueFull`, answered 429 with Retry-After). A server admits a request
(`admit`) before it parses or plans it, so a full server spends nothing on what it will refuse. A
request whose client has gone, or whose deadline passed, is cancelled: dropped from the queue if it
has not started, its result discarded if it has.
`close()` refuses new work (`ShuttingDown`, 503) and `drain()` waits for what is in flight.

A watchdog tells the truth about the device: a request's device call that has run longer than
`watchdog_s` makes the scheduler `stuck` (logged once per call; new requests are refused with
`Unavailable`, answered 503, instead of queueing behind a call that may never end), and a worker that
died makes it `dead`. A device call cannot be interrupted from Python, so the watchdog only reports:
`/health` answers 503 and an orchestrator restarts the process.

Compilation never stalls ready work. With a `ready(requests)` predicate (the engine's: would running
these requests together compile a new device program?), a request whose own programs are not compiled
yet goes to the compile lane, with device threads of its own, where it compiles and runs while the
main lane keeps serving requests whose programs are ready. The compile lane serves `compile_lanes`
such requests at once (default 2): compiling a program is one host thread's work, so on a machine of
two cores or more, requests that arrive together, each needing programs of its own (new states right
after start-up), compile side by side instead of each waiting for all the compiles before its own.
A batch of ready requests whose *combination* is new (stacked micro-batch shapes) runs its requests
one by one in the main lane, and the compile lane, when idle, compiles that combination in the
background by running the same batch once more, compile-only (`programs.compile_only`: its programs
built, none run; the results are dropped anyway), so the next such batch runs stacked.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lev_jax import programs

log = logging.getLogger("lev_jax.server")

MAX_RETRY_AFTER_S = 60.0
STOP_WAIT_S = 120.0  # how long stop() waits for a device call in flight
RunBatch = Callable[[Sequence[tuple[Any, dict]]], Sequence[Any]]
Ready = Callable[[Sequence[tuple[Any, dict]]], bool]


class QueueFull(Exception):
    def __init__(self, retry_after_s: float):
        super().__init__(f"queue full; retry after {retry_after_s:.2f}s")
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> int:
        """Whole seconds, as the Retry-After header needs them (at least 1)."""
        return max(1, math.ceil(self.retry_after_s))


class ShuttingDown(Exception):
    pass


class Unavailable(ShuttingDown):
    """The device is stuck or the worker is dead: nothing admitted now would be answered."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Ticket:
    state: Any
    questions: dict
    tokens: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None
    cancelled: bool = False

    @property
    def running(self) -> bool:
        return self.started is not None and not self.future.done()


class Scheduler:
    def __init__(
        self,
        run_batch: RunBatch,
        *,
        max_pending: int = 64,
        max_batch_tokens: int = 16384,
        max_batch_rows: int = 64,
        batch_wait_s: float = 0.0,
        metrics=None,
        ready: Ready | None = None,
        compile_lanes: int = 2,
        watchdog_s: float = 300.0,
    ):
        if watchdog_s <= 0:
            raise ValueError("watchdog_s must be positive")
        if max_pending < 1 or max_batch_tokens < 1 or max_batch_rows < 1 or compile_lanes < 1:
            raise ValueError("max_pending, max_batch_tokens, max_batch_rows and compile_lanes must be positive")
        self.run_batch = run_batch
        self.max_pending = max_pending
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_rows = max_batch_rows
        self.batch_wait_s = batch_wait_s
        self.metrics = metrics
        self.ready = ready
        self.compile_lanes = compile_lanes
        self.watchdog_s = watchdog_s
        self.dead: str | None = None  # why a worker died, once one has
        self._watchdog: asyncio.Task | None = None
        self._reported: set[int] = set()  # ids of tickets whose stuck call has been logged
        self._queue: collections.deque[Ticket] = collections.deque()
        # the compile lane: requests that need new programs, and batches to compile in the background
        self._cold: collections.deque[Ticket | list[Ticket]] = collections.deque()
        self._cold_wake: asyncio.Event | None = None
        self._cold_workers: list[asyncio.Task] = []
        self._cold_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.cold_runs = 0  # requests served in the compile lane
        self.background_compiles = 0  # micro-batch combinations compiled in the compile lane
        self.split_batches = 0  # batches of ready requests run one by one (their combination was new)
        self._running: list[Ticket] = []
        self._pending = 0  # admitted (being planned) + queued (not cancelled) + running
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closing = False
        self._batch_s = 0.0  # EMA of batch wall time
        self._batch_rows = 1.0  # EMA of rows per batch
        self.batches = 0

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lev-device")
        self._worker = asyncio.create_task(self._loop(), name="lev-scheduler")
        self._worker.add_done_callback(self._worker_done)
        if self.ready is not None:
            self._cold_wake = asyncio.Event()
            self._cold_executor = concurrent.futures.ThreadPoolExecutor(
                self.compile_lanes, thread_name_prefix="lev-compile"
            )
            for lane in range(self.compile_lanes):
                task = asyncio.create_task(self._cold_loop(lane), name=f"lev-compile-lane-{lane}")
                task.add_done_callback(self._worker_done)
                self._cold_workers.append(task)
        self._watchdog = asyncio.create_task(self._watch(), name="lev-watchdog")

    def _worker_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the scheduler's worker died; refusing new requests", exc_info=task.exception())
            self.dead = f"the scheduler's worker {task.get_name()} died: {task.exception()!r}"
            self._closing = True
            for t in self._tickets():
                if not t.future.done():
                    t.future.set_exception(ShuttingDown())

    def _tickets(self) -> list[Ticket]:
        """Every request queued in either lane."""
        return list(self._queue) + [t for t in self._cold if isinstance(t, Ticket)]

    def close(self) -> None:
        """Refuse new requests from now on; what is queued or running still completes."""
        self._closing = True

    @property
    def closing(self) -> bool:
        return self._closing

    async def drain(self, timeout: float | None = None) -> bool:
        """Close, wait until nothing is queued or running (True) or `timeout` passes (False), then stop."""
        self.close()
        done = True
        if self._idle is not None and self._pending:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                done = False
        await self.stop(wait_s=STOP_WAIT_S if done else 0.0)  # given up: do not wait any longer
        return done

    async def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Refuse and cancel what is queued; wait up to `wait_s` for a device call in flight."""
        self._closing = True
        workers = [self._worker, *self._cold_workers, self._watchdog]
        self._worker, self._cold_workers, self._watchdog = None, [], None
        for worker in workers:
            if worker is not None:
                worker.cancel()
                try:
                    await worker
                except (asyncio.CancelledError, Exception):
                    pass
        for t in self._tickets():
            if not t.future.done():
                t.future.set_exception(ShuttingDown())
        self._queue.clear()
        self._cold.clear()
        await self._shutdown_executor("_cold_executor", wait_s)
        await self._shutdown_executor("_executor", wait_s)

    async def _shutdown_executor(self, attr: str, wait_s: float) -> None:
        if getattr(self, attr) is not None:
            executor = getattr(self, attr)
            setattr(self, attr, None)
            if wait_s <= 0:
                executor.shutdown(wait=False, cancel_futures=True)
                return
            # A device call in flight cannot be interrupted; wait for it (off the event loop, bounded),
            # so no device thread outlives its server and overlaps the next one's compiles.
            done = asyncio.get_running_loop().run_in_executor(
                None, functools.partial(executor.shutdown, wait=True, cancel_futures=True)
            )
            try:
                await asyncio.wait_for(done, wait_s)
            except TimeoutError:
                log.warning("stop: a device call is still running after %gs; leaving it behind", wait_s)

    # -- admission -----------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Requests admitted and not finished: being planned, queued or running."""
        return self._pending

    @property
    def queued(self) -> int:
        return sum(1 for t in self._tickets() if not t.cancelled)

    @property
    def running(self) -> int:
        return len(self._running)

    def retry_after(self) -> float:
        """Seconds until a slot is likely free: the batch running now and the batches queued behind
        it, at the recent batch time (at least 50 ms, at most MAX_RETRY_AFTER_S)."""
        batches_ahead = max(1.0, self._pending / max(1.0, self._batch_rows))
        return min(MAX_RETRY_AFTER_S, max(0.05, batches_ahead * self._batch_s))

    # -- the watchdog --------------------------------------------------------------------------
    def stuck_for(self) -> float:
        """Seconds the oldest request's device call has run past `watchdog_s`; 0 when none has."""
        if not self._running:
            return 0.0
        over = time.perf_counter() - min(t.started for t in self._running) - self.watchdog_s
        return max(0.0, over)

    def unavailable(self) -> str | None:
        """Why nothing admitted now would be answered (a dead worker, a stuck device call), or None."""
        if self.dead:
            return self.dead
        if self.stuck_for() > 0:
            oldest = min(t.started for t in self._running)
            return (
                f"a device call has run for {time.perf_counter() - oldest:.0f}s, "
                f"past the watchdog's {self.watchdog_s:g}s"
            )
        return None

    async def _watch(self) -> None:
        """Logs each request's device call once when it passes `watchdog_s` (the state itself is
        computed where it is read: `unavailable()`), so the log says when the device stopped answering."""
        while True:
            await asyncio.sleep(min(5.0, self.watchdog_s / 4))
            now = time.perf_counter()
            for t in self._running:
                if id(t) not in self._reported and now - t.started > self.watchdog_s:
                    self._reported.add(id(t))
                    log.error(
                        "watchdog: a device call has run for %.0fs (limit %gs); /health reports the server "
                        "stuck and new requests are refused until it returns",
                        now - t.started,
                        self.watchdog_s,
                    )
            self._reported &= {id(t) for t in self._running}

    def admit(self) -> None:
        """Take a slot for a request about to be planned (QueueFull, ShuttingDown or Unavailable if
        none is to be had); hand it to `submit(..., admitted=True)` or give it back with `release()`."""
        if reason := self.unavailable():
            raise Unavailable(reason)
        if self._closing or self._worker is None:
            raise ShuttingDown()
        if self._pending >= self.max_pending:
            raise QueueFull(self.retry_after())
        self._pending += 1
        self._idle.clear()
        self._gauge()

    def release(self) -> None:
        """Give back a slot `admit` took for a request that was never submitted (refused, failed)."""
        self._pending -= 1
        if self._pending <= 0:
            self._pending = 0
            self._idle.set()
        self._gauge()

    def submit(self, state: Any, questions: dict, tokens: int, *, admitted: bool = False) -> Ticket:
        """Queue a request; `admitted`: in the slot `admit` took for it (which it keeps if this raises,
        for the caller to release)."""
        if reason := self.unavailable():
            raise Unavailable(reason)
        if self._closing or self._worker is None:
            raise ShuttingDown()
        if not admitted and self._pending >= self.max_pending:
            raise QueueFull(self.retry_after())
        t = Ticket(state, questions, tokens, asyncio.get_running_loop().create_future())
        self._queue.append(t)
        if not admitted:
            self._pending += 1
        self._idle.clear()
        self._wake.set()
        self._gauge()
        return t

    def cancel(self, t: Ticket) -> None:
        """The client has gone or the deadline passed: forget the request. A queued one frees its slot
        now; a running one when its batch ends (the device call cannot be interrupted)."""
        if t.cancelled:
            return
        t.cancelled = True
        if t.started is None:
            self._release(t)
        if not t.future.done():
            t.future.cancel()

    # -- the worker ----------------------------------------------------------------------------
    def _release(self, t: Ticket) -> None:
        self.release()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(self.queued, self._pending)

    def _take(self) -> list[Ticket]:
        """The next batch for the main lane: the oldest queued requests within the token and row
        budgets; a request whose programs are not compiled yet moves to the compile lane instead."""
        batch: list[Ticket] = []
        tokens = 0
        while self._queue and len(batch) < self.max_batch_rows:
            t = self._queue[0]
            if t.cancelled:
                self._queue.popleft()
                continue
            if self.ready is not None and not self._is_ready([t]):
                self._queue.popleft()
                self._cold.append(t)
                self._cold_wake.set()
                continue
            if batch and tokens + t.tokens > self.max_batch_tokens:
                break
            self._queue.popleft()
            batch.append(t)
            tokens += t.tokens
        return batch

    def _is_ready(self, tickets: list[Ticket]) -> bool:
        try:
            return bool(self.ready([(t.state, t.questions) for t in tickets]))
        except Exception:  # noqa: BLE001 — a predicate that fails must not lose requests: run them
            log.exception("ready() failed; running the requests as if ready")
            return True

    async def _loop(self) -> None:
        while True:
            if not any(not t.cancelled for t in self._queue):
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.batch_wait_s > 0 and self._pending < 2:
                await asyncio.sleep(self.batch_wait_s)  # let a burst's stragglers join the first batch
            batch = self._take()
            if not batch:
                continue
            one_by_one = False
            if len(batch) > 1 and self.ready is not None and not self._is_ready(batch):
                # each request is ready but their stacked shapes are not: serve them one by one now,
                # and have the compile lane compile the combination for next time (once at a time)
                one_by_one = True
                self.split_batches += 1
                if not any(isinstance(x, list) for x in self._cold):
                    self._cold.append(list(batch))
                    self._cold_wake.set()
            await self._run(batch, self._executor, one_by_one=one_by_one)

    async def _cold_loop(self, lane: int = 0) -> None:
        """One lane of the compile lane: requests whose programs are new, one at a time; lane 0 also
        runs the background compiles of micro-batch combinations (lowest priority, one at a time)."""
        while True:
            job = next((x for x in self._cold if isinstance(x, Ticket)), None)
            if job is None and lane == 0:
                job = next(iter(self._cold), None)
            if job is None:
                self._cold_wake.clear()
                await self._cold_wake.wait()
                continue
            self._cold.remove(job)
            if isinstance(job, Ticket):
                if not job.cancelled and self._is_ready([job]):
                    # an earlier request compiled its programs meanwhile: back to the main lane,
                    # ahead of younger requests
                    self._queue.appendleft(job)
                    self._wake.set()
                elif not job.cancelled:
                    self.cold_runs += 1
                    await self._run([job], self._cold_executor)
                continue
            requests = [(t.state, t.questions) for t in job]
            if self._is_ready(job):
                continue
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._cold_executor, self._compile_only, requests)
                self.background_compiles += 1
            except Exception:  # noqa: BLE001 — a compile job's failure affects nobody's answer
                log.exception("background compile of a micro-batch failed")

    async def _run(self, batch: list[Ticket], executor, *, one_by_one: bool = False) -> None:
        """Run a batch on `executor` and resolve each request's future with its own result."""
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        for t in batch:
            t.started = now
        self._running = self._running + batch
        self._gauge()
        requests = [(t.state, t.questions) for t in batch]
        try:
            call = self._call_each if one_by_one else self._call
            results = await loop.run_in_executor(executor, self._foreground, call, requests)
        except asyncio.CancelledError:
            for t in batch:
                if not t.future.done():
                    t.future.set_exception(ShuttingDown())
            raise
        took = time.perf_counter() - now
        self.batches += 1
        self._batch_s = took if self.batches == 1 else 0.8 * self._batch_s + 0.2 * took
        self._batch_rows = len(batch) if self.batches == 1 else 0.8 * self._batch_rows + 0.2 * len(batch)
        if self.metrics is not None:
            self.metrics.observe_batch(len(batch), sum(t.tokens for t in batch), took)
        self._running = [t for t in self._running if t not in batch]
        for t, r in zip(batch, results, strict=True):
            if not t.future.done():
                if isinstance(r, BaseException):
                    t.future.set_exception(r)
                else:
                    t.future.set_result(r)
            self._release(t)  # a cancelled running request held its slot until now, too

    @staticmethod
    def _foreground(call, requests: list[tuple[Any, dict]]) -> list[Any]:
        """Requests' work: background compiles and the warm-up wait for it (`programs.foreground`)."""
        with programs.foreground():
            return call(requests)

    def _compile_only(self, requests: list[tuple[Any, dict]]) -> list[Any]:
        """A background compile: the batch run compile-only (`programs.compile_only`), after any request in flight."""
        with programs.compile_only(), programs.background():
            return self._call(requests)

    def _call_each(self, requests: list[tuple[Any, dict]]) -> list[Any]:
        return [self._call([r])[0] for r in requests]

    def _call(self, requests: list[tuple[Any, dict]]) -> list[Any]:
        """run_batch, made total: a whole-batch failure (or a wrong number of results) is retried one
        request at a time, so one request's problem cannot fail its neighbours."""
        try:
            results = list(self.run_batch(requests))
            if len(results) == len(requests):
                return results
            log.error("run_batch returned %d results for %d requests", len(results), len(requests))
        except Exception as e:  # noqa: BLE001
            if len(requests) == 1:
                log.exception("run_batch failed")
                return [e]
            log.exception("run_batch failed for a batch of %d; retrying one by one", len(requests))
        out: list[Any] = []
        for req in requests:
            try:
                r = list(self.run_batch([req]))
                out.append(r[0] if len(r) == 1 else RuntimeError("run_batch returned no result"))
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out
