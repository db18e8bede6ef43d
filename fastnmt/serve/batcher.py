"""The batcher: every request's sentences join one queue, taken out in batches of one setting
bounded by ``--max-tokens`` (``batch_cost``), run one after another on the model's one thread
(``ModelThread``), off the event loop."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastnmt.serve.api import ERROR_LOG, RETRY, Rejected
from fastnmt.serve.metrics import Metrics
from fastnmt.translator import Translation


@dataclass(eq=False)
class Job:
    """One sentence of a request, waiting for its translation."""

    sentence: Translation
    key: tuple  # jobs of one key can share a batch: (Options[, a request batched alone])
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)
    prefix: str | None = None  # text its translation must start with
    line: int = 1  # its position in its request (its samples follow it)

    @property
    def tokens(self) -> int:
        return len(self.sentence.source_tokens) + 1  # + eos

    @property
    def beam(self) -> int:
        return self.key[0].beam


def batch_cost(jobs: list[Job]) -> int:
    """What --max-tokens bounds: the batch's source padded to its longest, times the beam."""
    return len(jobs) * max(job.tokens for job in jobs) * jobs[0].beam if jobs else 0


class ModelThread:
    """One daemon thread that makes every call touching the model: its loading and every batch.

    Not asyncio's default executor, which may run successive calls on different threads:
    PyTorch's CPU ops run on OpenMP, and libgomp keeps a team of worker threads for each thread
    that starts parallel work; with more workers than cores it lets idle ones sleep instead of
    spinning, and every op pays a wake-up (one thread of its own doubled the unbatched server's
    sentences/s on 2 cores). A daemon, unlike an executor's threads: a load or a batch that never
    ends does not keep the process from exiting.
    """

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="fastnmt-model", daemon=True).start()

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            if not future.set_running_or_notify_cancel():  # cancelled while it waited
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # the caller's to handle
                future.set_exception(error)


