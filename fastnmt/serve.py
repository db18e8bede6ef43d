"""A translation server that batches sentences across concurrent requests.

    pip install -e ".[serve]"
    python -m fastnmt.serve --checkpoint DIR [--host 127.0.0.1 --port 8000]

``POST /translate`` takes ``{"text": ["...", ...], "beam": 4, "n_best": 1}`` (or one string) and
answers ``{"translations": [...]}`` in the order sent (with n_best > 1, each item a list of
``{"text", "score"}``, best first). ``GET /health`` answers while the process serves, ``GET
/ready`` once the model is loaded, ``GET /metrics`` in Prometheus' text format.

The decoder is fastest on large batches, so every request's sentences join one queue and a
``Batcher`` takes them out in batches of up to ``--max-tokens`` source tokens (of one beam and
n_best setting), waiting at most ``--max-wait-ms`` after the oldest one arrived for more (and,
after a batch, up to ``--return-wait-ms`` for its clients' next requests: ``Batcher._wait``); a
batch runs on the model's one thread (``ModelThread``), off the event loop, and each request is
answered when its last sentence is done. A long request is so split over batches and short ones
are merged. The queue holds at most ``--max-queue`` sentences: beyond that a request gets 503
with Retry-After. A request whose client went away leaves the queue. SIGTERM drains: requests
already accepted are answered, new connections refused, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import json
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastnmt.runtime import configure_process
from fastnmt.translator import Translation, Translator

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
except ImportError as error:  # an optional extra: the error says how to get it
    raise ImportError(
        f'fastnmt.serve needs the serve extra (pip install "fastnmt[serve]"): {error}'
    ) from None

MAX_BEAM = 16


class Rejected(Exception):
    """A request answered with an error: HTTP status, message, the field at fault."""

    def __init__(self, status: int, message: str, field_name: str | None = None, **headers):
        super().__init__(message)
        self.status, self.field, self.headers = status, field_name, headers

    def response(self) -> JSONResponse:
        body = {"error": str(self), **({"field": self.field} if self.field else {})}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass(frozen=True)
class Limits:
    max_sentences: int = 64  # per request
    max_input_tokens: int = 256  # subword tokens per sentence
    max_queue: int = 4096  # sentences waiting, all requests together


@dataclass(frozen=True)
class Query:
    """A checked request."""

    texts: list[str]
    tokens: list[int]  # subword tokens of each text
    beam: int
    n_best: int
    single: bool  # "text" was one string: the answer is one item too


def parse_query(body: bytes, limits: Limits, count_tokens: Callable[[list[str]], list[int]]):
    """The request body as a Query, or Rejected naming what is wrong (400: not JSON; 422: a
    field of the wrong type or value; 413: a sentence over the token limit)."""
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise Rejected(400, f"the body is not valid UTF-8 ({error.reason})") from None
    except json.JSONDecodeError as error:
        raise Rejected(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise Rejected(422, "the body must be a JSON object with a 'text' field")
    unknown = sorted(set(data) - {"text", "beam", "n_best"})
    if unknown:
        raise Rejected(
            422, f"unknown field {unknown[0]!r} (expected text, beam, n_best)", unknown[0]
        )
    text = data.get("text")
    single = isinstance(text, str)
    texts = [text] if single else text
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise Rejected(422, "text must be a string or a list of strings", "text")
    if not 1 <= len(texts) <= limits.max_sentences:
        message = f"text must hold 1 to {limits.max_sentences} sentences, got {len(texts)}"
        raise Rejected(422, message, "text")
    beam = _integer(data, "beam", 4, 1, MAX_BEAM)
    n_best = _integer(data, "n_best", 1, 1, beam)
    tokens = count_tokens(texts)
    for index, count in enumerate(tokens):
        if count > limits.max_input_tokens:
            message = (
                f"text[{index}] has {count} subword tokens, more than the server's "
                f"--max-input-tokens {limits.max_input_tokens}"
            )
            raise Rejected(413, message, "text")
    return Query(texts, tokens, beam, n_best, single)


def _integer(data: dict, name: str, default: int, low: int, high: int) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Rejected(422, f"{name} must be an integer from {low} to {high}, got {value!r}", name)
    return value


class Metrics:
    """The server's Prometheus metrics, in a registry of their own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "fastnmt_requests", "Translation requests by HTTP status", ["status"],
            registry=self.registry,
        )  # fmt: skip
        self.sentences = Counter(
            "fastnmt_sentences", "Sentences translated", registry=self.registry
        )
        self.batch_sentences = Histogram(
            "fastnmt_batch_sentences", "Sentences per batch", registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        )  # fmt: skip
        self.queue_depth = Gauge(
            "fastnmt_queue_sentences", "Sentences waiting for a batch", registry=self.registry
        )
        self.latency = Histogram(
            "fastnmt_request_seconds", "Request latency, arrival to answer", registry=self.registry
        )


