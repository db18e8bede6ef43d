"""The app, as a real process on 127.0.0.1 with a real HTTP client: answers equal offline
translations in one shape, concurrent requests share batches, the probes, metrics and request
ids, a full queue is 429, a client that goes away leaves the queue, a request past its deadline
is 504, and SIGTERM answers what was accepted (within --shutdown-timeout) and exits 0. In the
app's process: POST /translate's shortcut past the framework, where a body is parsed, and the
collector's view of the loaded model."""

import asyncio
import concurrent.futures
import gc
import json
import random
import signal
import socket
import threading
import time

import pytest

from fastnmt.client import ServerError
from fastnmt.decoding.next_token import Sampling
from tests.serve.helpers import JSON, SERVE_EXTRA, ServerProcess, as_answered
from tests.test_translator import SENTENCES

httpx = pytest.importorskip("httpx", reason=SERVE_EXTRA)


def test_answers_equal_offline_translations_in_one_shape(server, offline):
    assert server.client.translate(SENTENCES, beam=2) == offline.translate(SENTENCES, beam=2)
    full = offline.translate_full(SENTENCES, beam=3, nbest=2)
    answer = server.client.translate_full(SENTENCES, beam=3, n_best=2)
    assert answer == [as_answered(t) for t in full]
    # One string is one sentence, answered as a list of one n-best list all the same.
    single = server.post({"text": SENTENCES[0], "beam": 1}).json()
    assert single == {
        "translations": [as_answered(offline.translate_full(SENTENCES[:1], beam=1)[0])]
    }


def test_max_length_and_length_penalty_per_request_and_truncation_reported(server, offline):
    length, penalty = random.randint(2, 6), random.choice([0.0, 0.6, 1.7])
    expected = offline.translate_full(
        SENTENCES, beam=2, nbest=2, lenpen=penalty, max_len_a=0.0, max_len_b=length
    )
    answer = server.client.translate_full(
        SENTENCES, beam=2, n_best=2, max_length=length, length_penalty=penalty
    )
    assert answer == [as_answered(t) for t in expected]
    # The random tiny model never ends a sentence of its own: every candidate was cut.
    assert all(c["truncated"] for n_best in answer if n_best[0]["text"] for c in n_best)


def test_concurrent_requests_are_batched_and_each_gets_its_own(server, offline):
    """Single sentences from 12 clients at once: merged into batches, each answered alone."""
    texts = [s for s in SENTENCES if s.strip()] * 3
    expected = offline.translate(texts, beam=2)
    before = server.metric("fastnmt_batch_sentences_count")
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(lambda t: server.client.translate([t], beam=2)[0], texts))
    assert answers == expected
    batches = server.metric("fastnmt_batch_sentences_count") - before
    assert batches < len(texts), "no two requests shared a batch"


def test_sampling_prefixes_and_ngrams_per_request_as_offline(server, offline):
    """Per request, what ``Translator.translate_full`` does with the same settings: a seed's
    samples follow each sentence's place in its request, whatever else shares its batch."""
    sampling = Sampling("topk", topk=5, temperature=1.5, seed=7, samples=2)
    expected = offline.translate_full(SENTENCES, nbest=2, sampling=sampling)
    body = dict(sampling="topk", sampling_topk=5, temperature=1.5, seed=7, samples=2, n_best=2)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # batched with one another
        answers = list(pool.map(lambda _: server.client.translate_full(SENTENCES, **body), "abc"))
    assert all(answer == [as_answered(t) for t in expected] for answer in answers)
    prefixes = ["Ein", None, "Zwei Hunde"] + [None] * (len(SENTENCES) - 3)
    expected = offline.translate_full(SENTENCES, beam=2, prefix=prefixes, no_repeat_ngram=2)
    answer = server.client.translate_full(SENTENCES, beam=2, prefix=prefixes, no_repeat_ngram=2)
    assert answer == [as_answered(t) for t in expected]
    assert answer[0][0]["text"].startswith("Ein")


