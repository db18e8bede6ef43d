"""Quick GPU benchmark of fastnmt against the PyTorch it replaces, as a markdown table.

``python tools/gpu_bench.py`` (run by ``tools/gpu-check``): on a CUDA GPU, in fp16 and bf16,
- attention forward + backward at translation shapes (64 sentences, 8 heads of 64, lengths 32 /
  64 / 128, a quarter of the keys padding) against ``F.scaled_dot_product_attention`` given the
  padding as a bool mask and as an additive float mask, and without a mask (the floor);
- add_layer_norm, feed_forward (library-GEMM and fused-GEMM paths) and linear_cross_entropy
  against their PyTorch compositions, forward + backward;
- a training step of the tiny and base presets (512 sentences x 32 tokens, bf16; fastnmt's
  backends vs the reference ops): eager, captured as one CUDA graph, and with ``--compile`` the
  forward compiled by ``torch.compile``; with peak memory;
- a Hugging Face fine-tuning step (Marian-base, ``tools/marian_base.py``, bf16, AdamW) of 64 and
  256 sentence pairs: ``apply_fastnmt`` against transformers' SDPA attention, with peak memory
  (``--memory-snapshots DIR`` also writes each variant's allocator history for
  https://pytorch.org/memory_viz);
- decoding a batch with the tiny preset, greedy and beam 4, to the length limit (eos banned, so a
  random model does a trained one's work): the static search (``fastnmt.decoding.static_search``,
  captured as CUDA graphs) against ``fastnmt.decoding.search`` on fastnmt's and the reference ops.
Times are medians of ``triton.testing.do_bench`` (L2 flushed between runs); peak memory is
``torch.cuda.max_memory_allocated`` over one call. ``--only`` picks groups of rows.
``--kernels N`` prints, instead of the table, where the GPU time of each eager training and
Hugging Face step of the chosen groups goes: its N kernels with the most GPU time (torch.profiler
over a few steps; on a CPU the N aten ops with the most CPU time), with launches per step.
``--train-minutes M`` also runs ``python -m fastnmt.train`` for M minutes on Multi30k and reports
its throughput (median of the logged windows) and test BLEU. ``--smoke`` runs tiny shapes on
whatever device there is, to check the script itself (tests/test_tools.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

import fastnmt
from fastnmt.cuda_graphs import Program
from fastnmt.decoding.search import LengthPenalty, beam_search, greedy
from fastnmt.decoding.static_search import StaticSearches, graph_reasons
from fastnmt.model import ModelConfig, Transformer, preset
from fastnmt.ops import add_layer_norm, attention, feed_forward, linear_cross_entropy
from fastnmt.ops.feed_forward import feed_forward_triton
from fastnmt.training.graph_updates import capture
from fastnmt.training.trainer import label_smoothed_loss


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
    hf_batches: tuple[int, ...]  # sentence pairs of a Hugging Face step (of train_length tokens)
    hf_tiny: bool  # the Hugging Face model at width 16 (marian_base's tiny)
    presets_tiny: bool  # the presets at width 32, 1+1 layers, 100 words (model_config)


FULL = Sizes(
    64, 8, 64, (32, 64, 128), 8192, 512, 32000, 512, 32, ("tiny", "base"), 256, (64, 256), False,
    False,
)  # fmt: skip
SMOKE = Sizes(2, 2, 16, (8,), 64, 32, 100, 4, 6, ("tiny",), 3, (2,), True, True)


class Row(NamedTuple):
    what: str  # the benchmark: rows of one are compared
    name: str  # the implementation
    ms: float
    peak_mib: float | None = None  # peak memory allocated over one call (CUDA only)


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


def peak_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """The most memory allocated on ``device`` during one call of ``fn``, in MiB (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def forward_backward(forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor]):
    """A callable running ``forward`` and its backward into the ``inputs``' ``.grad``, the
    output's gradient given (drawn once, as FlashAttention's benchmarks do)."""
    grad_out = torch.randn_like(forward())

    def step():
        for tensor in inputs:
            tensor.grad = None
        forward().backward(grad_out)

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


def attention_rows(sizes: Sizes, dtype, device) -> list[Row]:
    rows = []
    for length in sizes.lengths:
        inputs, candidates = attention_candidates(sizes, length, dtype, device)
        label = f"attention fwd+bwd B{sizes.batch} H{sizes.heads} L{length} D{sizes.head_dim}"
        for name, forward in candidates.items():
            step = forward_backward(forward, inputs)
            rows.append(Row(label, name, milliseconds(step, device)))
    return rows


