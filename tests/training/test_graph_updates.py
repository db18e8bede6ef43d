"""Graph training's programs: the same updates as eager training, exact resume, state untouched
by warm-up; captured as CUDA graphs on a GPU, called on a CPU."""

import contextlib
import copy
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fastnmt import cuda_graphs, train
from fastnmt.model import ModelConfig, Transformer
from fastnmt.training import graph_updates
from fastnmt.training.buckets import ShapeBuckets
from tests.test_train import NO_DROPOUT, _arguments

BUCKETS = ("--shape-buckets", "3")


def _weights(output):
    return load_file(str(output / "checkpoint_last" / "model.safetensors"))


def _trained(corpus, output, *extra) -> dict[str, torch.Tensor]:
    args = train.build_parser().parse_args(_arguments(corpus, output, *extra))
    assert train.prepare(args).run() == 0
    return _weights(output)


def test_capture_reasons_name_the_device_and_loss_scaling():
    assert graph_updates.capture_reasons(torch.device("cuda", 0), loss_scaling=False) == []
    assert graph_updates.capture_reasons(torch.device("cpu"), loss_scaling=False) == [
        "CUDA graphs need a CUDA device, got cpu"
    ]
    assert graph_updates.capture_reasons(torch.device("cuda", 0), loss_scaling=True) == [
        "fp16 loss scaling decides on the host whether to step (use bf16)"
    ]


def _model_and_optimizer():
    model = Transformer(ModelConfig(vocab_size=30, d_model=16, heads=2, d_ff=32))
    lr = torch.tensor(1e-2)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, fused=True, capturable=True)
    return model, optimizer


def _step(model, optimizer):
    src = torch.randint(3, 30, (2, 5))
    states = model(src, torch.tensor([5, 3]), src)
    states.float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-optimizer", "trained-optimizer"])
def test_state_preserved_undoes_updates_and_random_draws(fresh):
    """Warm-up updates leave no trace: the next update is the one without them."""
    torch.manual_seed(0)
    model, optimizer = _model_and_optimizer()
    twin, twin_optimizer = _model_and_optimizer()
    if not fresh:
        _step(model, optimizer)
    twin.load_state_dict(model.state_dict())
    # a copy: loading shares the given state's tensors where their dtype and device fit
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    rng = torch.get_rng_state()
    with graph_updates.state_preserved(model, optimizer):
        for _ in range(2):
            _step(model, optimizer)
    assert torch.equal(torch.get_rng_state(), rng)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    torch.set_rng_state(rng)
    _step(model, optimizer)
    torch.set_rng_state(rng)
    _step(twin, twin_optimizer)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_warm_up_leaves_a_trainers_whole_update_state(corpus, tmp_path):
    """The warm-up before a capture runs real updates of the trainer's programs: afterwards its
    parameters, optimizer and device update state (step count, learning rate, accumulators) are
    as before. The step count once was not: captured training ran its learning-rate schedule
    three updates ahead of eager training (caught on an H100)."""
    args = train.build_parser().parse_args(_arguments(corpus, tmp_path, *BUCKETS))
    trainer = train.prepare(args)
    bucketed = trainer.bucketed
    trainer.loss_scale.fill_(0.5)  # as the host sets it before an update
    trainer.updates.fill_(7)  # as a resumed run's
    names = ("updates", "lr", "loss_scale", "sums", "statistics")
    before = {name: getattr(trainer, name).clone() for name in names}
    parameters = [p.detach().clone() for p in trainer.model.parameters()]
    graph_updates.warm_up(bucketed.programs, trainer.model, trainer.optimizer, bucketed.state)
    for name in names:
        assert torch.equal(getattr(trainer, name), before[name]), name
    for kept, now in zip(parameters, trainer.model.parameters(), strict=True):
        assert torch.equal(kept, now)


