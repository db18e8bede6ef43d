"""The command line and the app factories: bad arguments and checkpoints exit 2 with a one-line
error, --workers N serve one port, the threads share the cores among the workers, and the app
builds from options or $FASTNMT_SERVE_ARGS for any ASGI server."""

import concurrent.futures
import os
import random
import signal
import subprocess
import sys

import pytest

from tests.serve.helpers import ServerProcess, free_port
from tests.test_translator import SENTENCES


def _main_error(capsys, *arguments) -> str:
    """``fastnmt.serve``'s main in this process: exit 2 and the last line of its error, which
    has no traceback."""
    from fastnmt.serve import main

    try:
        code = main(["--port", str(free_port()), "--no-access-log", *map(str, arguments)])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err.splitlines()[-1]


def test_bad_arguments_and_checkpoints_exit_2(tmp_path, checkpoint_dir, capsys):
    """The command's errors in this process (a subprocess apiece would mostly import torch),
    and one bad checkpoint through ``python -m fastnmt.serve`` itself."""
    message = _main_error(capsys, "--checkpoint", "x", "--max-queue", "0")
    assert "--max-queue must be positive" in message
    message = _main_error(capsys, "--checkpoint", "x", "--shutdown-timeout", "-1")
    assert "--shutdown-timeout must be >= 0" in message
    message = _main_error(capsys, "--checkpoint", "x", "--port", "70000")
    assert "--port must be at most 65535, got 70000" in message
    missing = tmp_path / "none"
    assert _main_error(capsys, "--checkpoint", missing, "--workers", 2).startswith("error: ")
    command = [sys.executable, "-m", "fastnmt.serve", "--port", str(free_port())]
    one = subprocess.run(
        [*command, "--checkpoint", str(missing)], capture_output=True, text=True, timeout=120
    )
    assert one.returncode == 2, one.stderr
    assert one.stderr.splitlines()[-1].startswith("error: ") and "Traceback" not in one.stderr
    terminate = signal.getsignal(signal.SIGTERM)  # main ignores SIGTERM while it serves
    try:
        message = _main_error(capsys, "--checkpoint", checkpoint_dir, "--max-input-tokens", 100_000)
    finally:
        signal.signal(signal.SIGTERM, terminate)
    assert "--max-input-tokens 100000 is more than the model's maximum source length" in message


def test_workers_share_the_port_and_their_metrics_each_with_its_threads(checkpoint_dir, offline):
    """--workers 2 --threads 1: answers as one process gives; /metrics, whichever worker answers
    it, sums both (the sentences all translated) and shows each worker ready (its pid)."""
    pair = ServerProcess(checkpoint_dir, "--workers", 2, "--threads", 1, "--no-access-log")
    try:
        texts = [s for s in SENTENCES if s.strip()]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda t: pair.client.translate([t], beam=2)[0], texts * 2))
        assert answers == offline.translate(texts * 2, beam=2)
        assert pair.ready_series() == [(True, 1.0), (True, 1.0)]  # each worker's, loaded
        assert pair.metric("fastnmt_sentences_total") == 2 * len(texts)
    finally:
        assert pair.stop() == 0


def test_the_app_factory_builds_the_app_for_any_asgi_server(checkpoint_dir, monkeypatch):
    from fastnmt.serve import ENVIRONMENT, app_from_environment, create_app

    app = create_app(["--checkpoint", str(checkpoint_dir), "--threads", "1"])
    assert "/translate" in app.openapi()["paths"]
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    with pytest.raises(RuntimeError, match=ENVIRONMENT):
        app_from_environment()
    monkeypatch.setenv(ENVIRONMENT, f"--checkpoint '{checkpoint_dir}' --max-sentences 3")
    assert app_from_environment().title == "fastnmt"


def test_threads_share_the_cores_among_workers(monkeypatch):
    from fastnmt.serve import parse_args, threads_per_worker

    cores = random.randint(1, 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)

    def threads(*options) -> int:
        return threads_per_worker(parse_args(["--checkpoint", "x", *map(str, options)]))

    assert threads() == cores
    workers = random.randint(2, 8)
    assert threads("--workers", workers) == max(1, cores // workers)
    assert threads("--workers", workers, "--threads", 3) == 3