def per_token_rows(sizes: Sizes, dtype, device) -> list[Row]:
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
            rows.append(Row(label, name, milliseconds(forward_backward(forward, inputs), device)))
    return rows


TRAINING_MODES = ("eager", "CUDA graph", "torch.compile")


def model_config(name: str, sizes: Sizes) -> ModelConfig:
    """The ``name`` preset; with ``sizes.presets_tiny`` shrunk, as the smoke run's model: a CPU
    compiles (``--compile``) and runs the full tiny preset's 3+3 layers many times slower, and
    the smoke run checks the script, not the model."""
    cfg = preset(name)
    if not sizes.presets_tiny:
        return cfg
    return dataclasses.replace(
        cfg, vocab_size=100, d_model=32, heads=2, d_ff=64, encoder_layers=1, decoder_layers=1
    )


def training_step(
    name: str, sizes: Sizes, dtype, device, mode: str, dropout: float | None = None
) -> Callable[[], None]:
    """One Adam update of a fresh ``name`` preset model (its dropout, or ``dropout``) on a
    random padded batch, run as ``mode`` (one of TRAINING_MODES) on the backend in force when it
    is built. The step's ``model`` attribute is its model."""
    cfg = model_config(name, sizes)
    if dropout is not None:
        cfg = dataclasses.replace(
            cfg, dropout=dropout, attention_dropout=dropout, activation_dropout=dropout
        )
    model = Transformer(cfg).to(device)
    graphed = mode == "CUDA graph"
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1e-4, fused=device.type == "cuda", capturable=graphed
    )
    shape = (sizes.train_batch, sizes.train_length)
    src, tgt = (torch.randint(3, cfg.vocab_size, shape, device=device) for _ in "st")
    src_lengths = padded_lengths(sizes.train_batch, sizes.train_length, device)
    positions = torch.arange(tgt.numel(), device=device)

    def loss():
        with torch.autocast(device.type, dtype):
            states = model(src, src_lengths, tgt)
            return label_smoothed_loss(model, states, tgt, positions, 0.1)[0] / tgt.numel()

    forward = torch.compile(loss) if mode == "torch.compile" else loss

    def step():
        forward().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=not graphed)  # a graph keeps its gradient tensors

    step.model = model
    if not graphed:
        return step
    program = Program(step)
    capture([program], model, optimizer, ())
    program.model = model
    return program


def training_label(name: str, sizes: Sizes, mode: str) -> str:
    return f"training step {name} ({sizes.train_batch} x {sizes.train_length} tokens), {mode}"


def training_rows(sizes: Sizes, dtype, device, modes: tuple[str, ...]) -> list[Row]:
    """bf16 only, as the training issue's rows (fp16 training needs loss scaling)."""
    if dtype != torch.bfloat16:
        return []
    rows = []
    for name, mode in itertools.product(sizes.presets, modes):
        label = training_label(name, sizes, mode)
        for backend in ("auto", "reference"):
            with fastnmt.backend(backend):  # also where a graph is captured or a step compiled
                build = functools.partial(training_step, name, sizes, dtype, device, mode)
                rows.append(step_row(label, f"fastnmt ops ({backend})", build, device))
    return rows


def step_row(what: str, name: str, build: Callable[[], Callable], device, snapshot=None) -> Row:
    """Time and peak memory of the training step ``build()`` makes (and its allocator history
    at ``snapshot``, on CUDA). The step is built here and dropped on return: it holds its model
    and optimizer state, which, still referenced while the next row's step was built, counted in
    that row's peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    step = build()
    step()  # the optimizer's state exists before memory is measured
    row = Row(what, name, milliseconds(step, device), peak_mib(step, device))
    if snapshot is not None and device.type == "cuda":
        memory_snapshot(step, snapshot)
    return row


# apply_fastnmt's layers stay padded on a GPU by default; "packed" forces them to drop padded
# positions (their attention then runs attention_varlen on the packed rows).
HF_VARIANTS = ("hf sdpa", "apply_fastnmt", "apply_fastnmt packed")


def hf_label(batch: int, sizes: Sizes) -> str:
    return f"HF Marian-base fine-tuning step ({batch} x {sizes.train_length} tokens)"


def hf_rows(sizes: Sizes, dtype, device, snapshots: Path | None = None) -> list[Row]:
    """A Marian-base fine-tuning step (forward with labels, backward, AdamW), bf16 only:
    transformers' SDPA attention against ``apply_fastnmt``."""
    if dtype != torch.bfloat16:
        return []
    rows = []
    for batch, variant in itertools.product(sizes.hf_batches, HF_VARIANTS):
        label = hf_label(batch, sizes)
        build = functools.partial(
            hf_step, batch, sizes.train_length, variant, dtype, device, sizes.hf_tiny
        )
        name = f"hf-{variant.replace(' ', '-')}-{batch}.pickle"
        rows.append(step_row(label, variant, build, device, snapshots and snapshots / name))
    return rows


