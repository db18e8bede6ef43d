"""The batcher and the model's thread, in process (a stand-in translator, the app served
through httpx's ASGI transport): a batcher that stops or a batch that hangs fails the probes
and the waiting requests, the model runs on one thread off the event loop, --max-tokens counts
padded source tokens times the beam, no sentence waits past --max-wait-ms, and a cancelled call
is skipped."""

import asyncio
import contextlib
import random
import threading
import time
from types import SimpleNamespace

import pytest

from fastnmt.translator import Candidate, Translation
from tests.serve.helpers import JSON, SERVE_EXTRA

httpx = pytest.importorskip("httpx", reason=SERVE_EXTRA)


class Upper:
    """A stand-in translator: each sentence's text in capitals, after ``gate`` opens."""

    max_source_tokens = 100
    max_target_tokens = 101
    vocab = SimpleNamespace(encode=lambda texts: [text.split() for text in texts])

    def __init__(self, gate: threading.Event | None = None):
        self.gate = gate
        self.calls: list[tuple[int, dict]] = []

    def translate_full(self, sentences, **options):
        self.calls.append((threading.get_ident(), options))
        if self.gate is not None:
            self.gate.wait(30)
        for sentence in sentences:
            sentence.candidates = [Candidate(sentence.source.upper(), [], -1.0, -1.0, True)]
        return sentences


@contextlib.asynccontextmanager
async def serving(translator, **options):
    """A Server around ``translator``, started, with an HTTP client talking to it in process."""
    from fastnmt.serve import Limits, Server

    options = dict(max_tokens=1000, max_wait=0.0, limits=Limits()) | options
    server = Server(lambda: translator, **options)
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            while server.translator is None:
                await asyncio.sleep(0.01)
            yield server, client


async def _translate(client, text: str) -> httpx.Response:
    return await client.post("/translate", json={"text": text}, headers=JSON)


def test_a_batcher_that_stops_fails_the_probes_and_the_waiting_requests():
    async def scenario():
        async with serving(Upper()) as (server, client):
            assert (await _translate(client, "a b")).json()["translations"][0][0]["text"] == "A B"

            def broken(*args, **kwargs):
                raise RuntimeError()  # no message: the answers still say what stopped

            server.batcher._take = broken
            response = await _translate(client, "c")
            assert response.status_code == 503
            assert response.json()["error"] == "the batcher stopped: RuntimeError"
            for probe in ("/health", "/ready"):
                answer = await client.get(probe)
                assert answer.status_code == 503 and "batcher stopped" in answer.json()["error"]
            assert (await _translate(client, "d")).status_code == 503

    asyncio.run(scenario())


def test_a_batch_past_its_deadline_is_504_and_the_server_unready_until_it_ends():
    from fastnmt.serve import Limits

    gate = threading.Event()

    async def scenario():
        limits = Limits(request_timeout=0.3)
        async with serving(Upper(gate), limits=limits) as (server, client):
            response = await _translate(client, "hangs")
            assert response.status_code == 504
            for _ in range(100):  # the batch's own deadline, just after the request's
                if server.batcher.stalled:
                    break
                await asyncio.sleep(0.01)
            for probe in ("/ready", "/health"):
                answer = await client.get(probe)
                assert answer.status_code == 503 and "run over 0.3 s" in answer.json()["error"]
            assert (await _translate(client, "refused")).status_code == 503
            gate.set()
            while (await client.get("/ready")).status_code != 200:
                await asyncio.sleep(0.01)
            answer = (await _translate(client, "served")).json()
            assert answer["translations"][0][0]["text"] == "SERVED"

    asyncio.run(scenario())


def test_the_model_is_loaded_and_run_on_one_thread_off_the_event_loop():
    """Loading and every batch share one thread, however short the batches: on more threads,
    PyTorch's OpenMP teams slow the unbatched server down (ModelThread)."""
    translator = Upper()

    async def scenario():
        async with serving(translator, batching=False) as (server, client):
            for i in range(20):
                answer = (await _translate(client, f"sentence {i}")).json()
                assert answer["translations"][0][0]["text"] == f"SENTENCE {i}"
        return server

    server = asyncio.run(scenario())
    threads = {thread for thread, _ in translator.calls}
    assert len(translator.calls) == 20 and len(threads) == 1
    assert threading.get_ident() not in threads
    assert server.requests == 20


def _jobs(lengths: list[int], beam: int, loop, arrived: float = 0.0):
    from fastnmt.serve import Job, Options

    key = (Options(beam, 1, None, 1.0),)
    return [
        Job(Translation("x", [0] * (n - 1)), key, loop.create_future(), arrived) for n in lengths
    ]


def _batcher(max_tokens: int, max_wait: float):
    from fastnmt.serve import Batcher, Metrics, ModelThread

    return Batcher(
        lambda jobs, on_translated: [job.sentence for job in jobs], ModelThread(),
        max_tokens=max_tokens,
        max_wait=max_wait, batch_timeout=60.0, max_queue=4096, metrics=Metrics(),
    )  # fmt: skip


