"""fastnmt.ops.linear_cross_entropy: the reference against F.cross_entropy in float64, and the fused
backends (Triton compiled on a GPU or in the interpreter, C++) against a float64 oracle with
FlashAttention's rule."""

import functools
import sys

import pytest
import torch
import torch.nn.functional as F

import fastnmt
from fastnmt.ops import linear_cross_entropy
from fastnmt.ops.linear_cross_entropy import per_token_losses
from fastnmt.ops.triton.common import gpu_tiles
from tests.helpers import (
    TRITON_DEVICE,
    HostOps,
    assert_error_within,
    device_of,
    opcheck,
    require_backend,
)

triton_module = sys.modules["fastnmt.ops.triton.linear_cross_entropy"]
lce_module = sys.modules["fastnmt.ops.linear_cross_entropy"]
IGNORE = -100


def _inputs(
    tokens, width, vocab, dtype=torch.float32, bias=True, ignored=(1,), device="cpu", logit_std=3
):
    """(hidden, weight, bias, target) on ``device``; hidden @ weight.T has about ``logit_std``."""
    hidden = torch.randn(tokens, width).to(device, dtype).requires_grad_()
    weight = torch.randn(vocab, width) * width**-0.5 * logit_std
    weight = weight.to(device, dtype).requires_grad_()
    bias_ = torch.randn(vocab).to(device, dtype).requires_grad_() if bias else None
    target = torch.randint(0, vocab, (tokens,))
    target[list(i for i in ignored if i < tokens)] = IGNORE
    return hidden, weight, bias_, target.to(device)


def _params(hidden, weight, bias):
    return [t for t in (hidden, weight, bias) if t is not None]


def _oracle(hidden, weight, bias, target, smoothing, reduction):
    """F.cross_entropy on float64 copies: the loss and its gradients, with the mean over zero
    counted tokens taken as 0."""
    leaves = [t.detach().double().requires_grad_() for t in _params(hidden, weight, bias)]
    bias64 = leaves[2] if bias is not None else None
    logits = F.linear(leaves[0], leaves[1], bias64)
    losses = F.cross_entropy(
        logits, target, ignore_index=IGNORE, label_smoothing=smoothing, reduction="none"
    )
    loss = losses.sum() / max(int((target != IGNORE).sum()), 1) if reduction == "mean" else losses
    loss = loss.sum() if reduction != "none" else loss
    return loss.detach(), torch.autograd.grad(loss, leaves), logits.detach()


def _loss_and_grads(hidden, weight, bias, target, smoothing, reduction):
    out = linear_cross_entropy(hidden, weight, bias, target, smoothing, IGNORE, reduction)
    return out, torch.autograd.grad(out.loss, _params(hidden, weight, bias))


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_reference_is_f_cross_entropy(reduction, smoothing):
    hidden, weight, bias, target = (
        t.double() if t.is_floating_point() else t for t in _inputs(9, 12, 31)
    )
    with fastnmt.backend("reference"):
        out = linear_cross_entropy(hidden, weight, bias, target, smoothing, IGNORE, reduction)
    expected = F.cross_entropy(
        F.linear(hidden, weight, bias),
        target,
        ignore_index=IGNORE,
        label_smoothing=smoothing,
        reduction=reduction,
    )
    torch.testing.assert_close(out.loss.double(), expected)
    assert out.tokens.item() == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [8003, 17])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_fused_matches_oracle(fused, monkeypatch, dtype, vocab, smoothing, reduction):
    """Chunks of 16 tokens over 40 (the last one partial); V not a multiple of any block."""
    monkeypatch.setattr(triton_module, "_CHUNK_ELEMENTS", 1)
    inputs = _inputs(
        40, 24, vocab, dtype, bias=vocab == 17, ignored=(1, 20), device=device_of(fused)
    )
    expected, expected_grads, _ = _oracle(*inputs, smoothing, reduction)
    out, grads = _loss_and_grads(*inputs, smoothing, reduction)
    with fastnmt.backend("reference"):
        plain, plain_grads = _loss_and_grads(*inputs, smoothing, reduction)
    assert out.loss.dtype == torch.float32 and out.loss.shape == ()
    # atol: fp32 rounding of a sum of 38 per-token losses (~1e-6 relative)
    atol = 1e-6 * max(10.0, expected.abs().item())
    assert_error_within(out.loss, plain.loss, expected, factor=2, atol=atol)
    for got, torch_same_dtype, oracle in zip(grads, plain_grads, expected_grads, strict=True):
        assert got.dtype == dtype
        assert_error_within(got, torch_same_dtype, oracle, factor=3, atol=1e-5)
    assert out.tokens.item() == plain.tokens.item() == 38
    torch.testing.assert_close(out.nll, plain.nll, rtol=2e-2, atol=0)  # smoothing 0: the loss


