"""A translation server that batches sentences across concurrent requests.

    pip install -e ".[serve]"
    python -m fastnmt.serve --checkpoint DIR [--host 127.0.0.1 --port 8000] [--workers N]

``POST /translate`` (``Content-Type: application/json``) takes ``{"text": ["...", ...], "beam":
4, "n_best": 1, "max_length": 64, "length_penalty": 1.0}`` (``text`` may be one string; the
others are optional) and answers ``{"translations": [[{"text", "score", "truncated"}, ...],
...]}``: for each sentence in the order sent, its n-best list, best first. Every error is
``{"error": message, "field": name or null}``. ``GET /health`` answers while the process can
serve, ``GET /ready`` once the model is loaded, ``GET /metrics`` in Prometheus' text format;
``/docs`` and ``/openapi.json`` describe the API. docs/serving.md is the user's guide.

The decoder is fastest on large batches, so every request's sentences join one queue and a
``Batcher`` takes them out in batches of up to ``--max-tokens`` (padded source tokens times the
beam) of one setting, waiting at most ``--max-wait-ms`` after the oldest one arrived for more. A
batch runs on the model's one thread (``ModelThread``), off the event loop, and each request is
answered when its last sentence is done. Bodies are parsed and tokenized on another thread.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import logging
import os
import queue
import shlex
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from fastnmt.decoding.next_token import SAMPLING_METHODS, Sampling
from fastnmt.devices import configure_process
from fastnmt.translator import Translation, Translator

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        CollectorRegistry,
        Counter,
        Gauge,
        GCCollector,
        Histogram,
        PlatformCollector,
        ProcessCollector,
        generate_latest,
    )
    from pydantic import BaseModel, ConfigDict, Field, ValidationError
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
except ImportError as error:  # an optional extra: the error says how to get it
    raise ImportError(
        f'fastnmt.serve needs the serve extra (pip install "fastnmt[serve]"): {error}'
    ) from None

MAX_BEAM = 16
MAX_NGRAM = 16  # --no-repeat-ngram's bound: longer n-grams repeat too rarely to matter
# The request fields that only sampling reads.
SAMPLING_FIELDS = ("sampling_topk", "sampling_topp", "temperature", "seed", "samples")
ACCESS_LOG = logging.getLogger("fastnmt.serve.access")
ERROR_LOG = logging.getLogger("fastnmt.serve")
RETRY = {"Retry-After": "1"}  # the header of the answers that say: try again soon


class Rejected(Exception):
    """A request answered with an error: HTTP status, message, the field at fault."""

    def __init__(self, status: int, message: str, field_name: str | None = None, **headers):
        super().__init__(message)
        self.status, self.field, self.headers = status, field_name, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, str(self), self.field, self.headers)


def error_response(status: int, message: str, field_name=None, headers=None) -> JSONResponse:
    """The one error format: ``{"error": message, "field": name or null}``."""
    body = {"error": message, "field": field_name}
    return JSONResponse(body, status_code=status, headers=headers)


def one_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


# ---------------------------------------------------------------------------------------------
# The API: request and response models (the OpenAPI schema) and their checks.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Bounds the server sets on every request. None: the model's own maximum."""

    max_sentences: int = 64  # per request
    max_input_tokens: int | None = None  # subword tokens per sentence
    max_output_tokens: int | None = None  # a request's max_length
    max_length_penalty: float = 2.0
    max_queue: int = 4096  # sentences waiting, all requests together
    max_body_bytes: int = 1 << 20
    request_timeout: float = 60.0  # seconds from arrival to answer


