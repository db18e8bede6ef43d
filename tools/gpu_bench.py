"""Quick GPU benchmark of fastnmt against the PyTorch it replaces, as a markdown table.

``python tools/gpu_bench.py`` (run by ``tools/gpu-check``): on a CUDA GPU, in fp16 and bf16,
- attention forward + backward at translation shapes (64 sentences, 8 heads of 64, lengths 32 /
  64 / 128, a quarter of the keys padding) against ``F.scaled_dot_product_attention`` given the
  padding as a bool mask and as an additive float mask, and without a mask (the floor);
- add_layer_norm, feed_forward (library-GEMM and fused-GEMM paths) and linear_cross_entropy
  against their PyTorch compositions, forward + backward;
- a training step of the tiny and base presets (fastnmt's backends vs the reference ops);
- decoding a batch with the tiny preset, greedy and beam 4, to the length limit (eos banned, so a
  random model does a trained one's work): the static search (``fastnmt.static_search``,
  captured as CUDA graphs) against ``fastnmt.search`` on fastnmt's and the reference ops.
Times are medians of ``triton.testing.do_bench`` (L2 flushed between runs). ``--smoke`` runs tiny
shapes on whatever device there is, to check the script itself (tests/test_tools.py).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fastnmt
from fastnmt.model import Transformer, preset
from fastnmt.ops import add_layer_norm, attention, feed_forward, linear_cross_entropy
from fastnmt.ops.feed_forward import feed_forward_triton
from fastnmt.search import LengthPenalty, beam_search, greedy
from fastnmt.static_search import StaticSearches, graph_reasons
from fastnmt.trainer import label_smoothed_loss


@dataclass(frozen=True)
class Sizes:
    batch: int
    heads: int
    head_dim: int
    lengths: tuple[int, ...]
    tokens: int  # rows of the per-token ops
    d_model: int
    vocab: int
    train_batch: int  # sentences of a training step
    train_length: int
    presets: tuple[str, ...]
    decode_batch: int  # sentences of a decoding batch (of train_length source tokens)


FULL = Sizes(64, 8, 64, (32, 64, 128), 8192, 512, 32000, 128, 32, ("tiny", "base"), 256)
SMOKE = Sizes(2, 2, 16, (8,), 64, 32, 100, 4, 6, ("tiny",), 3)


def milliseconds(fn: Callable[[], object], device: torch.device) -> float:
    """Median time of ``fn`` in ms: do_bench on CUDA, a few host-timed calls elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def forward_backward(forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor]):
    """A callable running ``forward`` and the backward of its sum of outputs into ``inputs``."""

    def step():
        for tensor in inputs:
            tensor.grad = None
        forward().float().sum().backward()

    return step


def padded_lengths(batch: int, length: int, device) -> torch.Tensor:
    """Lengths in [length / 2, length], the longest exactly ``length``: a quarter padding."""
    lengths = torch.randint(length // 2, length + 1, (batch,), device=device)
    lengths[0] = length
    return lengths


def attention_candidates(sizes: Sizes, length: int, dtype, device):
    """(q, k, v) and the forward of each implementation at one length, a quarter padding."""
    shape = (sizes.batch, sizes.heads, length, sizes.head_dim)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in "qkv")
    lengths = padded_lengths(sizes.batch, length, device)
    padding = torch.arange(length, device=device) >= lengths[:, None]  # (B, L) True = padding
    allowed = ~padding[:, None, None, :]  # (B, 1, 1, L) SDPA's bool mask: True = may attend
    additive = torch.zeros(allowed.shape, dtype=dtype, device=device)
    additive = additive.masked_fill(~allowed, float("-inf"))
    sdpa = F.scaled_dot_product_attention
    return [q, k, v], {
        "fastnmt attention(key_lengths=)": lambda: attention(q, k, v, key_lengths=lengths),
        "SDPA bool mask": lambda: sdpa(q, k, v, attn_mask=allowed),
        "SDPA float mask": lambda: sdpa(q, k, v, attn_mask=additive),
        "SDPA no mask (floor)": lambda: sdpa(q, k, v),
    }


def attention_rows(sizes: Sizes, dtype, device) -> list[tuple[str, str, float]]:
    rows = []
    for length in sizes.lengths:
        inputs, candidates = attention_candidates(sizes, length, dtype, device)
        label = f"attention fwd+bwd B{sizes.batch} H{sizes.heads} L{length} D{sizes.head_dim}"
        for name, forward in candidates.items():
            step = forward_backward(forward, inputs)
            rows.append((label, name, milliseconds(step, device)))
    return rows