@dataclass(eq=False)
class Job:
    """One sentence of a request, waiting for its translation."""

    text: str
    tokens: int
    key: tuple  # jobs of one key can share a batch: (beam, n_best[, request without batching])
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class ModelThread:
    """One daemon thread that makes every call touching the model: its loading and every batch.

    asyncio's default executor may run successive calls on different threads (it starts another
    when the last has not yet marked itself idle: 50 sequential calls here ran on 2). PyTorch's
    CPU ops run on OpenMP, and libgomp keeps a team of worker threads for each thread that starts
    parallel work; with more of them than cores it lets idle workers sleep instead of spinning,
    and every op pays a wake-up. Measured on a 2-core AMD EPYC (2026-11-26), random tiny model,
    beam 4: the server without batching answered 64 clients at 9.8-11.0 sentences/s with the
    executor and 19.5-21.4 with this thread; in one process, batches of 64 decoded at 128-145
    sentences/s on a second thread against 168-181 on the first. A daemon, unlike an executor's
    threads: a load that never ends does not keep the process from exiting.
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
    """One queue of sentences from every request, translated in token-bounded batches by
    ``translate(texts, beam, n_best)`` on the model's thread."""

    def __init__(
        self,
        translate: Callable[[list[str], int, int], list[Translation]],
        model_thread: ModelThread,
        *,
        max_tokens: int,
        max_wait: float,
        return_wait: float,
        limits: Limits,
        metrics: Metrics,
    ):
        self.translate, self.model_thread, self.max_tokens = translate, model_thread, max_tokens
        self.max_wait, self.return_wait = max_wait, return_wait
        self.limits, self.metrics = limits, metrics
        self.queue: collections.deque[Job] = collections.deque()
        self.arrival = asyncio.Event()
        # The last batch: when it was answered, how many sentences it held, and how many have
        # arrived since (its clients' next requests; see _wait).
        self.answered, self.answered_sentences, self.arrived_since = -float("inf"), 0, 0

    def submit(self, jobs: list[Job]) -> None:
        self.queue = collections.deque(j for j in self.queue if not j.future.done())
        if len(self.queue) + len(jobs) > self.limits.max_queue:
            raise Rejected(503, "the queue is full, retry later", **{"Retry-After": "1"})
        self.queue.extend(jobs)
        self.arrived_since += len(jobs)
        self.metrics.queue_depth.set(len(self.queue))
        self.arrival.set()

    async def run(self) -> None:
        while True:
            batch = await self._next_batch()
            self.metrics.batch_sentences.observe(len(batch))
            first = batch[0]
            texts = [job.text for job in batch]
            try:
                found = await asyncio.wrap_future(
                    self.model_thread.submit(self.translate, texts, *first.key[:2])
                )
            except Exception as error:  # answer the batch's requests; the server goes on
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(error)
                continue
            for job, translation in zip(batch, found, strict=True):
                if not job.future.done():  # not cancelled by a client that went away
                    job.future.set_result(translation)
            self.answered, self.answered_sentences, self.arrived_since = (
                time.monotonic(),
                len(batch),
                0,
            )
            self.metrics.sentences.inc(len(batch))

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
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.arrival.wait(), remaining)
                continue
            batch = self._take(oldest.key, dry_run=False)
            self.metrics.queue_depth.set(len(self.queue))
            return batch

    def _wait(self, oldest: Job, batch: list[Job]) -> float:
        """Seconds to wait for more sentences before running ``batch`` (<= 0: run it now).

        A batch of fewer than ``max_tokens`` waits for more at most ``max_wait`` after its oldest
        sentence arrived; and while fewer sentences have arrived since the last batch was
        answered than that batch held, until ``return_wait`` after that answer. Clients that send
        their next request once answered (a closed loop) so fill the next batch together, rather
        than split into two groups whose batches alternate, each half the size (one group's
        requests arriving while the other's batch runs)."""
        if sum(job.tokens for job in batch) >= self.max_tokens:
            return 0.0
        deadline = oldest.arrived + self.max_wait
        if self.arrived_since < self.answered_sentences:  # its clients are still coming back
            deadline = max(deadline, self.answered + self.return_wait)
        return deadline - time.monotonic()

    def _take(self, key: tuple, dry_run: bool) -> list[Job]:
        """The waiting jobs of ``key``, oldest first, up to ``max_tokens`` (at least one)."""
        batch, tokens, kept = [], 0, collections.deque()
        for job in self.queue:
            fits = not batch or tokens + job.tokens <= self.max_tokens
            if job.key == key and fits and not job.future.done():
                batch.append(job)
                tokens += job.tokens
            elif not job.future.done():
                kept.append(job)
        if not dry_run:
            self.queue = kept
        return batch


