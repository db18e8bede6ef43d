"""Compile every Triton kernel for real GPUs, without a GPU: ``python -m fastnmt.compile_check``.

For each case of ``fastnmt.ops.compile_cases`` (kernel, signature, block config), this builds a
cubin for sm_80 (A100) and sm_90 (H100), fp16 and bf16, reads registers and
spilled bytes from the cubin with the wheel's ``cuobjdump``, and fails a case that spills
(stack or local memory > 0), exceeds the chip's shared memory, or, for sm_90 matmul kernels, has no
``wgmma`` instruction or transposes a dot product's result in registers (``tt.trans`` of an
``#mma`` tensor: triton 3.4 to 3.7.0 miscompile it on Hopper, fla-org/flash-linear-attention#640,
which gave a wrong attention dK there). Each compiles with the options every launch states
(``triton_common.COMPILE_OPTIONS``). Prints a table; exits 1 when a case fails.

Must run in a process without TRITON_INTERPRET (compiling for a GPU fails under the interpreter).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from fastnmt.ops import compile_cases
from fastnmt.ops.compile_cases import CompileCase
from fastnmt.ops.triton import common as triton_common

TARGETS = {80: 163 * 1024, 90: 227 * 1024}  # compute capability -> shared memory per block
MMA_TRANSPOSE = re.compile(r"= tt\.trans .*: tensor<[^>]*#mma[^>]*> ->")
DTYPES = ("fp16", "bf16")


@dataclass
class CompileResult:
    kernel: str
    target: str
    dtype: str
    config: str
    registers: int = 0
    shared: int = 0
    spills: int = 0
    wgmma: bool = False
    problems: list[str] = field(default_factory=list)


def all_cases() -> list[tuple[str, CompileCase]]:
    """(dtype, case) for every case of ``fastnmt.ops.compile_cases`` in every dtype."""
    return [(dtype, case) for dtype in DTYPES for case in compile_cases.all_cases()]


def parse_resource_usage(text: str) -> tuple[int, int]:
    """Registers and spilled bytes per thread from ``cuobjdump --dump-resource-usage`` output.

    Spills show up as STACK (the per-thread stack frame ptxas spills registers to) or LOCAL."""
    registers = max((int(r) for r in re.findall(r"REG:(\d+)", text)), default=0)
    spilled = [int(n) for n in re.findall(r"(?:STACK|LOCAL):(\d+)", text)]
    return registers, max(spilled, default=0)


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def compile_one(index: int, capability: int) -> CompileResult:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.errors import TritonError

    dtype, case = all_cases()[index]
    result = CompileResult(case.name, f"sm_{capability}", dtype, case.label)
    signature = {k: v.replace("DTYPE", dtype) for k, v in case.signature.items()}
    source = ASTSource(fn=case.kernel, signature=signature, constexprs=case.constexprs)
    try:
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", capability, 32),
            options={
                "num_warps": case.num_warps,
                "num_stages": case.num_stages,
                **triton_common.COMPILE_OPTIONS,
            },
        )
    except (TritonError, RuntimeError) as error:  # MLIR passes raise RuntimeError
        result.problems.append(f"does not compile: {str(error).splitlines()[0][:200]}")
        return result
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", cubin.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    result.registers, result.spills = parse_resource_usage(usage)
    result.shared = compiled.metadata.shared
    result.wgmma = "wgmma" in compiled.asm["ptx"]
    if result.spills:
        result.problems.append(f"spills {result.spills} bytes per thread (stack/local memory)")
    if result.shared > TARGETS[capability]:
        result.problems.append(f"needs {result.shared} B shared memory > {TARGETS[capability]}")
    if capability == 90 and case.needs_wgmma and not result.wgmma:
        result.problems.append("no wgmma on sm_90")
    if capability == 90 and MMA_TRANSPOSE.search(compiled.asm["ttgir"]):
        result.problems.append("tl.trans of a dot's result in registers (Hopper miscompiles it)")
    return result


def run_all(workers: int = 2) -> list[CompileResult]:
    jobs = [(i, cap) for i in range(len(all_cases())) for cap in TARGETS]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(compile_one, *zip(*jobs, strict=True))) if jobs else []


def format_table(results: list[CompileResult]) -> str:
    header = (
        "| kernel | target | dtype | config | registers | shared (B) | spills (B) | wgmma | ok |"
    )
    lines = [header, "|" + "---|" * 9]
    for r in results:
        status = "yes" if not r.problems else "; ".join(r.problems)
        lines.append(
            f"| {r.kernel} | {r.target} | {r.dtype} | {r.config} | {r.registers} | {r.shared} "
            f"| {r.spills} | {'yes' if r.wgmma else 'no'} | {status} |"
        )
    return "\n".join(lines)