def per_token_rows(sizes: Sizes, dtype, device) -> list[tuple[str, str, float]]:
    n, e, vocab = sizes.tokens, sizes.d_model, sizes.vocab

    def param(*shape, scale=1.0):
        return (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_()

    x, residual = param(n, e), param(n, e)
    weight, bias = param(e), param(e)
    w1, b1, w2, b2 = param(4 * e, e, scale=e**-0.5), param(4 * e), param(e, 4 * e), param(e)
    out_weight = param(vocab, e, scale=e**-0.5)
    target = torch.randint(vocab, (n,), device=device)

    ops = {
        f"add_layer_norm fwd+bwd ({n}, {e})": (
            [x, residual, weight, bias],
            {
                "fastnmt": lambda: add_layer_norm(x, residual, weight, bias)[0],
                "torch": lambda: F.layer_norm(x + residual, (e,), weight, bias),
            },
        ),
        f"feed_forward gelu fwd+bwd ({n}, {e}, {4 * e})": (
            [x, w1, b1, w2, b2],
            {
                "fastnmt (library GEMM)": lambda: feed_forward(x, w1, b1, w2, b2, "gelu"),
                "torch": lambda: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2),
            },
        ),
        f"linear_cross_entropy fwd+bwd ({n}, {e}) x V{vocab}": (
            [x, out_weight],
            {
                "fastnmt": lambda: linear_cross_entropy(x, out_weight, None, target, 0.1).loss,
                "torch": lambda: F.cross_entropy(
                    F.linear(x, out_weight).float(), target, label_smoothing=0.1
                ),
            },
        ),
    }
    if device.type == "cuda":  # the Triton GEMM with the epilogue fused, to decide the default
        ffn = ops[f"feed_forward gelu fwd+bwd ({n}, {e}, {4 * e})"][1]
        ffn["fastnmt (fused GEMM)"] = lambda: feed_forward_triton(
            x, w1, b1, w2, b2, "gelu", 0.0, fused_gemm=True
        )
    rows = []
    for label, (inputs, candidates) in ops.items():
        for name, forward in candidates.items():
            rows.append((label, name, milliseconds(forward_backward(forward, inputs), device)))
    return rows


def training_step(name: str, sizes: Sizes, dtype, device) -> Callable[[], None]:
    """One Adam update of a fresh ``name`` preset model on a random padded batch."""
    cfg = preset(name)
    model = Transformer(cfg).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    shape = (sizes.train_batch, sizes.train_length)
    src, tgt = (torch.randint(3, cfg.vocab_size, shape, device=device) for _ in "st")
    src_lengths = padded_lengths(sizes.train_batch, sizes.train_length, device)
    positions = torch.arange(tgt.numel(), device=device)

    def step():
        with torch.autocast(device.type, dtype):
            states = model(src, src_lengths, tgt)
            loss = label_smoothed_loss(model, states, tgt, positions, 0.1)[0]
        (loss / tgt.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def training_rows(sizes: Sizes, dtype, device) -> list[tuple[str, str, float]]:
    rows = []
    for name in sizes.presets:
        step = training_step(name, sizes, dtype, device)
        label = f"training step {name} ({sizes.train_batch} x {sizes.train_length} tokens)"
        for backend in ("auto", "reference"):
            with fastnmt.backend(backend):
                rows.append((label, f"fastnmt ops ({backend})", milliseconds(step, device)))
    return rows


@torch.inference_mode()
def decoding_rows(sizes: Sizes, dtype, device) -> list[tuple[str, str, float]]:
    cfg = preset("tiny")
    model = Transformer(cfg).to(device, dtype).eval()
    batch, length = sizes.decode_batch, sizes.train_length
    src = torch.randint(3, cfg.vocab_size, (batch, length))
    src_lengths = padded_lengths(batch, length, "cpu")
    max_lens = (1.2 * src_lengths + 10).long()
    on_device = (model, src.to(device), src_lengths.to(device), max_lens)
    static = StaticSearches(model, capture=not graph_reasons(device))
    rows = []
    for beam in (1, 4):
        label = f"decoding tiny, beam {beam} ({batch} sentences x {length} tokens, to the limit)"
        options = dict(beam=beam, penalty=LengthPenalty(), eos=False)

        def dynamic(options=options):
            if options["beam"] == 1:  # the translator's choice for beam 1
                return greedy(*on_device, eos=False)
            return beam_search(*on_device, **options)

        for backend in ("auto", "reference"):
            with fastnmt.backend(backend):
                rows.append((label, f"fastnmt.search ({backend})", milliseconds(dynamic, device)))
        graphs = "CUDA graphs" if static.capture else "called"
        search = functools.partial(static.search, src, src_lengths, max_lens, **options)
        rows.append((label, f"static search ({graphs})", milliseconds(search, device)))
    return rows


def markdown(rows: list[tuple[str, str, str, float]]) -> str:
    """One line per measurement, with its ratio to the PyTorch row of the same benchmark."""
    baseline = {}
    for dtype, what, name, ms in rows:
        if name.startswith(
            ("torch", "SDPA bool", "fastnmt ops (reference)", "fastnmt.search (ref")
        ):
            baseline[(dtype, what)] = ms
    lines = ["| dtype | benchmark | implementation | ms | vs PyTorch |", "|---|---|---|---|---|"]
    for dtype, what, name, ms in rows:
        base = baseline.get((dtype, what))
        ratio = f"{base / ms:.2f}x" if base else ""
        lines.append(f"| {dtype} | {what} | {name} | {ms:.3f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: check the script")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("error: no CUDA device (use --smoke to check the script on a CPU)", file=sys.stderr)
        return 2
    sizes = SMOKE if args.smoke else FULL
    dtypes = (torch.float16, torch.bfloat16) if device.type == "cuda" else (torch.bfloat16,)
    torch.manual_seed(0)
    rows = []
    for dtype in dtypes:
        label = str(dtype).removeprefix("torch.")
        for measure in (attention_rows, per_token_rows, training_rows, decoding_rows):
            rows += [(label, *row) for row in measure(sizes, dtype, device)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, fastnmt {fastnmt.__version__}\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
