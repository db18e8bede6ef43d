"""The GPU check's measurements, one stage per process, each row written as it is measured.

    python tools/gpu_check.py STAGE --out DIR [--work DIR] [--smoke] [--seconds S]

``tools/gpu-check`` runs the stages in priority order inside one device call, each under its own
time limit, and appends their rows to DIR/gpu-check.md: every row is flushed to the file the
moment it is measured, so a stage cut short (or a whole call) keeps every row it reached. What the
stages make besides (training runs, prepared data, corpora) goes to ``--work`` (default: OUT.work
beside OUT), so that OUT holds only the report and the logs.

- ``firsts``: the code that never ran on a GPU, each check a PASS/FAIL row: every op forward +
  backward in fp16 and bf16 through the Launcher's direct path (a call's second run bitwise
  equal to its first, both within FlashAttention's rule of the float64 oracle), attention on
  (B, L, H, D) views, batched dropout seeds, attention's odd head dims (D 112, Dv 65), a few
  captured training updates, a captured static search against the dynamic one.
- ``kernels``: GPU time of forward + backward (the output's gradient given, as FlashAttention's
  benchmarks do) captured in one CUDA graph (replays timed), fastnmt against PyTorch's
  built-ins: SDPA with a bool mask, ``F.layer_norm(x + r)``,
  Linear-GELU-Linear, ``F.cross_entropy(F.linear(...))``; B64 H8 D64 (tokens: B x L, width
  512, FFN 2048, vocabulary 32k), L 64/128/32/256, bf16 then fp16.
- ``eager``: the same calls eager (what a user sees: do_bench's wall time), and each op's host
  µs per forward + backward call on tiny tensors (the least of ``HOST_ROUNDS`` runs, fastnmt's
  and PyTorch's alternated).
- ``train``: ``python -m fastnmt.train`` on Multi30k for ``--seconds`` each: ``--backend torch``
  (PyTorch's built-ins), auto (CUDA graphs), then ``--backend reference``; target tokens/s
  (median of the logged windows), the most memory reserved (the graph pool included) and the
  greedy validation BLEU of the one validation, when the run stops (no checkpoint averaging, no
  test translation: each run lasts its seconds plus startup and that validation).
- ``decode``: test2016 with the auto run's checkpoint, beam 4 and greedy, static against dynamic
  search, in the stage's process: sentences/s of the first pass (Triton compiling, CUDA graphs
  captured) and the median of the next three.
- ``hf``: the Hugging Face Marian-base step of 64 and 256 pairs, ``apply_fastnmt`` against SDPA,
  time and memory.
- ``profiles``: the rows furthest from their goals under torch.profiler (add_layer_norm's eager
  call, the Hugging Face step with ``apply_fastnmt``, a warm static beam-4 search): the ops with
  the most self CPU time per call, with their self device time.
- ``configs``: attention forward + backward at the two longest lengths with each candidate
  launch configuration of one kernel (``CONFIG_CANDIDATES``), the others as chosen: time per
  graph replay against the chosen configuration's, and the largest difference from its results.
- ``norm-configs``: add_layer_norm forward + backward at the two shortest lengths with each
  candidate value of one tuning constant (``NORM_CANDIDATES``), as ``configs`` does.

``--smoke`` runs a stage at tiny shapes on whatever device there is (CPU: calls timed instead of
graph replays), to check the plan itself (tests/test_tools.py); its ``python -m`` commands run
their module's ``main`` in the stage's process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' oracle and tools/, from a checkout

import fastnmt  # noqa: E402
from fastnmt.data.multi30k import load_multi30k, multi30k_file  # noqa: E402
from fastnmt.data.text import read_parallel_prefix  # noqa: E402
from fastnmt.decoding.search import LengthPenalty, beam_search  # noqa: E402
from fastnmt.decoding.static_search import StaticSearches, graph_reasons  # noqa: E402
from fastnmt.model import Transformer, preset  # noqa: E402
from fastnmt.ops import add_layer_norm, attention, feed_forward, linear_cross_entropy  # noqa: E402
from fastnmt.ops.triton import add_layer_norm as norm_triton  # noqa: E402
from fastnmt.ops.triton import attention as attention_triton  # noqa: E402
from fastnmt.ops.triton.common import INTERPRETER, dropout_seeds, gpu_tiles  # noqa: E402
from fastnmt.translator import Translator  # noqa: E402
from tests.helpers import error_check, small_corpus  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
import attention_sweep  # noqa: E402
import gpu_bench  # noqa: E402  (tools/, beside this script)

BF16, FP16 = torch.bfloat16, torch.float16


class Report:
    """Markdown appended to one file, a line at a time, each flushed and synced to disk."""

    def __init__(self, path: Path):
        self.path = path

    def line(self, text: str = "") -> None:
        with self.path.open("a") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())

    def table(self, title: str, *columns: str) -> Callable[..., None]:
        """Start a table; returns its ``row(*cells)``."""
        self.line(f"\n### {title}\n")
        self.line("| " + " | ".join(columns) + " |")
        self.line("|" + "---|" * len(columns))
        return lambda *cells: self.line("| " + " | ".join(str(c) for c in cells) + " |")


# ---------------------------------------------------------------------------------------------
# firsts: correctness of the code paths that never ran on a GPU.
# ---------------------------------------------------------------------------------------------


def _output_gradient(out: torch.Tensor) -> torch.Tensor:
    """A gradient for ``out`` drawn from a fixed seed (every run of a check gets the same)."""
    generator = torch.Generator(out.device).manual_seed(1)
    return torch.randn(out.shape, generator=generator, device=out.device).to(out.dtype)


def _fwd_bwd(forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor]):
    """(output, gradients of ``inputs``) of one forward + backward, the output's gradient drawn
    from a fixed seed (every run of a check gets the same)."""
    out = forward()
    grads = torch.autograd.grad(out, inputs, _output_gradient(out))
    return [out.detach().clone(), *(g.clone() for g in grads)]


def _op_cases(device, dtype, small: bool):
    """name -> (inputs, forward): each op on odd shapes (padding, Lq != Lk, views)."""
    b, h, lq, lk, d = (2, 2, 5, 7, 16) if small else (8, 4, 45, 70, 64)
    n, e, f, vocab = (12, 16, 32, 50) if small else (1000, 512, 2048, 8000)

    def leaf(*shape, scale=1.0):
        return (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_()

    q, k, v = leaf(b, h, lq, d), leaf(b, h, lk, d), leaf(b, h, lk, d)
    lengths = torch.randint(1, lk + 1, (b,), device=device)
    lengths[0] = lk
    # (B, L, H, D) as a model's projections come: attention takes their views, no copy
    qt, kt, vt = (leaf(b, length, h, d) for length in (lq, lk, lk))
    x, r = leaf(n, e), leaf(n, e)
    weight, bias = leaf(e), leaf(e)
    w1, b1, w2, b2 = leaf(f, e, scale=e**-0.5), leaf(f), leaf(e, f, scale=f**-0.5), leaf(e)
    out_w = leaf(vocab, e, scale=e**-0.5)
    target = torch.randint(vocab, (n,), device=device)
    return {
        "attention, key lengths": (
            [q, k, v],
            lambda q, k, v: attention(q, k, v, key_lengths=lengths),
        ),
        "attention, causal": (
            [q, k, v],
            lambda q, k, v: attention(q, k[:, :, :lq], v[:, :, :lq], causal=True),
        ),
        "attention, (B, L, H, D) views": (
            [qt, kt, vt],
            lambda q, k, v: attention(*(t.transpose(1, 2) for t in (q, k, v)), key_lengths=lengths),
        ),
        "add_layer_norm": ([x, r, weight, bias], lambda x, r, w, b: add_layer_norm(x, r, w, b)[0]),
        "feed_forward gelu": (
            [x, w1, b1, w2, b2],
            lambda *tensors: feed_forward(*tensors, "gelu"),
        ),
        "linear_cross_entropy": (
            [x, out_w],
            lambda x, w: linear_cross_entropy(x, w, None, target, 0.1).loss,
        ),
    }


def check_op(case) -> tuple[bool, str]:
    """(passed, detail): a signature's second call (the Launcher's direct path) bitwise equal to
    its first, and each tensor within FlashAttention's rule: at most 2x (outputs) or 3x
    (gradients) as far from the float64 reference as the reference in the same dtype, + 1e-3
    (the test suite's rule)."""
    inputs, forward = case
    first = _fwd_bwd(lambda: forward(*inputs), inputs)  # compiles, then keeps each kernel
    second = _fwd_bwd(lambda: forward(*inputs), inputs)
    repeat = all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    with fastnmt.backend("reference"):
        same_dtype = _fwd_bwd(lambda: forward(*inputs), inputs)
        exact = [t.detach().double().requires_grad_() for t in inputs]
        oracle = _fwd_bwd(lambda: forward(*exact), exact)
    worst, failed = 0.0, []
    for i, (got, torch_got, want) in enumerate(zip(first, same_dtype, oracle, strict=True)):
        check = error_check(got, torch_got, want, 2 if i == 0 else 3, 1e-3)
        worst = max(worst, check.error / check.allowed)
        if check.error > check.allowed:
            tensor = "out" if i == 0 else f"grad {i}"
            failed.append(f"{tensor} {check.error:.3g} > {check.allowed:.3g} at {check.where}")
    detail = f"repeat {'bitwise' if repeat else 'DIFFERS'}; worst error / allowed {worst:.2f}"
    return repeat and not failed, "; ".join([detail, *failed])


def check_dropout_seeds(device, dtype) -> tuple[bool, str]:
    """Batched seeds: one per call, the same seed the same mask, others other masks, keep
    fraction 1 - p."""
    x = torch.ones(4096, 256, device=device, dtype=dtype)
    seeds = dropout_seeds(3, device)
    masks = [
        add_layer_norm(x, None, None, None, dropout_p=0.3, dropout_seed=s)[1] != 0 for s in seeds
    ]
    again = add_layer_norm(x, None, None, None, dropout_p=0.3, dropout_seed=seeds[0])[1] != 0
    kept = masks[0].float().mean().item()
    same = torch.equal(masks[0], again)
    distinct = not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    passed = same and distinct and abs(kept - 0.7) < 0.01
    return passed, f"same seed same mask {same}; seeds distinct {distinct}; kept {kept:.4f} (0.7)"


def check_odd_dims(device, dtype) -> tuple[bool, str]:
    """The case whose dK triton 3.4 to 3.7.0 compile wrong on Hopper when a dot takes a
    transposed dot result (tools/attention_sweep.py's): out, dq, dk and dv within the rule,
    full and causal; the worst error / allowed of each."""
    if device.type != "cuda" and not INTERPRETER:
        return True, "not run: Triton takes CPU tensors in its interpreter only"
    worst = dict.fromkeys(("out", "dq", "dk", "dv"), 0.0)
    for causal in (False, True):
        torch.manual_seed(0)
        with gpu_tiles():
            checks, _ = attention_sweep.run(attention_sweep.BASE | {"dtype": dtype}, causal)
        worst = {name: max(worst[name], check.ratio) for name, check in checks.items()}
    detail = ", ".join(f"{name} {ratio:.2f}" for name, ratio in worst.items())
    return max(worst.values()) <= 1, f"worst error / allowed: {detail}"


def check_captured_updates(device, sizes) -> tuple[bool, str]:
    """A few training updates captured as one CUDA graph (the hazards' checks included)
    against the same updates eager: finite, and the parameters close."""
    if graph_reasons(device):
        return True, "not captured: " + graph_reasons(device)[0]
    torch.manual_seed(0)
    eager = gpu_bench.training_step("tiny", sizes, BF16, device, "eager", dropout=0.0)
    torch.manual_seed(0)
    graphed = gpu_bench.training_step("tiny", sizes, BF16, device, "CUDA graph", dropout=0.0)
    for _ in range(3):
        eager()
        graphed()
    torch.cuda.synchronize(device)
    pairs = zip(eager.model.parameters(), graphed.model.parameters(), strict=True)
    difference = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
    finite = all(p.isfinite().all() for p in graphed.model.parameters())
    return (
        finite and difference < 1e-2,
        f"finite {finite}; largest parameter difference {difference:.2e}",
    )


def check_static_search(device, smoke: bool) -> tuple[bool, str]:
    """The static search (captured on CUDA) finds beam_search's hypotheses."""
    cfg = preset("tiny")
    torch.manual_seed(0)
    model = Transformer(cfg).to(device).eval()
    with torch.no_grad():
        model.embedding.weight.mul_(4.0)  # peaked, varied choices
    batch, length = (3, 6) if smoke else (32, 20)
    src = torch.randint(3, cfg.vocab_size, (batch, length))
    src[:, -1] = cfg.eos_id
    lengths = torch.full((batch,), length)
    max_lens = torch.full((batch,), length + 5)
    static = StaticSearches(model, capture=not graph_reasons(device))
    options = dict(beam=4, penalty=LengthPenalty())
    with torch.inference_mode():
        found = static.search(src, lengths, max_lens, **options)
        expected = beam_search(model, src.to(device), lengths.to(device), max_lens, **options)
    differ = sum(a[0].tokens != b[0].tokens for a, b in zip(found, expected, strict=True))
    return differ == 0, f"{'captured' if static.capture else 'called'}; {differ} of {batch} differ"


def firsts(args, device, report: Report) -> None:
    row = report.table(
        "Firsts: the code that never ran on a GPU", "check", "dtype", "result", "detail"
    )
    smoke = args.smoke
    for dtype in (BF16, FP16) if device.type == "cuda" else (torch.float32,):
        label = str(dtype).removeprefix("torch.")
        for name, case in _op_cases(device, dtype, smoke).items():
            _checked(row, name, label, functools.partial(check_op, case))
        _checked(
            row, "dropout seeds", label, lambda dtype=dtype: check_dropout_seeds(device, dtype)
        )
        _checked(
            row, "attention, D 112 Dv 65", label, lambda dtype=dtype: check_odd_dims(device, dtype)
        )
    sizes = gpu_bench.SMOKE if smoke else gpu_bench.FULL
    _checked(
        row, "captured training updates", "bf16", lambda: check_captured_updates(device, sizes)
    )
    _checked(row, "static search beam 4", "fp32", lambda: check_static_search(device, smoke))


def _checked(row, name: str, dtype: str, check: Callable[[], tuple[bool, str]]) -> None:
    """One check's row; an exception is a FAIL row naming it (the stage goes on)."""
    try:
        passed, detail = check()
    except Exception as error:
        passed, detail = (
            False,
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
        )
    row(name, dtype, "PASS" if passed else "**FAIL**", detail.replace("|", "/"))


# ---------------------------------------------------------------------------------------------
# kernels and eager: the ops against PyTorch's built-ins.
# ---------------------------------------------------------------------------------------------


def _shapes(smoke: bool):
    return (
        dict(batch=2, heads=2, head_dim=8, lengths=(8,), ffn=4, vocab=100)
        if smoke
        else dict(batch=64, heads=8, head_dim=64, lengths=(64, 128, 32, 256), ffn=4, vocab=32000)
    )


def _pairs(shape: dict, length: int, dtype, device):
    """op -> (inputs, fastnmt forward, PyTorch forward) at one length: B x L tokens."""
    b, h, d = shape["batch"], shape["heads"], shape["head_dim"]
    e, tokens = h * d, b * length

    def leaf(*size, scale=1.0):
        return (torch.randn(size, device=device) * scale).to(dtype).requires_grad_()

    q, k, v = (leaf(b, h, length, d) for _ in "qkv")
    lengths = gpu_bench.padded_lengths(b, length, device)
    allowed = (torch.arange(length, device=device) < lengths[:, None])[:, None, None, :]
    x, r, w, bias = leaf(tokens, e), leaf(tokens, e), leaf(e), leaf(e)
    f = shape["ffn"] * e
    w1, b1, w2, b2 = leaf(f, e, scale=e**-0.5), leaf(f), leaf(e, f, scale=f**-0.5), leaf(e)
    out_w = leaf(shape["vocab"], e, scale=e**-0.5)
    target = torch.randint(shape["vocab"], (tokens,), device=device)
    sdpa = F.scaled_dot_product_attention
    return {
        "attention": (
            [q, k, v],
            lambda: attention(q, k, v, key_lengths=lengths),
            lambda: sdpa(q, k, v, attn_mask=allowed),
        ),
        "add_layer_norm": (
            [x, r, w, bias],
            lambda: add_layer_norm(x, r, w, bias)[0],
            lambda: F.layer_norm(x + r, (e,), w, bias),
        ),
        "feed_forward gelu": (
            [x, w1, b1, w2, b2],
            lambda: feed_forward(x, w1, b1, w2, b2, "gelu"),
            lambda: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2),
        ),
        "linear_cross_entropy": (
            [x, out_w],
            lambda: linear_cross_entropy(x, out_w, None, target, 0.1).loss,
            lambda: F.cross_entropy(F.linear(x, out_w).float(), target, label_smoothing=0.1),
        ),
    }


