"""The compiled extension: built by the install, loaded in one place, explained in one line."""

import os
import subprocess
import sys

import torch

import fastnmt
from tests.helpers import require_backend


def test_status_is_one_line_that_says_how_to_fix():
    status = fastnmt.extension_status()
    assert "\n" not in status
    assert ("loaded from" in status) == fastnmt.extension_available()
    if not fastnmt.extension_available():
        assert "pip install" in status


def test_the_install_built_the_cpp_kernels():
    require_backend("cpp")
    for op in ("add_layer_norm_cpp", "feed_forward_cpp"):
        assert hasattr(torch.ops.fastnmt, op)


def test_a_kernel_error_that_formats_a_number_reaches_python_as_runtime_error():
    """TORCH_CHECK(ok, "got ", value) formats with libstdc++'s locale. When g++ linked a second,
    static libstdc++ into _C (an Ubuntu 24.04 H100 machine did), that copy's locale was never set
    up and this call killed the process; setup.py now names the shared runtime. A child process
    runs it so that a crash fails this test instead of the whole run."""
    require_backend("cpp")
    script = (
        "import torch, fastnmt\n"
        "assert fastnmt.extension_available()\n"
        "try:\n"
        "    torch.ops.fastnmt.log_softmax_topk_cpp(torch.zeros(2, 5), 2, torch.tensor([7]))\n"
        "except RuntimeError as error:\n"
        "    print(str(error).splitlines()[0])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert "banned id 7 is outside [0, 5)" in result.stdout


def test_a_missing_extension_warns_once_at_import_and_the_package_works():
    script = (
        "import sys, torch; sys.modules['fastnmt._C'] = None\n"  # as if the build had failed
        "import fastnmt\n"
        "print(fastnmt.ops.add_layer_norm(torch.randn(2, 8))[0].shape)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FASTNMT_SKIP_EXTENSION"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "torch.Size([2, 8])" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warnings) == 1 and "pip install --no-build-isolation -e ." in warnings[0]