GPU_BLOCK_V = 4096


def _with_maxima_in_the_last_block(hidden, weight, target):
    """Gives rows 2 and 3 their largest logit in the last, partial block of V = 8003 (columns
    8002 and 8000, each set to its row's direction, about 7 standard deviations up) and makes
    those columns their targets; row 0's target goes in the second block too."""
    with torch.no_grad():
        for row, column in ((2, 8002), (3, 8000)):
            weight[column] = hidden[row] * (20 / hidden[row].float().norm())
            target[row] = column
    target[0] = 5000


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_triton_gpu_blocks_carry_max_sum_and_argmax_across_blocks(triton_device, dtype, smoothing):
    """The GPU's BLOCK_V under the interpreter too: V = 8003 spans two blocks, the second partial,
    so the online max / sum / argmax and the gradient pass run over several blocks."""
    inputs = _inputs(24, 16, 8003, dtype, ignored=(1, 7), device=triton_device)
    _with_maxima_in_the_last_block(*inputs[:2], inputs[3])
    expected, expected_grads, logits64 = _oracle(*inputs, smoothing, "sum")
    target = inputs[3]
    counted = target != IGNORE
    assert (logits64.argmax(-1)[2:4] >= GPU_BLOCK_V).all()  # the construction holds
    with fastnmt.backend("triton"), gpu_tiles():
        assert triton_module._block_v(8003)[0] == GPU_BLOCK_V
        out, grads = _loss_and_grads(*inputs, smoothing, "sum")
    with fastnmt.backend("reference"):
        plain, plain_grads = _loss_and_grads(*inputs, smoothing, "sum")
    atol = 1e-6 * max(10.0, expected.abs().item())
    assert_error_within(out.loss, plain.loss, expected, factor=2, atol=atol)
    nll64 = F.cross_entropy(logits64, target, ignore_index=IGNORE, reduction="sum")
    assert_error_within(out.nll, plain.nll, nll64, factor=2, atol=atol)
    assert out.correct.item() == ((logits64.argmax(-1) == target) & counted).sum().item() >= 2
    assert out.tokens.item() == 22
    for got, torch_same_dtype, oracle in zip(grads, plain_grads, expected_grads, strict=True):
        assert_error_within(got, torch_same_dtype, oracle, factor=3, atol=1e-5)