def _step(forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> Callable[[], object]:
    """Forward + backward of the op alone, as FlashAttention's benchmarks time it: the output's
    gradient is given (``_output_gradient``), the inputs' go into fresh tensors (none accumulate:
    a graph may replay it)."""
    grad_out = _output_gradient(forward())
    return lambda: torch.autograd.grad(forward(), inputs, grad_out)


def graph_ms(step: Callable[[], object], device, replays: int = 20) -> float:
    """ms per replay of ``step`` captured as a CUDA graph: kernel time, no host work (off CUDA,
    the median of a few calls)."""
    if graph_reasons(device):
        return gpu_bench.milliseconds(step, device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def _op_rows(args, device, report: Report, title: str, measure) -> None:
    row = report.table(title, "L", "dtype", "op", "fastnmt ms", "PyTorch ms", "speedup")
    shape = _shapes(args.smoke)
    dtypes = (BF16, FP16) if device.type == "cuda" else (BF16,)
    for dtype in dtypes:
        for length in shape["lengths"]:
            for name, (inputs, ours, theirs) in _pairs(shape, length, dtype, device).items():
                try:
                    mine, base = (measure(_step(fn, inputs), device) for fn in (ours, theirs))
                except Exception as error:
                    row(length, dtype, name, f"{type(error).__name__}", "", str(error)[:80])
                    continue
                label = str(dtype).removeprefix("torch.")
                row(length, label, name, f"{mine:.3f}", f"{base:.3f}", f"{base / mine:.2f}x")


def kernels(args, device, report: Report) -> None:
    title = "Kernel-only: forward + backward captured in a CUDA graph, replays timed"
    _op_rows(args, device, report, title, graph_ms)


HOST_ROUNDS = 5  # the host µs rows: the least of this many runs, fastnmt's and PyTorch's alternated


def host_microseconds(step: Callable[[], object], device, calls: int) -> float:
    """µs per call of ``step`` issued back to back on tiny tensors: the host's cost per call
    (the GPU keeps up)."""
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(calls):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / calls * 1e6


def eager(args, device, report: Report) -> None:
    _op_rows(
        args, device, report, "Eager: forward + backward wall time per call", gpu_bench.milliseconds
    )
    row = report.table(
        "Host µs per forward + backward call (tiny tensors)",
        "op",
        "fastnmt µs",
        "PyTorch µs",
        "ratio",
    )
    tiny = dict(batch=1, heads=1, head_dim=64, ffn=4, vocab=64)
    calls, rounds = (3, 1) if args.smoke else (200, HOST_ROUNDS)
    for name, (inputs, ours, theirs) in _pairs(tiny, 8, BF16, device).items():
        steps = [_step(fn, inputs) for fn in (ours, theirs)]
        runs = [[host_microseconds(step, device, calls) for step in steps] for _ in range(rounds)]
        mine, base = (min(times) for times in zip(*runs, strict=True))
        row(name, f"{mine:.1f}", f"{base:.1f}", f"{mine / base:.2f}")


# ---------------------------------------------------------------------------------------------
# train, decode, hf: the commands and the Hugging Face step.
# ---------------------------------------------------------------------------------------------

TRAIN_RUNS = {"auto": (), "reference": ("--backend", "reference"), "torch": ("--backend", "torch")}
TRAIN_ORDER = ("torch", "auto", "reference")  # the baseline, then the row that matters most


def run_command(command: list[str], smoke: bool, timeout=None) -> int:
    """The exit status of ``command`` (``python -m MODULE ...``), its output in this stage's log:
    a process; with ``smoke``, its module's ``main`` in this one (a tiny run takes a CPU less time
    than a process's start, mostly torch's import, and the smoke run checks the command)."""
    if not smoke:
        return subprocess.run(command, stderr=subprocess.STDOUT, timeout=timeout).returncode
    assert command[1] == "-m", command
    try:
        return importlib.import_module(command[2]).main(command[3:])
    except SystemExit as exit_:  # argparse's errors
        return exit_.code


def _train_command(args, device, name: str) -> list[str]:
    """A run that does only what its row needs: one validation, when it stops (its BLEU), no
    checkpoint averaging, no test translation (own data without ``--test``)."""
    command = [sys.executable, "-m", "fastnmt.train", "--device", str(device), "--output-dir",
               str(args.work / f"train-{name}"), "--prepared-dir", str(args.work / "prepared"),
               "--no-progress", "--valid-interval", "0", "--average-last", "1",
               *TRAIN_RUNS[name]]  # fmt: skip
    if args.smoke:  # a small model on the tests' corpus
        corpus = _smoke_corpus(args)
        return [*command, "--train", str(corpus / "train"), "--valid", str(corpus / "val"),
                          "--vocab-size", "300", "--d-model", "32", "--heads", "2", "--d-ff",
                          "64", "--encoder-layers", "1", "--decoder-layers", "1", "--max-tokens",
                          "400", "--max-steps", "4", "--log-interval", "1"]  # fmt: skip
    multi30k = _multi30k_dir()
    return [*command, "--train", str(multi30k / "train"), "--valid", str(multi30k / "val"),
                      "--log-interval", "20", "--max-time", f"{args.seconds:g}s"]  # fmt: skip


def _multi30k_dir() -> Path:
    """Multi30k's folder ($FASTNMT_DATA_DIR, else the download cache), its en-de training and
    validation files present: the runs read them as own data, which needs no test set."""
    files = [multi30k_file(split, lang) for split in ("train", "val") for lang in ("en", "de")]
    return files[0].parent


def _smoke_corpus(args) -> Path:
    folder = args.work / "corpus"
    return folder if (folder / "val.de").exists() else small_corpus(folder)


def train_summary(output: Path) -> tuple[int, float, float | None, float | None]:
    """(steps, target tokens/s: median of the logged windows, most MiB reserved, the last
    validation's BLEU) of a run."""
    path = output / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    windows = [r for r in records if r["event"] == "train"]
    steps = max((r.get("step", 0) for r in windows), default=0)
    speed = statistics.median(r["tgt_tokens_per_s"] for r in windows) if windows else 0.0
    reserved = [r["memory_reserved_mib"] for r in windows if "memory_reserved_mib" in r]
    bleu = [r["bleu"] for r in records if r["event"] == "valid" and "bleu" in r]
    return steps, speed, max(reserved) if reserved else None, bleu[-1] if bleu else None


def train(args, device, report: Report) -> None:
    """The runs in turn, each row written as its run ends; a run's output goes to this stage's
    (train.log), and a run that overstays its time by far is ended, so the next still runs."""
    row = report.table(
        f"python -m fastnmt.train, {'4 steps' if args.smoke else f'{args.seconds:g} s'} each",
        "backend", "steps", "target tok/s", "vs torch", "MiB reserved", "valid BLEU", "exit",
    )  # fmt: skip
    speeds = {}
    for name in TRAIN_ORDER:
        output = args.work / f"train-{name}"
        shutil.rmtree(output, ignore_errors=True)  # a fresh run, never a resumed one
        command = _train_command(args, device, name)
        print(f"\n=== train {name}: {shlex.join(command)}", flush=True)
        limit = None if args.smoke else args.seconds + 150
        try:
            status = run_command(command, args.smoke, timeout=limit)
        except subprocess.TimeoutExpired:
            status = f"timeout {limit:g} s"
        steps, speeds[name], reserved, bleu = train_summary(output)
        ratio = f"{speeds[name] / speeds['torch']:.2f}x" if speeds.get("torch") else ""
        mib = "" if reserved is None else f"{reserved:,.0f}"
        score = "" if bleu is None else f"{bleu:.2f}"
        row(name, steps, f"{speeds[name]:,.0f}", ratio, mib, score, f"{status} (log: train.log)")


def _test_corpus(args):
    """test2016 en-de (the tests' corpus under --smoke)."""
    if args.smoke:
        return read_parallel_prefix(str(_smoke_corpus(args) / "val"), "en", "de")
    return load_multi30k("test_2016_flickr", "en", "de")


def _sentences_per_second(translate: Callable[[], list[str]], device) -> float:
    started = time.perf_counter()
    hypotheses = translate()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(hypotheses) / (time.perf_counter() - started)


def decode(args, device, report: Report) -> None:
    """Each search's first pass over test2016 (Triton compiling, CUDA graphs captured) and the
    median of its next passes, in this process (no start-up per row); then scoring its pairs
    (teacher-forced, packed: ``attention_varlen``), against static beam 4 (#52's goal: 5x)."""
    row = report.table(
        "test2016 with the auto run's checkpoint",
        "search", "beam", "sent/s", "first pass sent/s", "passes",
    )  # fmt: skip
    corpus = _test_corpus(args)
    passes = 2 if args.smoke else 4
    for static in (True, False):
        translator = Translator.load(args.work / "train-auto", device=device, static=static)
        for beam in (4, 1):
            translate = functools.partial(translator.translate, corpus.src, beam=beam)
            speeds = [_sentences_per_second(translate, device) for _ in range(passes)]
            search = "static" if static else "dynamic"
            warm = statistics.median(speeds[1:])
            row(search, beam, f"{warm:,.1f}", f"{speeds[0]:,.1f}", passes)
    score = functools.partial(translator.score, corpus.src, corpus.tgt)
    speeds = [_sentences_per_second(score, device) for _ in range(passes)]
    row(
        "score (packed pairs)",
        "-",
        f"{statistics.median(speeds[1:]):,.1f}",
        f"{speeds[0]:,.1f}",
        passes,
    )


def hf(args, device, report: Report) -> None:
    row = report.table(
        "Hugging Face Marian-base step (bf16, AdamW)", "pairs", "variant", "ms", "MiB reserved"
    )
    try:
        import transformers  # noqa: F401
    except ImportError as error:
        row("-", "-", f"not run: {error}", "")
        return
    sizes = gpu_bench.SMOKE if args.smoke else gpu_bench.FULL
    for batch in sizes.hf_batches:
        for variant in gpu_bench.HF_VARIANTS:
            build = functools.partial(
                gpu_bench.hf_step, batch, sizes.train_length, variant, BF16, device, sizes.hf_tiny
            )
            with _reserved(device) as reserved:
                measured = gpu_bench.step_row("", variant, build, device)
            row(batch, variant, f"{measured.ms:.2f}", reserved())


# profiles: where the time of the rows short of their goals goes.
# ---------------------------------------------------------------------------------------------

PROFILE_OPS = 12  # per profile, the ops with the most self CPU time,
PROFILE_KERNELS = 6  # and those with the most self device time (kernels launched directly)


def _self_device_us(event) -> float:
    """An op's own time on the device, µs (named so in torch >= 2.4; 0 for CPU-only events)."""
    return getattr(event, "self_device_time_total", 0.0)


def profile_table(report: Report, title: str, run: Callable[[], object], device, calls: int):
    """``run``'s ops under torch.profiler (``calls`` calls after a warm one), per call: the
    total, the ops with the most self CPU time and those with the most self device time."""
    run()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(calls):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = profiler.key_averages()
    table = report.table(title, "op", "calls", "self CPU ms", "self device ms")

    def row(name: str, count: int, cpu_us: float, device_us: float) -> None:
        table(name, count // calls, f"{cpu_us / calls / 1e3:.3f}", f"{device_us / calls / 1e3:.3f}")

    row(
        "(all)",
        sum(e.count for e in events),
        sum(e.self_cpu_time_total for e in events),
        sum(map(_self_device_us, events)),
    )
    by_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:PROFILE_OPS]
    by_device = sorted(events, key=_self_device_us, reverse=True)[:PROFILE_KERNELS]
    for event in by_cpu + [e for e in by_device if e not in by_cpu and _self_device_us(e)]:
        row(event.key[:60], event.count, event.self_cpu_time_total, _self_device_us(event))


def profiles(args, device, report: Report) -> None:
    """The rows furthest from their goals, profiled: add_layer_norm's eager call (host-bound),
    a tiny model's training update captured as a CUDA graph (the training row's kernels), the
    Hugging Face step with apply_fastnmt, and a warm static beam-4 search."""
    shape = _shapes(args.smoke)
    length = shape["lengths"][0]
    inputs, ours, _ = _pairs(shape, length, BF16, device)["add_layer_norm"]
    title = f"Profile: add_layer_norm forward + backward, eager, L {length}, bf16"
    profile_table(report, title, _step(ours, inputs), device, calls=20)
    sizes = gpu_bench.SMOKE if args.smoke else gpu_bench.FULL
    mode = "eager" if graph_reasons(device) else "CUDA graph"
    update = gpu_bench.training_step("tiny", sizes, BF16, device, mode)
    for _ in range(3):  # captured, then replayed warm
        update()
    title = f"Profile: a tiny model's training update ({mode}, bf16, Adam, fused ops)"
    profile_table(report, title, update, device, calls=1 if args.smoke else 5)
    del update
    batch = sizes.hf_batches[0]
    step = gpu_bench.hf_step(
        batch, sizes.train_length, "apply_fastnmt", BF16, device, sizes.hf_tiny
    )
    title = f"Profile: Hugging Face Marian-base step, {batch} pairs, apply_fastnmt"
    profile_table(report, title, step, device, calls=1 if args.smoke else 3)
    del step
    translator = Translator.load(args.work / "train-auto", device=device, static=True)
    sentences = _test_corpus(args).src[: 8 if args.smoke else 256]
    translate = functools.partial(translator.translate, sentences, beam=4)
    title = f"Profile: static beam-4 search of {len(sentences)} test2016 sentences"
    profile_table(report, title, translate, device, calls=1)


# configs: attention's launch configurations, one kernel at a time, on the GPU.
# ---------------------------------------------------------------------------------------------

# (block_m, block_n, num_warps, num_stages) to try for each kernel at head dim 64, beside the
# one launch_config() picks: FlashAttention-2's tiles and their neighbours.
CONFIG_CANDIDATES = {
    "forward": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3)],
    # dK/dV's tiles have the keys along their rows; these compile without spills under triton
    # 3.6 at D 64 (python -m fastnmt.compile_check's way).
    "dkdv": [(32, 128, 8, 2), (16, 64, 8, 2), (16, 128, 8, 2), (32, 64, 8, 3), (32, 128, 8, 3)],
    "dq": [(128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 8, 2)],
}


