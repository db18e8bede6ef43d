"""Graph training's programs: the same updates as eager training, exact resume, state untouched
by warm-up; captured as CUDA graphs on a GPU, called on a CPU."""

import copy
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fastnmt import graphs, train
from fastnmt.buckets import ShapeBuckets
from fastnmt.model import ModelConfig, Transformer
from tests.test_train import NO_DROPOUT, _arguments

BUCKETS = ("--shape-buckets", "3")


def _weights(output):
    return load_file(str(output / "checkpoint_last" / "model.safetensors"))


def _trained(corpus, output, *extra) -> dict[str, torch.Tensor]:
    args = train.build_parser().parse_args(_arguments(corpus, output, *extra))
    assert train.prepare(args).run() == 0
    return _weights(output)


def test_capture_reasons_name_the_device_and_loss_scaling():
    assert graphs.capture_reasons(torch.device("cuda", 0), loss_scaling=False) == []
    assert graphs.capture_reasons(torch.device("cpu"), loss_scaling=False) == [
        "CUDA graphs need a CUDA device, got cpu"
    ]
    assert graphs.capture_reasons(torch.device("cuda", 0), loss_scaling=True) == [
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
    with graphs.state_preserved(model, optimizer):
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
    graphs.warm_up(bucketed.programs, trainer.model, trainer.optimizer, bucketed.state)
    for name in names:
        assert torch.equal(getattr(trainer, name), before[name]), name
    for kept, now in zip(parameters, trainer.model.parameters(), strict=True):
        assert torch.equal(kept, now)


def test_gradients_are_views_of_one_buffer_and_inputs_are_padding():
    model = Transformer(ModelConfig(vocab_size=30, d_model=16, heads=2, d_ff=32))
    buckets = ShapeBuckets(max_tokens=60, max_len=11, count=3, pad_id=0)
    updates = graphs.BucketedUpdates(model, buckets, None, lambda: None, None, torch.device("cpu"))
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