class TranslateRequest(BaseModel):
    """The body of ``POST /translate``. The server's limits (sentences per request, subword
    tokens per sentence, max_length, length_penalty) are checked after these."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] = Field(
        description="The sentences to translate (one string: one sentence)"
    )
    beam: int = Field(4, ge=1, le=MAX_BEAM, description="Beam size; 1 is greedy search")
    n_best: int = Field(1, ge=1, le=MAX_BEAM, description="Candidates per sentence, <= beam")
    max_length: int | None = Field(
        None, ge=1, description="Target subword tokens at most (eos included); default: "
        "1.2 x the source's + 10",
    )  # fmt: skip
    length_penalty: float = Field(
        1.0, ge=0.0, allow_inf_nan=False, description="Scores are log-probability / "
        "length ** length_penalty: higher favours longer translations",
    )  # fmt: skip
    sampling: Literal[SAMPLING_METHODS] | None = Field(
        None, description="Sample instead of searching (beam unused): from the sampling_topk "
        "most probable tokens (topk) or the sampling_topp nucleus (topp)",
    )  # fmt: skip
    sampling_topk: int | None = Field(None, ge=1, description="topk: K (default: all)")
    sampling_topp: float | None = Field(
        None, gt=0.0, le=1.0, allow_inf_nan=False, description="topp: P (default 0.9)"
    )
    temperature: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="softmax(logits / T) (default 1)"
    )
    seed: int | None = Field(
        None, ge=0, lt=1 << 63, description="The same seed and sentences, the same samples"
    )
    samples: int | None = Field(
        None, ge=1, le=MAX_BEAM, description="Samples per sentence, the candidates (default 1)"
    )
    prefix: str | list[str | None] | None = Field(
        None, description="Per sentence (one string: the one sentence), text its translation "
        "must start with, scored by the model",
    )  # fmt: skip
    no_repeat_ngram: int = Field(
        0, ge=0, le=MAX_NGRAM, description="No n-gram of this many subword tokens twice"
    )


class Candidate(BaseModel):
    text: str
    score: float = Field(description="log-probability / length penalty: the ranking")
    truncated: bool = Field(description="cut by the length limit before its end")


class TranslateResponse(BaseModel):
    translations: list[list[Candidate]] = Field(
        description="For each sentence, in the order sent, its n-best candidates, best first"
    )


class ErrorResponse(BaseModel):
    error: str
    field: str | None = Field(description="the request's field at fault, if one is")


@dataclass(frozen=True)
class Options:
    """The search settings of a request: sentences batch together only under equal options."""

    beam: int
    n_best: int
    max_length: int | None
    length_penalty: float
    sampling: Sampling | None = None
    no_repeat_ngram: int = 0

    def search(self) -> dict:
        """``Translator.translate_full``'s keyword arguments."""
        lengths = {} if self.max_length is None else dict(max_len_a=0.0, max_len_b=self.max_length)
        return dict(
            beam=self.beam,
            nbest=self.n_best,
            lenpen=self.length_penalty,
            sampling=self.sampling,
            no_repeat_ngram=self.no_repeat_ngram,
            **lengths,
        )


@dataclass(frozen=True)
class Query:
    """A checked request: its sentences encoded once, their target prefixes (None: none), and
    its options. ``alone``: its sentences may not share a batch with another request's (a
    prefix past its length limit fails its batch)."""

    sentences: list[Translation]
    prefixes: list[str | None]
    options: Options

    @property
    def alone(self) -> bool:
        return any(prefix is not None for prefix in self.prefixes)


def parse_query(
    body: bytes,
    limits: Limits,
    encode: Callable[[list[str]], list[list[int]]],
    max_input_tokens: int,
    max_output_tokens: int,
) -> Query:
    """The request body as a Query, or Rejected naming what is wrong (400: not JSON; 422: a
    field of the wrong type or value; 413: a sentence over the token limit)."""
    try:
        request = TranslateRequest.model_validate_json(body)
    except ValidationError as error:
        raise _rejection(error) from None
    texts = [request.text] if isinstance(request.text, str) else request.text
    if not 1 <= len(texts) <= limits.max_sentences:
        message = f"text must hold 1 to {limits.max_sentences} sentences, got {len(texts)}"
        raise Rejected(422, message, "text")
    sampling = _sampling(request)
    most, name = (request.beam, "beam") if sampling is None else (sampling.samples, "samples")
    if request.n_best > most:
        message = f"n_best must be at most {name} ({most}), got {request.n_best}"
        raise Rejected(422, message, "n_best")
    prefixes = _prefixes(request.prefix, len(texts))
    if request.max_length is not None and request.max_length > max_output_tokens:
        message = f"max_length must be at most {max_output_tokens}, got {request.max_length}"
        raise Rejected(422, message, "max_length")
    if request.length_penalty > limits.max_length_penalty:
        message = (
            f"length_penalty must be at most {limits.max_length_penalty}, "
            f"got {request.length_penalty}"
        )
        raise Rejected(422, message, "length_penalty")
    tokens = _encoded(texts, encode)
    for index, ids in enumerate(tokens):
        if len(ids) > max_input_tokens:
            message = (
                f"text[{index}] has {len(ids)} subword tokens, more than the server's limit "
                f"of {max_input_tokens}"
            )
            raise Rejected(413, message, "text")
    # Blank sentences are not translated (an empty answer), as Translator.translate_full does.
    sentences = [
        Translation(t, ids if t.strip() else []) for t, ids in zip(texts, tokens, strict=True)
    ]
    options = Options(
        request.beam,
        request.n_best,
        request.max_length,
        request.length_penalty,
        sampling,
        request.no_repeat_ngram,
    )
    return Query(sentences, prefixes, options)