def test_gradients_are_views_of_one_buffer_and_inputs_are_padding():
    model = Transformer(ModelConfig(vocab_size=30, d_model=16, heads=2, d_ff=32))
    buckets = ShapeBuckets(max_tokens=60, max_len=11, count=3, pad_id=0)
    cpu = torch.device("cpu")
    updates = graph_updates.BucketedUpdates(model, buckets, None, lambda: None, None, cpu)
    flat = updates.gradients
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    flat.fill_(1.0)
    assert all((p.grad == 1).all() for p in model.parameters())
    for shape, batch in updates.inputs.items():
        assert batch.src.shape == batch.tgt_out.shape == (shape.rows, shape.length)
        assert (batch.src == 0).all() and (batch.src_lengths == 0).all()


def test_bucketed_training_resumes_exactly_with_dropout(corpus, tmp_path):
    """Four updates straight == two, a restart, two more: the device step count, learning rate
    and random state come back with the checkpoint."""
    steps = ("--average-last", "1", *BUCKETS)
    straight = _trained(corpus, tmp_path / "straight", "--max-steps", "4", *steps)
    _trained(corpus, tmp_path / "resumed", "--max-steps", "2", *steps)
    resumed = _trained(corpus, tmp_path / "resumed", "--max-steps", "4", *steps)
    for name, expected in straight.items():
        assert torch.equal(resumed[name], expected), name