def configs(args, device, report: Report) -> None:
    """Forward + backward of attention (bf16, the kernels stage's shapes) with each candidate
    configuration of one kernel, the others as chosen: ms per CUDA-graph replay, the speedup
    over the chosen configuration and the largest difference from its outputs and gradients."""
    row = report.table(
        "Attention launch configurations (bf16, forward + backward, CUDA graph)",
        "L", "kernel", "config", "ms", "vs chosen", "max |diff|",
    )  # fmt: skip
    shape = _shapes(args.smoke)
    for length in sorted(shape["lengths"])[-2:]:  # the longest two: furthest from the goal
        inputs, forward, _ = _pairs(shape, length, BF16, device)["attention"]
        measure = _Candidates(forward, inputs, device)
        head_dim = shape["head_dim"]
        for kernel, candidates in CONFIG_CANDIDATES.items():
            now = attention_triton.launch_config(kernel, length, length, head_dim)
            row(length, kernel, f"{now.label} (chosen)", *measure.chosen_cells)
            for values in candidates:
                config = attention_triton.LaunchConfig(*values)
                if config == now:
                    continue
                try:
                    with attention_sweep.forced_configs({kernel: config}):
                        cells = measure()
                except Exception as error:  # a config that does not compile or fit
                    row(length, kernel, config.label, type(error).__name__, "", str(error)[:60])
                    continue
                row(length, kernel, config.label, *cells)


