"""The translation server, as a real process on 127.0.0.1 with a real HTTP client: answers equal
offline translations in one shape, every bad input is a 4xx JSON answer naming the field (an
abuse run of malformed and random bodies among good ones: never a 500), a full queue is 429, a
client that goes away leaves the queue, a request past its deadline is 504, SIGTERM answers what
was accepted (within --shutdown-timeout) and exits 0, --workers N serves; in process: a batcher
that stops or a batch that hangs fails the probes and the waiting requests."""

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastnmt.client import Client, ServerError
from fastnmt.decoding.next_token import Sampling
from fastnmt.translator import Candidate, Translation, Translator
from tests.helpers import tiny_checkpoint
from tests.test_translator import SENTENCES

# The serve extra and its test client; a machine without them (the GPU machine has no internet)
# skips this file for that reason.
SERVE_EXTRA = 'the serve extra is not installed: pip install "fastnmt[serve]"'
for _module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_module, reason=SERVE_EXTRA)
httpx = pytest.importorskip("httpx", reason=SERVE_EXTRA)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LIMITS = ("--max-input-tokens", 40, "--max-sentences", 16, "--max-output-tokens", 50)
JSON = {"Content-Type": "application/json"}


class ServerProcess:
    """``python -m fastnmt.serve`` on a free port, ready once this returns. Its stderr (the
    access log among it) goes to a file: a pipe nobody reads would block it once full."""

    def __init__(self, checkpoint, *options, limits=LIMITS, precision="fp32"):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "fastnmt.serve", "--checkpoint", str(checkpoint),
            "--port", str(self.port), "--precision", precision, *map(str, [*limits, *options]),
        ]  # fmt: skip
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read after the process ends)
        self.process = subprocess.Popen(command, stderr=self._stderr, text=True)
        self.client = Client(self.url, timeout=60)
        deadline = time.monotonic() + 120
        while not self.client.ready():
            assert self.process.poll() is None, self.stderr()
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.1)

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    def post(self, body: bytes | dict, timeout: float = 60, **headers) -> httpx.Response:
        content = dict(json=body) if isinstance(body, dict) else dict(content=body)
        headers = {**JSON, **headers}
        return httpx.post(f"{self.url}/translate", **content, headers=headers, timeout=timeout)

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    def stop(self) -> int:
        self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    process = ServerProcess(checkpoint_dir, "--max-wait-ms", 20)
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def offline(checkpoint_dir):
    return Translator.from_checkpoint(checkpoint_dir, precision="fp32")


def _as_answered(translation: Translation) -> list[dict]:
    if not translation.candidates:
        return [{"text": "", "score": 0.0, "truncated": False}]
    return [
        {"text": c.text, "score": pytest.approx(c.score), "truncated": not c.ended}
        for c in translation.candidates
    ]


def test_answers_equal_offline_translations_in_one_shape(server, offline):
    assert server.client.translate(SENTENCES, beam=2) == offline.translate(SENTENCES, beam=2)
    full = offline.translate_full(SENTENCES, beam=3, nbest=2)
    answer = server.client.translate_full(SENTENCES, beam=3, n_best=2)
    assert answer == [_as_answered(t) for t in full]
    # One string is one sentence, answered as a list of one n-best list all the same.
    single = server.post({"text": SENTENCES[0], "beam": 1}).json()
    assert single == {
        "translations": [_as_answered(offline.translate_full(SENTENCES[:1], beam=1)[0])]
    }


