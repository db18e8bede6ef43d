"""Every tensor a code path creates follows its inputs' device.

On a GPU a tensor made without ``device=`` lands on the CPU beside CUDA inputs, and the op fails
("index is on cpu") or syncs. The same bug shows on a CPU machine: each path runs here on CPU
inputs (and models) with the default device set to CUDA, which a CPU-only torch cannot create, so
a tensor made without ``device=`` raises where it is made. (``meta`` would not do: an op mixing a
meta and a CPU tensor may run silently.) With a GPU, CPU inputs meet a CUDA default device the
same way; the Triton backend runs on CUDA inputs there, against the CPU default.
"""

import contextlib

import pytest
import torch

import fastnmt
from fastnmt import train
from fastnmt.attention import KVCache, MultiheadAttention
from fastnmt.decoding.next_token import Sampling
from fastnmt.decoding.search import LengthPenalty, Rules, beam_search, greedy, sample
from fastnmt.decoding.shortlist import Shortlist
from fastnmt.decoding.static_search import StaticSearches
from fastnmt.model import ModelConfig, Transformer
from fastnmt.ops import (
    add_layer_norm,
    attention,
    dispatch,
    feed_forward,
    linear_cross_entropy,
    log_softmax_topk,
    sample_token,
)
from fastnmt.translator import Translator
from tests.helpers import device_of, require_backend, tiny_checkpoint
from tests.test_train import _arguments

BACKENDS = ["reference", "cpp", "triton"]  # triton: the interpreter on a CPU


CPU = torch.device("cpu")


@contextlib.contextmanager
def implicit_tensors_elsewhere(inputs: torch.device = CPU):
    """Tensors created without ``device=`` go to another device than the ``inputs``': CUDA for
    CPU inputs (without CUDA that raises at once), the CPU for CUDA inputs (the first op mixing
    them raises)."""
    with torch.device("cpu" if inputs.type == "cuda" else "cuda"):
        yield


def test_the_guard_catches_a_tensor_made_without_device():
    """The premise: a factory call inside the guard fails, or breaks the op it meets."""
    x = torch.randn(3)
    with implicit_tensors_elsewhere(), pytest.raises((RuntimeError, AssertionError)):
        x.index_select(0, torch.tensor([0, 2]))


@pytest.fixture(params=BACKENDS)
def device(request):
    """Each backend forced in turn; the device of its inputs (CUDA for triton and the reference
    on a GPU machine, else the CPU)."""
    require_backend(request.param)
    with dispatch.backend(request.param):
        yield device_of(request.param)


def _grads(device, *tensors):
    return [t.to(device).requires_grad_() for t in tensors]


@pytest.mark.parametrize(
    "masks", ["key_lengths", "key_padding_mask", "causal", "dropout", "cache_rows"]
)
def test_attention(device, masks):
    q, k, v = _grads(device, *(torch.randn(3, 2, 5, 16) for _ in range(3)))
    lengths = torch.tensor([5, 3, 0], device=device)
    options = {
        "key_lengths": dict(key_lengths=lengths, return_lse=True),
        "key_padding_mask": dict(
            key_padding_mask=torch.arange(5, device=device) >= lengths[:, None]
        ),
        "causal": dict(key_lengths=lengths, causal=True),
        "dropout": dict(key_lengths=lengths, dropout_p=0.3),
        "cache_rows": dict(key_lengths=lengths, cache_rows=torch.randint(0, 3, (3, 5)).to(device)),
    }[masks]
    if masks == "cache_rows":  # decoding only: no gradients
        q, k, v = q.detach(), k.detach(), v.detach()
    with implicit_tensors_elsewhere(device):
        out = attention(q, k, v, **options)
        out = out[0] if isinstance(out, tuple) else out
        if out.requires_grad:
            out.sum().backward()
    assert out.device == q.device


def test_attention_with_a_dense_mask_on_the_reference():
    q, k, v = _grads(CPU, *(torch.randn(2, 2, 4, 8) for _ in range(3)))
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    with dispatch.backend("reference"), implicit_tensors_elsewhere():
        attention(q, k, v, attn_mask=mask).sum().backward()


def test_add_layer_norm_and_feed_forward(device):
    x, residual = _grads(device, torch.randn(4, 7, 32), torch.randn(4, 7, 32))
    weight, bias = _grads(device, torch.ones(32), torch.zeros(32))
    w1, b1, w2, b2 = _grads(
        device, torch.randn(64, 32), torch.zeros(64), torch.randn(32, 64), torch.zeros(32)
    )
    with implicit_tensors_elsewhere(device):
        y, _ = add_layer_norm(x, residual, weight, bias, 1e-5, 0.1)
        feed_forward(y, w1, b1, w2, b2, "relu", 0.1).sum().backward()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy(device, reduction):
    hidden, weight, bias = _grads(
        device, torch.randn(20, 32), torch.randn(100, 32), torch.zeros(100)
    )
    target = torch.randint(0, 100, (20,))
    target[3] = -100
    with implicit_tensors_elsewhere(device):
        loss = linear_cross_entropy(hidden, weight, bias, target.to(device), 0.1, -100, reduction)
        loss.loss.backward()


