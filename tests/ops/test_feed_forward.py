"""fastnmt.ops.feed_forward: the reference backend against an independent float64 oracle, and
both Triton paths (fused-epilogue GEMMs; library GEMMs + elementwise kernel), forced and run on
the Triton device (compiled on a GPU, the interpreter on a CPU, where the GPU's block sizes are
exercised too), against the reference with FlashAttention's error rule."""

import contextlib
import importlib
import math

import pytest
import torch

import fastnmt
from fastnmt.ops import feed_forward
from fastnmt.ops.triton import common as triton_common
from tests.helpers import (
    TRITON_CPU_REASON,
    HostOps,
    assert_error_within,
    device_of,
    opcheck,
    require_backend,
)

feed_forward_module = importlib.import_module("fastnmt.ops.feed_forward")
triton_module = importlib.import_module("fastnmt.ops.triton.feed_forward")
# Every activation the op offers (an added one fails the oracle tests until it has an oracle).
ACTIVATION_NAMES = list(feed_forward_module.ACTIVATIONS)
# act(a) in float64, from the definitions rather than torch.nn.functional.
ACTIVATION_ORACLES = {
    "relu": lambda a: a.clamp_min(0),
    "gelu": lambda a: a * 0.5 * (1 + torch.erf(a / math.sqrt(2))),
    "silu": lambda a: a / (1 + torch.exp(-a)),
}


def feed_forward_oracle(x, w1, b1, w2, b2, activation):
    a = x.double() @ w1.double().T + b1.double()
    return ACTIVATION_ORACLES[activation](a) @ w2.double().T + b2.double()


def _inputs(tokens, d_model, d_ff, dtype=torch.float32, requires_grad=False, device="cpu"):
    def make(*shape):
        values = torch.randn(*shape, dtype=dtype, device=device) / math.sqrt(shape[-1])
        return values.requires_grad_(requires_grad)

    return (
        make(tokens, d_model),
        make(d_ff, d_model),
        make(d_ff),
        make(d_model, d_ff),
        make(d_model),
    )


@pytest.mark.parametrize(
    ("tokens", "d_model", "d_ff"), [(1, 16, 64), (37, 40, 100), (129, 64, 256)]
)
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_oracle(tokens, d_model, d_ff, activation, dtype):
    x, w1, b1, w2, b2 = _inputs(tokens, d_model, d_ff, dtype)
    y = feed_forward(x, w1, b1, w2, b2, activation)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(
        y.double(),
        feed_forward_oracle(x, w1, b1, w2, b2, activation),
        atol=tolerance,
        rtol=tolerance,
    )


