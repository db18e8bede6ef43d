"""fastnmt.ops.add_layer_norm: the reference backend against an independent float64 oracle, and
the fused kernels, Triton (forced; compiled on a GPU, the interpreter on a CPU, where the GPU's
tiles are exercised too) and C++, against the reference with FlashAttention's error rule."""

import importlib
import math

import pytest
import torch

import fastnmt
from fastnmt.ops import add_layer_norm
from fastnmt.ops.add_layer_norm import (
    UnscaledRows,
    add_layer_norm_reference,
    add_unscaled_layer_norm,
)
from fastnmt.ops.triton import common as triton_common
from tests.helpers import (
    TRITON_CPU_REASON,
    TRITON_DEVICE,
    HostOps,
    assert_error_within,
    device_of,
    host_python_calls,
    opcheck,
    require_backend,
)

triton_module = importlib.import_module("fastnmt.ops.triton.add_layer_norm")


def layer_norm_oracle(x, residual, weight, bias, eps):
    h = x.double() + (0 if residual is None else residual.double())
    centered = h - h.mean(-1, keepdim=True)
    variance = (centered**2).mean(-1, keepdim=True)
    return centered / torch.sqrt(variance + eps) * weight.double() + bias.double(), h


def _inputs(rows, width, dtype=torch.float32, requires_grad=False, device="cpu"):
    def make(*shape):
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad)

    return make(rows, width), make(rows, width), make(width), make(width)