def hf_step(
    batch: int, length: int, variant: str, dtype, device, tiny: bool = False
) -> Callable[[], None]:
    from marian_base import EOS, PAD, marian_base  # tools/, beside this script

    from fastnmt.integrations.transformers import apply_fastnmt

    model = marian_base(tiny=tiny).to(device).train()
    if variant.startswith("apply_fastnmt"):
        apply_fastnmt(model, packing=True if variant.endswith("packed") else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    shape = (batch, length)
    src_lengths, tgt_lengths = (padded_lengths(batch, length, device) for _ in "st")
    positions = torch.arange(length, device=device)
    input_ids = torch.randint(EOS + 1, PAD, shape, device=device)
    attention_mask = positions < src_lengths[:, None]
    labels = torch.randint(EOS + 1, PAD, shape, device=device)
    labels = labels.masked_fill(positions >= tgt_lengths[:, None], -100)
    inputs = dict(input_ids=input_ids.masked_fill(~attention_mask, PAD), labels=labels)

    def step():
        with torch.autocast(device.type, dtype):
            loss = model(**inputs, attention_mask=attention_mask.long()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def memory_snapshot(fn: Callable[[], object], path: Path) -> None:
    """The allocator's history over one call of ``fn`` (open it at pytorch.org/memory_viz)."""
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    fn()
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)


@torch.inference_mode()
def decoding_rows(sizes: Sizes, dtype, device) -> list[Row]:
    cfg = model_config("tiny", sizes)
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
                rows.append(
                    Row(label, f"dynamic search ({backend})", milliseconds(dynamic, device))
                )
        graphs = "CUDA graphs" if static.capture else "called"
        search = functools.partial(static.search, src, src_lengths, max_lens, **options)
        rows.append(Row(label, f"static search ({graphs})", milliseconds(search, device)))
    return rows


PROFILED_STEPS = 3


def eager_steps(sizes: Sizes, device, groups: list[str]):
    """(benchmark, implementation, backend, build) of each eager bf16 step of ``groups``."""
    dtype = torch.bfloat16
    if "training" in groups:
        for name, backend in itertools.product(sizes.presets, ("auto", "reference")):
            build = functools.partial(training_step, name, sizes, dtype, device, "eager")
            yield training_label(name, sizes, "eager"), f"fastnmt ops ({backend})", backend, build
    if "hf" in groups:
        for batch, variant in itertools.product(sizes.hf_batches, HF_VARIANTS):
            build = functools.partial(
                hf_step, batch, sizes.train_length, variant, dtype, device, sizes.hf_tiny
            )
            yield hf_label(batch, sizes), variant, "auto", build


def kernel_table(what: str, name: str, backend: str, build, device, top: int) -> str:
    """Markdown: the ``top`` kernels of the step ``build()`` makes by GPU time per step (aten ops
    by CPU time off CUDA), profiled over PROFILED_STEPS steps after two warm-up steps."""
    cuda = device.type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    gc.collect()
    with fastnmt.backend(backend):
        step = build()
        step()
        step()
        with torch.profiler.profile(activities=[activity]) as profile:
            for _ in range(PROFILED_STEPS):
                step()
            if cuda:
                torch.cuda.synchronize(device)
    events = [e for e in profile.key_averages() if _self_time(e, cuda) > 0]
    total = sum(_self_time(e, cuda) for e in events) / PROFILED_STEPS / 1e3
    launches = sum(e.count for e in events) / PROFILED_STEPS
    unit = "GPU" if cuda else "CPU"
    lines = [
        f"### {what}: {name}",
        f"{unit} time {total:.3f} ms a step in {launches:.0f} {'kernels' if cuda else 'ops'}",
        "",
        f"| {'kernel' if cuda else 'aten op'} | a step | {unit} ms a step | share |",
        "|---|---|---|---|",
    ]
    for event in sorted(events, key=lambda e: _self_time(e, cuda), reverse=True)[:top]:
        ms = _self_time(event, cuda) / PROFILED_STEPS / 1e3
        label = event.key.replace("|", "/")[:90]
        count = event.count / PROFILED_STEPS
        lines.append(f"| `{label}` | {count:g} | {ms:.3f} | {ms / total:.1%} |")
    return "\n".join(lines)


def _self_time(event, cuda: bool) -> float:
    """µs of the event's own device (CUDA) or CPU time, over all its calls."""
    return event.self_device_time_total if cuda else event.self_cpu_time_total


BASELINES = ("torch", "SDPA bool", "fastnmt ops (reference)", "dynamic search (ref", "hf sdpa")


def markdown(rows: list[tuple[str, Row]]) -> str:
    """One line per (dtype, row), with its ratio to the PyTorch row of the same benchmark."""
    baseline = {(dtype, row.what): row.ms for dtype, row in rows if row.name.startswith(BASELINES)}
    lines = [
        "| dtype | benchmark | implementation | ms | vs PyTorch | peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for dtype, row in rows:
        base = baseline.get((dtype, row.what))
        ratio = f"{base / row.ms:.2f}x" if base else ""
        peak = "" if row.peak_mib is None else f"{row.peak_mib:,.0f}"
        lines.append(f"| {dtype} | {row.what} | {row.name} | {row.ms:.3f} | {ratio} | {peak} |")
    return "\n".join(lines)


def training_run(minutes: float, preset_name: str | None, device: torch.device) -> str:
    """``python -m fastnmt.train`` on Multi30k for ``minutes``: a markdown line of its steps,
    target tokens/s (median of the logged windows) and test BLEU."""
    with tempfile.TemporaryDirectory() as output:
        command = [sys.executable, "-m", "fastnmt.train", "--device", str(device), "--max-time",
                   f"{minutes * 60:g}s", "--output-dir", output, "--no-progress"]  # fmt: skip
        if preset_name is not None:
            command += ["--preset", preset_name]
        subprocess.run(command, check=True, stdout=sys.stderr)  # its log beside the table
        return run_summary(Path(output) / "metrics.jsonl", " ".join(command[1:]))


def run_summary(metrics: Path, command: str) -> str:
    """The markdown table of a training run from its metrics.jsonl."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    windows = [r for r in records if r["event"] == "train"]
    tests = [r for r in records if r["event"] == "test"]
    speed = statistics.median(r["tgt_tokens_per_s"] for r in windows) if windows else 0.0
    steps = max((r.get("step", 0) for r in records), default=0)  # validation logs the last
    bleu = f"{tests[-1]['BLEU']:.2f} (beam {tests[-1]['beam']})" if tests else "not reached"
    return (
        "| training run | steps | target tok/s (window median) | test BLEU |\n|---|---|---|---|\n"
        f"| `{command}` | {steps:,} | {speed:,.0f} | {bleu} |"
    )


GROUPS = {
    "attention": attention_rows,
    "per-token": per_token_rows,
    "training": training_rows,
    "decoding": decoding_rows,
    "hf": hf_rows,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: check the script")
    parser.add_argument(
        "--only", nargs="+", choices=sorted(GROUPS), default=list(GROUPS), help="row groups"
    )
    parser.add_argument("--compile", action="store_true", help="training steps compiled too")
    parser.add_argument("--memory-snapshots", type=Path, help="dir for the HF steps' snapshots")
    parser.add_argument("--train-minutes", type=float, help="also time a training run")
    parser.add_argument("--train-preset", help="its model preset (default: the trainer's)")
    parser.add_argument(
        "--kernels", type=int, metavar="N", help="each eager step's N costliest kernels instead"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("error: no CUDA device (use --smoke to check the script on a CPU)", file=sys.stderr)
        return 2
    sizes = SMOKE if args.smoke else FULL
    dtypes = (torch.float16, torch.bfloat16) if device.type == "cuda" else (torch.bfloat16,)
    modes = tuple(
        mode
        for mode in TRAINING_MODES
        if (mode != "CUDA graph" or not graph_reasons(device))
        and (mode != "torch.compile" or args.compile)
    )
    options = {"training": dict(modes=modes), "hf": dict(snapshots=args.memory_snapshots)}
    if args.memory_snapshots is not None:
        args.memory_snapshots.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, fastnmt {fastnmt.__version__}\n")
    if args.kernels is not None:
        for step in eager_steps(sizes, device, args.only):
            print(kernel_table(*step, device, args.kernels) + "\n")
        return 0
    rows = []
    for dtype in dtypes:
        label = str(dtype).removeprefix("torch.")
        for group in args.only:
            measure = GROUPS[group]
            rows += [
                (label, row) for row in measure(sizes, dtype, device, **options.get(group, {}))
            ]
    print(markdown(rows))
    if args.train_minutes is not None:
        print("\n" + training_run(args.train_minutes, args.train_preset, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