def test_leading_dimensions_and_no_bias():
    x, w1, _, w2, _ = _inputs(6, 8, 12)
    y = feed_forward(x.view(2, 3, 8), w1, None, w2, None)
    expected = feed_forward_oracle(x, w1, torch.zeros(12), w2, torch.zeros(8), "relu")
    torch.testing.assert_close(y.reshape(6, 8).double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_gradcheck(activation):
    inputs = _inputs(4, 5, 7, torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: feed_forward(*a, activation), inputs)


def test_dropout_keep_fraction():
    x = torch.ones(512, 4)
    w1, w2 = torch.ones(256, 4), torch.eye(256)[:, :256]
    hidden = feed_forward(x, w1, None, w2, None, "relu", dropout_p=0.2)  # z itself (W2 = I)
    kept = hidden != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.01
    torch.testing.assert_close(hidden[kept], torch.full_like(hidden[kept], 4 / 0.8))


BAD_INPUTS = [
    (dict(w1=torch.randn(12, 9)), ValueError, r"w1 must have shape \(out_features, 8\)"),
    (dict(b1=torch.randn(11)), ValueError, "b1 must have shape"),
    (dict(w2=torch.randn(8, 11)), ValueError, r"w2 must have shape \(out_features, 12\)"),
    (dict(w2=torch.randn(8, 12, dtype=torch.float64)), TypeError, "w2 has dtype"),
    (
        dict(activation="tanh"),
        ValueError,
        r"activation must be one of \['gelu', 'relu', 'silu', 'swish'\], got 'tanh'",
    ),
    (dict(dropout_p=1), ValueError, "dropout_p must be in"),
    (dict(x=torch.tensor(2.0)), ValueError, "x must have at least one dimension"),
]


@pytest.mark.parametrize(("override", "error", "message"), BAD_INPUTS)
def test_bad_inputs_name_the_argument(override, error, message):
    x, w1, b1, w2, b2 = _inputs(3, 8, 12)
    arguments = dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    arguments.update(override)
    with pytest.raises(error, match=message):
        feed_forward(**arguments)


@pytest.mark.parametrize("backend", ["reference", "triton", "cpp"])
def test_swish_is_silu(backend):
    """Hugging Face's name reaches each backend as "silu", dropout included: the reference and
    the C++ op reject any other name, and the Triton kernels would take one for GELU."""
    require_backend(backend)
    inputs = _inputs(37, 40, 100, device=device_of(backend))
    results = []
    for activation in ("swish", "silu"):
        torch.manual_seed(2)
        with fastnmt.backend(backend):
            results.append(feed_forward(*inputs, activation, dropout_p=0.1))
    assert torch.equal(*results)


# ---------------------------------------------------------------------------------------------
# Triton paths (compiled on a GPU, the interpreter on a CPU), forced onto the triton backend.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def triton_backend(monkeypatch):
    """Forces the Triton kernels (output buffers start as NaN under the interpreter), on the
    default path unless a test asks for the other."""
    with fastnmt.backend("triton"):
        yield


def _run(run, inputs, dy):
    """y and the gradients of x, w1, b1, w2, b2 for the loss <y, dy>."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    y = run(*leaves)
    (y.double() * dy).sum().backward()
    return y, [t.grad for t in leaves]


ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# The interpreter's GEMM tile is 128 x 128 x 64: M = 129, K = 72, F = 200 need two tiles each, and
# no dimension is a multiple of its block.
SHAPES = [(1, 16, 64), (37, 40, 100), (129, 72, 200)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# An L9 orthogonal array over (shape, dtype, path, activation): every pair of values meets in 9
# cases instead of the 54 of the full product (the two-valued path folds its third level).
L9 = [(0, 0, 0, 0), (0, 1, 1, 1), (0, 2, 2, 2), (1, 0, 1, 2), (1, 1, 2, 0), (1, 2, 0, 1),
      (2, 0, 2, 1), (2, 1, 0, 2), (2, 2, 1, 0)]  # fmt: skip
TRITON_CASES = [
    (SHAPES[shape], path != 1, ACTIVATION_NAMES[activation], DTYPES[dtype])
    for shape, dtype, path, activation in L9
]


@pytest.mark.parametrize(("shape", "fused_gemm", "activation", "dtype"), TRITON_CASES)
def test_triton_matches_reference_error_rule(
    triton_backend, triton_device, shape, fused_gemm, activation, dtype
):
    inputs = _inputs(*shape, dtype, device=triton_device)
    dy = torch.randn(shape[0], shape[1], dtype=torch.float64, device=triton_device)
    reference = feed_forward_module.feed_forward_reference
    oracle = _run(lambda *a: reference(*a, activation, 0.0), [t.double() for t in inputs], dy)
    same_dtype = _run(lambda *a: reference(*a, activation, 0.0), inputs, dy)
    got = _run(
        lambda *a: feed_forward_module.feed_forward_triton(
            *a, activation, 0.0, fused_gemm=fused_gemm
        ),
        inputs,
        dy,
    )
    assert got[0].dtype == dtype
    assert_error_within(got[0], same_dtype[0], oracle[0], 2, ATOL[dtype])
    for candidate, torch_result, expected in zip(got[1], same_dtype[1], oracle[1], strict=True):
        assert candidate.dtype == dtype
        assert_error_within(candidate, torch_result, expected, 3, ATOL[dtype])


@pytest.mark.parametrize("fused_gemm", [True, False])
def test_triton_dropout_keep_fraction_and_seed(triton_backend, triton_device, fused_gemm):
    x = torch.ones(512, 4, device=triton_device)
    w1, w2 = torch.ones(256, 4, device=triton_device), torch.eye(256, device=triton_device)
    run = lambda: feed_forward_module.feed_forward_triton(  # noqa: E731
        x, w1, None, w2, None, "relu", 0.2, fused_gemm=fused_gemm
    )
    torch.manual_seed(1)
    hidden = run()  # z itself (W2 = I)
    kept = hidden != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.01
    torch.testing.assert_close(hidden[kept], torch.full_like(hidden[kept], 4 / 0.8))
    torch.manual_seed(1)
    assert torch.equal(run(), hidden)
    assert not torch.equal(run(), hidden)


@pytest.mark.parametrize(
    ("fused_gemm", "activation", "gpu_tiles"),
    [
        (True, "gelu", False),
        (False, "relu", False),
        (False, "gelu", True),
        (True, "silu", False),
        (False, "silu", True),
    ],
)
def test_triton_dropout_backward_uses_the_forward_mask(
    triton_backend, triton_device, fused_gemm, activation, gpu_tiles
):
    """The mask read off the kernel's z (z != 0; where ReLU gives 0 the mask does not matter),
    fed to a float64 oracle; both paths draw the same mask from the same seed. With the GPU's
    block sizes, the elementwise kernels run 26 blocks of 1024 elements, the last one ragged."""
    inputs = [t.requires_grad_() for t in _inputs(129, 72, 200, device=triton_device)]
    seed = triton_common.dropout_seed(inputs[0].device)
    forward = torch.ops.fastnmt.feed_forward_triton
    with triton_common.gpu_tiles() if gpu_tiles else contextlib.nullcontext():
        if gpu_tiles:
            assert triton_module._elementwise_block() == 1024
        y, z, _ = forward(*inputs, activation, 0.2, seed, fused_gemm)
        other_path = forward(*inputs, activation, 0.2, seed, not fused_gemm)[1]
        dy = torch.randn_like(y)
        y.backward(dy)
    torch.testing.assert_close(other_path, z, atol=1e-5, rtol=1e-5)
    keep = z.detach() != 0
    if activation != "relu":  # ReLU's zeros hide the mask
        assert abs(keep.double().mean().item() - 0.8) < 0.01
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    x, w1, b1, w2, b2 = leaves
    hidden = feed_forward_module.ACTIVATIONS[activation](x @ w1.T + b1) * keep / 0.8
    expected = hidden @ w2.T + b2
    expected.backward(dy.double())
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    for tensor, leaf in zip(inputs, leaves, strict=True):
        torch.testing.assert_close(tensor.grad.double(), leaf.grad, atol=1e-5, rtol=1e-5)


# The GEMM kernel at every GPU configuration (under the interpreter: inside gpu_tiles()), each
# with one activation and dtype in turn; the shapes come from the configurations, so an added one
# is covered too.
GPU_GEMM_CASES = [
    pytest.param(config, ACTIVATION_NAMES[i % 3], DTYPES[i % 3], id=config.label)
    for i, config in enumerate(triton_module._GPU_CONFIGS)
]


def _grouped_shape(config):
    """(m, n, k) for which GROUP_M grouping matters: two full groups of row blocks and a ragged
    third of one, two column blocks, and the last row, column and depth blocks partly outside."""
    m = (2 * config.group_m + 1) * config.block_m - 27
    return m, config.block_n + 37, config.block_k + 9


def _activation_derivative(saved, activation):
    """act'(a) from what the forward saves: z for ReLU (nonzero where a > 0 and kept), a for
    GELU and SiLU; in saved's dtype."""
    if activation == "relu":
        return (saved != 0).to(saved.dtype)
    if activation == "silu":
        s = torch.sigmoid(saved)
        return s * (1 + saved * (1 - s))
    cdf = 0.5 * (1 + torch.erf(saved / math.sqrt(2)))
    return cdf + saved * torch.exp(-0.5 * saved * saved) / math.sqrt(2 * math.pi)


@pytest.mark.parametrize(("config", "activation", "dtype"), GPU_GEMM_CASES)
def test_triton_gemm_epilogues_at_gpu_tiles(triton_device, config, activation, dtype):
    """The forward epilogue (bias, activation, dropout, saving a), the backward's
    (* keep / (1-p) * act'), and a bias-only product of a transposed operand (dW = dy^T z), each
    against a float64 oracle by FlashAttention's rule. The oracle takes the mask off the kernel's
    z (z != 0; where ReLU gives 0 the mask does not matter); the backward regenerates it."""
    m, n, k = _grouped_shape(config)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, dtype=dtype, device=triton_device) * scale

    # a and dz of unit scale: a spans the activations' curved region and da stays well above
    # ATOL, so a wrong act' shows even in bf16.
    x, w, bias = randn(m, k), randn(n, k, scale=k**-0.5), randn(n)
    left_t, right = randn(k, m), randn(k, n, scale=k**-0.5)
    left = left_t.t()  # strides (1, m), as dy^T in dW2 = dy^T z
    seed = triton_common.dropout_seed(triton_device)
    launch = triton_module._matmul_launch
    act = feed_forward_module.ACTIVATIONS[activation]

    with triton_common.gpu_tiles():
        assert triton_module.gemm_config(m, n) == config
        a = triton_module._output((m, n), dtype, triton_device)
        dropout = dict(seed=seed, activation=activation, dropout_p=0.2)
        z = launch(
            x, w.t(), bias, epilogue="activation", saved=a, save_preactivation=True, **dropout
        )
        a = a.to(dtype)
        saved = z if activation == "relu" else a
        da = launch(left, right, epilogue="activation_grad", saved=saved, **dropout)
        product = launch(left, right, bias)
    keep = z != 0
    x64, w64, bias64, left64, right64 = (t.double() for t in (x, w, bias, left, right))
    positive = x64 @ w64.T + bias64 > 0  # where even ReLU's z shows the mask
    assert abs(keep[positive].double().mean().item() - 0.8) < 0.02

    def dropped(values):  # values * keep / (1-p) in values' dtype
        return values * keep.to(values.dtype) / 0.8

    def check(candidate, same_dtype, oracle, factor=2):
        assert candidate.dtype == dtype
        assert_error_within(candidate, same_dtype, oracle, factor, ATOL[dtype])

    check(a, x @ w.T + bias, x64 @ w64.T + bias64)
    check(z, dropped(act(x @ w.T + bias)), dropped(act(x64 @ w64.T + bias64)))
    gradient_oracle = dropped(left64 @ right64) * _activation_derivative(saved.double(), activation)
    gradient_torch = dropped(left @ right) * _activation_derivative(saved, activation)
    check(da, gradient_torch, gradient_oracle, factor=3)
    check(product, left @ right + bias, left64 @ right64 + bias64)


