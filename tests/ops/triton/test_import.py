"""fastnmt without triton: the import works, and the other backends run (fastnmt.ops.triton)."""

import subprocess
import sys

WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError, as where it is absent
import torch
import fastnmt
from fastnmt.ops import attention
q = torch.randn(2, 2, 5, 8)
reasons = fastnmt.explain("attention", q, q, q)
assert reasons["triton"][0].startswith("triton is not installed"), reasons
assert reasons["chosen"] in ("cpp", "reference"), reasons
out = attention(q, q, q, key_lengths=torch.tensor([5, 2]))
assert out.shape == (2, 2, 5, 8) and torch.isfinite(out).all()
print("ok", reasons["chosen"])
"""


def test_import_and_ops_work_without_triton():
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
