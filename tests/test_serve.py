"""The translation server, as a real process on 127.0.0.1 with a real HTTP client: answers equal
offline translations, every bad input is a 4xx naming the field, a full queue is 503, a client
that goes away leaves the queue, SIGTERM answers what was accepted and exits 0."""

import asyncio
import concurrent.futures
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from fastnmt.client import Client, ServerError
from fastnmt.translator import Translator
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


LIMITS = ("--max-input-tokens", 40, "--max-sentences", 16)


class ServerProcess:
    """``python -m fastnmt.serve`` on a free port, ready once this returns."""

    def __init__(self, checkpoint, *options, limits=LIMITS, precision="fp32"):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "fastnmt.serve", "--checkpoint", str(checkpoint),
            "--port", str(self.port), "--precision", precision, *map(str, [*limits, *options]),
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        self.client = Client(self.url, timeout=60)
        deadline = time.monotonic() + 120
        while not self.client.ready():
            assert self.process.poll() is None, self.process.stderr.read()
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.1)

    def post(self, body: bytes | dict, timeout: float = 60) -> httpx.Response:
        content = dict(json=body) if isinstance(body, dict) else dict(content=body)
        return httpx.post(f"{self.url}/translate", **content, timeout=timeout)

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

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


def test_answers_equal_offline_translations_in_the_order_sent(server, offline):
    assert server.client.translate(SENTENCES, beam=2) == offline.translate(SENTENCES, beam=2)
    assert (
        server.client.translate(SENTENCES[0], beam=1) == offline.translate(SENTENCES[:1], beam=1)[0]
    )
    [full] = offline.translate_full(SENTENCES[:1], beam=3, nbest=2)
    answer = server.client.translate(SENTENCES[0], beam=3, n_best=2)
    assert [a["text"] for a in answer] == [c.text for c in full.candidates]
    assert [a["score"] for a in answer] == pytest.approx([c.score for c in full.candidates])


def test_concurrent_requests_are_batched_and_each_gets_its_own(server, offline):
    """Single sentences from 12 clients at once: merged into batches, each answered alone."""
    texts = [s for s in SENTENCES if s.strip()] * 3
    expected = offline.translate(texts, beam=2)
    before = server.metric("fastnmt_batch_sentences_count")
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(lambda t: server.client.translate(t, beam=2), texts))
    assert answers == expected
    batches = server.metric("fastnmt_batch_sentences_count") - before
    assert batches < len(texts), "no two requests shared a batch"


