"""The application: ``Server`` holds the FastAPI app and its state (the translator once loaded,
the batcher, the metrics), its routes (``/translate``, ``/health``, ``/ready``, ``/metrics``) and
``Observed``, the middleware that gives every response a request id, a metric and a log line."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from fastnmt.serve.api import (
    ERROR_LOG,
    RETRY,
    ErrorResponse,
    Limits,
    Rejected,
    TranslateRequest,
    TranslateResponse,
    candidates,
    check_limits,
    error_response,
    one_line,
    parse_query,
)
from fastnmt.serve.batcher import Batcher, Job, ModelThread
from fastnmt.serve.metrics import Metrics
from fastnmt.serve.model_process import ModelProcess
from fastnmt.translator import Translation, Translator

ACCESS_LOG = logging.getLogger("fastnmt.serve.access")
# Bodies up to this size are parsed and tokenized on the event loop (a sentence: 20 us; 4 KiB:
# about 1 ms), larger ones on the parser threads, so that a big body never stalls the loop. A
# small body's hand-off to a thread and back costs more than its parse: under load each hand-off
# waits for the interpreter lock.
INLINE_PARSE_BYTES = 4 * 1024


class Server:
    """The app and its state: the translator once loaded, the batcher, the metrics.

    ``load`` runs on the model's thread once the app starts and gives the translator: a
    ``ModelProcess`` (the command line's), or a Translator run on that thread."""

    def __init__(
        self,
        load: Callable[[], Translator],
        *,
        max_tokens: int,
        max_wait: float,
        limits: Limits,
        batching: bool = True,
    ):
        self.load, self.limits, self.batching = load, limits, batching
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
        try:
            translator = self.load()
            check_limits(self.limits, translator)
            # What the imports and the model made lives as long as the process: out of the
            # collector's sight, a full collection scans only what requests made since (a few
            # ms, against 200 ms with the event loop and the model stalled).
            gc.freeze()
            self.translator = translator
            self.metrics.ready.set(1)
        except Exception as error:  # reported by main, which exits 2
            self.load_error = one_line(error)
            ERROR_LOG.error("the model failed to load: %s", self.load_error)
            self.on_load_error()

    def _translate(self, jobs: list[Job], on_translated) -> list[Translation]:
        """A batch's translations, each also handed to ``on_translated(index, translation)`` as
        soon as it is final: its jobs share their options; a job with a prefix shares its batch
        with its request's sentences only (``Query.alone``). Each sentence's samples follow its
        position in its request, whatever the batching."""
        prefixes = [job.prefix for job in jobs]
        given = any(p is not None for p in prefixes)
        try:
            return self.translator.translate_full(
                [job.sentence for job in jobs],
                **jobs[0].key[0].search(),
                prefix=prefixes if given else None,
                first_line=[job.line for job in jobs],
                on_translated=on_translated,
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
        self.metrics.process_ended()

    def _batcher_ended(self, worker: asyncio.Task) -> None:
        """The batcher never returns: if it does, fail what waits and the probes."""
        if worker.cancelled():  # the app is shutting down
            return
        error = worker.exception()
        self.failure = f"the batcher stopped: {one_line(error) if error else 'it returned'}"
        ERROR_LOG.error(self.failure, exc_info=error)
        self.batcher.fail_waiting(Rejected(503, self.failure))

    def _app(self) -> FastAPI:
        app = _TranslationApp(
            Observed(self._translate_asgi, self.metrics),
            title="fastnmt",
            summary="Translation with batching across concurrent requests",
            lifespan=self._lifespan,
        )
        app.get("/health", responses={503: {"model": ErrorResponse}})(self.health)
        app.get("/ready", responses={503: {"model": ErrorResponse}})(self.ready)
        app.get("/metrics", response_class=Response)(self.prometheus)
        errors = {status: {"model": ErrorResponse} for status in (400, 408, 413, 415, 422, 429)}
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

    async def _translate_asgi(self, scope, receive, send) -> None:
        """POST /translate as a plain ASGI app (``_TranslationApp``'s shortcut), with the route's
        error handling: what ``translate`` does not answer is a 500 in the error format."""
        request = Request(scope, receive)
        try:
            response = await self.translate(request)
        except Exception as error:
            response = await self._unexpected_error(request, error)
        await response(scope, receive, send)

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
        if isinstance(self.translator, ModelProcess) and self.translator.ended:
            return self.translator.ended
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
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

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
        body = await self._body(request, arrived)
        translator = self.translator
        max_input = self.limits.max_input_tokens or translator.max_source_tokens
        max_output = self.limits.max_output_tokens or translator.max_target_tokens
        loop = asyncio.get_running_loop()
        parse = (body, self.limits, translator.vocab.encode, max_input, max_output)
        if len(body) <= INLINE_PARSE_BYTES:
            query = parse_query(*parse)
        else:
            query = await loop.run_in_executor(self.parser, parse_query, *parse)
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

    async def _body(self, request: Request, arrived: float) -> bytes:
        """The body, within the request's deadline: a client that sends it too slowly gets 408
        and its connection closed, rather than holding one for ever."""
        timeout = self.limits.request_timeout
        remaining = arrived + timeout - time.monotonic()
        try:
            return await asyncio.wait_for(
                _read_body(request, self.limits.max_body_bytes), remaining
            )
        except asyncio.TimeoutError:
            message = f"the body did not arrive within {timeout:g} s"
            raise Rejected(408, message, Connection="close") from None

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
    waits until then and answers http.disconnect: no polling, which would wake the event loop
    for each waiting request and take the interpreter lock from the translating thread."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _request_id(scope) -> bytes:
    """The client's X-Request-ID if it is a sane one (printable ASCII, up to 128 characters),
    else a new one."""
    for name, value in scope["headers"]:
        if name == b"x-request-id" and 0 < len(value) <= 128 and all(32 < c < 127 for c in value):
            return value
    return uuid.uuid4().hex.encode()


class _TranslationApp(FastAPI):
    """The FastAPI app, whose POST /translate requests skip FastAPI's and Starlette's layers
    (middleware, routing, dependency solving: about 150 us a request, against 25 us for the route
    itself) and go straight to ``translate``, the route the OpenAPI schema describes. Under load
    the event loop answers a batch's requests and takes in their clients' next ones while the
    model waits, so each request's time on the loop is time the model is idle."""

    def __init__(self, translate, **options):
        super().__init__(**options)
        self.translate = translate  # an ASGI app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/translate" and scope["method"] == "POST":
            return await self.translate(scope, receive, send)
        return await super().__call__(scope, receive, send)


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
