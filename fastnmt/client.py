"""A Python client of ``python -m fastnmt.serve`` (needs httpx: ``pip install "fastnmt[serve]"``).

from fastnmt.client import Client

client = Client("http://127.0.0.1:8000")
client.translate(["A man is walking his dog."], beam=4)  # -> ["..."]
client.translate("Dogs.", n_best=2)  # -> [{"text": ..., "score": ...}, ...]
"""

from __future__ import annotations

import httpx


class ServerError(Exception):
    """The server refused or failed a request: its status and the message it gave."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class Client:
    def __init__(self, url: str = "http://127.0.0.1:8000", *, timeout: float = 300.0):
        # A plain-http client skips the TLS context: loading the CA bundle costs ~20 ms of CPU
        # per client, which 64 clients starting together take from the server on a small machine.
        self.http = httpx.Client(base_url=url, timeout=timeout, verify=url.startswith("https:"))

    def translate(self, text: str | list[str], *, beam: int = 4, n_best: int = 1):
        """The translations of ``text`` (one string: one item), as the server answers them."""
        response = self.http.post("/translate", json={"text": text, "beam": beam, "n_best": n_best})
        if response.status_code != 200:
            try:
                message = response.json()["error"]
            except (ValueError, KeyError):
                message = response.text
            raise ServerError(response.status_code, message)
        return response.json()["translations"]

    def ready(self) -> bool:
        try:
            return self.http.get("/ready").status_code == 200
        except httpx.TransportError:
            return False

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
