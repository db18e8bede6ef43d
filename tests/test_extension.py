"""The compiled extension: built by the install, loaded in one place, explained in one line."""

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
