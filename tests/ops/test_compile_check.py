"""Every Triton kernel compiles for sm_80 and sm_90 (fp16, bf16) without spills; no GPU needed."""

import os
import subprocess
import sys

from fastnmt.ops.compile_check import parse_resource_usage


def test_every_kernel_compiles_for_sm80_and_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "fastnmt.compile_check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_resource_usage_parser_sees_spills():
    text = " Function k:\n  REG:96 STACK:8 SHARED:0 LOCAL:24 CONSTANT[0]:568\n"
    assert parse_resource_usage(text) == (96, 24)
    text = " Function k:\n  REG:255 STACK:6192 SHARED:0 LOCAL:0 CONSTANT[0]:568\n"
    assert parse_resource_usage(text) == (255, 6192)
    assert parse_resource_usage("  REG:40 STACK:0 SHARED:0 LOCAL:0") == (40, 0)