def test_fused_statistics_count_correct_predictions(fused):
    hidden, weight, bias, target = _inputs(50, 16, 7, device=device_of(fused))
    logits = F.linear(hidden, weight, bias).detach()
    target[::2] = logits.argmax(-1)[::2]  # half the tokens predicted right by construction
    target[1] = IGNORE
    out = linear_cross_entropy(hidden, weight, bias, target, 0.1, IGNORE, "sum")
    counted = target != IGNORE
    assert out.correct.item() == ((logits.argmax(-1) == target) & counted).sum().item()
    nll = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(out.nll.float(), nll, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", ["triton", "cpp", "reference"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_all_tokens_ignored_give_zero_loss_and_gradients(backend, reduction):
    require_backend(backend)
    hidden, weight, bias, target = _inputs(5, 8, 11, ignored=range(5), device=device_of(backend))
    with fastnmt.backend(backend):
        out, grads = _loss_and_grads(hidden, weight, bias, target, 0.1, reduction)
    assert out.loss.item() == 0.0 and out.tokens.item() == 0 and out.correct.item() == 0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("dloss", [1.0, -2.5])
def test_fused_backward_scales_by_dloss_and_keeps_its_saved_gradients(fused, dloss):
    """A second backward of a retained graph gets the same gradients: handing the saved ones to
    ``.grad`` (dloss = 1) must not let an accumulation write into them."""
    hidden, weight, bias, target = _inputs(9, 8, 13, device=device_of(fused))
    loss = linear_cross_entropy(hidden, weight, bias, target, 0.1, IGNORE, "mean").loss * dloss
    with fastnmt.backend("reference"):
        expected = linear_cross_entropy(hidden, weight, bias, target, 0.1, IGNORE, "mean").loss
    expected = torch.autograd.grad(expected * dloss, _params(hidden, weight, bias))
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in _params(hidden, weight, bias)]
    loss.backward()
    for param, first, oracle in zip(_params(hidden, weight, bias), once, expected, strict=True):
        torch.testing.assert_close(first, oracle, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(param.grad, 2 * oracle, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mean", [False, True])
def test_triton_backward_scales_each_gradient_over_its_blocks(triton_device, dtype, mean):
    """The scaling kernel's programs cover dh's blocks, then dw's, then db's: sizes that end
    each region in a partial block, every output element written (outputs start poisoned)."""
    dh = torch.randn(3001, device=triton_device).to(dtype)
    dw, db = torch.randn(4099, device=triton_device), torch.randn(2050, device=triton_device)
    sums = torch.tensor([1.0, 2.0, 7.0], dtype=torch.float64, device=triton_device)
    dloss = torch.tensor(-2.5, device=triton_device)
    grads = triton_module._scale_gradients(dloss, sums, dh, dw, db, mean, dtype, dtype, dtype)
    factor = dloss / 7 if mean else dloss
    for got, summed in zip(grads, (dh, dw, db), strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got, (summed.float() * factor).to(dtype))
    without_bias = triton_module._scale_gradients(dloss, sums, dh, dw, db, mean, dtype, dtype, None)
    assert without_bias[2].numel() == 0


def test_fused_one_chunk_equals_many_chunks(fused, monkeypatch):
    inputs = _inputs(70, 32, 300, device=device_of(fused))
    whole, whole_grads = _loss_and_grads(*inputs, 0.1, "sum")
    monkeypatch.setattr(triton_module, "_CHUNK_ELEMENTS", 1)
    chunked, chunked_grads = _loss_and_grads(*inputs, 0.1, "sum")
    torch.testing.assert_close(chunked.loss, whole.loss)
    for a, b in zip(chunked_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_fused_under_autocast_keeps_fp32_weight_gradient(fused):
    device = device_of(fused)
    hidden, weight, _, target = _inputs(40, 32, 8003, bias=False, device=device)
    expected, expected_grads, _ = _oracle(hidden, weight, None, target, 0.1, "sum")
    with torch.autocast(device.type, torch.bfloat16):
        out, grads = _loss_and_grads(hidden, weight, None, target, 0.1, "sum")
        with fastnmt.backend("reference"):
            plain, plain_grads = _loss_and_grads(hidden, weight, None, target, 0.1, "sum")
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]
    assert_error_within(out.loss, plain.loss, expected, factor=2, atol=1e-4)
    for got, torch_same_dtype, oracle in zip(grads, plain_grads, expected_grads, strict=True):
        assert_error_within(got, torch_same_dtype, oracle, factor=3, atol=1e-4)


def _scaled_loss_grads(inputs, loss_scale):
    """The gradients of (mean loss * loss_scale), divided by loss_scale again: a GradScaler's
    backward and unscale."""
    hidden, weight, bias, target = (
        t.detach().requires_grad_(t.is_floating_point()) for t in inputs
    )
    out = linear_cross_entropy(hidden, weight, bias, target, 0.1, IGNORE, "mean")
    (out.loss * loss_scale).backward()
    return [t.grad / loss_scale for t in (hidden, weight, bias)]


def test_fused_fp16_mean_gradient_survives_loss_scaling(fused):
    """fp16 with a GradScaler: (loss * 65536).backward() of a mean over 511 tokens. Unfused
    autocast computes the cross entropy's gradient in fp32, scaled by 65536 / 511, before the fp16
    cast; the fused backward must apply 1 / 511 as late. Folded into the kernels' fp16 gradient,
    1 / 511 puts the probabilities (about 1 / V, logits of std 1) in fp16's subnormals, and the
    gradients of hidden and bias come out about 5x as far from the oracle as torch's."""
    inputs = _inputs(512, 8, 4000, torch.float16, device=device_of(fused), logit_std=1)
    _, expected_grads, _ = _oracle(*inputs, 0.1, "mean")
    grads = _scaled_loss_grads(inputs, 65536.0)
    with fastnmt.backend("reference"):
        plain_grads = _scaled_loss_grads(inputs, 65536.0)
    for got, torch_same_dtype, oracle in zip(grads, plain_grads, expected_grads, strict=True):
        assert got.dtype == torch.float16
        assert_error_within(got, torch_same_dtype, oracle, factor=3, atol=1e-7)


def test_reduction_none_with_gradients_runs_on_the_reference():
    hidden, weight, bias, target = _inputs(6, 8, 11)
    reasons = fastnmt.ops.dispatch.explain(
        "linear_cross_entropy", hidden, weight, bias, target, reduction="none"
    )
    assert reasons["chosen"] == "reference" and "reduction='none'" in reasons["cpp"][0]
    out = linear_cross_entropy(
        hidden.view(2, 3, 8), weight, bias, target.view(2, 3), 0.1, IGNORE, "none"
    )
    assert out.loss.shape == (2, 3) and out.loss[0, 1] == 0.0
    on_triton = (t.to(TRITON_DEVICE) for t in (hidden, weight, bias, target))
    with fastnmt.backend("triton"), pytest.raises(fastnmt.BackendUnavailableError, match="none"):
        linear_cross_entropy(*on_triton, 0.1, IGNORE, "none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_per_token_losses_without_gradients_on_the_cpp_kernel(monkeypatch, dtype, smoothing):
    """Scoring: reduction='none' under no_grad takes the C++ row kernel, chunk by chunk (chunks
    of 16 tokens over 40, the last partial), within the reference's error of float64; ignored
    tokens give 0."""
    require_backend("cpp")
    monkeypatch.setattr(triton_module, "_CHUNK_ELEMENTS", 1)
    inputs = _inputs(40, 24, 8003, dtype, bias=True, ignored=(1, 20))
    hidden, weight, bias, target = (
        t.detach().double() if t.is_floating_point() else t for t in inputs
    )
    expected = F.cross_entropy(
        F.linear(hidden, weight, bias), target,
        ignore_index=IGNORE, label_smoothing=smoothing, reduction="none",
    )  # fmt: skip
    with torch.no_grad():
        reasons = fastnmt.ops.dispatch.explain(
            "linear_cross_entropy", *inputs, smoothing, IGNORE, "none"
        )
        out = linear_cross_entropy(*inputs, smoothing, IGNORE, "none")
        with fastnmt.backend("reference"):
            plain = linear_cross_entropy(*inputs, smoothing, IGNORE, "none")
    assert reasons["chosen"] == "cpp"
    assert out.loss.shape == (40,) and out.loss.dtype == torch.float32
    assert out.loss[1] == out.loss[20] == 0.0
    assert_error_within(out.loss, plain.loss, expected, factor=2, atol=1e-6)
    assert out.tokens.item() == plain.tokens.item() == 38
    assert out.correct.item() == plain.correct.item()
    torch.testing.assert_close(out.nll, plain.nll, rtol=1e-3, atol=0)


def test_fused_opcheck(fused):
    hidden, weight, bias, target = _inputs(20, 8, 37, device=device_of(fused))
    op = getattr(torch.ops.fastnmt, f"linear_cross_entropy_{fused}").default
    for mean in (False, True):
        opcheck(op, (hidden, weight, bias, target, 0.1, IGNORE, mean, True, None))
    frozen = (hidden.detach(), weight.detach(), None, target, 0.0, IGNORE, True, False, None)
    opcheck(op, frozen)


def test_fused_traced_by_torch_compile(fused):
    inputs = _inputs(20, 8, 37, device=device_of(fused))

    def loss_of(hidden, weight, bias, target):
        return linear_cross_entropy(hidden, weight, bias, target, 0.1, IGNORE, "mean").loss * 2

    torch._dynamo.reset()  # the backend is chosen at trace time
    compiled = torch.compile(loss_of, fullgraph=True, backend="aot_eager")
    results = [
        (loss, *torch.autograd.grad(loss, _params(*inputs[:3])))
        for loss in (loss_of(*inputs), compiled(*inputs))
    ]
    for expected, got in zip(*results, strict=True):
        torch.testing.assert_close(got, expected)


def test_cpp_rows_are_independent_of_thread_count():
    require_backend("cpp")
    logits = torch.randn(67, 8003).bfloat16()
    target = torch.randint(0, 8003, (67,))
    results = []
    threads = torch.get_num_threads()
    for count in (1, 2):
        torch.set_num_threads(count)
        z = logits.clone()
        stats = torch.ops.fastnmt.cross_entropy_rows_cpp(z, target, 0.1, IGNORE, True)
        results.append((z, stats))
    torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def _bad(**override):
    hidden, weight, bias, target = _inputs(4, 8, 11)
    args = dict(hidden=hidden, weight=weight, bias=bias, target=target)
    return {**args, **override}


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        (dict(target=torch.zeros(5, dtype=torch.long)), ValueError, r"target must have shape"),
        (dict(target=torch.zeros(4)), TypeError, "target must hold int64 or int32"),
        (dict(hidden=torch.randn(4, 9)), ValueError, r"hidden must have shape \(\.\.\., 8\)"),
        (dict(weight=torch.randn(11, 8).double()), TypeError, "weight has dtype"),
        (dict(bias=torch.randn(12)), ValueError, "bias must have shape"),
        (dict(label_smoothing=1.0), ValueError, "label_smoothing must be in"),
        (dict(reduction="avg"), ValueError, "reduction must be"),
        (dict(ignore_index=0.5), TypeError, "ignore_index must be an int"),
    ],
)
def test_bad_inputs_name_the_argument(override, error, message):
    with pytest.raises(error, match=message):
        linear_cross_entropy(**_bad(**override))


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (torch.tensor([0, 1, 11, 2]), r"target .*\[0, 11\).* got 11 at flat position 2"),
        (torch.tensor([0, -3, 1, 2]), r"target .*\[0, 11\).* got -3 at flat position 1"),
    ],
)
@pytest.mark.parametrize("backend", ["triton", "cpp", "reference"])
def test_target_range_checked_under_fastnmt_check_values(monkeypatch, backend, target, message):
    require_backend(backend)
    monkeypatch.setenv("FASTNMT_CHECK_VALUES", "1")
    fastnmt.ops.settings.reload()
    hidden, weight, bias, _ = _inputs(4, 8, 11, device=device_of(backend))
    target = target.to(hidden.device)
    with fastnmt.backend(backend), pytest.raises(ValueError, match=message) as raised:
        linear_cross_entropy(hidden, weight, bias, target)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("wrong", [11, -3, 2**40])