def _sampling(request: TranslateRequest) -> Sampling | None:
    """The request's sampling, or None (search); a sampling field without ``sampling`` is a 422
    naming it."""
    given = {name: getattr(request, name) for name in SAMPLING_FIELDS}
    if request.sampling is None:
        for name, value in given.items():
            if value is not None:
                raise Rejected(422, f"{name} needs sampling (topk or topp)", name)
        return None
    names = dict(sampling_topk="topk", sampling_topp="topp")
    values = {names.get(k, k): v for k, v in given.items() if v is not None}
    return Sampling(request.sampling, **values)  # each value within bounds (the model's fields)


def _prefixes(prefix: str | list[str | None] | None, count: int) -> list[str | None]:
    """Each sentence's target prefix (None: none); one string serves a one-sentence request."""
    if prefix is None:
        return [None] * count
    prefixes = [prefix] if isinstance(prefix, str) else prefix
    if len(prefixes) != count:
        given = f"{len(prefixes)} prefixes"
        raise Rejected(
            422, f"prefix must hold one text per sentence ({count}), got {given}", "prefix"
        )
    return [p if p and p.strip() else None for p in prefixes]


def _encoded(texts: list[str], encode) -> list[list[int]]:
    """``encode(texts)``; a sentence the tokenizer refuses is a 422 naming it."""
    try:
        return encode(texts)
    except Exception:
        for index, text in enumerate(texts):
            try:
                encode([text])
            except Exception as error:
                message = f"text[{index}] cannot be tokenized: {one_line(error)}"
                raise Rejected(422, message, "text") from None
        raise


def _rejection(error: ValidationError) -> Rejected:
    """The first problem pydantic found, as a Rejected naming its field."""
    problem = error.errors(include_url=False)[0]
    if problem["type"] == "json_invalid":
        return Rejected(400, f"the body is not valid JSON: {problem['msg']}")
    location = problem["loc"]
    if not location:
        return Rejected(422, "the body must be a JSON object with a 'text' field")
    name = str(location[0])
    if problem["type"] == "extra_forbidden":
        expected = ", ".join(TranslateRequest.model_fields)
        return Rejected(422, f"unknown field {name!r} (expected {expected})", name)
    if name == "text" and problem["type"] != "missing":
        return Rejected(422, "text must be a string or a list of strings", name)
    path = name + "".join(f"[{part}]" for part in location[1:])
    value = problem.get("input")
    got = "" if problem["type"] == "missing" else f", got {_shortened(value)}"
    return Rejected(422, f"{path}: {problem['msg']}{got}", name)


