"""python -m fastnmt.train on small slices of Multi30k: outputs, exact resume, DDP, bad input."""

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastnmt import checkpoint, train
from fastnmt.training import trainer

SMALL_MODEL = [
    "--vocab-size", "300", "--d-model", "32", "--heads", "2", "--d-ff", "64",
    "--encoder-layers", "1", "--decoder-layers", "1", "--max-tokens", "400",
    "--log-interval", "2", "--no-progress", "--precision", "fp32",
]  # fmt: skip
# The CLI's behaviour (checkpoints, exact resume, DDP on gloo, errors) is checked on the CPU on
# every machine; the GPU tests below run the same loop on CUDA.
ON_CPU = ["--device", "cpu"]


def _arguments(corpus: Path, output: Path, *extra: str) -> list[str]:
    data = ["--train", str(corpus / "train"), "--valid", str(corpus / "val")]
    return [*data, *SMALL_MODEL, *ON_CPU, "--output-dir", str(output), *extra]


def _run(arguments: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fastnmt.train", *arguments],
        capture_output=True, text=True, timeout=600, **kwargs,
    )  # fmt: skip


def _weights(output: Path, name: str = "checkpoint_last") -> dict[str, torch.Tensor]:
    return load_file(str(output / name / "model.safetensors"))


def test_training_writes_checkpoints_metrics_and_test_translations(corpus, tmp_path):
    arguments = _arguments(corpus, tmp_path, "--test", str(corpus / "val"), "--max-steps", "4")
    result = _run(arguments)
    assert result.returncode == 0, result.stderr
    assert "validation after 4 steps" in result.stderr
    assert "test (" in result.stderr and "BLEU" in result.stderr and "chrF" in result.stderr
    for name in ("checkpoint_last", "checkpoint_best"):
        files = sorted(p.name for p in (tmp_path / name).iterdir())
        assert files == ["config.json", "model.safetensors", "spm.model", "trainer_state.pt"]
    state = torch.load(tmp_path / "checkpoint_last" / "trainer_state.pt", weights_only=True)
    assert state["progress"]["step"] == 4
    events = [line.split('"event": "')[1][:4] for line in (tmp_path / "metrics.jsonl").open()]
    assert events == ["trai", "trai", "vali", "test"]
    hypotheses = (tmp_path / "test.de.hyp").read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == 20


def test_average_of_the_last_checkpoints_is_kept_only_when_it_validates_better(corpus, tmp_path):
    arguments = _arguments(corpus, tmp_path, "--max-epochs", "3", "--average-last", "3")
    result = _run(arguments)
    assert result.returncode == 0, result.stderr
    steps = checkpoint.step_checkpoints(tmp_path)
    assert len(steps) == 3  # --keep-last 2 is raised to the 3 being averaged
    averaged = checkpoint.average_weights(steps)
    name = next(iter(averaged))
    expected = sum(_weights(tmp_path, p.name)[name].double() for p in steps) / 3
    torch.testing.assert_close(averaged[name].double(), expected)
    line = next(x for x in result.stderr.splitlines() if "average of the last 3" in x)
    kept = line.endswith("; kept")
    assert (tmp_path / "checkpoint_average").exists() == kept
    best = (tmp_path / "checkpoint_best").resolve().name
    assert (best == "checkpoint_average") == kept


def test_valid_interval_validates_every_n_epochs_and_when_training_stops(corpus, tmp_path):
    """``--valid-interval 2`` over 3 epochs: after the second, then at the end (the third)."""
    arguments = _arguments(
        corpus, tmp_path, "--max-epochs", "3", "--valid-interval", "2", "--keep-last", "5"
    )
    arguments += ["--average-last", "1"]
    result = _run(arguments)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["epoch"] for r in records if r["event"] == "valid"] == [2, 3]
    assert len(checkpoint.step_checkpoints(tmp_path)) == 2  # one saved per validation