def _opcheck_cases(seed):
    """(activation, dropout_p, seed) of the opcheck tests: each activation, with dropout where a
    is saved."""
    return [("relu", 0.0, None), ("gelu", 0.2, seed), ("silu", 0.2, seed)]


@pytest.mark.parametrize("fused_gemm", [True, False])
def test_triton_opcheck(triton_backend, triton_device, fused_gemm):
    inputs = [t.requires_grad_() for t in _inputs(5, 8, 12, device=triton_device)]
    x, w1, _, w2, _ = (t.detach() for t in inputs)
    seed = triton_common.dropout_seed(x.device)
    for activation, dropout_p, seed_or_none in _opcheck_cases(seed):
        args = (*inputs, activation, dropout_p, seed_or_none, fused_gemm)
        opcheck(torch.ops.fastnmt.feed_forward_triton.default, args)
        y, z, a = (t.detach() for t in torch.ops.fastnmt.feed_forward_triton(*args))
        backward_args = (
            torch.randn_like(y),
            x,
            w1,
            w2,
            z,
            a,
            seed_or_none,
            activation,
            dropout_p,
            fused_gemm,
        )
        opcheck(torch.ops.fastnmt.feed_forward_triton_backward.default, backward_args)


@pytest.mark.parametrize("fused_gemm", [True, False])
@pytest.mark.parametrize("activation", ["gelu", "silu"])  # the fakes must size the saved a
def test_triton_traced_by_torch_compile(
    triton_backend, triton_device, monkeypatch, fused_gemm, activation
):
    """Traced with fullgraph=True, dropout included: same seed, same loss and gradients."""
    monkeypatch.setenv(fastnmt.ops.settings.FFN_FUSED_GEMM, "1" if fused_gemm else "0")
    fastnmt.ops.settings.reload()
    inputs = [t.requires_grad_() for t in _inputs(5, 8, 12, device=triton_device)]
    step = lambda *a: (feed_forward(*a, activation, dropout_p=0.2) ** 2).sum()  # noqa: E731
    torch._dynamo.reset()  # the backend is chosen at trace time: no graph from another backend
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for run in (step, compiled):
        torch.manual_seed(5)
        loss = run(*inputs)
        results.append((loss, *torch.autograd.grad(loss, inputs)))
    for expected, got in zip(*results, strict=True):
        torch.testing.assert_close(got, expected)


