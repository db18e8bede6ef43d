"""The command line, ``python -m fastnmt.serve`` (its options, one process or --workers N), and
the app factories for other ASGI servers (``create_app``, ``app_from_environment``)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from fastnmt.cli import finite_float
from fastnmt.serve.api import Limits, check_limits, one_line
from fastnmt.serve.app import ACCESS_LOG, Server
from fastnmt.serve.metrics import MULTIPROCESS
from fastnmt.serve.model_process import ModelProcess
from fastnmt.translator import Translator

DESCRIPTION = "A translation server that batches sentences across concurrent requests."
ENVIRONMENT = "FASTNMT_SERVE_ARGS"  # the options of app_from_environment (each --workers process)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastnmt.serve", description=DESCRIPTION)
    p.add_argument("--checkpoint", required=True, help="fastnmt or Hugging Face checkpoint dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--precision", default="auto")
    p.add_argument("--src-code", help="NLLB/M2M100 source language code")
    p.add_argument("--tgt-code", help="NLLB/M2M100 target language code")
    processes = p.add_argument_group("processes")
    processes.add_argument(
        "--workers", type=int, default=1, help="server processes sharing the port, each with "
        "its own copy of the model",
    )  # fmt: skip
    processes.add_argument(
        "--threads", type=int, help="threads of each process's model (default: the cores "
        "divided among the workers)",
    )  # fmt: skip
    processes.add_argument(
        "--shutdown-timeout", type=finite_float, default=30.0,
        help="on SIGTERM, seconds to finish accepted requests before closing them",
    )  # fmt: skip
    processes.add_argument("--no-access-log", action="store_true", help="no line per request")
    batching = p.add_argument_group("batching")
    batching.add_argument(
        "--max-tokens", type=int, default=16000,
        help="a batch's source tokens, padded to its longest sentence, times the beam",
    )  # fmt: skip
    batching.add_argument(
        "--max-wait-ms", type=finite_float, default=10.0, help="a sentence waits for more this long"
    )
    batching.add_argument("--no-batching", action="store_true", help="each request alone")
    limits = p.add_argument_group("limits")
    limits.add_argument("--max-queue", type=int, default=Limits.max_queue, help="sentences")
    limits.add_argument("--max-sentences", type=int, default=Limits.max_sentences)
    limits.add_argument(
        "--max-input-tokens", type=int, help="subword tokens a sentence (default: the model's)"
    )
    limits.add_argument(
        "--max-output-tokens", type=int, help="a request's max_length (default: the model's)"
    )
    limits.add_argument(
        "--max-length-penalty", type=finite_float, default=Limits.max_length_penalty
    )
    limits.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes)
    limits.add_argument(
        "--request-timeout", type=finite_float, default=Limits.request_timeout,
        help="seconds from a request's arrival to its answer, else 504",
    )  # fmt: skip
    args = p.parse_args(argv)
    positive = ("port", "workers", "threads", "max_tokens", "max_queue", "max_sentences")
    positive += ("max_input_tokens", "max_output_tokens", "max_body_bytes", "request_timeout")
    for name in positive:
        value = getattr(args, name)
        if value is not None and not value > 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.port > 65535:  # uvloop binds it modulo 2**16: 70000 served on port 4464
        p.error(f"--port must be at most 65535, got {args.port}")
    for name in ("max_wait_ms", "shutdown_timeout", "max_length_penalty"):
        if not getattr(args, name) >= 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return args


def threads_per_worker(args: argparse.Namespace) -> int:
    """--threads, else the cores shared among the workers. Each worker's model runs in a process
    of its own, which its HTTP work barely slows: a 2-core server under 64 clients on the same
    host translated 1.1-1.16x faster on 2 threads than on 1."""
    if args.threads is not None:
        return args.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // args.workers)


def loader(args: argparse.Namespace) -> Callable[[], Translator]:
    """The Translator's load, picklable (``ModelProcess`` runs it in its child)."""
    return functools.partial(
        Translator.load,
        args.checkpoint,
        src_code=args.src_code,
        tgt_code=args.tgt_code,
        device=args.device,
        precision=args.precision,
        max_tokens=args.max_tokens,
    )