RESUME_RUN = ("--max-steps", "8", "--save-interval", "4", "--max-tokens", "250")


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of an uninterrupted RESUME_RUN (CPU, fp32, with dropout)."""
    output = tmp_path_factory.mktemp("straight")
    assert _run(_arguments(corpus, output, *RESUME_RUN)).returncode == 0
    return _weights(output)


def _assert_same_weights(expected, actual, message=""):
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} {message}"


def _start(arguments: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fastnmt.train", *arguments],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_resume_after_sigkill_continues_exactly(corpus, tmp_path, straight):
    """N steps straight == N/2 steps, kill -9, resume, N/2 steps; the restart reuses the
    prepared data."""
    process = _start(_arguments(corpus, tmp_path, *RESUME_RUN))
    deadline = time.monotonic() + 300
    while not (tmp_path / "checkpoint_step4").exists() and process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _kill(process)
    assert process.returncode == -signal.SIGKILL, "training ended before it could be killed"
    result = _run(_arguments(corpus, tmp_path, *RESUME_RUN))
    assert result.returncode == 0, result.stderr
    assert "using the prepared data in" in result.stderr and "resumed from" in result.stderr
    _assert_same_weights(straight, _weights(tmp_path))


def test_sigkill_at_random_moments_of_saves_loses_nothing(corpus, tmp_path, straight):
    """Saving after every step, killed (kill -9) three times, each at a random moment after the
    save of a randomly chosen step has begun (in it, or in the steps after), and resumed each
    time: the end result is the uninterrupted run's."""
    arguments = _arguments(corpus, tmp_path, *RESUME_RUN, "--save-interval", "1")
    rng = random.Random()
    kills = []  # (step whose save was under way, seconds after it began)
    for step in sorted(rng.sample(range(1, 8), 3)):
        process = _start(arguments)
        deadline = time.monotonic() + 300
        started = (tmp_path / f".checkpoint_step{step}.new", tmp_path / f"checkpoint_step{step}")
        while not any(p.exists() for p in started) and process.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        kills.append((step, round(rng.uniform(0, 0.05), 3)))  # a save takes milliseconds
        time.sleep(kills[-1][1])
        _kill(process)
    result = _run(arguments)
    assert result.returncode == 0, (kills, result.stderr)
    _assert_same_weights(straight, _weights(tmp_path), f"after kills {kills}")