def test_triton_out_of_range_target_unchecked_stays_in_its_row(triton_device, wrong):
    """Without FASTNMT_CHECK_VALUES the kernel reads nothing outside the row of a wrong target
    (its loss is undefined); every other row's gradient is as if that token were ignored."""
    hidden, weight, bias, target = _inputs(6, 8, 11, device=triton_device)
    ignoring = target.clone()
    target[3], ignoring[3] = wrong, IGNORE
    with fastnmt.backend("triton"):
        _, (dh, *_) = _loss_and_grads(hidden, weight, bias, target, 0.1, "sum")
        _, (dh_ignoring, *_) = _loss_and_grads(hidden, weight, bias, ignoring, 0.1, "sum")
    others = torch.arange(6, device=triton_device) != 3
    torch.testing.assert_close(dh[others], dh_ignoring[others])


def test_cpp_kernel_refuses_an_out_of_range_target_unchecked():
    """The C++ kernel has the targets on the CPU: it checks them at no sync cost."""
    require_backend("cpp")
    with fastnmt.backend("cpp"), pytest.raises(RuntimeError, match="target 11 at row 2 is outside"):
        linear_cross_entropy(**_bad(target=torch.tensor([0, 1, 11, 2])))


def test_fused_backends_refuse_float64():
    hidden, weight, bias, target = (
        t.double() if t.is_floating_point() else t for t in _inputs(4, 8, 11)
    )
    reasons = fastnmt.ops.dispatch.explain("linear_cross_entropy", hidden, weight, bias, target)
    assert "float64" in reasons["cpp"][0] and reasons["chosen"] == "reference"