def test_max_length_and_length_penalty_per_request_and_truncation_reported(server, offline):
    length, penalty = random.randint(2, 6), random.choice([0.0, 0.6, 1.7])
    expected = offline.translate_full(
        SENTENCES, beam=2, nbest=2, lenpen=penalty, max_len_a=0.0, max_len_b=length
    )
    answer = server.client.translate_full(
        SENTENCES, beam=2, n_best=2, max_length=length, length_penalty=penalty
    )
    assert answer == [_as_answered(t) for t in expected]
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
    assert all(answer == [_as_answered(t) for t in expected] for answer in answers)
    prefixes = ["Ein", None, "Zwei Hunde"] + [None] * (len(SENTENCES) - 3)
    expected = offline.translate_full(SENTENCES, beam=2, prefix=prefixes, no_repeat_ngram=2)
    answer = server.client.translate_full(SENTENCES, beam=2, prefix=prefixes, no_repeat_ngram=2)
    assert answer == [_as_answered(t) for t in expected]
    assert answer[0][0]["text"].startswith("Ein")


@pytest.mark.parametrize(
    ("body", "status", "field", "message"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b'{"text": "caf\xe9"}', 400, None, "not valid JSON"),
        (b'{"text": "\\ud800"}', 400, None, "not valid JSON"),  # a lone surrogate
        (b"[" * 100_000, 400, None, "not valid JSON"),
        (b'{"text": "a", "beam": ' + b"9" * 5000 + b"}", 400, None, "not valid JSON"),
        (b"", 400, None, "not valid JSON"),
        (b'["a list"]', 422, None, "a JSON object"),
        ({"text": 3}, 422, "text", "a string or a list of strings"),
        ({"text": ["ok", 4]}, 422, "text", "a string or a list of strings"),
        ({"beam": 2}, 422, "text", "text: Field required"),
        ({"text": []}, 422, "text", "1 to 16 sentences, got 0"),
        ({"text": ["a"] * 17}, 422, "text", "1 to 16 sentences, got 17"),
        ({"text": ["ok", "word " * 60]}, 413, "text", "text[1] has"),
        ({"text": "ok", "beam": 0}, 422, "beam", "greater than or equal to 1, got 0"),
        ({"text": "ok", "beam": 17}, 422, "beam", "less than or equal to 16, got 17"),
        ({"text": "ok", "beam": "4"}, 422, "beam", "got '4'"),
        ({"text": "ok", "beam": True}, 422, "beam", "got True"),
        ({"text": "ok", "beam": 2.5}, 422, "beam", "got 2.5"),
        ({"text": "ok", "beam": 2, "n_best": 3}, 422, "n_best", "at most beam (2), got 3"),
        ({"text": "ok", "max_length": 0}, 422, "max_length", "greater than or equal to 1"),
        ({"text": "ok", "max_length": 51}, 422, "max_length", "at most 50, got 51"),
        ({"text": "ok", "length_penalty": 2.5}, 422, "length_penalty", "at most 2.0, got 2.5"),
        ({"text": "ok", "length_penalty": -1}, 422, "length_penalty", "greater than or equal"),
        (b'{"text": "ok", "length_penalty": 1e999}', 422, "length_penalty", "finite number"),
        ({"text": "ok", "nbest": 2}, 422, "nbest", "unknown field 'nbest'"),
        ({"text": "ok", "sampling": "beam"}, 422, "sampling", "'topk' or 'topp'"),
        ({"text": "ok", "seed": 3}, 422, "seed", "seed needs sampling"),
        (
            {"text": "ok", "sampling": "topk", "sampling_topk": 0},
            422,
            "sampling_topk",
            "equal to 1",
        ),
        (
            {"text": "ok", "sampling": "topp", "sampling_topp": 1.5},
            422,
            "sampling_topp",
            "less than",
        ),
        (
            {"text": "ok", "sampling": "topk", "temperature": 0},
            422,
            "temperature",
            "greater than 0",
        ),
        ({"text": "ok", "sampling": "topk", "n_best": 2}, 422, "n_best", "samples (1), got 2"),
        ({"text": ["a", "b"], "prefix": ["Ein"]}, 422, "prefix", "one text per sentence (2)"),
        ({"text": "ok", "prefix": "Ein " * 30}, 422, "prefix", "past the length limit"),
        ({"text": "ok", "no_repeat_ngram": -1}, 422, "no_repeat_ngram", "greater than or"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(server, body, status, field, message):
    response = server.post(body)
    assert response.status_code == status
    answer = response.json()
    assert message in answer["error"] and answer["field"] == field


def test_every_error_is_in_one_format(server):
    """404, 405, 413 (before the body is read, and while reading one of unknown length) and
    415 answer {"error", "field"} too."""

    def error_of(response: httpx.Response, status: int) -> dict:
        assert response.status_code == status
        answer = response.json()
        assert set(answer) == {"error", "field"} and answer["error"]
        return answer

    error_of(httpx.get(f"{server.url}/nowhere"), 404)
    error_of(httpx.get(f"{server.url}/translate"), 405)
    answer = error_of(server.post({"text": "ok"}, **{"Content-Type": "text/plain"}), 415)
    assert answer["field"] == "Content-Type"
    huge = b'{"text": "' + b"a" * (2 << 20) + b'"}'
    error_of(server.post(huge), 413)
    chunks = (huge[i : i + 65536] for i in range(0, len(huge), 65536))
    error_of(server.post(chunks), 413)
    assert server.client.translate(["Dogs."], beam=1)  # the server goes on


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


def test_bad_arguments_and_checkpoints_exit_2(tmp_path, checkpoint_dir):
    command = [sys.executable, "-m", "fastnmt.serve"]

    def run(*arguments):
        options = ["--port", str(_free_port()), *map(str, arguments)]
        return subprocess.run([*command, *options], capture_output=True, text=True, timeout=120)

    bad = run("--checkpoint", "x", "--max-queue", "0")
    assert bad.returncode == 2 and "--max-queue must be positive" in bad.stderr
    negative = run("--checkpoint", "x", "--shutdown-timeout", "-1")
    assert negative.returncode == 2 and "--shutdown-timeout must be >= 0" in negative.stderr
    for workers in (1, 2):
        missing = run("--checkpoint", tmp_path / "none", "--workers", workers)
        assert missing.returncode == 2, missing.stderr
        assert missing.stderr.splitlines()[-1].startswith("error: ")
        assert "Traceback" not in missing.stderr
    too_long = run("--checkpoint", checkpoint_dir, "--max-input-tokens", 100_000)
    assert too_long.returncode == 2
    assert (
        "--max-input-tokens 100000 is more than the model's maximum source length"
        in (too_long.stderr.splitlines()[-1])
    )


def test_workers_share_the_port_each_with_its_threads(checkpoint_dir, offline):
    """--workers 2 --threads 1: answers as one process gives, from more than one process."""
    pair = ServerProcess(checkpoint_dir, "--workers", 2, "--threads", 1, "--no-access-log")
    try:
        texts = [s for s in SENTENCES if s.strip()]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda t: pair.client.translate([t], beam=2)[0], texts * 2))
        assert answers == offline.translate(texts * 2, beam=2)
        # Each process counts the scrapes it answered: one process alone would count 0, 1,
        # 2, ... New connections go to whichever worker accepts first (the second may still be
        # starting): ask until two have answered.
        scrapes, deadline = [], time.monotonic() + 60
        name = 'fastnmt_responses_total{code="200",handler="/metrics"}'
        while scrapes == list(range(len(scrapes))) and time.monotonic() < deadline:
            scrapes.append(int(pair.metric(name)))
            time.sleep(0.02)
        assert scrapes != list(range(len(scrapes))), "one process answered every connection"
    finally:
        assert pair.stop() == 0


