"""fastnmt.client against small standard-library HTTP servers (tests/serve/ runs it against the
real server), and on the standard library alone: no torch, no server."""

import concurrent.futures
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fastnmt.client import Client, ServerError

ROOT = Path(__file__).resolve().parents[1]


class Handler(BaseHTTPRequestHandler):
    """Answers /translate as the real server does, with each text reversed, n_best times, the
    request's options in the candidates (beam 0: with the status and body in the first text,
    "status body"), /ready and /health with 200. ``forget`` closes each connection after its
    answer without saying so (as a server does with a connection that stayed idle past its
    keep-alive timeout)."""

    protocol_version = "HTTP/1.1"
    forget = False

    def do_POST(self):
        query = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if query["beam"] == 0:
            status, body = query["text"][0].split(" ", 1)
            self._send(int(status), body.encode())
            return
        options = {k: v for k, v in query.items() if k not in ("text", "beam", "n_best")}
        candidate = {"score": -1.0, "truncated": False, "options": options}
        n_best = [[{"text": t[::-1], **candidate}] * query["n_best"] for t in query["text"]]
        self._send(200, json.dumps({"translations": n_best}).encode())
        self.close_connection = self.forget

    def setup(self):
        """Once per accepted connection: counted, not named by the peer's port, which the
        kernel may give a later connection again."""
        super().setup()
        self.server.connections.append(self.client_address)

    def do_GET(self):
        self._send(200 if self.path in ("/ready", "/health") else 404, b"{}")

    def _send(self, status: int, body: bytes):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(forget: bool = False):
    handler = type("H", (Handler,), {"forget": forget})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.connections = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_one_connection_is_kept_alive_and_one_the_server_closed_is_reopened():
    with serving() as (server, url), Client(url) as client:
        assert client.ready() and client.health()
        assert client.translate(["abc", "de"]) == ["cba", "ed"]
        assert client.translate(["xyz"]) == ["zyx"]
        assert len(server.connections) == 1
    with serving(forget=True) as (server, url), Client(url) as client:
        assert [client.translate([t])[0] for t in ("ab", "cd", "ef")] == ["ba", "dc", "fe"]
        assert len(server.connections) == 3


def test_translate_full_sends_the_options_and_returns_the_n_best_lists():
    with serving() as (_, url), Client(url) as client:
        [n_best] = client.translate_full(["abc"], beam=3, n_best=2, max_length=7)
        assert [c["text"] for c in n_best] == ["cba", "cba"]
        assert n_best[0]["options"] == {"max_length": 7}  # None: the server's default
        [[best]] = client.translate_full(["a"], length_penalty=0.5)
        assert best["options"] == {"length_penalty": 0.5}


def test_one_string_is_a_type_error_not_a_request():
    with serving() as (server, url), Client(url) as client:
        with pytest.raises(TypeError, match="texts must be a list of strings, got str"):
            client.translate("abc")
        assert server.connections == []


def test_each_thread_has_its_own_connection():
    texts = [f"sentence {i}" for i in range(64)]
    pool = concurrent.futures.ThreadPoolExecutor(8)
    with serving() as (server, url), Client(url) as client, pool:
        answers = list(pool.map(lambda t: client.translate([t])[0], texts))
    assert answers == [t[::-1] for t in texts]
    assert 1 < len(server.connections) <= 8


@pytest.mark.parametrize(
    ("status", "body", "message", "field"),
    [(422, '{"error": "beam must be in [1, 64]", "field": "beam"}', "beam must be in", "beam"),
     (429, '{"error": "the queue is full", "field": null}', "the queue is full", None),
     (500, "Internal Server Error", "Internal Server Error", None),
     (502, '["not", "the server format"]', '["not", "the server format"]', None)],
)  # fmt: skip
def test_a_refusal_is_a_server_error_with_its_status_message_and_field(
    status, body, message, field
):
    refused = pytest.raises(ServerError, match=re.escape(f"{status}: {message}"))
    with serving() as (_, url), Client(url) as client, refused as raised:
        client.translate([f"{status} {body}"], beam=0)
    assert raised.value.status == status and raised.value.field == field


def test_nothing_listening_is_not_ready_and_a_connection_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = Client(f"http://127.0.0.1:{port}", timeout=5)
    assert not client.ready() and not client.health()
    with pytest.raises(ConnectionError):
        client.translate(["a"])


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://host", "http://"])
def test_a_bad_url_is_a_one_line_error(url):
    with pytest.raises(ValueError, match="url must be http://host"):
        Client(url)


def test_the_client_needs_only_the_standard_library():
    """fastnmt/client.py run on its own by an interpreter without site-packages."""
    client = ROOT / "fastnmt" / "client.py"
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('client', {str(client)!r}); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "module.Client('http://127.0.0.1:1')"
    )
    subprocess.run([sys.executable, "-I", "-S", "-c", code], check=True, env={**os.environ})


def test_the_client_imports_without_torch_or_the_server():
    """``import fastnmt.client`` where torch cannot be imported: fastnmt loads its names lazily,
    and the client imports neither torch nor fastnmt.serve (run from the repository's root, so
    that this tree's fastnmt is the one imported)."""
    code = (
        "import sys; sys.modules['torch'] = None; import fastnmt.client; "
        "loaded = [m for m in ('torch', 'fastnmt.serve') if sys.modules.get(m) is not None]; "
        "assert not loaded, f'fastnmt.client imported {loaded}'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
