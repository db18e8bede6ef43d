"""A real server process for the server's tests and its load benchmark (``ServerProcess``), and
what its tests share. Importing this module skips the importing module where the serve extra
or its test client is missing (the GPU machine has no internet)."""

import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fastnmt.client import Client
from fastnmt.translator import Translation

SERVE_EXTRA = 'the serve extra is not installed: pip install "fastnmt[serve]"'
for _module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_module, reason=SERVE_EXTRA)
httpx = pytest.importorskip("httpx", reason=SERVE_EXTRA)

LIMITS = ("--max-input-tokens", 40, "--max-sentences", 16, "--max-output-tokens", 50)
JSON = {"Content-Type": "application/json"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m fastnmt.serve`` on a free port, ready once this returns. Its stderr (the
    access log among it) goes to a file: a pipe nobody reads would block it once full."""

    def __init__(self, checkpoint, *options, limits=LIMITS, precision="fp32"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "fastnmt.serve", "--checkpoint", str(checkpoint),
            "--port", str(self.port), "--precision", precision, *map(str, [*limits, *options]),
        ]  # fmt: skip
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read after the process ends)
        self.process = subprocess.Popen(command, stderr=self._stderr, text=True)
        self.client = Client(self.url, timeout=60)
        # /ready answers for whichever worker takes the connection: wait for every worker, or
        # a request may reach one still loading (503).
        options = list(map(str, options))
        workers = int(options[options.index("--workers") + 1]) if "--workers" in options else 1
        loaded = [(True, 1.0)] * workers
        deadline = time.monotonic() + 120
        while not (self.client.ready() and (workers == 1 or self.ready_series() == loaded)):
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

    def ready_series(self) -> list[tuple[bool, float]]:
        """Each ``fastnmt_ready`` series in /metrics: whether it has a pid label (one per
        worker) and its value (1: loaded)."""
        scrape = httpx.get(f"{self.url}/metrics").text.splitlines()
        series = [line for line in scrape if line.startswith("fastnmt_ready{")]
        return [('pid="' in line, float(line.rsplit(" ", 1)[1])) for line in series]

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    def stop(self) -> int:
        self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


def as_answered(translation: Translation) -> list[dict]:
    """A translation's n-best list as the server answers it (scores compared approximately)."""
    if not translation.candidates:
        return [{"text": "", "score": 0.0, "truncated": False}]
    return [
        {"text": c.text, "score": pytest.approx(c.score), "truncated": not c.ended}
        for c in translation.candidates
    ]