def test_triton_reasons(triton_device):
    x, w1, b1, w2, b2 = _inputs(3, 8, 12)
    cpu = fastnmt.ops.dispatch.explain("feed_forward", x, w1, b1, w2, b2)
    assert cpu["chosen"] in ("cpp", "reference") and TRITON_CPU_REASON in cpu["triton"][0]
    with (
        fastnmt.backend("triton"),
        pytest.raises(fastnmt.BackendUnavailableError, match=r"x has dtype torch\.float64"),
    ):
        feed_forward(*(t.to(triton_device, torch.float64) for t in (x, w1, b1, w2, b2)))


def test_triton_path_is_the_library_gemm_unless_asked(triton_backend, triton_device, monkeypatch):
    """No GPU benchmark has shown the fused GEMM faster: it runs only when asked for, by
    ``fused_gemm=True`` or FASTNMT_FFN_FUSED_GEMM=1, and ``fused_gemm=False`` overrides that."""
    launches = []
    launch = triton_module._matmul_launch
    monkeypatch.setattr(
        triton_module,
        "_matmul_launch",
        lambda *args, **kwargs: launches.append(args) or launch(*args, **kwargs),
    )
    inputs = _inputs(5, 8, 12, device=triton_device)

    def gemm_kernel_launches(**path):
        launches.clear()
        feed_forward_module.feed_forward_triton(*inputs, "relu", 0.0, **path)
        return len(launches)

    assert gemm_kernel_launches() == 0
    assert gemm_kernel_launches(fused_gemm=True) == 2
    monkeypatch.setenv(fastnmt.ops.settings.FFN_FUSED_GEMM, "1")
    fastnmt.ops.settings.reload()
    assert gemm_kernel_launches() == 2
    assert gemm_kernel_launches(fused_gemm=False) == 0


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_inference_is_the_library_products_around_an_aten_activation(
    triton_backend, triton_device, activation, dtype
):
    """Without autograd and dropout (decoding) there is nothing to fuse: no Triton launch, the
    activation in place where aten has that form, the error rule against float64 met."""
    inputs = _inputs(37, 40, 100, dtype, device=triton_device)
    with torch.no_grad():
        with HostOps(triton_module, ["_ACTIVATION_FORWARD", "_MATMUL"]) as host:
            y = feed_forward(*inputs, activation)
        same_dtype = feed_forward_module.feed_forward_reference(*inputs, activation, 0.0)
        with HostOps(triton_module, ["_ACTIVATION_FORWARD"]) as dropped:
            feed_forward(*inputs, activation, dropout_p=0.5)  # the seeded mask: the kernel's
    assert host.launches == [] and dropped.launches == ["_ACTIVATION_FORWARD"]
    activation_op = {"relu": "relu_", "silu": "silu_", "gelu": "gelu"}[activation]
    assert activation_op in host.aten and "empty" not in host.aten, host.aten
    oracle = feed_forward_oracle(*inputs, activation)
    assert_error_within(y, same_dtype, oracle, 2, ATOL[dtype])