@pytest.mark.parametrize("rows", [1, 3, 129])
@pytest.mark.parametrize("width", [64, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_float64_oracle(rows, width, dtype):
    x, residual, weight, bias = _inputs(rows, width, dtype)
    y, h = add_layer_norm(x, residual, weight, bias, eps=1e-5)
    expected_y, expected_h = layer_norm_oracle(x, residual, weight, bias, 1e-5)
    tolerance = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 8e-2}[dtype]
    assert y.dtype == dtype and h.dtype == dtype
    torch.testing.assert_close(y.double(), expected_y, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(h.double(), expected_h, atol=tolerance, rtol=tolerance)


def test_without_residual_and_residual_in_fp32():
    x, residual, weight, bias = _inputs(5, 32, torch.bfloat16)
    y, h = add_layer_norm(x, None, weight, bias)
    torch.testing.assert_close(h, x)
    y, h = add_layer_norm(x, residual.float(), weight, bias, residual_in_fp32=True)
    assert h.dtype == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(h.double(), x.double() + residual.float().double())


def _affine(layout, weight, bias):
    """weight and bias (x's dtype) as the forward may get them."""
    return {
        "as x": (weight, bias),
        "float32": (weight.float(), bias.float()),
        "mixed": (weight, bias.float()),
        "strided": (torch.stack([weight, weight], dim=1)[:, 0], bias),
        "no bias": (weight, None),
    }[layout]


@pytest.mark.parametrize("layout", ["as x", "float32", "mixed", "strided", "no bias"])
def test_cpp_affine_parameters_in_any_dtype_give_the_same_result(layout):
    """In x's dtype and contiguous (a bf16 model translating), the C++ forward reads them as
    they are, with no copy per call; otherwise it converts them to fp32 first: the same values."""
    require_backend("cpp")
    x, residual, weight, bias = _inputs(7, 100, torch.bfloat16)
    weight_in, bias_in = _affine(layout, weight, bias)
    with fastnmt.backend("cpp"), torch.profiler.profile() as profile:
        y, h = add_layer_norm(x, residual, weight_in, bias_in)
    with fastnmt.backend("cpp"):
        converted = add_layer_norm(
            x, residual, weight.float(), None if bias_in is None else bias.float()
        )
    torch.testing.assert_close((y, h), converted, rtol=0, atol=0)
    copies = sum(event.name in ("aten::_to_copy", "aten::clone") for event in profile.events())
    assert copies == {"mixed": 1, "strided": 2}.get(layout, 0), copies  # the weight: fp32, dense


def test_gradcheck_through_both_outputs():
    x, residual, weight, bias = _inputs(3, 7, torch.float64, requires_grad=True)

    def both_outputs(x, residual, weight, bias):
        y, h = add_layer_norm(x, residual, weight, bias)
        return y, h * 0.5  # pre-norm stacks send gradient into h as well

    assert torch.autograd.gradcheck(both_outputs, (x, residual, weight, bias))


def test_prenorm_and_postnorm_stacks():
    """Pre-norm chains h into the next residual; post-norm feeds y back as the residual."""
    x, residual, weight, bias = _inputs(4, 16)
    y, h = add_layer_norm(x, residual, weight, bias)
    y2, _ = add_layer_norm(x * 2, h, weight, bias)
    expected, _ = layer_norm_oracle(x * 2, residual + x, weight, bias, 1e-5)
    torch.testing.assert_close(y2.double(), expected, atol=1e-5, rtol=1e-5)
    post, _ = add_layer_norm(x * 2, y, weight, bias)
    expected_post, _ = layer_norm_oracle(x * 2, y, weight, bias, 1e-5)
    torch.testing.assert_close(post.double(), expected_post, atol=1e-5, rtol=1e-5)


def test_dropout_keep_fraction_and_scaling():
    x = torch.ones(256, 1024)
    _, h = add_layer_norm(x, torch.zeros_like(x), dropout_p=0.2)
    kept = h != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.01
    torch.testing.assert_close(h[kept], torch.full_like(h[kept], 1 / 0.8))


BAD_INPUTS = [
    (dict(x=torch.tensor(1.0)), ValueError, "x must have at least one dimension"),
    (dict(residual=torch.randn(2, 9)), ValueError, "residual must have shape"),
    (dict(residual=torch.randn(2, 8, dtype=torch.float64)), TypeError, "residual must have dtype"),
    (dict(weight=torch.randn(7)), ValueError, "weight must have shape"),
    (dict(bias=torch.randn(8, 1)), ValueError, "bias must have shape"),
    (dict(eps=0), ValueError, "eps must be a positive number"),
    (dict(dropout_p=1.5), ValueError, "dropout_p must be in"),
    (dict(x=torch.randint(0, 2, (2, 8))), TypeError, "x must have a floating dtype"),
]


@pytest.mark.parametrize(("override", "error", "message"), BAD_INPUTS)
def test_bad_inputs_name_the_argument(override, error, message):
    arguments = dict(x=torch.randn(2, 8), residual=torch.randn(2, 8), weight=torch.randn(8))
    arguments.update(override)
    with pytest.raises(error, match=message):
        add_layer_norm(**arguments)


# ---------------------------------------------------------------------------------------------
# Fused kernels, Triton (on the Triton device) and C++ (on the CPU), each forced by ``fused``.
# ---------------------------------------------------------------------------------------------


def _run(backend, inputs, upstream, dropout_p=0.0, residual_in_fp32=False):
    """Outputs and input gradients of add_layer_norm on ``backend`` for loss <y, dy> + <h, dh>
    (dh None: the post-norm use, h unused)."""
    leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
    with fastnmt.backend(backend):
        y, h = add_layer_norm(*leaves, dropout_p=dropout_p, residual_in_fp32=residual_in_fp32)
    dy, dh = upstream
    loss = (y.double() * dy).sum() + (0 if dh is None else (h.double() * dh).sum())
    loss.backward()
    return [y, h], [t.grad for t in leaves if t is not None]


def _assert_within_error_rule(backend, inputs, prenorm, atol, residual_in_fp32=False):
    rows, width = inputs[0].shape
    upstream = (
        torch.randn(rows, width, dtype=torch.float64, device=inputs[0].device),
        torch.randn(rows, width, dtype=torch.float64, device=inputs[0].device) if prenorm else None,
    )
    double = [None if t is None else t.double() for t in inputs]
    expected = _run("reference", double, upstream)
    same_dtype = _run("reference", inputs, upstream, residual_in_fp32=residual_in_fp32)
    got = _run(backend, inputs, upstream, residual_in_fp32=residual_in_fp32)
    for results, factor in ((0, 2), (1, 3)):  # outputs within 2x, gradients within 3x
        for candidate, torch_result, oracle in zip(
            got[results], same_dtype[results], expected[results], strict=True
        ):
            assert candidate.dtype == torch_result.dtype
            assert_error_within(candidate, torch_result, oracle, factor, atol)


ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Every width with every row count, dtypes and pre/post-norm cycling so that every pair of
# values meets (pairwise, not the full product).
FUSED_CASES = [
    (width, rows, DTYPES[(i + j) % 3], (i + j) % 2 == 0)
    for i, width in enumerate([7, 48, 64, 100, 256, 512, 1000])
    for j, rows in enumerate([1, 3, 129])
]


@pytest.mark.parametrize(("width", "rows", "dtype", "prenorm"), FUSED_CASES)
def test_fused_matches_reference_error_rule(fused, width, rows, dtype, prenorm):
    inputs = _inputs(rows, width, dtype, device=device_of(fused))
    _assert_within_error_rule(fused, inputs, prenorm, ATOL[dtype])


@pytest.mark.parametrize("offset", [1e3, -3e4])
def test_fused_rows_far_from_zero_keep_their_variance(fused, offset):
    """Rows centred far from zero with a spread small against it (the C++ forward sums each
    row's h - c and its squares in one pass, c near the row's first value) lose nothing to
    cancellation."""
    x, residual, weight, bias = _inputs(33, 100, device=device_of(fused))
    inputs = (x * 0.01 + offset, residual * 0.01, weight, bias)
    _assert_within_error_rule(fused, inputs, True, ATOL[torch.float32])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 7), (3, 5, 48), (2, 37, 100)], ids=str)