def test_cuda_graphs_on_the_device_at_hand(corpus, tmp_path):
    """On a CPU, ``--cuda-graphs on`` is a usage error naming why; on a GPU, captured graphs
    reach the weights of the same programs called eagerly."""
    if not torch.cuda.is_available():
        command = [sys.executable, "-m", "fastnmt.train", *_arguments(corpus, tmp_path)]
        result = subprocess.run(
            [*command, "--cuda-graphs", "on"], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 2
        assert "--cuda-graphs on: CUDA graphs need a CUDA device, got cpu" in result.stderr
        return
    gpu = ("--device", "cuda:0", "--precision", "bf16", *NO_DROPOUT, *BUCKETS)
    eager = _trained(corpus, tmp_path / "eager", *gpu, "--cuda-graphs", "off")
    replayed = _trained(corpus, tmp_path / "graphs", *gpu, "--cuda-graphs", "on")
    for name, expected in eager.items():
        torch.testing.assert_close(replayed[name], expected, atol=1e-5, rtol=1e-4, msg=name)


class FakeCuda:
    """Stand-ins for the torch.cuda calls a capture makes, recording them: a capture's logic
    runs on a CPU. ``allocated`` lists what memory_allocated returns, call by call."""

    def __init__(self, monkeypatch, allocated=(0, 0)):
        self.calls, self.allocated = [], list(allocated)
        fake = self

        class Graph:
            def replay(self):
                fake.calls.append("replay")

        class Stream:
            def __init__(self, device=None):
                fake.calls.append(("Stream", device))

            def wait_stream(self, other):
                pass

        @contextlib.contextmanager
        def graph(cuda_graph, pool=None, capture_error_mode="global"):
            self.calls.append(("graph", pool, capture_error_mode))
            yield

        @contextlib.contextmanager
        def entered(name, value):
            self.calls.append((name, value))
            yield

        for name, value in {
            "CUDAGraph": Graph,
            "Stream": Stream,
            "graph": graph,
            "device": lambda device: entered("device", device),
            "stream": lambda stream: entered("stream", stream),
            "current_stream": lambda device=None: Stream(device),
            "current_device": lambda: 1,
            "memory_allocated": lambda device=None: self.allocated.pop(0),
            "synchronize": lambda device=None: None,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)


def test_a_capture_is_thread_local_on_the_programs_device(monkeypatch):
    """Captures take the thread-local mode (a loader thread pinning memory meanwhile must not
    fail them), and warm-up and capture run on the model's device and its side stream."""
    cuda = FakeCuda(monkeypatch)
    ran = []
    program = cuda_graphs.Program(lambda: ran.append("program"))
    device = torch.device("cuda", 1)
    cuda_graphs.capture_on(device, [program], "pool", lambda: ran.append("warm-up"))
    assert ran == ["warm-up", "program"]
    assert cuda.calls[0] == ("device", device)
    assert ("Stream", device) in cuda.calls and ("graph", "pool", "thread_local") in cuda.calls
    program()
    assert cuda.calls[-1] == "replay" and ran == ["warm-up", "program"]


@pytest.mark.parametrize(
    ("kept", "raises"), [(0, False), (4096, True), (-512, True), (1 << 20, False)]
)
def test_a_capture_leaving_memory_allocated_raises(monkeypatch, kept, raises):
    """A tensor a program allocates and keeps would be overwritten by another graph of the
    shared pool; only a cuBLAS workspace (here 1 MiB) may stay."""
    FakeCuda(monkeypatch, allocated=[1000, 1000 + kept])
    monkeypatch.setattr(cuda_graphs, "workspace_allowances", lambda: frozenset({0, 1 << 20}))
    program = cuda_graphs.Program(lambda: None)
    if raises:
        with pytest.raises(RuntimeError, match=f"{kept} bytes allocated while capturing"):
            program.capture("pool")
        assert program.graph is None
    else:
        program.capture("pool")
        assert program.graph is not None


def test_workspace_allowances_are_cublas_sizes_or_no_check(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCublasWorkspaceSize", lambda: 8, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCublasLtWorkspaceSize", lambda: 3, raising=False)
    assert cuda_graphs.workspace_allowances() == {0, 3, 8, 11}
    monkeypatch.delattr(torch._C, "_cuda_getCublasLtWorkspaceSize")
    assert cuda_graphs.workspace_allowances() is None


def test_pieces_reach_the_programs_through_one_reused_host_buffer_per_shape(monkeypatch):
    """Each shape pads its pieces into one host buffer (pinned for a GPU, so the copy in does
    not block the host), waits for its last copy out before refilling it, and the program sees
    exactly the pieces ``split`` makes."""
    model = Transformer(ModelConfig(vocab_size=30, d_model=16, heads=2, d_ff=32))
    buckets = ShapeBuckets(max_tokens=60, max_len=11, count=3, pad_id=0)
    seen = []

    def piece(batch):
        seen.append({name: getattr(batch, name).clone() for name in graph_updates._INPUTS})

    cpu = torch.device("cpu")
    updates = graph_updates.BucketedUpdates(model, buckets, piece, lambda: None, None, cpu)
    buffers = {shape: staging.batch.src for shape, staging in updates.staging.items()}
    batches = [_random_batch(rows, seed) for seed, rows in enumerate((1, 9, 23))]
    expected = [p for batch in batches for p in buckets.split(batch)]
    for _ in range(2):  # buffers reused: a second pass sees the same pieces
        seen.clear()
        updates.accumulate(batches)
        assert len(seen) == len(expected) > len(batches)
        for got, want in zip(seen, expected, strict=True):
            for name, tensor in got.items():
                assert torch.equal(tensor, getattr(want, name)), name
    assert all(updates.staging[s].batch.src is b for s, b in buffers.items())

    events, pinned = [], []
    monkeypatch.setattr(
        ShapeBuckets, "empty", lambda self, shape, device, pin_memory=False: pinned.append(
            (torch.device(device).type, pin_memory)
        ) or _empty(self, shape, "cpu")
    )  # fmt: skip

    class Event:
        def synchronize(self):
            events.append("wait")

        def record(self):
            events.append("record")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    shape = buckets.shape_of(batches[0])
    staging = graph_updates.HostStaging(buckets, shape, torch.device("cuda"))
    assert pinned == [("cpu", True)]
    inputs = _empty(buckets, shape, "cpu")
    staging.copy(batches[0], 0, 1, inputs)
    staging.copy(batches[0], 0, 1, inputs)
    assert events == ["wait", "record", "wait", "record"]


_empty = ShapeBuckets.empty


def _random_batch(rows: int, seed: int):
    from tests.training.test_buckets import _batch

    return _batch(rows, 11, seed)