def _shortened(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def candidates(translation: Translation) -> list[dict]:
    """A sentence's n-best list as the response holds it (a blank sentence: one empty one)."""
    if not translation.candidates:
        return [{"text": "", "score": 0.0, "truncated": False}]
    return [
        {"text": c.text, "score": c.score, "truncated": not c.ended} for c in translation.candidates
    ]


# ---------------------------------------------------------------------------------------------
# Metrics.
# ---------------------------------------------------------------------------------------------

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
HANDLERS = ("/translate", "/health", "/ready", "/metrics")  # any other path is "other"


class Metrics:
    """The server's Prometheus metrics, in a registry of their own, with the process's (CPU,
    memory, file descriptors), the interpreter's and its garbage collector's."""

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        self.duration = Histogram(
            "fastnmt_request_duration_seconds", "HTTP requests, arrival to answer",
            ["handler", "status_class"], buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.responses = Counter(
            "fastnmt_responses", "HTTP responses by status code (499: the client went away)",
            ["handler", "code"], registry=registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "fastnmt_requests_in_flight", "HTTP requests being served", registry=registry
        )
        self.sentences = Counter("fastnmt_sentences", "Sentences translated", registry=registry)
        self.batch_sentences = Histogram(
            "fastnmt_batch_sentences", "Sentences per batch", registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        )  # fmt: skip
        self.batch_tokens = Histogram(
            "fastnmt_batch_tokens", "Padded source tokens times the beam per batch (--max-tokens)",
            registry=registry, buckets=tuple(250 * 2**i for i in range(10)),
        )  # fmt: skip
        self.batch_duration = Histogram(
            "fastnmt_batch_duration_seconds", "Translating one batch", registry=registry,
            buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "fastnmt_queue_wait_seconds", "A sentence's wait from arrival to its batch's start",
            registry=registry, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "fastnmt_queue_sentences", "Sentences waiting for a batch", registry=registry
        )

    def observe(self, path: str, status: int, seconds: float) -> None:
        handler = path if path in HANDLERS else "other"
        self.duration.labels(handler, f"{status // 100}xx").observe(seconds)
        self.responses.labels(handler, str(status)).inc()


# ---------------------------------------------------------------------------------------------
# The batcher and the model's thread.
# ---------------------------------------------------------------------------------------------


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

    asyncio's default executor may run successive calls on different threads (it starts another
    when the last has not yet marked itself idle: 50 sequential calls here ran on 2). PyTorch's
    CPU ops run on OpenMP, and libgomp keeps a team of worker threads for each thread that starts
    parallel work; with more of them than cores it lets idle workers sleep instead of spinning,
    and every op pays a wake-up: one thread of its own doubled the unbatched server's sentences/s
    on 2 cores. A daemon, unlike an executor's threads: a load or a batch that never ends does
    not keep the process from exiting.
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
    ``max_tokens`` (``batch_cost``) by ``translate(sentences, options)`` on the model's thread.

    A batch that runs past ``batch_timeout`` fails its requests with 504 and marks the batcher
    ``stalled`` (the server is then not ready) until the model's thread is free again."""

    def __init__(
        self,
        translate: Callable[[list[Job]], list[Translation]],
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
        # The last batch's size, and how many sentences arrived since it was answered (its
        # clients' next requests; see _wait).
        self.answered_sentences, self.arrived_since = 0, 0

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
            running = self.model_thread.submit(self.translate, batch)
            try:
                found = await self._within_deadline(asyncio.wrap_future(running), batch)
            except Exception as error:  # answer the batch's requests; the server goes on
                _settle(batch, error=error)
                continue
            if found is None:  # past its deadline, answered already
                continue
            _settle(batch, found=found)
            self.metrics.batch_duration.observe(time.monotonic() - started)
            self.answered_sentences, self.arrived_since = len(batch), 0
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

        A batch waits for more at most ``max_wait`` after its oldest sentence arrived, and not at
        all once it is full, or once as many sentences have arrived since the last batch was
        answered as that batch held: clients that send their next request once answered (a
        closed loop) are then all back, and a lone client waits for nobody."""
        if batch_cost(batch) >= self.max_tokens:
            return 0.0
        if self.answered_sentences and self.arrived_since >= self.answered_sentences:
            return 0.0
        return oldest.arrived + self.max_wait - time.monotonic()

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


def _settle(batch: list[Job], found=None, error: BaseException | None = None) -> None:
    """Answer the batch's jobs still waiting (not cancelled by a client that went away)."""
    for index, job in enumerate(batch):
        if job.future.done():
            continue
        if error is None:
            job.future.set_result(found[index])
        else:
            job.future.set_exception(error)


# ---------------------------------------------------------------------------------------------
# The application.
# ---------------------------------------------------------------------------------------------


class Server:
    """The app and its state: the translator once loaded, the batcher, the metrics.

    ``load`` runs on the model's thread once the app starts; ``threads`` is the number of
    threads the model's ops use (None: PyTorch's default)."""

    def __init__(
        self,
        load: Callable[[], Translator],
        *,
        max_tokens: int,
        max_wait: float,
        limits: Limits,
        batching: bool = True,
        threads: int | None = None,
    ):
        self.load, self.limits, self.batching, self.threads = load, limits, batching, threads
        self.translator: Translator | None = None
        self.load_error: str | None = None
        self.failure: str | None = None  # why the batcher stopped, once it has
        self.metrics = Metrics()
        # No other request can join an unbatched request's batch: nothing to wait for.
        self.batcher_options = dict(max_tokens=max_tokens, max_wait=max_wait if batching else 0.0)
        self.batcher: Batcher | None = None
        self.requests = 0
        self.on_load_error: Callable[[], None] = lambda: None
        self.parser = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="fastnmt-parse")
        self.app = self._app()

    # The model's thread.

    def _load(self) -> None:
        if self.threads is not None:  # OpenMP's thread count is the calling thread's setting
            import torch

            torch.set_num_threads(self.threads)
        try:
            translator = self.load()
            check_limits(self.limits, translator)
            self.translator = translator
        except Exception as error:  # reported by main, which exits 2
            self.load_error = one_line(error)
            ERROR_LOG.error("the model failed to load: %s", self.load_error)
            self.on_load_error()

    def _translate(self, jobs: list[Job]) -> list[Translation]:
        """A batch's translations: its jobs share their options; a job with a prefix shares its
        batch with its request's sentences only (``Query.alone``). Each sentence's samples follow
        its position in its request, whatever the batching."""
        prefixes = [job.prefix for job in jobs]
        given = any(p is not None for p in prefixes)
        try:
            return self.translator.translate_full(
                [job.sentence for job in jobs],
                **jobs[0].key[0].search(),
                prefix=prefixes if given else None,
                first_line=[job.line for job in jobs],
            )
        except ValueError as error:
            if not given:  # every other value was checked with the request: a fault, not a 4xx
                raise
            # A prefix past its sentence's length limit, known only once the limit is.
            raise Rejected(422, one_line(error), "prefix") from None

    # The event loop.

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        model_thread = ModelThread()
        self.batcher = Batcher(
            self._translate,
            model_thread,
            batch_timeout=self.limits.request_timeout,
            max_queue=self.limits.max_queue,
            metrics=self.metrics,
            **self.batcher_options,
        )
        worker = asyncio.create_task(self.batcher.run())
        worker.add_done_callback(self._batcher_ended)
        model_thread.submit(self._load)
        yield
        worker.cancel()
        self.parser.shutdown(wait=False, cancel_futures=True)

    def _batcher_ended(self, worker: asyncio.Task) -> None:
        """The batcher never returns: if it does, fail what waits and the probes."""
        if worker.cancelled():  # the app is shutting down
            return
        error = worker.exception()
        self.failure = f"the batcher stopped: {one_line(error) if error else 'it returned'}"
        ERROR_LOG.error(self.failure, exc_info=error)
        self.batcher.fail_waiting(Rejected(503, self.failure))

    def _app(self) -> FastAPI:
        app = FastAPI(
            title="fastnmt",
            summary="Translation with batching across concurrent requests",
            lifespan=self._lifespan,
        )
        app.get("/health", responses={503: {"model": ErrorResponse}})(self.health)
        app.get("/ready", responses={503: {"model": ErrorResponse}})(self.ready)
        app.get("/metrics", response_class=Response)(self.prometheus)
        errors = {status: {"model": ErrorResponse} for status in (400, 413, 415, 422, 429)}
        errors |= {status: {"model": ErrorResponse} for status in (500, 503, 504)}
        app.post(
            "/translate",
            response_model=None,
            responses={200: {"model": TranslateResponse}, **errors},
            openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                "schema": TranslateRequest.model_json_schema()}}}},
        )(self.translate)  # fmt: skip
        app.exception_handler(HTTPException)(self._http_error)
        app.exception_handler(Exception)(self._unexpected_error)
        app.add_middleware(Observed, metrics=self.metrics)
        return app

    async def _http_error(self, request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's own errors (404, 405) in the error format."""
        return error_response(error.status_code, str(error.detail), headers=error.headers)

    async def _unexpected_error(self, request: Request, error: Exception) -> JSONResponse:
        ERROR_LOG.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return error_response(500, f"internal error: {one_line(error)}")

    def broken(self) -> str | None:
        """Why the process cannot serve until restarted (or a hung batch ends), or None."""
        if self.failure is not None:
            return self.failure
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.batcher is not None and self.batcher.stalled:
            return f"a batch has run over {self.limits.request_timeout:g} s"
        return None

    def unavailable(self) -> str | None:
        """Why the server cannot translate now, or None."""
        if self.translator is None and self.broken() is None:
            return "the model is loading"
        return self.broken()

    async def health(self):
        """The process serves (liveness): fails once its batcher has stopped or a batch hangs."""
        reason = self.broken()
        if reason is not None:
            return error_response(503, reason)
        return {"status": "ok"}

    async def ready(self):
        """The model is loaded and translating (readiness)."""
        reason = self.unavailable()
        if reason is not None:
            return error_response(503, reason, headers=RETRY)
        return {"ready": True}

    async def prometheus(self):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def translate(self, request: Request):
        arrived = time.monotonic()
        try:
            return await self._answer(request, arrived)
        except Rejected as rejected:
            return rejected.response()
        except ClientDisconnect:  # while sending the body
            return Response(status_code=499)
        except asyncio.CancelledError:  # the ASGI server's shutdown ran out of time
            return error_response(503, "the server is shutting down, retry later", headers=RETRY)

    async def _answer(self, request: Request, arrived: float) -> Response:
        reason = self.unavailable()
        if reason is not None:
            raise Rejected(503, f"{reason}, retry later", **RETRY)
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            shown = media_type or "none"
            raise Rejected(415, f"the body must be application/json, got {shown}", "Content-Type")
        body = await _read_body(request, self.limits.max_body_bytes)
        translator = self.translator
        max_input = self.limits.max_input_tokens or translator.max_source_tokens
        max_output = self.limits.max_output_tokens or translator.model.cfg.max_positions
        loop = asyncio.get_running_loop()
        query = await loop.run_in_executor(
            self.parser, parse_query, body, self.limits, translator.vocab.encode, max_input,
            max_output,
        )  # fmt: skip
        self.requests += 1
        alone = query.alone or not self.batching
        key = (query.options,) + ((self.requests,) if alone else ())
        jobs = [
            Job(sentence, key, loop.create_future(), arrived, prefix, line)
            for line, (sentence, prefix) in enumerate(
                zip(query.sentences, query.prefixes, strict=True), start=1
            )
        ]
        self.batcher.submit(jobs)
        translations = await self._translations(request, jobs, arrived)
        if translations is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        return JSONResponse({"translations": [candidates(t) for t in translations]})

    async def _translations(self, request: Request, jobs: list[Job], arrived: float):
        """The jobs' translations, or None if the client went away first; 504 past the
        request's deadline."""
        waiting = asyncio.gather(*(job.future for job in jobs))
        gone = asyncio.ensure_future(_client_gone(request))
        timeout = arrived + self.limits.request_timeout - time.monotonic()
        try:
            await asyncio.wait(
                [waiting, gone], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            gone.cancel()
            answered = waiting.done()
            waiting.cancel()  # and so its jobs: a request failed or abandoned leaves the queue
        if not answered:
            if gone.done():
                return None
            raise Rejected(504, f"no answer within {self.limits.request_timeout:g} s")
        try:
            return waiting.result()
        except Rejected:
            raise
        except Exception as error:  # the batch failed: its requests say why
            ERROR_LOG.error("a batch failed", exc_info=error)
            raise Rejected(500, f"translation failed: {one_line(error)}") from None


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` bytes (from Content-Length,
    before reading; else once read that far). The connection is closed after a 413, so that
    the rest of the body is never read."""
    message = f"the body is over the server's limit of {limit} bytes"
    too_large = Rejected(413, message, Connection="close")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects. Once the body is read, the ASGI server's receive()
    waits until then and answers http.disconnect: no polling, which woke the event loop 20 times
    a second for each waiting request and took the interpreter lock from the translating thread
    (64 clients: 1,280 wake-ups a second)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _request_id(scope) -> bytes:
    """The client's X-Request-ID if it is a sane one (printable ASCII, up to 128 characters),
    else a new one."""
    for name, value in scope["headers"]:
        if name == b"x-request-id" and 0 < len(value) <= 128 and all(32 < c < 127 for c in value):
            return value
    return uuid.uuid4().hex.encode()


class Observed:
    """ASGI middleware: an X-Request-ID on every response (the client's, or a new one), the
    request's duration and status in the metrics, and an access log line.

    A pure ASGI middleware: Starlette's BaseHTTPMiddleware runs each request in a task group."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        request_id = _request_id(scope)
        status = 500  # if the app fails before it answers

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.metrics.in_flight.dec()
            seconds = time.perf_counter() - started
            self.metrics.observe(scope["path"], status, seconds)
            if ACCESS_LOG.isEnabledFor(logging.INFO):
                client = scope.get("client") or ("-", 0)
                ACCESS_LOG.info(
                    '%s:%s "%s %s" %d %.1fms id=%s', client[0], client[1], scope["method"],
                    scope["path"], status, seconds * 1e3, request_id.decode(),
                )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The command line and the app factory.
# ---------------------------------------------------------------------------------------------

ENVIRONMENT = "FASTNMT_SERVE_ARGS"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastnmt.serve", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="fastnmt or Hugging Face checkpoint dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--precision", default="auto")
    p.add_argument("--src-code", help="NLLB/M2M100 source language code")
    p.add_argument("--tgt-code", help="NLLB/M2M100 target language code")
    processes = p.add_argument_group("processes")
    processes.add_argument(
        "--workers", type=int, default=1, help="server processes sharing the port, each with "
        "its own copy of the model",
    )  # fmt: skip
    processes.add_argument(
        "--threads", type=int, help="threads of each process's model (default: the cores "
        "divided among the workers; one worker: all cores but one)",
    )  # fmt: skip
    processes.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="on SIGTERM, seconds to finish accepted requests before closing them",
    )  # fmt: skip
    processes.add_argument("--no-access-log", action="store_true", help="no line per request")
    batching = p.add_argument_group("batching")
    batching.add_argument(
        "--max-tokens", type=int, default=6000,
        help="a batch's source tokens, padded to its longest sentence, times the beam",
    )  # fmt: skip
    batching.add_argument(
        "--max-wait-ms", type=float, default=10.0, help="a sentence waits for more this long"
    )
    batching.add_argument("--no-batching", action="store_true", help="each request alone")
    limits = p.add_argument_group("limits")
    limits.add_argument("--max-queue", type=int, default=Limits.max_queue, help="sentences")
    limits.add_argument("--max-sentences", type=int, default=Limits.max_sentences)
    limits.add_argument(
        "--max-input-tokens", type=int, help="subword tokens a sentence (default: the model's)"
    )
    limits.add_argument(
        "--max-output-tokens", type=int, help="a request's max_length (default: the model's)"
    )
    limits.add_argument("--max-length-penalty", type=float, default=Limits.max_length_penalty)
    limits.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes)
    limits.add_argument(
        "--request-timeout", type=float, default=Limits.request_timeout,
        help="seconds from a request's arrival to its answer, else 504",
    )  # fmt: skip
    args = p.parse_args(argv)
    positive = ("port", "workers", "threads", "max_tokens", "max_queue", "max_sentences")
    positive += ("max_input_tokens", "max_output_tokens", "max_body_bytes", "request_timeout")
    for name in positive:
        value = getattr(args, name)
        if value is not None and not value > 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("max_wait_ms", "shutdown_timeout", "max_length_penalty"):
        if not getattr(args, name) >= 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return args


def threads_per_worker(args: argparse.Namespace) -> int:
    """--threads, else the cores shared among the workers, one core left to a single worker's
    HTTP work. Under load a decoder on every core gains nothing: its OpenMP team stalls whenever
    the event loop (or a client on the same host) takes a core; 64 clients on a 2-core EPYC got
    60.2 sentences/s from a server on 2 threads, 63.1 on one."""
    if args.threads is not None:
        return args.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if args.workers == 1:
        return max(1, (cores or 1) - 1)
    return max(1, (cores or 1) // args.workers)


def loader(args: argparse.Namespace) -> Callable[[], Translator]:
    def load() -> Translator:
        return Translator.load(
            args.checkpoint,
            src_code=args.src_code,
            tgt_code=args.tgt_code,
            device=args.device,
            precision=args.precision,
            max_tokens=args.max_tokens,
        )

    return load


def check_limits(limits: Limits, translator: Translator) -> None:
    """ValueError if the limits ask for more than the model takes (it would truncate)."""
    model_limit = translator.max_source_tokens
    if (limits.max_input_tokens or 0) > model_limit:
        raise ValueError(
            f"--max-input-tokens {limits.max_input_tokens} is more than the model's maximum "
            f"source length, {model_limit} subword tokens"
        )
    output_limit = translator.model.cfg.max_positions
    if (limits.max_output_tokens or 0) > output_limit:
        raise ValueError(
            f"--max-output-tokens {limits.max_output_tokens} is more than the model's maximum "
            f"length, {output_limit} tokens"
        )


def build_limits(args: argparse.Namespace) -> Limits:
    return Limits(
        max_sentences=args.max_sentences,
        max_input_tokens=args.max_input_tokens,
        max_output_tokens=args.max_output_tokens,
        max_length_penalty=args.max_length_penalty,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
    )


def build_server(args: argparse.Namespace) -> Server:
    configure_process(decoding=True)
    if not args.no_access_log:
        _log_access()
    return Server(
        loader(args),
        max_tokens=args.max_tokens,
        max_wait=args.max_wait_ms / 1000,
        limits=build_limits(args),
        batching=not args.no_batching,
        threads=threads_per_worker(args),
    )


def create_app(argv: list[str]) -> FastAPI:
    """The ASGI app for ``python -m fastnmt.serve``'s options (--host, --port, --workers and
    --shutdown-timeout are then the ASGI server's business), for any ASGI server."""
    return build_server(parse_args(argv)).app


def app_from_environment() -> FastAPI:
    """``create_app`` with the options in $FASTNMT_SERVE_ARGS, for ASGI servers that take an
    app factory: ``FASTNMT_SERVE_ARGS="--checkpoint DIR" uvicorn --factory
    fastnmt.serve:app_from_environment``; gunicorn: ``'fastnmt.serve:app_from_environment()'``."""
    if ENVIRONMENT not in os.environ:
        raise RuntimeError(f"${ENVIRONMENT} must hold the server's options (--checkpoint DIR)")
    return create_app(shlex.split(os.environ[ENVIRONMENT]))


def _log_access() -> None:
    if not ACCESS_LOG.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        ACCESS_LOG.addHandler(handler)
        ACCESS_LOG.setLevel(logging.INFO)
        ACCESS_LOG.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    print(f"fastnmt serving on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    if args.workers > 1:
        return _serve_workers(args, argv)
    server = build_server(args)
    config = uvicorn.Config(
        server.app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    web = uvicorn.Server(config)

    def stop() -> None:  # from the model thread, a daemon: gone if uvicorn fails to start
        # Not before startup completes: uvicorn < 0.30 would leave its lifespan task to be
        # cancelled, which logs a traceback.
        while not web.started:
            time.sleep(0.01)
        web.should_exit = True

    server.on_load_error = stop
    # uvicorn re-raises SIGTERM after draining; with the default handler that would kill the
    # process (exit -15) instead of returning 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    web.run()
    if server.load_error is not None:
        print(f"error: {server.load_error}", file=sys.stderr)
        return 2
    return 0


def _serve_workers(args: argparse.Namespace, argv: list[str]) -> int:
    """--workers N: uvicorn's worker processes, each built by ``app_from_environment``. The
    checkpoint is loaded here once first, so that a bad one exits 2 rather than failing every
    worker in turn."""
    try:
        check_limits(build_limits(args), loader(args)())
    except Exception as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    os.environ[ENVIRONMENT] = shlex.join(argv)
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(
        "fastnmt.serve:app_from_environment",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level="warning",
        timeout_graceful_shutdown=args.shutdown_timeout,
        **_patient_healthcheck(),
    )
    return 0


def _patient_healthcheck() -> dict:
    """uvicorn >= 0.30 pings each worker and restarts one that does not answer within 5 s; a
    worker importing PyTorch on a busy machine takes longer, and would be restarted for ever."""
    if "timeout_worker_healthcheck" in inspect.signature(uvicorn.Config).parameters:
        return {"timeout_worker_healthcheck": 120}
    return {}


if __name__ == "__main__":
    sys.exit(main())