def test_cpp_unscaled_rows_are_finished_in_the_norm(shape, dtype, bias):
    """An int8 GEMM's unfinished output (``UnscaledRows``: values * scales + bias) added and
    normalised in one pass, within the error rule of finishing it in torch, then adding and
    normalising, in the same dtype."""
    require_backend("cpp")
    values = torch.randn(*shape).to(dtype)
    scales = torch.rand(values[..., 0].numel()) * 3 + 0.1
    shift = torch.randn(shape[-1]) if bias else None
    residual, weight, norm_bias = (
        torch.randn(*s).to(dtype) for s in (shape, shape[-1:], shape[-1:])
    )
    y, h = add_unscaled_layer_norm(UnscaledRows(values, scales, shift), residual, weight, norm_bias)
    assert y.shape == h.shape == shape and y.dtype == h.dtype == dtype

    def finished(values, to):
        out = values.to(to) * scales.to(to).view(*shape[:-1], 1)
        return out if shift is None else out + shift.to(to)

    inputs = (residual, weight, norm_bias)
    expected = add_layer_norm_reference(
        finished(values, torch.float64), *(t.double() for t in inputs), 1e-5, 0.0, False
    )
    torch_result = add_layer_norm_reference(finished(values, dtype), *inputs, 1e-5, 0.0, False)
    for got, same_dtype, oracle in zip((y, h), torch_result, expected, strict=True):
        assert_error_within(got, same_dtype, oracle, 2, ATOL[dtype])


def test_cpp_unscaled_rows_refusals_are_one_line():
    require_backend("cpp")
    values, residual = torch.randn(4, 8), torch.randn(4, 8)
    for rows, res, reason in [
        (
            UnscaledRows(values, torch.ones(3), None),
            residual,
            "x_scales must be contiguous float32 \\(4,\\)",
        ),
        (
            UnscaledRows(values, torch.ones(4), torch.ones(5)),
            residual,
            "x_bias must be contiguous float32 \\(8,\\)",
        ),
        (
            UnscaledRows(values, torch.ones(4), None),
            torch.randn(4, 9),
            "residual must have x's 32 elements",
        ),
    ]:
        with pytest.raises(RuntimeError, match=reason) as error:
            add_unscaled_layer_norm(rows, res, None, None)
        assert len(str(error.value).strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("drop", "dtype", "residual_in_fp32"),
    [
        ("residual", torch.float16, False),
        ("weight", torch.float32, False),
        ("bias", torch.bfloat16, False),
        ("nothing", torch.float16, True),
        ("nothing", torch.bfloat16, True),
    ],
)
def test_fused_optional_inputs_and_fp32_residual(fused, drop, dtype, residual_in_fp32):
    x, residual, weight, bias = _inputs(3, 100, dtype, device=device_of(fused))
    inputs = dict(x=x, residual=residual, weight=weight, bias=bias)
    if drop != "nothing":
        inputs[drop] = None
    if residual_in_fp32:
        inputs["residual"] = residual.float()
    _assert_within_error_rule(fused, list(inputs.values()), True, ATOL[dtype], residual_in_fp32)