class Server:
    """The app and its state: the translator once loaded, the batcher, the metrics."""

    def __init__(
        self, load: Callable[[], Translator], *, max_tokens, max_wait, return_wait, limits, batching
    ):
        self.load, self.limits, self.batching = load, limits, batching
        self.translator: Translator | None = None
        self.load_error: str | None = None
        self.metrics = Metrics()
        if not batching:  # no other request can join a batch: nothing to wait for
            max_wait = return_wait = 0.0
        self.batcher_options = dict(
            max_tokens=max_tokens, max_wait=max_wait, return_wait=return_wait
        )
        self.batcher: Batcher | None = None
        self.requests = 0
        self.on_load_error: Callable[[], None] = lambda: None
        self.app = self._app()

    def _load(self) -> None:
        try:
            self.translator = self.load()
        except Exception as error:  # reported by main, which exits 2
            self.load_error = str(error).splitlines()[0] if str(error) else repr(error)
            self.on_load_error()

    def _translate(self, texts: list[str], beam: int, n_best: int) -> list[Translation]:
        return self.translator.translate_full(texts, beam=beam, nbest=n_best)

    def _app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            model_thread = ModelThread()
            self.batcher = Batcher(
                self._translate,
                model_thread,
                limits=self.limits,
                metrics=self.metrics,
                **self.batcher_options,
            )
            worker = asyncio.create_task(self.batcher.run())
            model_thread.submit(self._load)
            yield
            worker.cancel()

        app = FastAPI(title="fastnmt", lifespan=lifespan)
        app.get("/health")(self.health)
        app.get("/ready")(self.ready)
        app.get("/metrics")(self.prometheus)
        # A plain Starlette route: FastAPI's own (dependency solving, response validation) cost
        # 0.38 ms of server CPU a request against 0.22 (64 clients, an instant translator).
        app.router.add_route("/translate", self.translate, methods=["POST"])
        return app

    async def health(self):
        return {"status": "ok"}

    async def ready(self):
        if self.translator is None:
            return JSONResponse({"ready": False, "error": "the model is loading"}, status_code=503)
        return {"ready": True}

    async def prometheus(self):
        return Response(generate_latest(self.metrics.registry), media_type="text/plain")

    async def translate(self, request: Request):
        started = time.monotonic()
        try:
            response = await self._answer(request)
        except Rejected as rejected:
            response = rejected.response()
        if response is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        self.metrics.requests.labels(status=str(response.status_code)).inc()
        self.metrics.latency.observe(time.monotonic() - started)
        return response

    async def _answer(self, request: Request) -> JSONResponse | None:
        if self.translator is None:
            raise Rejected(503, "the model is loading, retry later", **{"Retry-After": "1"})
        vocab = self.translator.vocab
        query = parse_query(
            await request.body(), self.limits, lambda texts: [len(t) for t in vocab.encode(texts)]
        )
        self.requests += 1
        key = (query.beam, query.n_best) + (() if self.batching else (self.requests,))
        loop = asyncio.get_running_loop()
        jobs = [
            Job(text, tokens + 1, key, loop.create_future())  # + eos
            for text, tokens in zip(query.texts, query.tokens, strict=True)
        ]
        self.batcher.submit(jobs)
        waiting = asyncio.gather(*(job.future for job in jobs))
        gone = asyncio.ensure_future(_client_gone(request))
        await asyncio.wait([waiting, gone], return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            waiting.cancel()  # cancels the jobs: the batcher drops them
            self.metrics.requests.labels(status="disconnected").inc()
            return None
        gone.cancel()
        try:
            translations = waiting.result()
        except Exception as error:  # the batch failed: its requests say why
            raise Rejected(500, f"translation failed: {str(error).splitlines()[0]}") from None
        items = [_item(t, query.n_best) for t in translations]
        return JSONResponse({"translations": items[0] if query.single else items})


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects. Once the body is read, the ASGI server's receive()
    waits until then and answers http.disconnect: no polling, which woke the event loop 20 times
    a second for each waiting request and took the interpreter lock from the translating thread
    (64 clients: 1,280 wake-ups a second)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _item(translation: Translation, n_best: int):
    if n_best == 1:
        return translation.text
    return [{"text": c.text, "score": c.score} for c in translation.candidates]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastnmt.serve", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="fastnmt or Hugging Face checkpoint dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--precision", default="auto")
    p.add_argument("--src-code", help="NLLB/M2M100 source language code")
    p.add_argument("--tgt-code", help="NLLB/M2M100 target language code")
    batching = p.add_argument_group("batching")
    batching.add_argument("--max-tokens", type=int, default=6000, help="source tokens a batch")
    batching.add_argument(
        "--max-wait-ms", type=float, default=10.0, help="a sentence waits for more this long"
    )
    batching.add_argument(
        "--return-wait-ms", type=float, default=50.0,
        help="after a batch, wait this long for its clients' next requests",
    )  # fmt: skip
    batching.add_argument("--no-batching", action="store_true", help="each request alone")
    limits = p.add_argument_group("limits")
    limits.add_argument("--max-queue", type=int, default=Limits.max_queue, help="sentences")
    limits.add_argument("--max-sentences", type=int, default=Limits.max_sentences)
    limits.add_argument("--max-input-tokens", type=int, default=Limits.max_input_tokens)
    args = p.parse_args(argv)
    for name in ("port", "max_tokens", "max_queue", "max_sentences", "max_input_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("max_wait_ms", "return_wait_ms"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_process(decoding=True)

    def load() -> Translator:
        return Translator.load(
            args.checkpoint,
            src_code=args.src_code,
            tgt_code=args.tgt_code,
            device=args.device,
            precision=args.precision,
            max_tokens=args.max_tokens,
        )

    server = Server(
        load,
        max_tokens=args.max_tokens,
        max_wait=args.max_wait_ms / 1000,
        return_wait=args.return_wait_ms / 1000,
        limits=Limits(args.max_sentences, args.max_input_tokens, args.max_queue),
        batching=not args.no_batching,
    )
    config = uvicorn.Config(server.app, host=args.host, port=args.port, log_level="warning")
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
    print(f"fastnmt serving on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    web.run()
    if server.load_error is not None:
        print(f"error: {server.load_error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