# ---------------------------------------------------------------------------------------------
# The abuse run.
# ---------------------------------------------------------------------------------------------


def _random_json(rng: random.Random, depth: int = 0):
    """A random JSON value, most often an object with the request's field names."""
    kind = rng.choice(["object", "request", "list", "string", "number", "literal"][depth > 2 :])
    if kind == "request":
        names = ["text", "beam", "n_best", "max_length", "length_penalty", "x"]
        return {rng.choice(names): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == "object":
        return {_random_text(rng): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "string":
        return _random_text(rng)
    if kind == "number":
        return rng.choice([rng.randint(-(10**30), 10**30), rng.uniform(-1e6, 1e6), 0, 1, -1])
    return rng.choice([True, False, None])


def _random_text(rng: random.Random) -> str:
    alphabet = 'ab cé€😀\n\t"\\\x00\u200b\U0001f600'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))


def _malformed(rng: random.Random) -> list[tuple[str, bytes, dict]]:
    """(name, body, headers) of bodies no server should answer with a 500."""
    huge_int = b"9" * 5000
    return [
        ("16 MB string", b'{"text": "' + b"a" * (16 << 20) + b'"}', JSON),
        ("lone surrogate", b'{"text": ["ok", "\\ud800"]}', JSON),
        ("lone surrogate, raw", b'{"text": "\xed\xa0\x80"}', JSON),
        ("100k brackets", b"[" * 100_000 + b"]" * 100_000, JSON),
        ("100k braces", b'{"text":' * 50_000, JSON),
        ("5,000-digit beam", b'{"text": "a", "beam": ' + huge_int + b"}", JSON),
        ("5,000-digit float", b'{"text": "a", "length_penalty": 0.' + huge_int + b"}", JSON),
        ("NaN", b'{"text": "a", "length_penalty": NaN}', JSON),
        ("no content type", b'{"text": "a"}', {}),
        ("form", b"text=a", {"Content-Type": "application/x-www-form-urlencoded"}),
        ("random bytes", rng.randbytes(rng.randint(1, 300)), JSON),
        ("random JSON", json.dumps(_random_json(rng)).encode(), JSON),
        ("random JSON, ASCII", json.dumps(_random_json(rng), ensure_ascii=True).encode(), JSON),
    ]