def test_fused_wide_rows(fused):
    inputs = _inputs(3, 4000, device=device_of(fused))
    _assert_within_error_rule(fused, inputs, prenorm=True, atol=1e-5)


def test_fused_dropout_keep_fraction_scaling_and_seed(fused):
    x = torch.ones(256, 1024, device=device_of(fused))
    torch.manual_seed(1)
    _, h = add_layer_norm(x, torch.zeros_like(x), dropout_p=0.2)
    kept = h != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.01
    torch.testing.assert_close(h[kept], torch.full_like(h[kept], 1 / 0.8))
    torch.manual_seed(1)
    _, again = add_layer_norm(x, torch.zeros_like(x), dropout_p=0.2)
    assert torch.equal(h, again)
    _, other = add_layer_norm(x, torch.zeros_like(x), dropout_p=0.2)
    assert not torch.equal(h, other)


def _assert_dropout_backward_matches_oracle(rows, width, prenorm, device):
    """The kernel's mask, read off its h (x != 0 everywhere), fed to a float64 oracle."""
    x, residual, weight, bias = _inputs(rows, width, requires_grad=True, device=device)
    y, h = add_layer_norm(x, residual, weight, bias, dropout_p=0.2)
    keep = (h - residual).detach() != 0
    # 0.01, or 4 standard deviations of the kept fraction where there are few elements
    assert abs(keep.double().mean().item() - 0.8) < max(0.01, 4 * math.sqrt(0.16 / keep.numel()))
    dy, dh = torch.randn_like(y), torch.randn_like(h) if prenorm else torch.zeros_like(h)
    torch.autograd.backward([y, h], [dy, dh])
    leaves = [t.detach().double().requires_grad_() for t in (x, residual, weight, bias)]
    dropped = leaves[0] * keep / 0.8
    expected_y, expected_h = layer_norm_oracle(dropped, *leaves[1:], 1e-5)
    torch.autograd.backward([expected_y, expected_h], [dy.double(), dh.double()])
    torch.testing.assert_close(h.double(), expected_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y.double(), expected_y, atol=1e-4, rtol=1e-4)
    for tensor, leaf in zip((x, residual, weight, bias), leaves, strict=True):
        torch.testing.assert_close(tensor.grad.double(), leaf.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prenorm", [True, False])
def test_fused_dropout_backward_uses_the_forward_mask(fused, prenorm):
    _assert_dropout_backward_matches_oracle(129, 1000, prenorm, device_of(fused))


def test_fused_weight_gradient_is_deterministic(fused):
    x, residual, weight, bias = _inputs(129, 100, requires_grad=True, device=device_of(fused))
    gradients = []
    for _ in range(2):
        y, _ = add_layer_norm(x, residual, weight, bias)
        gradients.append(torch.autograd.grad(y.sum(), (weight, bias)))
    assert all(torch.equal(a, b) for a, b in zip(*gradients, strict=True))


@pytest.mark.parametrize("affine", [True, False])
def test_fused_opcheck(fused, affine):
    x, residual, weight, bias = _inputs(3, 100, requires_grad=True, device=device_of(fused))
    weight, bias = (weight, bias) if affine else (None, None)
    seed = triton_common.dropout_seed(x.device)
    for dropout_p, seed_or_none in ((0.0, None), (0.2, seed)):
        args = (x, residual, weight, bias, 1e-5, dropout_p, False, seed_or_none)
        opcheck(getattr(torch.ops.fastnmt, f"add_layer_norm_{fused}").default, args)
        forward = getattr(torch.ops.fastnmt, f"add_layer_norm_{fused}")
        y, h, mean, rstd = (t.detach() for t in forward(*args))
        backward_args = (
            torch.randn_like(y),
            torch.randn_like(h),
            h,
            None if weight is None else weight.detach(),
            mean,
            rstd,
            seed_or_none,
            dropout_p,
            True,
            affine,
        )
        backward = getattr(torch.ops.fastnmt, f"add_layer_norm_{fused}_backward")
        opcheck(backward.default, backward_args)


def test_fused_traced_by_torch_compile(fused):
    """Traced with fullgraph=True, dropout included: same seed, same loss and gradients."""
    inputs = _inputs(3, 100, requires_grad=True, device=device_of(fused))

    def pre_norm_step(x, residual, weight, bias):
        y, h = add_layer_norm(x, residual, weight, bias, dropout_p=0.2)
        return (y * 2).sum() + (h * h).sum()

    torch._dynamo.reset()  # the backend is chosen at trace time: no graph from another backend
    compiled = torch.compile(pre_norm_step, fullgraph=True, backend="aot_eager")
    results = []
    for step in (pre_norm_step, compiled):
        torch.manual_seed(5)
        loss = step(*inputs)
        results.append((loss, *torch.autograd.grad(loss, inputs)))
    for expected, got in zip(*results, strict=True):
        torch.testing.assert_close(got, expected)


# The GPU's tiles (4096 elements; under the interpreter inside gpu_tiles()): whole rows of a
# power-of-two block, as many rows as fit. A row never spans two tiles (MAX_WIDTH is one tile),
# so the widths run from many rows per tile to MAX_WIDTH, powers of two or not.
GPU_TILE_CASES = [
    (width, DTYPES[i % 3], i % 2 == 0)
    for i, width in enumerate([40, 100, 1000, 3000, triton_module.MAX_WIDTH])
]


@pytest.mark.parametrize(("width", "dtype", "prenorm"), GPU_TILE_CASES)
def test_triton_at_gpu_tiles(triton_device, width, dtype, prenorm):
    """Three row tiles, the last holding one row, so that the backward's two programs (on a CPU)
    sum dweight/dbias over two tiles and one; forward and backward by the error rule, and with
    dropout against the float64 oracle."""
    with triton_common.gpu_tiles():
        block_m, block_n, _ = triton_module._tile(1 << 20, width)
        rows = 2 * block_m + 1
        assert triton_module._tile(rows, width)[:2] == (block_m, block_n)
        assert block_m * block_n == triton_module._GPU_TILE == 4096
        inputs = _inputs(rows, width, dtype, device=triton_device)
        _assert_within_error_rule("triton", inputs, prenorm, ATOL[dtype])
        with fastnmt.backend("triton"):
            _assert_dropout_backward_matches_oracle(rows, width, prenorm, triton_device)


_KERNELS = ["_FORWARD", "_BACKWARD", "_SUM_PARTIALS"]  # their Launchers
# aten ops that launch no GPU kernel: views, and allocations (the interpreter fills new outputs
# with NaN, a GPU leaves them empty: ``full``, and ``fill_`` after each ``empty_like``).
_NO_LAUNCH = {
    "view",
    "_unsafe_view",
    "reshape",
    "detach",
    "empty",
    "full",
    "new_empty",
    "empty_like",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("parameters", ["weight and bias", "weight", "none"])
def test_triton_forward_and_backward_launch_three_kernels(triton_device, dtype, parameters):
    """On a GPU a call's wall time is its launches: the forward, the backward and one kernel
    summing dweight and dbias over the backward's programs (none without either), in the
    parameters' dtype; in fp32 and fp16 no aten op launches a kernel, no cast of a gradient
    included (in bf16 the interpreter's fp32 buffers are cast with aten ops a GPU does not make).
    Both outputs take a gradient, as in a pre-norm stack."""
    x, residual, weight, bias = _inputs(9, 100, dtype, requires_grad=True, device=triton_device)
    weight, bias = {"weight and bias": (weight, bias), "weight": (weight, None)}.get(
        parameters, (None, None)
    )
    seeds = torch.ones_like(x), torch.ones_like(x)
    with fastnmt.backend("triton"), triton_common.gpu_tiles():
        add_layer_norm(x, residual, weight, bias)  # the backend's choice, cached
        with HostOps(triton_module, _KERNELS) as host:
            torch.autograd.backward(add_layer_norm(x, residual, weight, bias), seeds)
    assert host.launches == (_KERNELS if weight is not None else _KERNELS[:2])
    if dtype != torch.bfloat16 or not triton_common.INTERPRETER:
        poisoned = host.aten.count("empty_like") if triton_common.INTERPRETER else 0
        assert [op for op in host.aten if op not in _NO_LAUNCH] == ["fill_"] * poisoned, host.aten


def test_the_host_work_of_a_triton_call_is_a_few_dozen_python_calls(monkeypatch):
    """Forward + backward on the Triton path with the launches taken out: the dispatcher's
    cached decision, the autograd.Function, a launch plan per launch cached per signature, the
    output buffers and three Launcher calls; ``F.layer_norm(x + r)``'s step makes 17 (the step's
    ``sum`` and ``backward`` most of them). Without the plans: 95."""
    x, residual, weight, bias = _inputs(9, 100, torch.float32, requires_grad=True,
                                        device=TRITON_DEVICE)  # fmt: skip
    step = lambda: add_layer_norm(x, residual, weight, bias)[0].sum().backward()  # noqa: E731
    assert host_python_calls(monkeypatch, triton_module, _KERNELS, step) <= 56


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("parameters", [("weight", "bias"), ("weight",), ("bias",)])
def test_triton_sums_the_backward_partials(triton_device, parameters, dtype):
    """dweight and dbias add the backward programs' fp32 partial rows into the parameters'
    dtype: more rows than a step of the sums' kernel loads (a GPU has four programs per SM), a
    width off its column tile."""
    programs = 2 * triton_module._SUM_TILE[0] + 45
    partials = {name: torch.randn(programs, 100, device=triton_device) for name in parameters}
    sums = triton_module._sum_partials(partials.get("weight"), partials.get("bias"), dtype)
    for name, got in zip(("weight", "bias"), sums, strict=True):
        if name not in partials:
            assert got is None
            continue
        expected = partials[name].double().sum(0)
        assert got.dtype == dtype
        rtol = 1e-5 if dtype == torch.float32 else 2**-10  # an ulp: a sum near a tie may flip
        torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=1e-5)


def test_triton_inference_launches_the_forward_and_keeps_no_statistics(triton_device):
    """Without a backward to come (decoding): one launch, y and h allocated, no mean and rstd."""
    x, residual, weight, bias = _inputs(9, 100, torch.float32, device=triton_device)
    with fastnmt.backend("triton"), torch.no_grad():
        add_layer_norm(x, residual, weight, bias)  # the backend's choice, cached
        with HostOps(triton_module, _KERNELS) as host:
            add_layer_norm(x, residual, weight, bias)
    assert host.launches == ["_FORWARD"]
    assert [op for op in host.aten if op not in ("fill_", "detach")] == ["empty_like"] * 2


def test_triton_reasons(triton_device):
    """CPU tensors: Triton only in the interpreter, and only when forced (with a GPU: not at
    all). Tensors on the Triton device: chosen on a GPU; forced, the kernel's own limits."""
    cpu = fastnmt.ops.dispatch.explain("add_layer_norm", torch.randn(2, 8))
    assert cpu["chosen"] in ("cpp", "reference") and TRITON_CPU_REASON in cpu["triton"][0]
    if torch.cuda.is_available():
        on_gpu = torch.randn(2, 8, device=triton_device)
        assert fastnmt.ops.dispatch.explain("add_layer_norm", on_gpu)["chosen"] == "triton"
    with fastnmt.backend("triton"):
        with pytest.raises(fastnmt.BackendUnavailableError, match="a row must fit one Triton"):
            add_layer_norm(torch.randn(1, 9000, device=triton_device))
        with pytest.raises(fastnmt.BackendUnavailableError, match=r"x has dtype torch\.float64"):
            add_layer_norm(torch.randn(2, 8, dtype=torch.float64, device=triton_device))


def test_cpp_is_chosen_for_cpu_tensors_and_independent_of_thread_count():
    require_backend("cpp")
    assert fastnmt.ops.dispatch.explain("add_layer_norm", torch.randn(2, 8))["chosen"] == "cpp"
    x, residual, weight, bias = _inputs(300, 512, torch.bfloat16, requires_grad=True)
    results = []
    threads = torch.get_num_threads()
    for count in (1, 2):
        torch.set_num_threads(count)
        torch.manual_seed(3)
        y, h = add_layer_norm(x, residual, weight, bias, dropout_p=0.1)
        grads = torch.autograd.grad(
            (y.float().sum() + h.float().pow(2).sum()), (x, residual, weight, bias)
        )
        results.append((y, h, *grads))
    torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