# aten ops that launch no GPU kernel: views, and allocations (the interpreter fills new outputs
# with NaN, a GPU leaves them empty).
_NO_LAUNCH = {"t", "slice", "select", "detach", "unbind", "empty", "full"}


_KERNELS = ["_ROWS", "_SUM_STATISTICS", "_SCALE_GRADIENTS"]  # their Launchers


def _triton_launches(tokens: int, vocab: int, dtype=torch.float32) -> list[str]:
    """The kernels (aten ops that launch one on a GPU, and Triton kernels) of a forward +
    backward (mean, with a bias) on the Triton backend at the GPU's chunking, its choice
    cached; the gradients start as None, as after ``zero_grad()``."""
    hidden, weight, bias, target = _inputs(tokens, 24, vocab, dtype, device=TRITON_DEVICE)
    seed = torch.ones((), device=TRITON_DEVICE)
    with fastnmt.backend("triton"), gpu_tiles():
        linear_cross_entropy(hidden, weight, bias, target, 0.1, IGNORE, "mean").loss.backward()
        for param in (hidden, weight, bias):
            param.grad = None
        with HostOps(triton_module, _KERNELS) as host:
            out = linear_cross_entropy(hidden, weight, bias, target, 0.1, IGNORE, "mean")
            out.loss.backward(seed)
    # clone: CPU GEMMs get a contiguous transposed weight; cuBLAS takes the view.
    cpu_only = {"clone"} if hidden.device.type == "cpu" else set()
    return host.launches + [op for op in host.aten if op not in _NO_LAUNCH | cpu_only]


