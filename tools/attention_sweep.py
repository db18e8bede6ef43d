"""The attention case that failed on an H100, and its neighbours, in one device call.

    python tools/attention_sweep.py [OUTPUT_DIR] [--first N]   (tools/gpu-check runs it)

The case: bf16 and fp16, head dim 112, value dim 65, key lengths (full, none, one key), 45 queries
over 70 keys (``test_triton_gpu_tiling_bf16_with_an_odd_value_dim``). A dK/dV kernel that feeds a
dot a transposed dot result (miscompiled on Hopper by triton 3.4 to 3.7.0;
``fastnmt.compile_check`` rejects it) gets dK up to 158 times the allowed error wrong there on an
H100, while the interpreter passes. This script varies one thing at a time (dtype, head dims,
masks, lengths, each kernel's launch config) and prints, per variant, each tensor's error over what
FlashAttention's rule allows (> 1 fails) and where the largest error is, so that one GPU run tells
which factor matters. It saves the base case's inputs and results (OUTPUT_DIR/attention-case.pt,
bf16, a few hundred KB) for a look on any machine. Variants run in order of what they tell, each
printed when done, so a run cut short keeps its first rows. Without a GPU it runs in the Triton
interpreter (slow: for checking the script).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter; set before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' oracle, from a checkout

from fastnmt.ops.triton.common import LaunchConfig, gpu_tiles
from tests.helpers import error_check
from tests.ops import test_attention as cases

attention_module = importlib.import_module("fastnmt.ops.triton.attention")  # the launchers
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DEVICE = cases.TRITON_DEVICE
# The failing case: (batch, heads, Lq, Lk, head dim, value dim, masks, dtype).
BASE = dict(batch=3, heads=1, lq=45, lk=70, head_dim=112, value_dim=65, masks="lengths", dtype=BF16)
# Each kernel's config for the base case, and others that fit its registers (compile_check).
OTHER_CONFIGS = {
    "dq": [LaunchConfig(64, 16, 4, 2), LaunchConfig(32, 16, 4, 1), LaunchConfig(64, 32, 8, 2)],
    "dkdv": [LaunchConfig(32, 64, 8, 2), LaunchConfig(16, 64, 8, 1), LaunchConfig(16, 128, 8, 2)],
    "forward": [LaunchConfig(64, 32, 4, 2), LaunchConfig(32, 32, 4, 1)],
}


def variants() -> list[tuple[str, dict, dict]]:
    """(name, case overrides, kernel -> forced config), most telling first."""
    shapes = [
        ("base", {}),
        ("fp16", dict(dtype=FP16)),
        ("fp32", dict(dtype=FP32)),
        ("Dv 64", dict(value_dim=64)),
        ("Dv 66", dict(value_dim=66)),
        ("Dv 112", dict(value_dim=112)),
        ("D 128", dict(head_dim=128)),
        ("D 64", dict(head_dim=64)),
        ("no mask", dict(masks="none")),
        ("padding mask", dict(masks="padding")),
        ("one sentence (full length)", dict(batch=1)),
        # Only the full case reaches a key block that is partly past the keys (keys 64-69 of
        # dK/dV's 64-key blocks and dQ's 16-key ones, in sentence 0): the causal one, which
        # passed, stops at query 45. Key counts at and across those block edges:
        ("45 x 64", dict(lk=64)),
        ("45 x 65", dict(lk=65)),
        ("45 x 128", dict(lk=128)),
        ("64 x 64", dict(lq=64, lk=64)),
        ("45 x 45", dict(lk=45)),
        ("32 x 70", dict(lq=32)),
    ]
    found = [(name, overrides, {}) for name, overrides in shapes]
    for kernel, configs in OTHER_CONFIGS.items():
        found += [(f"{kernel} {config.label}", {}, {kernel: config}) for config in configs]
    return found


@contextlib.contextmanager
def forced_configs(forced: dict):
    """launch_config with ``forced`` kernels' configs replaced."""
    choose = attention_module.launch_config
    attention_module.launch_config = lambda kernel, *a: forced.get(kernel) or choose(kernel, *a)
    try:
        yield
    finally:
        attention_module.launch_config = choose


def run(case: dict, causal: bool) -> tuple[dict, dict]:
    """Per tensor (out, dq, dk, dv), its ``error_check``; and the tensors of the run."""
    dtype, masks_kind = case["dtype"], case["masks"]
    shape = (case["batch"], case["heads"], case["lq"], case["lk"], case["head_dim"])
    q, k, v = cases._qkv(*shape, dtype, device=DEVICE, value_dim=case["value_dim"])
    grad_out = torch.randn(*shape[:3], case["value_dim"], dtype=dtype, device=DEVICE)
    masks = cases._masks(masks_kind, case["batch"], case["lk"], DEVICE)
    forced = functools.partial(cases._forced, "triton")
    out, lse, grads = cases._with_grads(forced, (q, k, v), grad_out, 0.0, causal, **masks)
    expected, _, expected_grads = cases._oracle_with_grads(
        (q, k, v), grad_out, None, 0.0, causal=causal, **masks
    )
    plain, _, plain_grads = cases._with_grads(
        cases._plain_torch, (q, k, v), grad_out, None, 0.0, causal=causal, **masks
    )
    atol = cases.ATOL[dtype]
    checks = {"out": error_check(out, plain, expected, 2, atol)}
    for name, grad, plain_grad, oracle in zip(
        ("dq", "dk", "dv"), grads, plain_grads, expected_grads, strict=True
    ):
        checks[name] = error_check(grad, plain_grad, oracle, 3, atol)
    saved = dict(q=q, k=k, v=v, grad_out=grad_out, out=out, lse=lse, dq=grads[0], dk=grads[1])
    saved |= dict(dv=grads[2], causal=causal, **masks)
    return checks, {name: x.cpu() if torch.is_tensor(x) else x for name, x in saved.items()}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", nargs="?", default=os.environ.get("OUT", "."))
    parser.add_argument("--first", type=int, help="run only the first N variants")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (interpreter)"
    print(f"{device}: per tensor, error / allowed (> 1 fails: '!'), where the largest error is")
    print("and (entries over the bound)", flush=True)
    saved = {}
    failed = 0
    for name, overrides, configs in variants()[: args.first]:
        for causal in (False, True):
            torch.manual_seed(0)
            started = time.perf_counter()
            with gpu_tiles(), forced_configs(configs):
                checks, tensors = run(BASE | overrides, causal)
            if name == "base":
                saved["causal" if causal else "full"] = tensors
            failed += any(check.ratio > 1 for check in checks.values())
            cells = "  ".join(
                f"{tensor} {c.ratio:5.2f}{'!' if c.ratio > 1 else ' '} at {c.where} ({c.over})"
                for tensor, c in checks.items()
            )
            label = f"{name}, {'causal' if causal else 'full'}"
            print(f"{label:32s} {cells}  [{time.perf_counter() - started:.1f} s]", flush=True)
        if name == "base":
            torch.save(saved, out_dir / "attention-case.pt")
    print(f"{failed} variant runs over the bound", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
