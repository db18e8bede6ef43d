"""The GPU tools run end to end on a CPU, at tiny shapes (tools/gpu_bench.py --smoke)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_smoke_writes_a_table_with_every_benchmark():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_bench.py"), "--smoke"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    table = result.stdout
    for row in ("SDPA bool mask", "SDPA float mask", "SDPA no mask", "add_layer_norm",
                "feed_forward", "linear_cross_entropy", "training step tiny",
                "decoding tiny, beam 4", "static search"):  # fmt: skip
        assert row in table, row