class _Candidates:
    """Forward + backward of one op timed as a CUDA graph, first as chosen (at construction),
    then under each candidate (a call): the cells ms, speedup over the chosen, and the largest
    difference from the chosen's output and gradients."""

    def __init__(self, forward, inputs, device):
        self.forward, self.inputs, self.device = forward, inputs, device
        self.step = _step(forward, inputs)
        self.ms, self.results = self._run()
        self.chosen_cells = (f"{self.ms:.3f}", "1.00x", "0")

    def _run(self):
        return graph_ms(self.step, self.device), _fwd_bwd(self.forward, self.inputs)

    def __call__(self) -> tuple[str, str, str]:
        ms, got = self._run()
        pairs = zip(got, self.results, strict=True)
        diff = max((g.float() - b.float()).abs().max().item() for g, b in pairs)
        return f"{ms:.3f}", f"{self.ms / ms:.2f}x", f"{diff:.2e}"


# add_layer_norm's tuning constants (fastnmt/ops/triton/add_layer_norm.py) to try, one at a time:
# the elements of a row tile, the backward programs per SM (each sums its tiles' dweight and
# dbias into a partial row) and the partial rows' reduction (rows per step, columns per program).
NORM_CANDIDATES = {
    "_GPU_TILE": [2048, 8192],
    "_PROGRAMS_PER_SM": [1, 2, 8],
    "_SUM_TILE": [(128, 16), (128, 8), (64, 32)],
}
# What the constants go into, cached per call signature (or per device).
_NORM_CACHES = (
    "_chosen_tile", "_forward_plan", "_backward_plan", "_sums_plan", "_most_backward_programs"
)  # fmt: skip