class Batcher:
    """One queue of sentences from every request, translated in batches bounded by
    ``max_tokens`` (``batch_cost``) by ``translate(jobs, on_translated)`` on the model's thread.
    Each sentence is answered as soon as ``on_translated(index, translation)`` says it is done,
    while the rest of its batch is translated: under load its client's next request is then
    back before the batch ends, so the next batch can start at once.

    A batch that runs past ``batch_timeout`` fails its requests with 504 and marks the batcher
    ``stalled`` (the server is then not ready) until the model's thread is free again."""

    def __init__(
        self,
        translate: Callable[[list[Job], Callable[[int, Translation], None]], list[Translation]],
        model_thread: ModelThread,
        *,
        max_tokens: int,
        max_wait: float,
        batch_timeout: float,
        max_queue: int,
        metrics: Metrics,
    ):
        self.translate, self.model_thread, self.max_tokens = translate, model_thread, max_tokens
        self.max_wait, self.batch_timeout, self.max_queue = max_wait, batch_timeout, max_queue
        self.metrics = metrics
        self.queue: collections.deque[Job] = collections.deque()
        self.arrival = asyncio.Event()
        self.stalled = False
        # The last batch's size, how many sentences arrived since it started (its clients' next
        # requests, sent as soon as answered) and when the model became free (see _wait).
        self.answered_sentences, self.arrived_since, self.free_since = 0, 0, 0.0

    def submit(self, jobs: list[Job]) -> None:
        self.queue = collections.deque(j for j in self.queue if not j.future.done())
        if len(self.queue) + len(jobs) > self.max_queue:
            raise Rejected(429, "the queue is full, retry later", **RETRY)
        self.queue.extend(jobs)
        self.arrived_since += len(jobs)
        self.metrics.queue_depth.set(len(self.queue))
        self.arrival.set()

    def fail_waiting(self, rejected: Rejected) -> None:
        """Answer every queued sentence's request with ``rejected``."""
        for job in self.queue:
            if not job.future.done():
                job.future.set_exception(rejected)
        self.queue.clear()
        self.metrics.queue_depth.set(0)

    async def run(self) -> None:
        while True:
            batch = await self._next_batch()
            started = time.monotonic()
            for job in batch:
                self.metrics.queue_wait.observe(started - job.arrived)
            self.metrics.batch_sentences.observe(len(batch))
            self.metrics.batch_tokens.observe(batch_cost(batch))
            self.answered_sentences, self.arrived_since = len(batch), 0
            running = self.model_thread.submit(self.translate, batch, _answerer(batch))
            try:
                found = await self._within_deadline(asyncio.wrap_future(running), batch)
            except Exception as error:  # answer the batch's requests; the server goes on
                _settle(batch, error=error)
                continue
            finally:
                self.free_since = time.monotonic()
            if found is None:  # past its deadline, answered already
                continue
            _settle(batch, found=found)
            self.metrics.batch_duration.observe(time.monotonic() - started)
            self.metrics.sentences.inc(len(batch))

    async def _within_deadline(self, running: asyncio.Future, batch: list[Job]):
        """The batch's result; past ``batch_timeout``, None once its requests have their 504,
        the batcher stalled until the model's thread has finished the batch."""
        try:
            return await asyncio.wait_for(asyncio.shield(running), self.batch_timeout)
        except asyncio.TimeoutError:
            seconds = self.batch_timeout
            _settle(batch, error=Rejected(504, f"the translation took over {seconds:g} s"))
            ERROR_LOG.error("a batch of %d sentences ran over %g s", len(batch), seconds)
        self.stalled = True
        try:
            with contextlib.suppress(Exception):
                await running
        finally:
            self.stalled = False
        return None

    async def _next_batch(self) -> list[Job]:
        """The oldest waiting sentence and those that can join it, once ``_wait`` says so."""
        while True:
            while self.queue and self.queue[0].future.done():  # its client went away
                self.queue.popleft()
            if not self.queue:
                self.arrival.clear()
                await self.arrival.wait()
                continue
            oldest = self.queue[0]
            remaining = self._wait(oldest, self._take(oldest.key, dry_run=True))
            if remaining > 0:
                self.arrival.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.arrival.wait(), remaining)
                continue
            batch = self._take(oldest.key, dry_run=False)
            self.metrics.queue_depth.set(len(self.queue))
            return batch

    def _wait(self, oldest: Job, batch: list[Job]) -> float:
        """Seconds to wait for more sentences before running ``batch`` (<= 0: run it now).

        A batch waits for more at most ``max_wait`` after its oldest sentence arrived or the model
        became free, whichever is later, and not at all once it is full, or once as many
        sentences have arrived since the last batch started as that batch held: clients
        that send their next request once answered (a closed loop) are then all back, and a lone
        client waits for nobody. Counting from the moment the model is free lets the sentences
        that queued while a batch ran wait for that batch's clients: without it, closed-loop
        clients split into two cohorts that take turns with half batches."""
        if batch_cost(batch) >= self.max_tokens:
            return 0.0
        if self.answered_sentences and self.arrived_since >= self.answered_sentences:
            return 0.0
        return max(oldest.arrived, self.free_since) + self.max_wait - time.monotonic()

    def _take(self, key: tuple, dry_run: bool) -> list[Job]:
        """The waiting jobs of ``key``, oldest first, within ``max_tokens`` (at least one)."""
        batch, kept = [], collections.deque()
        for job in self.queue:
            if job.future.done():
                continue
            if job.key == key and (not batch or batch_cost([*batch, job]) <= self.max_tokens):
                batch.append(job)
            else:
                kept.append(job)
        if not dry_run:
            self.queue = kept
        return batch


def _answerer(batch: list[Job]) -> Callable[[int, Translation], None]:
    """``on_translated`` for the model's thread: answers a batch's job on the event loop."""
    loop = asyncio.get_running_loop()

    def answer(index: int, translation: Translation) -> None:
        loop.call_soon_threadsafe(_answer, batch[index].future, translation)

    return answer


def _answer(future: asyncio.Future, translation: Translation) -> None:
    if not future.done():  # not cancelled by a client that went away, nor failed past a deadline
        future.set_result(translation)


def _settle(batch: list[Job], found=None, error: BaseException | None = None) -> None:
    """Answer the batch's jobs still waiting (not cancelled by a client that went away)."""
    for index, job in enumerate(batch):
        if job.future.done():
            continue
        if error is None:
            job.future.set_result(found[index])
        else:
            job.future.set_exception(error)
