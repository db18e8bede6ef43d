"""The server's Prometheus metrics (``GET /metrics``).

Worker processes (``--workers N``, or any ASGI server's workers with $PROMETHEUS_MULTIPROC_DIR
set) share their metrics through prometheus_client's multiprocess mode: each process writes its
values to files in that directory and a scrape, whichever worker answers it, sums them. The
process and interpreter collectors are then left out (they describe one process)."""

from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    multiprocess,
)

MULTIPROCESS = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's; read when it is imported

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
HANDLERS = ("/translate", "/health", "/ready", "/metrics")  # any other path is "other"


class Metrics:
    """The server's Prometheus metrics, in a registry of their own, with (one process) the
    process's (CPU, memory, file descriptors), the interpreter's and its garbage collector's."""

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.shared = MULTIPROCESS in os.environ
        if not self.shared:
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        self.duration = Histogram(
            "fastnmt_request_duration_seconds", "HTTP requests, arrival to answer",
            ["handler", "status_class"], buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.responses = Counter(
            "fastnmt_responses", "HTTP responses by status code (499: the client went away)",
            ["handler", "code"], registry=registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "fastnmt_requests_in_flight", "HTTP requests being served", registry=registry,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.ready = Gauge(
            "fastnmt_ready", "1 once the model is loaded (per worker: its pid label)",
            registry=registry, multiprocess_mode="liveall",
        )  # fmt: skip
        self.sentences = Counter("fastnmt_sentences", "Sentences translated", registry=registry)
        self.batch_sentences = Histogram(
            "fastnmt_batch_sentences", "Sentences per batch", registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        )  # fmt: skip
        self.batch_tokens = Histogram(
            "fastnmt_batch_tokens", "Padded source tokens times the beam per batch (--max-tokens)",
            registry=registry, buckets=tuple(250 * 2**i for i in range(10)),
        )  # fmt: skip
        self.batch_duration = Histogram(
            "fastnmt_batch_duration_seconds", "Translating one batch", registry=registry,
            buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "fastnmt_queue_wait_seconds", "A sentence's wait from arrival to its batch's start",
            registry=registry, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "fastnmt_queue_sentences", "Sentences waiting for a batch", registry=registry,
            multiprocess_mode="livesum",
        )  # fmt: skip

    def exposition(self) -> bytes:
        """The text format of a scrape: this process's, or every worker's summed."""
        if not self.shared:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)

    def process_ended(self) -> None:
        """Drop this process's live gauges from the shared files (a worker that stops)."""
        if self.shared:
            multiprocess.mark_process_dead(os.getpid())

    def observe(self, path: str, status: int, seconds: float) -> None:
        handler = path if path in HANDLERS else "other"
        self.duration.labels(handler, f"{status // 100}xx").observe(seconds)
        self.responses.labels(handler, str(status)).inc()