@pytest.mark.parametrize("device", ["reference", "cpp"], indirect=True)  # it has no Triton kernel
def test_log_softmax_topk(device):
    logits, banned = torch.randn(5, 50, device=device), torch.tensor([0, 1], device=device)
    with implicit_tensors_elsewhere(device):
        log_softmax_topk(logits, 4, banned)


@pytest.mark.parametrize("device", ["reference", "cpp"], indirect=True)  # it has no Triton kernel
@pytest.mark.parametrize("restriction", [dict(), dict(topk=3), dict(topp=0.9)])
def test_sample_token(device, restriction):
    logits, banned = torch.randn(5, 50, device=device), torch.tensor([0, 1], device=device)
    uniforms = torch.rand(5, device=device)
    with implicit_tensors_elsewhere(device):
        sample_token(logits, uniforms, banned, temperature=0.7, **restriction)


def test_multihead_attention_with_a_kv_cache(device):
    mha = MultiheadAttention(32, 2, batch_first=True).to(device).eval()
    x, lengths = torch.randn(3, 6, 32, device=device), torch.tensor([6, 4, 1], device=device)
    cache, moved = KVCache(), torch.tensor([0, 0, 2], device=device)
    with implicit_tensors_elsewhere(device), torch.no_grad():
        for t in range(3):
            step = x[:, t : t + 1]
            mha(step, step, step, cache=cache, need_weights=False)
            cache.reorder(moved)  # beams moved
        mha(x, x, x, key_lengths=lengths)


SEARCH_MODEL = ModelConfig(
    vocab_size=50, d_model=32, heads=2, d_ff=64, encoder_layers=1, decoder_layers=1
)


def _search_inputs():
    """A model's source batch (host tensors): sources, their lengths, length limits."""
    src = torch.randint(3, 50, (3, 6))
    src[:, -1] = SEARCH_MODEL.eos_id
    return src, torch.tensor([6, 4, 2]), torch.tensor([5, 6, 4])


# log_softmax_topk and sample_token have no Triton kernel: the reference serves them, as on a GPU
REFERENCE_TOPK = dict(name="reference", ops=["log_softmax_topk", "sample_token"])


@pytest.mark.parametrize(
    "search", ["greedy", "beam", "shortlist", "no cache", "prefix", "top-p", "top-k with rules"]
)
def test_search(device, search):
    model = Transformer(SEARCH_MODEL).to(device).eval()
    src, lengths, max_lens = _search_inputs()  # host lengths are accepted
    src, lengths = src.to(device), lengths.to(device)
    options = {
        "greedy": dict(),
        "beam": dict(beam=3, nbest=2),
        "shortlist": dict(
            beam=3, shortlist=Shortlist(torch.tensor([4, 6]), torch.full((50, 3), 8), "")
        ),
        "no cache": dict(beam=2, incremental=False),
        "prefix": dict(beam=2, prefix=[7]),
        "top-p": dict(sampling=Sampling("topp", topp=0.8, samples=2)),
        "top-k with rules": dict(sampling=Sampling("topk", topk=4), rules=Rules(None, 2)),
    }[search]
    run = beam_search if "beam" in options else sample if "sampling" in options else greedy
    with fastnmt.backend(**REFERENCE_TOPK), implicit_tensors_elsewhere(device):
        found = run(model, src, lengths, max_lens, **options)
    assert len(found) == 3


@pytest.mark.parametrize("sampling", [None, Sampling("topp", topp=0.8, samples=2, seed=1)])
def test_static_search(device, sampling):
    searches = StaticSearches(Transformer(SEARCH_MODEL).to(device).eval(), capture=False)
    inputs = _search_inputs()  # host tensors: the search copies them in
    with fastnmt.backend(**REFERENCE_TOPK), implicit_tensors_elsewhere(device):
        found = searches.search(
            *inputs, beam=2, prefix=[7], penalty=LengthPenalty(), sampling=sampling
        )
    assert len(found) == 3


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("on", ["cpu", "default"])
def test_translator(checkpoint_dir, beam, on):
    """On the CPU, and on the default device (CUDA where there is one)."""
    device = CPU if on == "cpu" else None
    translator = Translator.from_checkpoint(checkpoint_dir, precision="fp32", device=device)
    with implicit_tensors_elsewhere(translator.device):
        found = translator.translate(["A dog runs.", "", "Two men play football."], beam=beam)
    assert len(found) == 3


@pytest.mark.parametrize("extra", [[], ["--shape-buckets", "3"]], ids=["eager", "bucketed"])
def test_a_training_step_and_its_report(corpus, tmp_path, extra):
    """The step and the log line (the batches come from a DataLoader, whose iterator makes a
    tensor of its own without a device: outside the guard)."""
    run = train.prepare(train.build_parser().parse_args(_arguments(corpus, tmp_path, *extra)))
    batches = list(run.batches.iterate(epoch=1))
    with implicit_tensors_elsewhere():
        run.train_step(batches[:2])
        run.report()