@contextlib.contextmanager
def forced_norm_tuning(name: str, value) -> Iterator[None]:
    """add_layer_norm's tuning constant ``name`` set to ``value``; its launch plans, cached per
    call signature, are made again inside and after."""
    saved = getattr(norm_triton, name)

    def set_value(new) -> None:
        setattr(norm_triton, name, new)
        for cached in _NORM_CACHES:
            getattr(norm_triton, cached).cache_clear()

    set_value(value)
    try:
        yield
    finally:
        set_value(saved)


def norm_configs(args, device, report: Report) -> None:
    """Forward + backward of add_layer_norm (bf16, the kernels stage's shapes, the two shortest
    lengths: the rows furthest from the goal) with each candidate of one tuning constant."""
    row = report.table(
        "add_layer_norm tuning constants (bf16, forward + backward, CUDA graph)",
        "L", "constant", "value", "ms", "vs chosen", "max |diff|",
    )  # fmt: skip
    shape = _shapes(args.smoke)
    for length in sorted(shape["lengths"])[:2]:
        inputs, forward, _ = _pairs(shape, length, BF16, device)["add_layer_norm"]
        measure = _Candidates(forward, inputs, device)
        for name, candidates in NORM_CANDIDATES.items():
            chosen = f"{getattr(norm_triton, name)} (chosen)"
            row(length, name, chosen, *measure.chosen_cells)
            for value in candidates:
                with forced_norm_tuning(name, value):
                    row(length, name, value, *measure())


@contextlib.contextmanager
def _reserved(device) -> Iterator[Callable[[], str]]:
    """The most memory the caching allocator reserved inside, in MiB (CUDA)."""
    if device.type != "cuda":
        yield lambda: ""
        return
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    most = []
    yield lambda: f"{most[0]:,.0f}" if most else ""
    most.append(torch.cuda.max_memory_reserved(device) / 2**20)


STAGES = {
    "firsts": firsts,
    "kernels": kernels,
    "eager": eager,
    "train": train,
    "decode": decode,
    "hf": hf,
    "profiles": profiles,
    "configs": configs,
    "norm-configs": norm_configs,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("--out", type=Path, required=True, help="the report's folder")
    parser.add_argument(
        "--work",
        type=Path,
        help="training runs, prepared data, corpora: kept out of --out, whose files a device "
        "call brings back (default: OUT.work beside it; train and decode must agree)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: check the plan")
    parser.add_argument("--seconds", type=float, default=90.0, help="each training run's time")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("error: no CUDA device (use --smoke to check the plan on a CPU)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.work or args.out.with_name(args.out.name + ".work")
    args.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    STAGES[args.stage](args, device, Report(args.out / "gpu-check.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