def test_triton_under_autocast_takes_the_autocast_dtype(triton_backend, triton_device):
    """fp32 parameters and a bf16 activation, as a bf16-autocast model passes them."""
    x, w1, b1, w2, b2 = (t.requires_grad_() for t in _inputs(37, 40, 100, device=triton_device))
    with torch.autocast(triton_device.type, dtype=torch.bfloat16):
        y = feed_forward(x.bfloat16(), w1, b1, w2, b2, "gelu")
        expected = feed_forward_module.feed_forward_reference(x, w1, b1, w2, b2, "gelu", 0.0)
    assert y.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected, atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    assert w1.grad.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# C++ kernels: library GEMMs around one fused activation + dropout pass each way.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def cpp_backend():
    require_backend("cpp")
    with fastnmt.backend("cpp"):
        yield


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpp_matches_reference_error_rule(cpp_backend, shape, activation, dtype):
    inputs = _inputs(*shape, dtype)
    dy = torch.randn(shape[0], shape[1], dtype=torch.float64)
    reference = lambda *a: feed_forward_module.feed_forward_reference(*a, activation, 0.0)  # noqa: E731
    oracle = _run(reference, [t.double() for t in inputs], dy)
    same_dtype = _run(reference, inputs, dy)
    got = _run(lambda *a: feed_forward(*a, activation), inputs, dy)
    assert got[0].dtype == dtype
    assert_error_within(got[0], same_dtype[0], oracle[0], 2, ATOL[dtype])
    for candidate, torch_result, expected in zip(got[1], same_dtype[1], oracle[1], strict=True):
        assert candidate.dtype == dtype
        assert_error_within(candidate, torch_result, expected, 3, ATOL[dtype])