def build_limits(args: argparse.Namespace) -> Limits:
    return Limits(
        max_sentences=args.max_sentences,
        max_input_tokens=args.max_input_tokens,
        max_output_tokens=args.max_output_tokens,
        max_length_penalty=args.max_length_penalty,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
    )


def build_server(args: argparse.Namespace) -> Server:
    """The server, its model in a process of its own (``ModelProcess``)."""
    if not args.no_access_log:
        _log_access()
    return Server(
        functools.partial(ModelProcess, loader(args), threads_per_worker(args)),
        max_tokens=args.max_tokens,
        max_wait=args.max_wait_ms / 1000,
        limits=build_limits(args),
        batching=not args.no_batching,
    )


def create_app(argv: list[str]) -> FastAPI:
    """The ASGI app for ``python -m fastnmt.serve``'s options (--host, --port, --workers and
    --shutdown-timeout are then the ASGI server's business), for any ASGI server."""
    return build_server(parse_args(argv)).app


def app_from_environment() -> FastAPI:
    """``create_app`` with the options in $FASTNMT_SERVE_ARGS, for ASGI servers that take an
    app factory: ``FASTNMT_SERVE_ARGS="--checkpoint DIR" uvicorn --factory
    fastnmt.serve:app_from_environment``; gunicorn: ``'fastnmt.serve:app_from_environment()'``."""
    if ENVIRONMENT not in os.environ:
        raise RuntimeError(f"${ENVIRONMENT} must hold the server's options (--checkpoint DIR)")
    return create_app(shlex.split(os.environ[ENVIRONMENT]))


def _log_access() -> None:
    if not ACCESS_LOG.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        ACCESS_LOG.addHandler(handler)
        ACCESS_LOG.setLevel(logging.INFO)
        ACCESS_LOG.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    print(f"fastnmt serving on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    if args.workers > 1:
        return _serve_workers(args, argv)
    server = build_server(args)
    config = uvicorn.Config(
        server.app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    web = uvicorn.Server(config)

    def stop() -> None:  # from the model thread, a daemon: gone if uvicorn fails to start
        # Not before startup completes: uvicorn < 0.30 would leave its lifespan task to be
        # cancelled, which logs a traceback.
        while not web.started:
            time.sleep(0.01)
        web.should_exit = True

    server.on_load_error = stop
    # uvicorn re-raises SIGTERM after draining; with the default handler that would kill the
    # process (exit -15) instead of returning 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    web.run()
    if server.load_error is not None:
        print(f"error: {server.load_error}", file=sys.stderr)
        return 2
    return 0


def _serve_workers(args: argparse.Namespace, argv: list[str]) -> int:
    """--workers N: uvicorn's worker processes, each built by ``app_from_environment``. The
    checkpoint is loaded here once first, so that a bad one exits 2 rather than failing every
    worker in turn."""
    try:
        check_limits(build_limits(args), loader(args)())
    except Exception as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    os.environ[ENVIRONMENT] = shlex.join(argv)
    signal.signal(signal.SIGTERM, lambda *_: None)
    with _shared_metrics():
        _run_workers(args)
    return 0


@contextlib.contextmanager
def _shared_metrics():
    """$PROMETHEUS_MULTIPROC_DIR for the workers (the user's, or an empty temporary one), so that
    a scrape of /metrics answers for all of them."""
    if MULTIPROCESS in os.environ:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="fastnmt-metrics-") as directory:
        os.environ[MULTIPROCESS] = directory
        try:
            yield
        finally:
            del os.environ[MULTIPROCESS]


def _run_workers(args: argparse.Namespace) -> None:
    uvicorn.run(
        "fastnmt.serve:app_from_environment",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level="warning",
        timeout_graceful_shutdown=args.shutdown_timeout,
        **_patient_healthcheck(),
    )


def _patient_healthcheck() -> dict:
    """uvicorn >= 0.30 pings each worker and restarts one that does not answer within 5 s; a
    worker importing PyTorch on a busy machine takes longer, and would be restarted for ever."""
    if "timeout_worker_healthcheck" in inspect.signature(uvicorn.Config).parameters:
        return {"timeout_worker_healthcheck": 120}
    return {}
