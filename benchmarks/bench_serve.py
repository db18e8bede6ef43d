"""Load on the translation server (``python -m fastnmt.serve``), on loopback: throughput
(sentences/s), p50/p99 request latency and mean batch size.

Rows, each over the 1,000 sentences of Multi30k test_2016_flickr, beam 4:
- ``offline``: ``Translator.translate`` on all of them at once (the translate CLI's work);
- ``64 clients x 1``: 64 concurrent clients, each sending single sentences, one after another;
- ``64 clients x 1, no batching``: the same against a server that translates each request
  alone (``--no-batching``);
- ``8 clients x 32``: 8 concurrent clients sending 32 sentences a request.

``extra_info`` holds each row's numbers and, on the 64-client row, its throughput against
offline and against the unbatched server. The model is FASTNMT_BENCH_CHECKPOINT when set (a
trained model's output lengths), else a random ``tiny`` model with a vocabulary trained on the
test set (whose outputs run to their length limit).
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import threading
import time

import pytest
import torch

from fastnmt import checkpoint
from fastnmt.client import Client
from fastnmt.data import Vocabulary, load_multi30k
from fastnmt.model import Transformer, preset
from fastnmt.translator import Translator
from tests.test_serve import ServerProcess

LIMITS = ("--max-sentences", 64, "--max-input-tokens", 256)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint directory, source sentences)."""
    test = load_multi30k("test_2016_flickr", "en", "de")
    sentences = test.src
    path = os.environ.get("FASTNMT_BENCH_CHECKPOINT")
    if path:
        return path, sentences
    vocab = Vocabulary.train(test.src + test.tgt, 8000)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=len(vocab)))
    saved = checkpoint.Checkpoint(
        model.state_dict(), {"model": model.cfg.to_dict()}, vocab.to_bytes(), None
    )
    return checkpoint.save(tmp_path_factory.mktemp("model"), 1, saved, keep_last=1), sentences


def _load(url: str, requests: list[list[str]], clients: int) -> dict:
    """Send ``requests`` from ``clients`` concurrent clients (each one request at a time, all
    connected before the clock starts): sentences/s and the latency percentiles, in ms."""
    latencies: list[float] = []
    connections = [Client(url) for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def client(connection: Client, share: list[list[str]]) -> None:
        start.wait()
        for texts in share:
            started = time.perf_counter()
            connection.translate(texts, beam=4)
            latencies.append((time.perf_counter() - started) * 1e3)

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        shares = [requests[i::clients] for i in range(clients)]
        done = [pool.submit(client, c, share) for c, share in zip(connections, shares, strict=True)]
        start.wait()
        started = time.perf_counter()
        for future in done:
            future.result()
        elapsed = time.perf_counter() - started
    for connection in connections:
        connection.close()
    quantiles = statistics.quantiles(latencies, n=100)
    sentences = sum(map(len, requests))
    return {"sent_per_s": sentences / elapsed, "p50_ms": quantiles[49], "p99_ms": quantiles[98]}


def _serve(path, sentences, requests, clients, *options) -> dict:
    server = ServerProcess(path, *options, limits=LIMITS, precision="auto")
    try:
        server.client.translate(sentences[:8], beam=4)  # one-time kernel setup
        before = [server.metric(f"fastnmt_batch_sentences_{x}") for x in ("sum", "count")]
        result = _load(server.url, requests, clients)
        after = [server.metric(f"fastnmt_batch_sentences_{x}") for x in ("sum", "count")]
        result["mean_batch"] = (after[0] - before[0]) / (after[1] - before[1])
    finally:
        server.stop()
    return result


def test_serve_under_load(benchmark, setup):
    path, sentences = setup
    singles = [[s] for s in sentences]

    def run() -> dict:
        translator = Translator.from_checkpoint(path)
        translator.translate(sentences[:8], beam=4)
        started = time.perf_counter()
        translator.translate(sentences, beam=4)
        rows = {"offline": {"sent_per_s": len(sentences) / (time.perf_counter() - started)}}
        rows["64 clients x 1"] = _serve(path, sentences, singles, 64)
        rows["64 clients x 1, no batching"] = _serve(path, sentences, singles, 64, "--no-batching")
        requests = [sentences[i : i + 32] for i in range(0, len(sentences), 32)]
        rows["8 clients x 32"] = _serve(path, sentences, requests, 8)
        return rows

    rows = benchmark.pedantic(run, rounds=1, iterations=1)
    batched = rows["64 clients x 1"]
    batched["vs_offline"] = batched["sent_per_s"] / rows["offline"]["sent_per_s"]
    batched["vs_no_batching"] = (
        batched["sent_per_s"] / rows["64 clients x 1, no batching"]["sent_per_s"]
    )
    batched["p99_over_p50"] = batched["p99_ms"] / batched["p50_ms"]
    benchmark.extra_info.update(rows)
    for name, row in rows.items():
        print(name, {k: round(v, 2) for k, v in row.items()})
