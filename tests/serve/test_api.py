"""The API's checks and its one error format, against a real server on loopback: every bad
input is a 4xx JSON answer naming the field, every error (404, 405, 413, 415 too) has the one
format, and an abuse run of malformed and random bodies among good ones never gets a 500."""

import json
import random
import subprocess
import sys
import time

import pytest

from fastnmt.translator import Translation
from tests.serve.helpers import JSON, SERVE_EXTRA, ServerProcess, as_answered
from tests.test_translator import SENTENCES

httpx = pytest.importorskip("httpx", reason=SERVE_EXTRA)


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
            "greater than or equal to 0.000001",
        ),
        (  # float32 draws NaN there: an unencodable score, once a 500
            {"text": "ok", "sampling": "topk", "temperature": 1e-320},
            422,
            "temperature",
            "greater than or equal to 0.000001",
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


def test_sentences_encoded_once_translate_as_their_text(offline):
    """The server hands Translator.translate_full the sentences it encoded to check them."""
    encoded = [
        Translation(text, tokens if text.strip() else [])
        for text, tokens in zip(SENTENCES, offline.vocab.encode(SENTENCES), strict=True)
    ]
    found = offline.translate_full(encoded, beam=2, nbest=2)
    assert all(a is b for a, b in zip(found, encoded, strict=True))  # filled in and returned
    expected = offline.translate_full(SENTENCES, beam=2, nbest=2)
    assert [as_answered(t) for t in found] == [as_answered(t) for t in expected]


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


# The watcher's own process: in the test's, a thread waiting for the interpreter lock while the
# abuse loop builds or sends a multi-megabyte body would add that wait to /health's answer.
_WATCH = """
import http.client, json, sys, threading, time
connection = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=5)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
slowest, polls, failures = 0.0, 0, []
while not stop.wait(0.02):
    started = time.perf_counter()
    connection.request("GET", "/health")
    response = connection.getresponse()
    response.read()
    slowest, polls = max(slowest, time.perf_counter() - started), polls + 1
    if response.status != 200:
        failures.append(response.status)
print(json.dumps([slowest, polls, failures]))
"""


class HealthWatch:
    """GET /health every 20 ms on a kept-alive connection, from another process, until
    ``stop``: then the slowest answer in seconds, the polls and the statuses other than 200."""

    def __init__(self, port: int):
        self._process = subprocess.Popen(
            [sys.executable, "-c", _WATCH, str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.slowest, self.polls, self.failures = 0.0, 0, []

    def stop(self) -> None:
        output, _ = self._process.communicate("", timeout=30)
        self.slowest, self.polls, self.failures = json.loads(output)


def test_abuse_never_gets_a_500_and_good_requests_their_translations(checkpoint_dir, offline):
    """Malformed bodies (huge, badly encoded, deeply nested, 5,000-digit numbers, NaN, other
    content types), random JSON and random bytes, interleaved with good requests, on loopback:
    bounded to 12 rounds and 120 s."""
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