@pytest.fixture(scope="module")
def single_process(corpus, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Weights after 3 updates of one process on two batches each (no dropout): what two DDP
    processes on one batch each must reach (in this process: the DDP runs are the commands
    under test)."""
    output = tmp_path_factory.mktemp("single")
    assert train.main(_arguments(corpus, output, *NO_DROPOUT, "--update-freq", "2")) == 0
    return _weights(output)


NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0", "--max-steps", "3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Three updates of the tiny model take seconds on two ranks; a job still running after this long
# is hung (a collective one rank never reaches), and waiting longer tells nothing more.
HANG_SECONDS = 240


def _torchrun(*arguments: str, agents: int = 1) -> str:
    """The output of ``agents`` torchrun agents run with ``arguments``, each asserted to exit 0.
    A hung job fails the test with its processes' Python stacks: they get SIGABRT, and
    faulthandler prints the stacks as they abort."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", *arguments]
    started = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for _ in range(agents)
    ]
    deadline = time.monotonic() + HANG_SECONDS
    try:
        outputs = [p.communicate(timeout=max(deadline - time.monotonic(), 1))[0] for p in started]
    except subprocess.TimeoutExpired:
        workers = [pid for p in started for pid in _descendants(p.pid)]
        _signal(workers, signal.SIGABRT)  # the agents then report their failed workers
        try:
            stacks = "".join(p.communicate(timeout=60)[0] for p in started)
        finally:
            _signal([*workers, *(p.pid for p in started)], signal.SIGKILL)
        pytest.fail(f"torchrun hung for {HANG_SECONDS} s; the stacks:\n{stacks[-30000:]}")
    assert [p.returncode for p in started] == [0] * agents, outputs
    return "".join(outputs)


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (torchrun's ranks start sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # the process has ended
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return found


def _signal(pids: list[int], number: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it has ended
            os.kill(pid, number)


def _assert_close_weights(expected, actual) -> None:
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("extra", [[], ["--shape-buckets", "3"]], ids=["ddp", "bucketed"])
def test_ddp_with_two_gloo_processes_equals_one_process_on_the_combined_batches(
    corpus, tmp_path, single_process, extra
):
    """Through DDP, or (shape buckets) the static programs' own gradient all-reduce."""
    log = _torchrun(
        "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        "-m", "fastnmt.train",
        *_arguments(corpus, tmp_path, *NO_DROPOUT, "--check-replicas", *extra),
    )  # fmt: skip
    assert "parameters identical on all 2 ranks" in log
    _assert_close_weights(single_process, _weights(tmp_path))


def test_two_nodes_through_the_c10d_rendezvous(corpus, tmp_path, single_process):
    """Two torchrun agents ("nodes" on 127.0.0.1) meet through the c10d rendezvous; node 0's
    rank prepares the data, node 1's maps it."""
    log = _torchrun(
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        "--rdzv-id", f"fastnmt-{os.getpid()}", "--local-addr", "127.0.0.1",
        "-m", "fastnmt.train", *_arguments(corpus, tmp_path, *NO_DROPOUT, "--check-replicas"),
        agents=2,
    )  # fmt: skip
    assert "batches per epoch per rank x 2" in log, log
    assert "parameters identical on all 2 ranks" in log
    _assert_close_weights(single_process, _weights(tmp_path))


def test_non_finite_loss_stops_naming_the_step_and_last_checkpoint(
    corpus, tmp_path, monkeypatch, capsys
):
    args = train.build_parser().parse_args(_arguments(corpus, tmp_path, "--save-interval", "2"))
    run = train.prepare(args)
    real_loss = trainer.label_smoothed_loss

    def poisoned(*a, **k):
        loss, nll, correct = real_loss(*a, **k)
        return (loss * float("nan") if run.progress.step == 3 else loss), nll, correct

    monkeypatch.setattr(trainer, "label_smoothed_loss", poisoned)
    assert run.run() == 1
    message = capsys.readouterr().err
    assert "loss became nan at step 4" in message
    assert "checkpoint_step2" in message


def test_ctrl_c_saves_and_exits(corpus, tmp_path, monkeypatch):
    args = train.build_parser().parse_args(_arguments(corpus, tmp_path))
    run = train.prepare(args)
    real_step = run.train_step

    def interrupted(batches):
        if run.progress.step == 2:
            raise KeyboardInterrupt
        return real_step(batches)

    monkeypatch.setattr(run, "train_step", interrupted)
    assert run.run() == 130
    state = torch.load(tmp_path / "checkpoint_last" / "trainer_state.pt", weights_only=True)
    assert state["progress"]["step"] == 2


class TestBadInput:
    """Each is a one-line error and exit code 2, run in-process through ``main``."""

    @pytest.fixture(autouse=True)
    def _capture(self, capsys):
        self.capsys = capsys

    def _error(self, arguments) -> str:
        try:
            code = train.main(arguments)
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
        assert code == 2
        lines = self.capsys.readouterr().err.strip().splitlines()
        assert lines[-1].startswith(("error:", "python -m fastnmt.train: error:")), lines
        return lines[-1]

    def test_line_count_mismatch_names_both_files_and_counts(self, corpus, tmp_path):
        (tmp_path / "bad.en").write_text("a\nb\nc\n")
        (tmp_path / "bad.de").write_text("a\nb\n")
        arguments = _arguments(corpus, tmp_path / "out")
        arguments[1] = str(tmp_path / "bad")
        message = self._error(arguments)
        assert "bad.en" in message and "bad.de" in message and "3" in message and "2" in message

    def test_non_utf8_line_is_named(self, corpus, tmp_path):
        (tmp_path / "bad.en").write_bytes(b"fine\n\xff broken\n")
        (tmp_path / "bad.de").write_text("gut\nkaputt\n")
        arguments = _arguments(corpus, tmp_path / "out")
        arguments[1] = str(tmp_path / "bad")
        assert "bad.en:2" in self._error(arguments)

    def test_missing_files(self, corpus, tmp_path):
        arguments = _arguments(corpus, tmp_path / "out")
        arguments[1] = str(tmp_path / "nothing")
        assert "nothing" in self._error(arguments)

    def test_every_pair_filtered_out(self, corpus, tmp_path):
        arguments = _arguments(corpus, tmp_path / "out", "--max-len", "2")
        assert "every pair was filtered out" in self._error(arguments)

    def test_unknown_preset_and_bad_values(self, corpus, tmp_path):
        assert "invalid choice" in self._error(_arguments(corpus, tmp_path, "--preset", "huge"))
        message = self._error(_arguments(corpus, tmp_path, "--dropout", "1.5"))
        assert "--dropout must be in [0, 1)" in message
        message = self._error(_arguments(corpus, tmp_path, "--valid-interval", "-1"))
        assert "--valid-interval must be >= 0" in message
        for flag in ("--clip-norm", "--max-steps", "--max-epochs", "--save-interval"):
            message = self._error(_arguments(corpus, tmp_path, flag, "-1"))
            assert f"{flag} must be >= 0, got -1" in message
        assert "--precision fp16 needs a GPU" in self._error(
            _arguments(corpus, tmp_path, "--precision", "fp16")
        )

    def test_incompatible_checkpoint_is_not_overwritten(self, corpus, tmp_path):
        assert _run(_arguments(corpus, tmp_path, "--max-steps", "2")).returncode == 0
        before = _weights(tmp_path)
        message = self._error(_arguments(corpus, tmp_path, "--d-model", "48", "--max-steps", "4"))
        assert "holds a checkpoint of another run" in message and "d_model" in message
        after = _weights(tmp_path)
        assert all(torch.equal(before[k], after[k]) for k in before)

    def test_bad_device(self, corpus, tmp_path):
        assert "--device must be auto, cpu, cuda or cuda:N, got 'tpu'" in self._error(
            _arguments(corpus, tmp_path, "--device", "tpu")
        )
        if not torch.cuda.is_available():
            message = self._error(_arguments(corpus, tmp_path, "--device", "cuda:1"))
            assert "--device cuda:1: no CUDA device is available" in message

    def test_resume_without_checkpoint(self, corpus, tmp_path):
        assert "no checkpoint to resume" in self._error(_arguments(corpus, tmp_path, "--resume"))

    def test_a_dangling_checkpoint_last_is_never_a_fresh_start(self, corpus, tmp_path):
        arguments = _arguments(corpus, tmp_path, "--max-steps", "4", "--save-interval", "2")
        assert _run([*arguments, "--average-last", "1"]).returncode == 0
        shutil.rmtree(tmp_path / "checkpoint_step4")
        message = self._error(arguments)
        last = tmp_path / "checkpoint_last"
        assert f"{last} points to checkpoint_step4, which does not exist" in message
        assert f"the newest checkpoint that loads is {tmp_path / 'checkpoint_step2'}" in message
        assert not (tmp_path / "checkpoint_step4").exists()  # nothing trained

    def test_tensorboard_without_the_package(self, corpus, tmp_path, monkeypatch):
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
        message = self._error(_arguments(corpus, tmp_path, "--tensorboard", str(tmp_path / "tb")))
        assert message == (
            "error: --tensorboard needs the tensorboard package: pip install 'fastnmt[tensorboard]'"
        )


def test_resuming_a_finished_run_trains_no_further(corpus, tmp_path):
    """Both runs through ``main`` in this process: the checkpoint is what is tested here."""
    arguments = _arguments(corpus, tmp_path, "--max-steps", "3")
    assert train.main(arguments) == 0
    before = _weights(tmp_path)
    assert train.main(arguments) == 0
    after = _weights(tmp_path)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_training_on_a_gpu(corpus, tmp_path, precision):
    """A few steps on cuda:0 through the compiled kernels, replayed as CUDA graphs in bf16 (fp16
    loss scaling runs eagerly); needs a GPU (CPU runs are above)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the same loop runs on the CPU in the tests above")
    arguments = [*_arguments(corpus, tmp_path), "--device", "cuda:0", "--precision", precision]
    result = _run([*arguments, "--max-steps", "4", "--average-last", "1"])
    assert result.returncode == 0, result.stderr
    assert "on cuda:0" in result.stderr
    assert ("captured 9 CUDA graphs" in result.stderr) == (precision == "bf16"), result.stderr


@pytest.mark.gpu
def test_ddp_with_two_nccl_processes_equals_one_process(corpus, tmp_path):
    """The gloo DDP test's code path on two GPUs (NCCL for gradients, gloo for host values)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs: the same code path runs on gloo above")
    gpu = ["--device", "cuda", "--dropout", "0", "--attention-dropout", "0", "--max-steps", "3"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    result = _run([*_arguments(corpus, single, "--update-freq", "2"), *gpu])
    assert result.returncode == 0, result.stderr
    log = _torchrun(
        "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        "-m", "fastnmt.train", *_arguments(corpus, ddp, "--check-replicas"), *gpu,
    )  # fmt: skip
    assert "parameters identical on all 2 ranks" in log
    _assert_close_weights(_weights(single), _weights(ddp))