def _valid_request(body: bytes) -> bool:
    from fastnmt.serve import TranslateRequest

    try:
        request = TranslateRequest.model_validate_json(body)
    except ValueError:
        return False
    return 1 <= len(request.text) <= 16 and request.n_best <= request.beam


class HealthWatch:
    """GET /health every 20 ms on a kept-alive connection: the slowest answer, in seconds."""

    def __init__(self, port: int):
        self.slowest, self.failures, self.polls = 0.0, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(port,))
        self._thread.start()

    def _run(self, port: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        while not self._stop.wait(0.02):
            started = time.perf_counter()
            connection.request("GET", "/health")
            response = connection.getresponse()
            response.read()
            self.slowest = max(self.slowest, time.perf_counter() - started)
            self.polls += 1
            if response.status != 200:
                self.failures.append(response.status)
        connection.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_abuse_never_gets_a_500_and_good_requests_their_translations(checkpoint_dir, offline):
    """Every malformed input the server once failed on, random JSON and random bytes,
    interleaved with good requests, on loopback: bounded to 12 rounds and 120 s."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    good = [s for s in SENTENCES if s.strip()]
    short = dict(beam=1, max_len_a=0.0, max_len_b=4)  # the random model runs to the limit
    expected = dict(zip(good, offline.translate(good, **short), strict=True))
    target = ServerProcess(checkpoint_dir, "--no-access-log")
    http_client = httpx.Client(base_url=target.url, timeout=30)
    try:
        target.client.translate(good, beam=1)  # warm up before measuring memory
        for _, body, headers in _malformed(rng):
            http_client.post("/translate", content=body, headers=headers)
        rss_before = target.rss_mb()
        watch = HealthWatch(target.port)
        deadline = time.monotonic() + 120
        try:
            for round_ in range(12):
                assert time.monotonic() < deadline, f"round {round_} past the time bound"
                for name, body, headers in _malformed(rng):
                    response = http_client.post("/translate", content=body, headers=headers)
                    label = f"{name} (seed {seed}): {response.status_code} {response.text[:200]}"
                    answer = response.json()
                    if response.status_code == 200:  # random JSON may be a valid request
                        assert _valid_request(body), label
                        assert len(answer["translations"]) >= 1, label
                    else:
                        assert 400 <= response.status_code < 500, label
                        assert set(answer) == {"error", "field"} and answer["error"], label
                    text = rng.choice(good)
                    answer = target.client.translate([text], beam=1, max_length=4)
                    assert answer == [expected[text]], f"after {name} (seed {seed})"
        finally:
            watch.stop()
        assert target.metric('fastnmt_request_duration_seconds_count{handler="/translate",'
                             'status_class="5xx"}') == 0  # fmt: skip
        assert watch.polls > 10 and not watch.failures
        assert watch.slowest < 0.1, f"/health took {watch.slowest * 1e3:.0f} ms"
        growth = target.rss_mb() - rss_before
        assert growth < 50, f"RSS grew by {growth:.0f} MB"
    finally:
        http_client.close()
        assert target.stop() == 0


# ---------------------------------------------------------------------------------------------
# In process: the batcher, its waits and its watch.
# ---------------------------------------------------------------------------------------------


class Upper:
    """A stand-in translator: each sentence's text in capitals, after ``gate`` opens."""

    max_source_tokens = 100
    model = SimpleNamespace(cfg=SimpleNamespace(max_positions=101))
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
    PyTorch's OpenMP teams made the unbatched server half as fast (ModelThread)."""
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
        lambda jobs: [job.sentence for job in jobs], ModelThread(), max_tokens=max_tokens,
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
    sentence arrived; and not at all once the last batch's clients are all back."""
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
            wait = batcher._wait(jobs[0], batcher._take(jobs[0].key, dry_run=True))
            assert max(wait, 0.0) <= max(arrived + max_wait - time.monotonic(), 0.0) + 1e-3
            if 0 < batcher.answered_sentences <= batcher.arrived_since:
                assert wait <= 0

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


def test_the_app_factory_builds_the_app_for_any_asgi_server(checkpoint_dir, monkeypatch):
    from fastnmt.serve import ENVIRONMENT, app_from_environment, create_app

    app = create_app(["--checkpoint", str(checkpoint_dir), "--threads", "1"])
    assert "/translate" in app.openapi()["paths"]
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    with pytest.raises(RuntimeError, match=ENVIRONMENT):
        app_from_environment()
    monkeypatch.setenv(ENVIRONMENT, f"--checkpoint '{checkpoint_dir}' --max-sentences 3")
    assert app_from_environment().title == "fastnmt"


def test_the_client_needs_only_the_standard_library():
    """fastnmt/client.py run on its own by an interpreter without site-packages."""
    client = Path(__file__).parents[1] / "fastnmt" / "client.py"
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('client', {str(client)!r}); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "module.Client('http://127.0.0.1:1')"
    )
    subprocess.run([sys.executable, "-I", "-S", "-c", code], check=True, env={**os.environ})


def test_threads_share_the_cores_among_workers(monkeypatch):
    from fastnmt.serve import parse_args, threads_per_worker

    cores = random.randint(1, 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)

    def threads(*options) -> int:
        return threads_per_worker(parse_args(["--checkpoint", "x", *map(str, options)]))

    assert threads() == max(1, cores - 1)  # one core left to the HTTP work
    workers = random.randint(2, 8)
    assert threads("--workers", workers) == max(1, cores // workers)
    assert threads("--workers", workers, "--threads", 3) == 3


def test_sentences_encoded_once_translate_as_their_text(offline):
    """The server hands Translator.translate_full the sentences it encoded to check them."""
    encoded = [
        Translation(text, tokens if text.strip() else [])
        for text, tokens in zip(SENTENCES, offline.vocab.encode(SENTENCES), strict=True)
    ]
    found = offline.translate_full(encoded, beam=2, nbest=2)
    assert all(a is b for a, b in zip(found, encoded, strict=True))  # filled in and returned
    expected = offline.translate_full(SENTENCES, beam=2, nbest=2)
    assert [_as_answered(t) for t in found] == [_as_answered(t) for t in expected]
