"""A translation server that batches sentences across concurrent requests.

    pip install -e ".[serve]"
    python -m fastnmt.serve --checkpoint DIR [--host 127.0.0.1 --port 8000] [--workers N]

``POST /translate`` (``Content-Type: application/json``) takes ``{"text": ["...", ...], "beam":
4, "n_best": 1, "max_length": 64, "length_penalty": 1.0}`` (``text`` may be one string; the
others are optional) and answers ``{"translations": [[{"text", "score", "truncated"}, ...],
...]}``: for each sentence in the order sent, its n-best list, best first. Every error is
``{"error": message, "field": name or null}``. ``GET /health`` answers while the process can
serve, ``GET /ready`` once the model is loaded, ``GET /metrics`` in Prometheus' text format;
``/docs`` and ``/openapi.json`` describe the API. docs/serving.md is the user's guide.

The decoder is fastest on large batches, so every request's sentences join one queue and a
``Batcher`` takes them out in batches of up to ``--max-tokens`` (padded source tokens times the
beam) of one setting, waiting at most ``--max-wait-ms`` after the oldest one arrived for more. A
batch runs in the model's process (``ModelProcess``), called from one thread (``ModelThread``)
off the event loop, and each sentence is answered as soon as its search ends. Bodies over 4 KiB
are parsed and tokenized on another thread.

Modules: ``api`` (the request and response models, the limits, a request's checks, the error
format), ``batcher`` (the queue, its batches and the model's thread), ``model_process`` (the
model in a child process), ``metrics``, ``app`` (the FastAPI app: routes, probes, middleware)
and ``command`` (the command line and the app factories). Their public names are importable
from ``fastnmt.serve`` itself.
"""

from __future__ import annotations

import sys

try:  # the serve extra: the error says how to get it
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import pydantic  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as error:
    _MISSING = f'fastnmt.serve needs the serve extra (pip install "fastnmt[serve]"): {error}'
    # python -m fastnmt.serve imports this package while sys.argv[0] is still "-m" (the module
    # is being located): the command's user gets one line, not a traceback.
    if sys.argv[:1] == ["-m"]:
        sys.exit(f"python -m fastnmt.serve: error: {_MISSING}")
    raise ImportError(_MISSING) from None

from fastnmt.serve.api import (
    ERROR_LOG,
    MAX_BEAM,
    MAX_NGRAM,
    RETRY,
    SAMPLING_FIELDS,
    Candidate,
    ErrorResponse,
    Limits,
    Options,
    Query,
    Rejected,
    TranslateRequest,
    TranslateResponse,
    candidates,
    check_limits,
    error_response,
    one_line,
    parse_query,
)
from fastnmt.serve.app import ACCESS_LOG, Observed, Server
from fastnmt.serve.batcher import Batcher, Job, ModelThread, batch_cost
from fastnmt.serve.command import (
    ENVIRONMENT,
    app_from_environment,
    build_limits,
    build_server,
    create_app,
    loader,
    main,
    parse_args,
    threads_per_worker,
)
from fastnmt.serve.metrics import HANDLERS, LATENCY_BUCKETS, Metrics
from fastnmt.serve.model_process import ModelProcess

__all__ = [
    "ACCESS_LOG",
    "ENVIRONMENT",
    "ERROR_LOG",
    "HANDLERS",
    "LATENCY_BUCKETS",
    "MAX_BEAM",
    "MAX_NGRAM",
    "RETRY",
    "SAMPLING_FIELDS",
    "Batcher",
    "Candidate",
    "ErrorResponse",
    "Job",
    "Limits",
    "Metrics",
    "ModelProcess",
    "ModelThread",
    "Observed",
    "Options",
    "Query",
    "Rejected",
    "Server",
    "TranslateRequest",
    "TranslateResponse",
    "app_from_environment",
    "batch_cost",
    "build_limits",
    "build_server",
    "candidates",
    "check_limits",
    "create_app",
    "error_response",
    "loader",
    "main",
    "one_line",
    "parse_args",
    "parse_query",
    "threads_per_worker",
]