def test_cpp_dropout_keep_fraction_and_seed(cpp_backend):
    x = torch.ones(512, 4)
    w1, w2 = torch.ones(256, 4), torch.eye(256)
    torch.manual_seed(1)
    hidden = feed_forward(x, w1, None, w2, None, "relu", 0.2)  # z itself (W2 = I)
    kept = hidden != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.01
    torch.testing.assert_close(hidden[kept], torch.full_like(hidden[kept], 4 / 0.8))
    torch.manual_seed(1)
    assert torch.equal(feed_forward(x, w1, None, w2, None, "relu", 0.2), hidden)
    assert not torch.equal(feed_forward(x, w1, None, w2, None, "relu", 0.2), hidden)


@pytest.mark.parametrize("activation", ["gelu", "silu"])  # z != 0 shows the mask everywhere
def test_cpp_dropout_backward_uses_the_forward_mask(cpp_backend, activation):
    inputs = [t.requires_grad_() for t in _inputs(129, 72, 200)]
    seed = triton_common.dropout_seed(inputs[0].device)
    y, z, _ = torch.ops.fastnmt.feed_forward_cpp(*inputs, activation, 0.2, seed)
    keep = z.detach() != 0
    assert abs(keep.double().mean().item() - 0.8) < 0.01
    dy = torch.randn_like(y)
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    x, w1, b1, w2, b2 = leaves
    hidden = feed_forward_module.ACTIVATIONS[activation](x @ w1.T + b1) * keep / 0.8
    expected = hidden @ w2.T + b2
    expected.backward(dy.double())
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    for tensor, leaf in zip(inputs, leaves, strict=True):
        torch.testing.assert_close(tensor.grad.double(), leaf.grad, atol=1e-5, rtol=1e-5)


def test_cpp_opcheck(cpp_backend):
    inputs = [t.requires_grad_() for t in _inputs(5, 8, 12)]
    x, w1, _, w2, _ = (t.detach() for t in inputs)
    seed = triton_common.dropout_seed(x.device)
    for activation, dropout_p, seed_or_none in _opcheck_cases(seed):
        args = (*inputs, activation, dropout_p, seed_or_none)
        opcheck(torch.ops.fastnmt.feed_forward_cpp.default, args)
        y, z, a = (t.detach() for t in torch.ops.fastnmt.feed_forward_cpp(*args))
        backward_args = (torch.randn_like(y), x, w1, w2, z, a, seed_or_none, activation, dropout_p)
        opcheck(torch.ops.fastnmt.feed_forward_cpp_backward.default, backward_args)


def test_cpp_under_autocast_and_independent_of_thread_count(cpp_backend):
    x, w1, b1, w2, b2 = (t.requires_grad_() for t in _inputs(300, 64, 256))
    results = []
    threads = torch.get_num_threads()
    for count in (1, 2):
        torch.set_num_threads(count)
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = feed_forward(x.bfloat16(), w1, b1, w2, b2, "relu", 0.1)
        assert y.dtype == torch.bfloat16
        results.append((y, *torch.autograd.grad(y.float().sum(), (x, w1, b1, w2, b2))))
    torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_backward_fills_no_gradient_for_the_saved_outputs(fused):
    """z and a are outputs only to be saved for the backward: autograd must not allocate and
    zero two (N, d_ff) gradients for them (a launch and N x d_ff x 2 writes each, per layer)."""
    device = device_of(fused)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    w1, w2 = (torch.randn(s, device=device, requires_grad=True) for s in ((32, 16), (16, 32)))
    b1, b2 = (torch.randn(s, device=device, requires_grad=True) for s in (32, 16))
    y = feed_forward(x, w1, b1, w2, b2, "relu", 0.0)
    seed = torch.ones_like(y)
    with HostOps() as host:
        y.backward(seed)
    assert not {"zeros", "zeros_like", "zero_", "fill_"} & set(host.aten), host.aten
    assert x.grad is not None and w1.grad is not None