@pytest.mark.parametrize(
    ("body", "status", "field", "message"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b'{"text": "caf\xe9"}', 400, None, "not valid UTF-8"),
        (b'["a list"]', 422, None, "a JSON object"),
        ({"text": 3}, 422, "text", "a string or a list of strings"),
        ({"text": ["ok", 4]}, 422, "text", "a string or a list of strings"),
        ({"beam": 2}, 422, "text", "a string or a list of strings"),
        ({"text": []}, 422, "text", "1 to 16 sentences, got 0"),
        ({"text": ["a"] * 17}, 422, "text", "1 to 16 sentences, got 17"),
        ({"text": ["ok", "word " * 60]}, 413, "text", "text[1] has"),
        ({"text": "ok", "beam": 0}, 422, "beam", "beam must be an integer from 1 to 16, got 0"),
        ({"text": "ok", "beam": "4"}, 422, "beam", "got '4'"),
        ({"text": "ok", "beam": True}, 422, "beam", "got True"),
        ({"text": "ok", "beam": 2, "n_best": 3}, 422, "n_best", "from 1 to 2, got 3"),
        ({"text": "ok", "nbest": 2}, 422, "nbest", "unknown field 'nbest'"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(server, body, status, field, message):
    response = server.post(body)
    assert response.status_code == status
    answer = response.json()
    assert message in answer["error"] and answer.get("field") == field


def test_health_ready_and_metrics(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").json() == {"ready": True}
    server.client.translate("Dogs.")
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in ("fastnmt_requests_total", "fastnmt_sentences_total", "fastnmt_batch_sentences",
                 "fastnmt_queue_sentences", "fastnmt_request_seconds"):  # fmt: skip
        assert name in metrics, name
    assert server.metric('fastnmt_requests_total{status="200"}') >= 1


def test_a_full_queue_is_503_with_retry_after(checkpoint_dir):
    small = ServerProcess(checkpoint_dir, "--max-queue", 2)
    try:
        response = small.post({"text": ["a", "b", "c"]})
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert "queue is full" in response.json()["error"]
        with pytest.raises(ServerError, match="503"):
            small.client.translate(["a", "b", "c"])
        assert small.client.translate(["a", "b"]) == small.client.translate(["a", "b"])
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
        assert slow.metric('fastnmt_requests_total{status="disconnected"}') == 1
        time.sleep(1.5)  # past the batch's wait: the abandoned sentence was not translated
        assert slow.metric("fastnmt_sentences_total") == 0

        texts = [s for s in SENTENCES if s.strip()]
        with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
            answers = [pool.submit(slow.client.translate, t, beam=2) for t in texts]
            time.sleep(0.5)  # accepted and queued, the batch not yet run
            slow.process.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            with pytest.raises(httpx.ConnectError):  # new connections are refused
                httpx.get(f"{slow.url}/health")
            assert [a.result(timeout=60) for a in answers] == offline.translate(texts, beam=2)
        assert slow.process.wait(timeout=60) == 0
    finally:
        slow.stop()


def test_bad_arguments_and_checkpoints_exit_2(tmp_path):
    command = [sys.executable, "-m", "fastnmt.serve"]
    bad = subprocess.run([*command, "--checkpoint", "x", "--max-queue", "0"], capture_output=True)
    assert bad.returncode == 2 and b"--max-queue must be positive" in bad.stderr
    negative = subprocess.run([*command, "--checkpoint", "x", "--return-wait-ms", "-1"],
                              capture_output=True)  # fmt: skip
    assert negative.returncode == 2 and b"--return-wait-ms must be >= 0" in negative.stderr
    missing = subprocess.run(
        [*command, "--checkpoint", str(tmp_path / "none"), "--port", str(_free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2
    assert missing.stderr.splitlines()[-1].startswith("error: ")
    assert "Traceback" not in missing.stderr


def _closed_loop_batch_sizes(return_wait: float) -> list[int]:
    """Batch sizes the Batcher forms for 8 clients that each send their next sentence once
    answered, client i after i x 5 ms (arrivals spread over 35 ms, max_wait is 5 ms)."""
    from fastnmt.serve import Batcher, Job, Limits, Metrics, ModelThread
    from fastnmt.translator import Translation

    sizes = []

    def translate(texts, beam, n_best):
        sizes.append(len(texts))
        time.sleep(0.02)
        return [Translation(text, []) for text in texts]

    async def scenario():
        loop = asyncio.get_running_loop()
        batcher = Batcher(
            translate, ModelThread(), max_tokens=1000, max_wait=0.005, return_wait=return_wait,
            limits=Limits(), metrics=Metrics(),
        )  # fmt: skip
        worker = asyncio.create_task(batcher.run())

        async def client(i: int):
            for _ in range(4):
                job = Job(f"sentence {i}", 3, (1, 1), loop.create_future())
                batcher.submit([job])
                await job.future
                await asyncio.sleep(0.005 * i)

        await asyncio.gather(*(client(i) for i in range(8)))
        worker.cancel()

    asyncio.run(scenario())
    return sizes


def test_clients_answered_together_come_back_into_one_batch():
    assert _closed_loop_batch_sizes(return_wait=0.5) == [8, 8, 8, 8]
    # Without the return wait the clients split into groups that arrive within max_wait.
    assert max(_closed_loop_batch_sizes(return_wait=0.0)[1:]) < 8


def test_the_model_is_loaded_and_run_on_one_thread_off_the_event_loop():
    """Loading and every batch share one thread, however short the batches: on more threads,
    PyTorch's OpenMP teams made the unbatched server half as fast (ModelThread)."""
    from fastnmt.serve import Job, Limits, Server
    from fastnmt.translator import Translation

    threads = []

    class Recording:
        def translate_full(self, texts, beam, nbest):
            threads.append(threading.get_ident())
            return [Translation(text, []) for text in texts]

    def load():
        threads.append(threading.get_ident())
        return Recording()

    server = Server(
        load, max_tokens=100, max_wait=0.0, return_wait=0.0, limits=Limits(), batching=False
    )

    async def scenario():
        async with server.app.router.lifespan_context(server.app):
            loop = asyncio.get_running_loop()
            while server.translator is None:
                await asyncio.sleep(0.01)
            for i in range(50):
                job = Job(f"sentence {i}", 3, (1, 1, i), loop.create_future())
                server.batcher.submit([job])
                assert (await job.future).source == f"sentence {i}"

    asyncio.run(scenario())
    assert len(threads) == 51 and len(set(threads)) == 1
    assert threads[0] != threading.get_ident()


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


def test_without_batching_a_request_waits_for_nothing():
    """No other request can join its batch: the unbatched baseline must not pay the waits."""
    from fastnmt.serve import Limits, Server

    def server(batching: bool) -> Server:
        return Server(
            lambda: None, max_tokens=100, max_wait=0.01, return_wait=0.05, limits=Limits(),
            batching=batching,
        )  # fmt: skip

    assert server(True).batcher_options == dict(max_tokens=100, max_wait=0.01, return_wait=0.05)
    assert server(False).batcher_options == dict(max_tokens=100, max_wait=0.0, return_wait=0.0)
