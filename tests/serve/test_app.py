"""The app, as a real process on 127.0.0.1 with a real HTTP client: answers equal offline
translations in one shape, concurrent requests share batches, the probes, metrics and request
ids, a full queue is 429, a client that goes away leaves the queue, a request past its deadline
is 504, and SIGTERM answers what was accepted (within --shutdown-timeout) and exits 0."""

import concurrent.futures
import json
import random
import signal
import socket
import time

import pytest

from fastnmt.client import ServerError
from fastnmt.decoding.next_token import Sampling
from tests.serve.helpers import SERVE_EXTRA, ServerProcess, as_answered
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