def test_health_ready_metrics_and_request_ids(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").json() == {"ready": True}
    response = server.post({"text": "Dogs."}, **{"X-Request-ID": "trace-42"})
    assert response.headers["X-Request-ID"] == "trace-42"
    made = server.post({"text": 3}).headers["X-Request-ID"]
    assert len(made) == 32 and made != server.post({"text": 3}).headers["X-Request-ID"]
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in (
        'fastnmt_request_duration_seconds_bucket{handler="/translate",le="0.005",status_class=',
        'fastnmt_responses_total{code="422",handler="/translate"}',
        "fastnmt_requests_in_flight", "fastnmt_sentences_total", "fastnmt_batch_sentences_count",
        "fastnmt_batch_tokens_count", "fastnmt_queue_wait_seconds_count",
        "fastnmt_batch_duration_seconds_count", "fastnmt_queue_sentences",
        "process_resident_memory_bytes", "process_cpu_seconds_total", "python_info",
        "python_gc_collections_total",
    ):  # fmt: skip
        assert name in metrics, name
    assert server.metric('fastnmt_request_duration_seconds_count{handler="/translate",'
                         'status_class="4xx"}') >= 2  # fmt: skip
    assert "/translate" in httpx.get(f"{server.url}/openapi.json").json()["paths"]
    time.sleep(0.2)  # the access log line is written once the answer is sent
    assert '"POST /translate" 200' in server.stderr() and "id=trace-42" in server.stderr()


def test_a_full_queue_is_429_with_retry_after(checkpoint_dir):
    small = ServerProcess(checkpoint_dir, "--max-queue", 2, "--no-access-log")
    try:
        response = small.post({"text": ["a", "b", "c"]})
        assert response.status_code == 429 and response.headers["Retry-After"] == "1"
        assert "queue is full" in response.json()["error"]
        with pytest.raises(ServerError, match="429") as refused:
            small.client.translate(["a", "b", "c"])
        assert refused.value.status == 429 and refused.value.field is None
        assert small.client.translate(["a", "b"]) == small.client.translate(["a", "b"])
        assert small.stderr() == "" or "POST" not in small.stderr()  # --no-access-log
    finally:
        assert small.stop() == 0


def test_a_client_that_goes_away_leaves_the_queue_and_sigterm_drains(checkpoint_dir, offline):
    """A batch waits up to 1.5 s for more: time for a client to give up, and for SIGTERM to
    arrive while requests are queued."""
    slow = ServerProcess(checkpoint_dir, "--max-wait-ms", 1500)
    try:
        with pytest.raises(httpx.ReadTimeout):
            slow.post({"text": SENTENCES[0]}, timeout=0.3)
        time.sleep(0.1)  # the handler hears of the disconnection at once
        assert slow.metric('fastnmt_responses_total{code="499",handler="/translate"}') == 1
        time.sleep(1.5)  # past the batch's wait: the abandoned sentence was not translated
        assert slow.metric("fastnmt_sentences_total") == 0

        texts = [s for s in SENTENCES if s.strip()]
        with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
            answers = [pool.submit(slow.client.translate, [t], beam=2) for t in texts]
            time.sleep(0.5)  # accepted and queued, the batch not yet run
            slow.process.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            with pytest.raises(httpx.ConnectError):  # new connections are refused
                httpx.get(f"{slow.url}/health")
            assert [a.result(timeout=60)[0] for a in answers] == offline.translate(texts, beam=2)
        assert slow.process.wait(timeout=60) == 0
    finally:
        slow.stop()


def test_a_body_slower_than_the_deadline_is_408_and_its_connection_closed(checkpoint_dir):
    """A client that sends half its body and stalls (slowloris) holds no connection past the
    request's deadline (1 s); the server goes on answering."""
    server = ServerProcess(checkpoint_dir, "--request-timeout", 1)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as stalled:
            stalled.sendall(
                b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 40\r\n\r\n{"text": '
            )
            started, answer = time.monotonic(), b""
            while chunk := stalled.recv(4096):  # until the server closes the connection
                answer += chunk
        assert 0.9 < time.monotonic() - started < 10
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body) == {"error": "the body did not arrive within 1 s", "field": None}
        assert len(server.client.translate(["Dogs."])) == 1
    finally:
        server.stop()


def test_a_request_past_its_deadline_is_504_and_sigterm_waits_at_most_the_shutdown_timeout(
    checkpoint_dir,
):
    """Batches wait 60 s for more: a request's deadline (3 s) comes first, and SIGTERM with a
    request still queued ends after --shutdown-timeout (0.5 s), not after the batch, and answers
    that request 503, before its deadline."""
    stuck = ServerProcess(
        checkpoint_dir, "--max-wait-ms", 60_000, "--request-timeout", 3, "--shutdown-timeout", 0.5
    )
    try:
        started = time.monotonic()
        response = stuck.post({"text": "Dogs."})
        assert response.status_code == 504 and "within 3 s" in response.json()["error"]
        assert 2.9 < time.monotonic() - started < 20
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(stuck.post, {"text": "Cats."})
            time.sleep(0.5)
            stopped = time.monotonic()
            stuck.process.send_signal(signal.SIGTERM)
            assert stuck.process.wait(timeout=30) == 0
            assert time.monotonic() - stopped < 10
            response = pending.result(timeout=30)
            assert response.status_code == 503 and "shutting down" in response.json()["error"]
            assert response.headers["retry-after"] == "1"
    finally:
        stuck.stop()


def _in_process_server(checkpoint_dir):
    """The app of ``python -m fastnmt.serve`` without its lifespan: no batcher, no model."""
    from fastnmt.serve import build_server, parse_args

    return build_server(parse_args(["--checkpoint", str(checkpoint_dir), "--no-access-log"]))


def _requests(app, *requests: tuple[str, str, bytes]) -> list[httpx.Response]:
    async def send_all():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return [
                await client.request(method, path, content=body, headers=JSON)
                for method, path, body in requests
            ]

    return asyncio.run(send_all())


def test_translate_skips_the_framework_and_keeps_request_ids_metrics_and_errors(
    checkpoint_dir, monkeypatch
):
    """POST /translate goes from the app straight to its route (FastAPI's layers cost more than
    the route, on the event loop the model waits for); it keeps the request id, the metrics and
    the one error format, a failure in the route is the format's 500, and every other request
    goes through FastAPI."""
    from fastapi import FastAPI

    server = _in_process_server(checkpoint_dir)
    through_fastapi = []
    original = FastAPI.__call__

    async def counted(self, scope, receive, send):
        through_fastapi.append((scope.get("method"), scope.get("path")))
        await original(self, scope, receive, send)

    monkeypatch.setattr(FastAPI, "__call__", counted)
    body = json.dumps({"text": "Dogs."}).encode()
    loading, wrong_method = _requests(
        server.app, ("POST", "/translate", body), ("GET", "/translate", b"")
    )
    assert through_fastapi == [("GET", "/translate")]
    assert loading.status_code == 503 and loading.headers["Retry-After"] == "1"
    assert loading.json() == {"error": "the model is loading, retry later", "field": None}
    assert len(loading.headers["X-Request-ID"]) == 32
    assert wrong_method.status_code == 405 and set(wrong_method.json()) == {"error", "field"}
    exposition = server.metrics.exposition().decode()
    assert 'fastnmt_responses_total{code="503",handler="/translate"} 1.0' in exposition

    async def fails(request):
        raise RuntimeError("a fault")

    monkeypatch.setattr(server, "translate", fails)
    (failed,) = _requests(server.app, ("POST", "/translate", body))
    assert failed.status_code == 500
    assert failed.json() == {"error": "internal error: a fault", "field": None}


def test_small_bodies_are_parsed_on_the_event_loop_large_ones_off_it(
    checkpoint_dir, offline, monkeypatch
):
    """A small body's parse takes less than a hand-off to a thread; one past INLINE_PARSE_BYTES
    is parsed on the parser threads, so that it never stalls the event loop."""
    from fastnmt.serve import app as app_module

    server = _in_process_server(checkpoint_dir)
    server.translator = offline
    threads = []
    parse = app_module.parse_query

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return parse(*args)

    monkeypatch.setattr(app_module, "parse_query", recorded)
    small = json.dumps({"text": "Dogs.", "beam": 0}).encode()
    large = json.dumps({"text": "Dogs." * 1000, "beam": 0}).encode()
    assert len(small) <= app_module.INLINE_PARSE_BYTES < len(large)
    answers = _requests(server.app, ("POST", "/translate", small), ("POST", "/translate", large))
    assert [a.status_code for a in answers] == [422, 422]
    assert threads[0] == threading.current_thread().name  # the event loop's
    assert threads[1].startswith("fastnmt-parse")


def test_the_loaded_model_is_out_of_the_collectors_sight(checkpoint_dir):
    """Once loaded, what the imports and the model made is frozen: a full collection (200 ms
    with a model's process, the event loop stalled) scans only what came since."""
    server = _in_process_server(checkpoint_dir)
    server.threads = None  # this process's thread count stays as it is
    gc.unfreeze()
    try:
        server._load()
        assert server.translator is not None and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