def test_per_token_losses_on_the_cpp_kernel_chunk_by_the_cpu_budget(monkeypatch):
    """Scoring on a CPU: chunks of a CPU's size (logits that stay in its caches) also where the
    Triton launchers would pick a GPU's (a CPU-only process: no interpreter, GPU tiles); 256
    tokens at 8,000 words, more over fewer words, never fewer for a larger vocabulary."""
    assert lce_module._scoring_chunk_rows(8000) == 256
    assert lce_module._scoring_chunk_rows(300) == 6976
    assert lce_module._scoring_chunk_rows(256_000) == 256
    require_backend("cpp")
    monkeypatch.setattr(lce_module, "_SCORING_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(lce_module, "_SCORING_MIN_ROWS", 16)  # 16 tokens a chunk
    rows = torch.ops.fastnmt.cross_entropy_rows_cpp
    chunks = []
    monkeypatch.setattr(
        torch.ops.fastnmt,
        "cross_entropy_rows_cpp",
        lambda z, *a: chunks.append(len(z)) or rows(z, *a),
    )
    hidden, weight, bias, target = _inputs(40, 24, 300, torch.float32, bias=True)
    with gpu_tiles(), torch.no_grad(), fastnmt.backend("cpp"):
        linear_cross_entropy(hidden, weight, bias, target, reduction="none")
    assert chunks == [16, 16, 8]


def test_per_token_losses_of_any_output_layer_without_the_extension(monkeypatch):
    """``per_token_losses`` of a callable output layer: the C++ kernels' losses and statistics,
    and the reference's where the extension is missing."""
    hidden, weight, bias, target = _inputs(40, 24, 300, torch.float32, bias=True, ignored=(3,))
    layer = functools.partial(F.linear, weight=weight, bias=bias)
    with torch.no_grad(), fastnmt.backend("reference"):
        plain = linear_cross_entropy(hidden, weight, bias, target, 0.1, IGNORE, "none")
    results = [per_token_losses(hidden, layer, 300, target, 0.1, IGNORE)]
    monkeypatch.setattr(lce_module, "extension_available", lambda: False)
    results.append(per_token_losses(hidden, layer, 300, target, 0.1, IGNORE))
    for losses, statistics in results:
        torch.testing.assert_close(losses, plain.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(statistics[1:], torch.stack([plain.correct, plain.tokens]))
        torch.testing.assert_close(statistics[0], plain.nll, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpp_rows_apply_row_scales_as_they_read_the_logits(dtype):
    """An int8 GEMM's unscaled logits with their rows' scales: the statistics of the scaled
    logits (computed in fp32, so as close as fp32 rounding of the scaled rows allows), no
    gradient; a layer with an ``unscaled`` method hands its rows and scales to the row kernel."""
    require_backend("cpp")
    raw = torch.randn(37, 1003).to(dtype) * 3
    scales = torch.rand(37) * 4 + 0.01
    target = torch.randint(0, 1003, (37,))
    target[5] = IGNORE
    rows = torch.ops.fastnmt.cross_entropy_rows_cpp
    scaled = raw.float() * scales[:, None]
    expected = rows(scaled.clone(), target, 0.1, IGNORE, False)
    got = rows(raw.clone(), target, 0.1, IGNORE, False, scales)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-5)
    for bad, reason in [
        ((True, scales), "give no gradient"),
        (
            (False, scales[:5]),
            "cross_entropy_rows: row_scales must be contiguous float32 \\(37,\\)",
        ),
    ]:
        with pytest.raises(RuntimeError, match=reason) as error:
            rows(raw.clone(), target, 0.1, IGNORE, *bad)
        assert len(str(error.value).strip().splitlines()) == 1

    class Unscaled:  # the protocol of fastnmt.quantize's int8 layers
        def unscaled(self, x):
            return raw.clone(), scales

    losses, _ = per_token_losses(raw, Unscaled(), 1003, target, 0.1, IGNORE)
    torch.testing.assert_close(losses, expected[:, 0], rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize("scaled", [False, True], ids=["logits", "int8 rows and scales"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_rows_loss_only_in_one_pass_equal_the_two_passes(dtype, scaled):
    """Scoring's rows: each nll shifted by its gold logit, in one pass; a gold logit 90 or 200
    below its row's max (the shifted exponentials would overflow) takes the two passes. No
    argmax is taken: ``correct`` is NaN. Not with a gradient or smoothing."""
    require_backend("cpp")
    raw = (torch.randn(41, 1003) * 3).to(dtype)
    scales = torch.rand(41) * 2 + 0.5 if scaled else None
    target = torch.randint(0, 1003, (41,))
    target[5] = IGNORE
    for row, below in ((7, 90.0), (9, 200.0)):  # the gold logit far below the max
        raw[row, target[row]] = -below / (scales[row] if scaled else 1.0)
    rows = torch.ops.fastnmt.cross_entropy_rows_cpp
    expected = rows(raw.clone(), target, 0.0, IGNORE, False, scales)
    got = rows(raw.clone(), target, 0.0, IGNORE, False, scales, True)
    torch.testing.assert_close(got[:, :2], expected[:, :2], rtol=2e-6, atol=2e-5)
    assert got[:, 2].isnan()[target != IGNORE].all() and got[5].eq(0).all()
    assert expected[7, 1] > 90 and expected[9, 1] > 200
    for bad in ((0.1, IGNORE, False), (0.0, IGNORE, True)):
        with pytest.raises(RuntimeError, match="loss_only takes no gradient and no label"):
            rows(raw.float().clone(), target, *bad, None, True)

    class Unscaled:  # the protocol of fastnmt.quantize's int8 layers
        def unscaled(self, x):
            return raw.clone(), scales

    losses, statistics = per_token_losses(raw, Unscaled(), 1003, target, 0.0, IGNORE, False)
    assert statistics is None
    torch.testing.assert_close(losses, expected[:, 0], rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_launches_are_few_and_do_not_grow_with_the_vocabulary(dtype):
    """On a GPU a call's wall time is its launches (the host-path issue counted 348 at 4,096
    tokens x 32k words, and asks for at most 8): one chunk there, and per call the three GEMMs
    of the unfused loss, the row kernel, the column sum of db, the kernel that sums the row
    statistics into the loss, the backward's scaling kernel, and in half precision the cast of
    dw's GEMM to fp32; no zero-filled buffer or gradient, the same count for 17 words as for
    3,000."""
    assert triton_module.chunk_rows(32000, gpu=True) >= 4096
    launches = _triton_launches(40, 17, dtype)
    assert launches == _triton_launches(40, 3000, dtype) == _triton_launches(300, 3000, dtype)
    assert sorted(launches[:3]) == sorted(_KERNELS), launches
    half = dtype != torch.float32
    assert sorted(launches[3:]) == sorted(["addmm", "mm", "mm", "sum"] + ["_to_copy"] * half)