def test_max_tokens_counts_padded_source_tokens_times_the_beam():
    from fastnmt.serve import batch_cost

    rng = random.Random()

    async def scenario():
        loop = asyncio.get_running_loop()
        for _ in range(50):
            max_tokens, beam = rng.randint(20, 400), rng.randint(1, 6)
            batcher = _batcher(max_tokens, 0.0)
            lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
            batcher.submit(_jobs(lengths, beam, loop))
            taken = batcher._take(batcher.queue[0].key, dry_run=True)
            cost = len(taken) * max(job.tokens for job in taken) * beam
            assert batch_cost(taken) == cost and taken[0] is batcher.queue[0]
            assert len(taken) == 1 or cost <= max_tokens
            for left in (job for job in batcher.queue if job not in taken):  # would not fit
                assert batch_cost([*taken, left]) > max_tokens

    asyncio.run(scenario())


def test_no_sentence_waits_for_more_past_max_wait():
    """Whatever the state of the batcher, a batch waits at most max_wait after its oldest
    sentence arrived or the model became free (the later); and not at all once the last batch's
    clients are all back."""
    rng = random.Random()

    async def scenario():
        loop = asyncio.get_running_loop()
        for _ in range(200):
            max_wait = rng.uniform(0.0, 0.1)
            batcher = _batcher(rng.randint(10, 1000), max_wait)
            batcher.answered_sentences = rng.randint(0, 64)
            arrived = time.monotonic() - rng.uniform(0.0, 0.2)
            jobs = _jobs([rng.randint(1, 20) for _ in range(rng.randint(1, 64))], 1, loop, arrived)
            batcher.submit(jobs)
            batcher.arrived_since = rng.randint(0, 64)
            batcher.free_since = time.monotonic() - rng.uniform(0.0, 0.2)
            wait = batcher._wait(jobs[0], batcher._take(jobs[0].key, dry_run=True))
            since = max(arrived, batcher.free_since)
            assert max(wait, 0.0) <= max(since + max_wait - time.monotonic(), 0.0) + 1e-3
            if 0 < batcher.answered_sentences <= batcher.arrived_since:
                assert wait <= 0

    asyncio.run(scenario())


def test_sentences_queued_during_a_batch_wait_for_its_clients_once_the_model_is_free():
    """Closed-loop clients in two cohorts: the half that queued while the other half's batch ran
    waits (up to max_wait from the moment the model is free) for that half to come back, and
    then runs with it as one batch."""

    async def scenario():
        loop = asyncio.get_running_loop()
        batcher = _batcher(10_000, 0.05)
        waiting = _jobs([5] * 32, 1, loop, time.monotonic() - 1.0)  # queued a second ago
        batcher.submit(waiting)
        batcher.answered_sentences, batcher.arrived_since = 32, 0
        batcher.free_since = time.monotonic()
        taken = batcher._take(waiting[0].key, dry_run=True)
        assert 0.04 < batcher._wait(waiting[0], taken) <= 0.05
        batcher.submit(_jobs([5] * 32, 1, loop))  # the answered batch's clients are back
        taken = batcher._take(waiting[0].key, dry_run=True)
        assert batcher._wait(waiting[0], taken) <= 0 and len(taken) == 64

    asyncio.run(scenario())


def test_a_sentence_is_answered_once_translated_and_its_client_back_starts_the_next_batch():
    """A sentence is answered as soon as the translation hands it over, while its batch still
    runs; its client's next request, sent then, counts as back: once the model is free the next
    batch starts at once, not max_wait later."""
    from fastnmt.serve import Batcher, Metrics, ModelThread

    gate, batches = threading.Event(), []

    def translate(jobs, on_translated):
        batches.append(len(jobs))
        for index, job in enumerate(jobs):
            on_translated(index, job.sentence)
        if len(batches) == 1:
            assert gate.wait(30)
        return [job.sentence for job in jobs]

    async def scenario():
        loop = asyncio.get_running_loop()
        batcher = Batcher(
            translate, ModelThread(), max_tokens=1000, max_wait=30.0, batch_timeout=60.0,
            max_queue=16, metrics=Metrics(),
        )  # fmt: skip
        first = _jobs([3], 1, loop, arrived=time.monotonic() - 60.0)  # its wait is over
        batcher.submit(first)
        running = asyncio.create_task(batcher.run())
        try:
            await asyncio.wait_for(first[0].future, 10)  # the batch is still at the gate
            assert not gate.is_set() and batches == [1]
            again = _jobs([3], 1, loop, arrived=time.monotonic())
            batcher.submit(again)
            gate.set()
            await asyncio.wait_for(again[0].future, 10)  # max_wait is 30 s
            assert batches == [1, 1]
        finally:
            gate.set()
            running.cancel()

    asyncio.run(scenario())


def test_a_call_cancelled_before_it_ran_is_skipped_and_the_model_thread_goes_on():
    from fastnmt.serve import ModelThread

    model_thread, started = ModelThread(), threading.Event()
    release = threading.Event()
    first = model_thread.submit(lambda: (started.set(), release.wait(5))[1])
    started.wait(5)
    skipped = model_thread.submit(lambda: pytest.fail("a cancelled call ran"))
    assert skipped.cancel() and not first.cancel()  # the first is running
    release.set()
    assert first.result(5) is True
    assert model_thread.submit(lambda: 1 / 0).exception(5).__class__ is ZeroDivisionError
    assert model_thread.submit(lambda: "still serving").result(5) == "still serving"
