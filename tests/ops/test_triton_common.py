"""Shared Triton helpers: dot precision, device guard, GPU tiles (fastnmt/ops/triton_common.py)."""

import contextlib

import pytest
import torch

from fastnmt.ops import triton_common


@pytest.mark.parametrize(
    ("precision", "expected"), [("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")]
)
def test_fp32_dots_follow_torch_float32_matmul_precision(monkeypatch, precision, expected):
    monkeypatch.setattr(triton_common, "INTERPRETER", False)  # as on a GPU
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert triton_common.dot_precision(torch.float32) == expected
        assert triton_common.dot_precision(torch.bfloat16) == "ieee"  # half: no TF32 question
    finally:
        torch.set_float32_matmul_precision(previous)


def test_the_interpreter_computes_fp32_dots_exactly(monkeypatch):
    monkeypatch.setattr(triton_common, "INTERPRETER", True)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert triton_common.dot_precision(torch.float32) == "ieee"
    finally:
        torch.set_float32_matmul_precision(previous)


def test_device_guard_is_a_no_op_off_cuda():
    assert isinstance(triton_common.device_guard(torch.device("cpu")), contextlib.nullcontext)


def test_gpu_tiles_is_scoped():
    outside = triton_common.use_gpu_tiles()
    with triton_common.gpu_tiles():
        assert triton_common.use_gpu_tiles()
    assert triton_common.use_gpu_tiles() == outside == torch.cuda.is_available()
