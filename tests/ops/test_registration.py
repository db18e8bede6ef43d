"""How the ops join PyTorch: under ``torch.compile`` the Triton ops are ``triton_op``s whose
kernels appear in the graph, forward and backward, for Inductor to compile and fuse around."""

import json
import os
import subprocess
import sys
from pathlib import Path

from torch._library.custom_ops import OPDEFS
from torch._subclasses.functional_tensor import FunctionalTensorMode

from fastnmt.ops.triton import common as triton_common

ROOT = Path(__file__).resolve().parents[2]

# Traced in a process of its own without the interpreter (whose kernels cannot be traced), on
# CPU tensors with the Triton backend's device reason lifted as on a GPU: fullgraph, AOT
# autograd's joint graph (forward and backward), recorded by its partitioner, then stopped
# before anything would be compiled or run.
TRACE = """
import json, sys
from collections import Counter
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from fastnmt.ops import dispatch
from fastnmt.ops import add_layer_norm, attention, feed_forward, linear_cross_entropy

dispatch._DEVICE_REASONS["triton"] = lambda device, forced: []
joint = []

class Traced(Exception):
    pass

def partition(graph, inputs, **_):
    joint.append(graph)
    raise Traced

def leaf(*shape):
    return torch.randn(*shape, requires_grad=True)

lengths, target = torch.tensor([7, 3]), torch.randint(50, (10,))

def model(q, k, v, x, w, w1, w2, out_w):
    scores = attention(q, k, v, key_lengths=lengths).sum()
    y, _ = add_layer_norm(x, x, w, None)
    z = feed_forward(y, w1, None, w2, None, "gelu", dropout_p=0.1)  # without, aten's ops
    return scores + linear_cross_entropy(z, out_w, None, target).loss

inputs = (leaf(2, 2, 5, 16), leaf(2, 2, 7, 16), leaf(2, 2, 7, 16), leaf(10, 16), leaf(16),
          leaf(32, 16), leaf(16, 32), leaf(50, 16))
backend = aot_autograd(fw_compiler=lambda graph, _: graph, partition_fn=partition)
try:
    torch.compile(model, backend=backend, fullgraph=True)(*inputs)
except Exception as error:
    if not joint:
        raise
(graph,) = joint
calls = [n for n in graph.graph.nodes if n.op == "call_function"]
kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
           for n in calls if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
opaque = [str(n.target) for n in calls if str(n.target).startswith("fastnmt.")]
print(json.dumps({"kernels": kernels, "opaque": opaque}))
"""


def test_torch_compile_sees_the_triton_kernels_of_every_op():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", TRACE], capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    traced = json.loads(result.stdout.splitlines()[-1])
    assert traced["opaque"] == []
    assert traced["kernels"] == [
        "_attention_forward_kernel",
        "_add_layer_norm_forward_kernel",
        "_activation_forward_kernel",
        "_cross_entropy_rows_kernel",
        "_sum_statistics_kernel",
        "_scale_gradients_kernel",
        "_activation_backward_kernel",
        "_add_layer_norm_backward_kernel",
        "_sum_partials_kernel",
        "_attention_backward_dq_kernel",
        "_attention_backward_dkdv_kernel",
    ]


def test_under_the_interpreter_the_triton_ops_are_custom_ops():
    """The interpreter's kernels cannot be traced: there the ops are custom_ops, opaque, where a
    triton_op decomposes into its body for the functional graph torch.compile traces."""
    assert (os.environ.get("TRITON_INTERPRET") == "1") == triton_common.INTERPRETER
    for name in ("attention_forward", "add_layer_norm_triton", "feed_forward_triton"):
        traced_into = FunctionalTensorMode in OPDEFS[f"fastnmt::{name}"]._torch_dispatch_fns
        assert traced_into == (not triton_common.INTERPRETER), name
