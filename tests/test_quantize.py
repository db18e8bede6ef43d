import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastnmt.attention import MultiheadAttention
from fastnmt.model import Transformer, preset
from fastnmt.quantize import (
    Bf16Linear,
    Int8Bf16Linear,
    Int8Linear,
    Int8VnniLinear,
    RowInt8Linear,
    bf16_packing_supported,
    int8_activation_dtype,
    int8_bf16_supported,
    int8_linear,
    int8_supported,
    int8_vnni_supported,
    pack_bf16,
    padded_rows,
    quantize_int8,
)
from fastnmt.translator import Translator, load_checkpoint

from .helpers import HostOps, assert_error_within, tiny_checkpoint

ACTIVATIONS = {None: lambda y: y, "relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def quantization_bound(x, weight, steps):
    """Largest |int8 GEMM - exact| per output (M, N): per-channel symmetric weights (step s_w),
    each row of activations symmetric, max |x| in ``steps`` steps each side (s_x), each value
    rounded by at most half a step: |x dW + dx W + dx dW| summed over K."""
    x = x.reshape(-1, x.shape[-1]).double()
    weight = weight.double()
    s_w = weight.abs().amax(dim=1) / 127  # (N,)
    s_x = x.abs().amax(dim=1, keepdim=True) / steps
    k = x.shape[1]
    return (
        0.5 * x.abs().sum(1, keepdim=True) * s_w
        + 0.5 * s_x * weight.abs().sum(1)
        + 0.25 * s_x * s_w * k
    )


# int8 GEMMs between bf16 activations run where the CPU computes in bf16 (and fastnmt's C++
# kernels, which quantize their inputs, are built); elsewhere quantize_int8 refuses a bf16 model.
INT8_BF16 = not int8_bf16_supported("cpu")


# The int8 GEMMs (rows quantized one by one) and whether they run here: oneDNN's between bf16
# activations where the CPU computes bf16 natively, between float32 ones where it has VNNI;
# fbgemm's (float32) everywhere (``int8_linear`` picks it where the CPU lacks VNNI).
ROW_INT8 = {
    Int8Bf16Linear: INT8_BF16,
    Int8VnniLinear: not int8_vnni_supported("cpu"),
    Int8Linear: True,
}


@pytest.mark.parametrize("gemm", list(ROW_INT8), ids=lambda gemm: gemm.__name__)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("shape", [(1, 1, 8), (3, 5, 37), (2, 70, 256)])
def test_int8_linear_is_within_the_quantization_bound(shape, activation, gemm):
    *lead, k = shape
    n = 51
    x = (torch.randn(*lead, k) * 2).to(gemm.activation_dtype)
    weight, bias = torch.randn(n, k) / k**0.5, torch.randn(n)
    if gemm is Int8Bf16Linear and not INT8_BF16:
        with pytest.raises(ValueError, match="quantize_int8: "):
            quantize_int8(nn.Sequential(nn.Linear(k, n).bfloat16()))
        return
    if not ROW_INT8[gemm]:
        assert int8_linear(torch.float32) is Int8Linear
        return
    layer = gemm(weight, bias, activation)
    out = layer(x)
    product = F.linear(x.double(), weight.double())
    exact = ACTIVATIONS[activation](product + bias.double())
    # The quantization's bound, then the activation dtype's rounding of the GEMM's unscaled
    # output and of the result (each at most half its epsilon, relative), the activations
    # changing by at most 1.13x their input's.
    steps = 63 if layer.reduce_range else 127
    rounding = torch.finfo(gemm.activation_dtype).eps / 2
    bound = quantization_bound(x, weight, steps).view(*lead, n)
    bound = 1.13 * (bound + rounding * (product.abs() + bound)) + rounding * exact.abs() + 1e-5
    error = (out.double() - exact).abs()
    assert out.shape == (*lead, n) and out.dtype == gemm.activation_dtype
    assert (error <= bound).all(), f"error {error.max():.3g} over the bound"
    assert error.max() > 0
    rows = torch.tensor([0, 7, 50])
    narrow = gemm(weight, bias, activation).rows(rows)
    torch.testing.assert_close(narrow(x), out[..., rows], rtol=0, atol=0)


# Each row-quantizing GEMM's aten op, and whether it runs some row counts padded.
# Per GEMM, row counts of a (64, 256) layer, the op that multiplies them and whether the GEMM
# runs them padded (oneDNN's blocked kernels: 300 rows as 320; fbgemm's and int8_mm run any).
GEMM_OPS = {
    Int8Bf16Linear: [
        (18, "int8_mm", False),
        (32, "int8_mm", False),
        (320, "qlinear_pointwise", False),
        (300, "qlinear_pointwise", True),
    ],
    Int8Linear: [
        (18, "linear_with_input_q_dq_qweight_dq_output_fp32", False),
        (300, "linear_with_input_q_dq_qweight_dq_output_fp32", False),
    ],
}


@pytest.mark.parametrize("gemm", list(GEMM_OPS), ids=lambda gemm: gemm.__name__)
def test_an_int8_call_is_one_quantizer_one_gemm_and_one_scale_pass(gemm):
    """The host path of a call: its quantizer, the GEMM and the rows' scaling, once each; a row
    count the GEMM runs unpadded slices nothing (decoding calls these every step)."""
    if not ROW_INT8[gemm]:
        pytest.skip(f"{gemm.__name__} does not run on this CPU")
    layer = gemm(torch.randn(64, 256), torch.randn(64), "relu")
    for rows, op, pads in GEMM_OPS[gemm]:
        with HostOps() as host:
            layer(torch.randn(2, rows // 2, 256).to(gemm.activation_dtype))
        for name in ("quantize_rows", op, "scale_rows_"):
            assert host.aten.count(name) == 1, (rows, host.aten)
        assert ("slice" in host.aten) == pads, (rows, host.aten)
        assert "copy_" not in host.aten, host.aten


ONEDNN_INT8 = [gemm for gemm in (Int8Bf16Linear, Int8VnniLinear) if ROW_INT8[gemm]]


@pytest.mark.skipif(not ONEDNN_INT8, reason="oneDNN's int8 GEMMs do not run here")
@pytest.mark.parametrize("zeros", [False, True], ids=["values", "zero rows"])
@pytest.mark.parametrize(
    "shape", [(1, 256, 768), (4, 256, 8000), (7, 250, 131), (16, 1024, 256), (3, 8, 1)], ids=str
)
def test_few_rows_are_multiplied_by_int_mm_to_qlinear_s_bits(shape, zeros):
    """``int8_mm`` (torch._int_mm's exact int32 sums times the weight's scales) gives what
    oneDNN's qlinear_pointwise gives, bit for bit, so a row's result does not depend on which
    of the two its row count takes."""
    rows, k, n = shape
    generator = torch.Generator().manual_seed(rows * k + n)
    for gemm in ONEDNN_INT8:
        layer = gemm(torch.randn(n, k, generator=generator) / 8, None)
        x = torch.randn(rows, k, generator=generator).to(gemm.activation_dtype) * 3
        if zeros:
            x[0] = 0.0
        q, _ = layer._quantize(x)
        few = torch.ops.fastnmt.int8_mm(
            q, layer.int8_weight, layer.scales, layer.zero_point, gemm.activation_dtype
        )
        blocked = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, layer.zero_point, layer.packed, layer.scales, layer.zero_points, None,
            1.0, 0, gemm.activation_dtype, "none", [], "",
        )  # fmt: skip
        assert few.dtype == gemm.activation_dtype and few.shape == (rows, n)
        torch.testing.assert_close(few, blocked[:rows], rtol=0, atol=0)


def test_int8_mm_refusals_are_one_line():
    q, weight, scales = (
        torch.zeros(2, 4, dtype=torch.uint8),
        torch.zeros(4, 3, dtype=torch.int8),
        torch.ones(3),
    )
    for args, reason in [
        ((q.float(), weight, scales, 128, torch.float32), "q must be contiguous uint8"),
        ((q, weight[:3], scales, 128, torch.float32), "weight must be int8 \\(K, N\\) with K = 4"),
        ((q, weight.float(), scales, 128, torch.float32), "weight must be int8"),
        ((q, weight, scales[:2], 128, torch.float32), "weight_scales must be"),
        ((q, weight, scales, 128, torch.float16), "out_dtype must be float32 or bfloat16"),
        ((q, weight, scales, 0, torch.float32), "zero_point must be in"),
    ]:
        with pytest.raises(RuntimeError, match=reason) as error:
            torch.ops.fastnmt.int8_mm(*args)
        assert len(str(error.value).strip().splitlines()) == 1


@pytest.mark.skipif(not INT8_BF16, reason="int8 between bf16 activations does not run here")
def test_an_int8_bf16_layer_hands_over_its_unscaled_rows_when_it_has_no_bias():
    """``unscaled(x)``: (y, scales) with the layer's output y * scales (the rows as the GEMM
    wrote them, before the bf16 rounding of the scaled values); a layer with a bias or an
    activation gives its output and None."""
    x = torch.randn(37, 64).bfloat16()
    weight = torch.randn(51, 64) / 8
    layer = Int8Bf16Linear(weight, None)
    y, scales = layer.unscaled(x)
    assert y.shape == (37, 51) and scales.shape == (37,)
    torch.testing.assert_close(
        (y.float() * scales[:, None]).bfloat16(), layer(x), rtol=2**-7, atol=1e-6
    )
    for biased in (Int8Bf16Linear(weight, torch.randn(51)), Int8Bf16Linear(weight, None, "relu")):
        out, none = biased.unscaled(x)
        assert none is None
        torch.testing.assert_close(out, biased(x), rtol=0, atol=0)


@pytest.mark.parametrize("gemm", list(ROW_INT8), ids=lambda gemm: gemm.__name__)
@pytest.mark.parametrize("rows", [1, 15, 16, 37, 300])
def test_an_int8_row_does_not_depend_on_its_batch_mates(rows, gemm):
    """Each row has its own scale: a row's output is the same, bit for bit, alone or beside
    rows a thousand times larger (one scale for the batch would flatten the small row's
    values into a few steps) at any row count (oneDNN runs other kernels at other counts)."""
    if not ROW_INT8[gemm]:
        pytest.skip(f"{gemm.__name__} does not run on this CPU")
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(40, 72, generator=generator), torch.randn(40, generator=generator)
    layer = gemm(weight, bias, "relu")
    x = torch.randn(rows, 72, generator=generator).to(gemm.activation_dtype)
    x[1:] *= 1000
    alone = layer(x[:1])
    torch.testing.assert_close(layer(x)[:1], alone, rtol=0, atol=0)
    exact = F.relu(F.linear(x[:1].double(), weight.double(), bias.double()))
    assert (alone.double() - exact).abs().max() < 0.05 * exact.abs().max()


def _rows_oracle(x: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows' scales and values, in float32 as it computes them: zero point half + 1."""
    high = x.float().abs().amax(dim=1)
    usable = (high > 0) & high.isfinite()
    scales = torch.where(usable, high / half, torch.ones_like(high))
    inverse = torch.where(usable, half / high, torch.ones_like(high))[:, None]
    q = torch.where(usable[:, None], (x.float() * inverse + (half + 1.5)).floor(), half + 1.0)
    return scales, q


@pytest.mark.parametrize("reduce_range", [False, True], ids=["8-bit", "7-bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("values", ["normal", "positive", "negative", "zeros", "mixed"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (70, 256)], ids=str)
def test_activations_are_quantized_row_by_row_to_within_half_a_step(
    shape, values, dtype, reduce_range
):
    """Each row's values within half a step of theirs once dequantized, in 2h + 1 values around
    the zero point h + 1 (h = 127, 63 with reduce_range), 0.0 exactly there, the steps
    max |x[m]| / h; an all-zero row keeps scale 1; the padded rows are there."""
    x = {
        "normal": lambda: torch.randn(shape) * 3,
        "positive": lambda: torch.rand(shape) + 0.5,
        "negative": lambda: -torch.rand(shape) - 0.5,
        "zeros": lambda: torch.zeros(shape),
        "mixed": lambda: torch.randn(shape) * torch.logspace(-3, 3, shape[0])[:, None],
    }[values]().to(dtype)
    if values in ("normal", "mixed"):
        x.view(-1)[0] = 0.0
        x[-1] = 0.0 if shape[0] > 1 else x[-1]
    half = 63 if reduce_range else 127
    padded = padded_rows(shape[0]) + 3
    q, scales = torch.ops.fastnmt.quantize_rows(x, padded, reduce_range)
    assert q.shape == (padded, shape[1]) and q.dtype == torch.uint8
    assert scales.shape == (shape[0],) and scales.dtype == torch.float32
    centered, same = torch.ops.fastnmt.quantize_rows(x, padded, reduce_range, as_float=True)
    assert centered.shape == (padded, shape[1]) and centered.dtype == torch.float32
    assert torch.equal(centered[: shape[0]], q[: shape[0]].float() - (half + 1))
    assert torch.equal(same, scales)
    expected_scales, expected_q = _rows_oracle(x, half)
    torch.testing.assert_close(scales, expected_scales, rtol=1e-6, atol=0)
    q = q[: shape[0]].double()
    assert (q - expected_q.double()).abs().max() <= 1  # x / s and x (1 / s) differ by an ulp
    assert q.min() >= 1 and q.max() <= 2 * half + 1
    dequantized = (q - (half + 1)) * scales.double()[:, None]
    error = (dequantized - x.double()).abs()
    assert (error <= 0.5 * scales.double()[:, None] * (1 + 1e-5)).all(), error.max()
    assert torch.equal(q[x == 0], torch.full_like(q[x == 0], half + 1.0))


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [5, 16, 100, 1031])
def test_a_gemms_unscaled_output_is_scaled_on_the_way_in(width, bias, relu):
    """quantize_rows(y, x_scales=s, x_bias=b, relu) quantizes act(y s + b) (the previous GEMM's
    output, never written), and scale_rows_ writes it (in place, the rows given scales)."""
    y = torch.randn(9, width).bfloat16()
    scales = torch.rand(7) * 10 + 0.1
    shift = torch.randn(width) if bias else None
    finished = y[:7].float() * scales[:, None] + (0 if shift is None else shift)
    finished = finished.relu() if relu else finished
    q, out_scales = torch.ops.fastnmt.quantize_rows(y[:7], 7, False, scales, shift, relu)
    centered, _ = torch.ops.fastnmt.quantize_rows(y[:7], 7, False, scales, shift, relu, True)
    assert torch.equal(centered, q.float() - 128)
    expected_scales, expected_q = _rows_oracle(finished, 127)
    torch.testing.assert_close(out_scales, expected_scales, rtol=1e-6, atol=0)
    assert (q.double() - expected_q.double()).abs().max() <= 1
    written = torch.ops.fastnmt.scale_rows_(y, scales, shift, relu)
    assert written is y
    # within one bf16 step: the kernel's fused multiply-add rounds once where torch rounds twice
    torch.testing.assert_close(y[:7].float(), finished.bfloat16().float(), rtol=2**-7, atol=1e-6)
    assert torch.equal(y[7:], y[7:].clone())


def test_activation_quantizer_refusals_are_one_line():
    quantize = torch.ops.fastnmt.quantize_rows
    for args, reason in [
        ((torch.zeros(2, 3, 4), 2, False), "must be \\(rows, K\\)"),
        ((torch.zeros(2, 4, dtype=torch.float16), 2, False), "float32 or bfloat16"),
        ((torch.zeros(5, 4), 4, False), "padded_rows must be >= 5"),
        ((torch.zeros(5, 4), 5, False, None, torch.zeros(4)), "pass x_scales"),
        ((torch.zeros(5, 4), 5, False, torch.ones(4)), "x_scales must be contiguous float32"),
        ((torch.zeros(5, 4), 5, False, torch.ones(5), torch.zeros(3)), "x_bias must be"),
    ]:
        with pytest.raises(RuntimeError, match=reason) as error:
            quantize(*args)
        assert len(str(error.value).strip().splitlines()) == 1
    for args, reason in [
        ((torch.zeros(4, 4).t(), torch.ones(4), None, False), "y must be contiguous"),
        ((torch.zeros(4, 4), torch.ones(5), None, False), "at most y's 4 rows"),
        ((torch.zeros(4, 4), torch.ones(4).double(), None, False), "scales must be"),
        ((torch.zeros(4, 4), torch.ones(4), torch.ones(5), False), "bias must be"),
    ]:
        with pytest.raises(RuntimeError, match=reason) as error:
            torch.ops.fastnmt.scale_rows_(*args)
        assert len(str(error.value).strip().splitlines()) == 1


@pytest.mark.skipif(not INT8_BF16, reason="int8 between bf16 activations does not run here")
@pytest.mark.parametrize("activation", ["relu", "gelu", None])
def test_a_feed_forward_block_passes_its_hidden_layer_unwritten(activation):
    """first.then(second, x): second(first(x)) with the hidden layer scaled on its way into
    second's quantizer (one scale_rows_ in all; gelu is applied by torch, so written), as
    accurate as the two layers one after the other."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 37, 64, generator=generator).bfloat16()
    w1, b1 = torch.randn(96, 64, generator=generator) / 8, torch.randn(96, generator=generator)
    w2, b2 = torch.randn(64, 96, generator=generator) / 10, torch.randn(64, generator=generator)
    first, second = Int8Bf16Linear(w1, b1, activation), Int8Bf16Linear(w2, b2)
    with HostOps() as host:
        fused = first.then(second, x)
    assert host.aten.count("scale_rows_") == (1 if activation != "gelu" else 2), host.aten
    hidden = ACTIVATIONS[activation](F.linear(x.double(), w1.double(), b1.double()))
    exact = F.linear(hidden, w2.double(), b2.double())
    # Mean errors: the largest is one draw of the quantization's rounding, 1.5x apart either way.
    error, unfused_error = ((y.double() - exact).abs().mean() for y in (fused, second(first(x))))
    assert fused.shape == exact.shape and fused.dtype == torch.bfloat16
    assert error <= 1.1 * unfused_error, (error, unfused_error)


@pytest.mark.skipif(not ROW_INT8[Int8VnniLinear], reason="oneDNN's VNNI kernels do not run here")
@pytest.mark.parametrize("activation", ["relu", None])
@pytest.mark.parametrize("shape", [(1, 8, 3), (37, 72, 51), (300, 256, 1024)], ids=str)
def test_fbgemm_and_onednn_give_a_float32_model_the_same_bits(shape, activation):
    """The same quantized rows and exact int32 sums, scaled alike: a float32 model's int8
    translation does not depend on which library multiplies."""
    rows, k, n = shape
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(n, k, generator=generator) / 8, torch.randn(n, generator=generator)
    x = torch.randn(rows, k, generator=generator)
    fbgemm, onednn = (gemm(weight, bias, activation) for gemm in (Int8Linear, Int8VnniLinear))
    torch.testing.assert_close(fbgemm(x), onednn(x), rtol=0, atol=0)


def test_float32_activations_are_multiplied_in_fbgemm_without_vnni(monkeypatch):
    """oneDNN's int8 kernels for CPUs without VNNI are not its fast ones: fbgemm's there."""
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    assert any("no AVX-512 VNNI" in reason for reason in int8_vnni_supported("cpu"))
    assert int8_linear(torch.float32) is Int8Linear
    assert int8_linear(torch.bfloat16) is Int8Bf16Linear


def test_a_zero_weight_row_gives_its_bias():
    weight = torch.randn(4, 16)
    weight[2] = 0
    bias = torch.arange(4.0)
    out = Int8Linear(weight, bias)(torch.randn(3, 16))
    torch.testing.assert_close(out[:, 2], torch.full((3,), 2.0))


def _model(**overrides):
    """A random model; a random output bias too, when it has one."""
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=97, d_model=64, heads=4, d_ff=96, **overrides)
    model = Transformer(cfg).eval()
    if model.output_bias is not None:
        model.output_bias.normal_()
    return model


# Pre- and post-norm, each activation, with and without an output bias.
MODEL_VARIANTS = [
    {}, {"prenorm": False, "activation": "gelu", "output_bias": True}, {"activation": "silu"},
]  # fmt: skip


def _outputs(model):
    """Teacher-forced log-probabilities (B, T, V), and the last step's logits from the decoding
    output layer and from ``logits``."""
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(3, 97, (3, 11), generator=generator)
    src_lengths = torch.tensor([11, 4, 1])
    tgt = torch.randint(3, 97, (3, 9), generator=generator)
    with torch.inference_mode():
        states = model.decode(tgt, model.encode(src, src_lengths), src_lengths)
        last = states[:, -1]
        return model.logits(states).log_softmax(-1), model.output_layer()(last), model.logits(last)


def _packed_outputs(model, pack):
    """``_outputs`` of ``model`` once ``pack`` converted it in place, its state_dict unchanged."""
    before = {name: value.clone() for name, value in model.state_dict().items()}
    assert pack(model) is model
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], value) for name, value in before.items())
    return _outputs(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("overrides", MODEL_VARIANTS)
def test_a_quantized_model_keeps_its_state_dict_and_predictions(overrides, dtype):
    model = _model(**overrides)
    exact = _outputs(model)[0]
    bf16 = _outputs(copy.deepcopy(model).to(torch.bfloat16))[0].float()
    model = model.to(dtype)
    if dtype == torch.bfloat16 and not INT8_BF16:
        with pytest.raises(ValueError, match="quantize_int8: "):
            quantize_int8(model)
        return
    quantized, step, last = _packed_outputs(model, quantize_int8)
    assert isinstance(model.packed_output, int8_linear(dtype))
    # The yardstick: the same model with bf16 weights (int8 measured 2.7x to 2.8x its error;
    # int8 between bf16 activations, up to 3.5x).
    error, bf16_error = ((x.float() - exact).abs().max() for x in (quantized, bf16))
    assert 0 < error <= 5 * bf16_error, (error, bf16_error)
    assert (quantized.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(step, last, rtol=0, atol=0)


@pytest.mark.parametrize("overrides", MODEL_VARIANTS[:2])
def test_a_quantized_transformer_finishes_its_residual_gemms_in_the_norms(overrides):
    """The GEMMs whose output the residual stack adds and normalises (each attention's output
    projection, each feed-forward block's second layer) hand it over unfinished, to the
    add_layer_norm after them: an encoder layer scales its qkv projection's rows itself (and a
    GELU block's hidden rows, which torch activates), not its other GEMMs'. Outside fastnmt's
    Transformer, every layer finishes its own."""
    model = quantize_int8(_model(**overrides))
    finishing = {name for name, m in model.named_modules() if getattr(m, "finish_in_norm", 0)}
    cfg = model.cfg
    assert finishing == {
        *(f"encoder.{i}.{part}" for i in range(cfg.encoder_layers)
          for part in ("self_attn.out_proj", "ffn.linear2")),
        *(f"decoder.{i}.{part}" for i in range(cfg.decoder_layers)
          for part in ("self_attn.out_proj", "cross_attn.out_proj", "ffn.linear2")),
    }  # fmt: skip
    src = torch.randint(3, 97, (2, 6))
    with torch.inference_mode(), HostOps() as host:
        model.encode(src, torch.tensor([6, 3]))
    scaled = 1 if cfg.activation == "relu" else 2
    assert host.aten.count("scale_rows_") == scaled * cfg.encoder_layers, host.aten
    assert host.aten.count("add_layer_norm_unscaled_cpp") == 2 * cfg.encoder_layers, host.aten
    attention = quantize_int8(nn.ModuleDict({"a": MultiheadAttention(16, 2, batch_first=True)}))
    x = torch.randn(2, 3, 16)
    assert not attention["a"].out_proj.finish_in_norm
    assert isinstance(attention["a"](x, x, x)[0], torch.Tensor)


def test_other_models_get_every_linear_layer_quantized():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    exact = model(x)
    quantize_int8(model)
    assert all(isinstance(model[i], int8_linear(torch.float32)) for i in (0, 2))
    torch.testing.assert_close(model(x), exact, rtol=0.05, atol=0.05)


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match="must be float32"):
        quantize_int8(_model().to(torch.float16))
    assert int8_supported("cpu") == []
    assert "CPUs" in int8_supported("cuda")[0]
    assert "CPUs, not on cuda" in int8_vnni_supported("cuda")[0]
    with pytest.raises(ValueError, match="relu, gelu, silu or None"):
        Int8Linear(torch.randn(2, 2), None, "tanh")


def test_the_translator_translates_in_int8(tmp_path):
    """On a CPU (also where a GPU would be the default device); CUDA is refused in one line."""
    directory = tiny_checkpoint(tmp_path / "ckpt")
    fp32 = Translator.from_checkpoint(directory, precision="fp32")
    int8 = Translator.from_checkpoint(directory, precision="int8", device="cpu")
    refusal = "int8 GEMMs run on CPUs" if torch.cuda.is_available() else "CUDA"
    with pytest.raises(ValueError, match=refusal):
        Translator.from_checkpoint(directory, precision="int8", device="cuda")
    assert isinstance(int8.model.packed_output, int8_linear(int8_activation_dtype("cpu")))
    lines = ["a small test", "another line of text here", ""]
    translated = int8.translate_full(lines, beam=2)
    assert [len(t.candidates) for t in translated] == [1, 1, 0]
    assert len(fp32.translate(lines, beam=2)) == 3


# The int8 models a Translator builds: bf16 activations where the CPU computes bf16 natively,
# float32 ones (oneDNN's GEMMs with VNNI, fbgemm's without) everywhere.
INT8_MODELS = {torch.bfloat16: INT8_BF16, torch.float32: True}


@pytest.fixture(params=list(INT8_MODELS), ids=str)
def int8_activations(request, monkeypatch):
    """Each int8 activation dtype the Translator can run here (others skipped)."""
    if not INT8_MODELS[request.param]:
        pytest.skip("int8 between bf16 activations does not run here")
    monkeypatch.setattr("fastnmt.translator.int8_activation_dtype", lambda _: request.param)
    return request.param


@pytest.mark.parametrize("output_bias", [False, True])
def test_an_int8_translation_does_not_depend_on_its_batch(tmp_path, int8_activations, output_bias):
    """Each sentence translates as it does alone, in a batch of any size (the server batches
    concurrent requests together), n-best scores included: short sentences among long ones too
    (attention's kernel for up to 8 queries takes them whatever the batch's longest)."""
    directory = tiny_checkpoint(tmp_path / "ckpt", output_bias=output_bias)
    translator = Translator.from_checkpoint(directory, precision="int8", device="cpu")
    assert translator.model.packed_output.activation_dtype == int8_activations
    lines = [
        "two young dogs play together in the deep snow .", "a small test", "", "a man in a red "
        "shirt is riding a bike down a busy city street past a very long row of parked cars .",
        "hello", "a group of people stand in front of an old building .",
    ]  # fmt: skip
    batched = translator.translate_full(lines, beam=3, nbest=2)
    translator.max_sentences = 1
    alone = translator.translate_full(lines, beam=3, nbest=2)
    assert [t.candidates for t in alone] == [t.candidates for t in batched]


def test_a_beam_step_reads_the_int8_logits_unscaled(tmp_path, int8_activations, monkeypatch):
    """A bias-free int8 output layer hands its rows and their scales to ``log_softmax_topk``:
    one scaling pass less a step; float32 logits translate bit for bit as when scaled first
    (bf16 ones skip a rounding to bf16, which moves this random model's near-ties)."""
    directory = tiny_checkpoint(tmp_path / "ckpt")
    translator = Translator.from_checkpoint(directory, precision="int8", device="cpu")
    lines = ["two young dogs play together in the deep snow .", "a small test", "hello"]

    def translated_and_scaling_passes():
        with HostOps() as host:  # one step
            translator.translate(lines[1:2], beam=2, max_len_a=0, max_len_b=1)
        return translator.translate_full(lines, beam=3, nbest=2), host.aten.count("scale_rows_")

    fused, passes = translated_and_scaling_passes()
    monkeypatch.delattr(RowInt8Linear, "unscaled")  # the logits scaled first
    scaled_first, more_passes = translated_and_scaling_passes()
    assert more_passes == passes + 1
    if int8_activations == torch.float32:
        assert [t.candidates for t in fused] == [t.candidates for t in scaled_first]


# Packed bf16 GEMMs run where the CPU computes in bf16; elsewhere pack_bf16 refuses in one line
# (the tests below check whichever this machine does).
BF16_PACKING = not bf16_packing_supported("cpu")


def _refused_here():
    return pytest.raises(ValueError, match="pack_bf16: this CPU has no native bf16")


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("shape", [(1, 1, 8), (3, 5, 37), (2, 70, 256)])
def test_bf16_linear_is_as_close_to_float64_as_torch_in_bf16(shape, activation):
    *lead, k = shape
    n = 51
    x = torch.randn(*lead, k).bfloat16()
    weight, bias = (torch.randn(n, k) / k**0.5).bfloat16(), torch.randn(n).bfloat16()
    if not BF16_PACKING:
        with _refused_here():
            pack_bf16(nn.Sequential(nn.Linear(k, n).bfloat16()))
        return
    out = Bf16Linear(weight, bias, activation)(x)
    act = ACTIVATIONS[activation]
    exact = act(F.linear(x.double(), weight.double(), bias.double()))
    assert out.shape == (*lead, n) and out.dtype == torch.bfloat16
    assert_error_within(out, act(F.linear(x, weight, bias)), exact, 2, 1e-3)
    rows = torch.tensor([0, 7, 50])
    narrow = Bf16Linear(weight, bias, activation).rows(rows)
    torch.testing.assert_close(narrow(x), out[..., rows], rtol=0, atol=0)


def test_bf16_gemms_run_at_a_few_row_counts():
    """oneDNN compiles a kernel per shape: a beam search's every row count would each cost one.
    Below 16 rows (a sentence or a few: decoding one at a time) they run unpadded."""
    assert [padded_rows(m) for m in (0, 1, 15, 16, 17, 250, 256, 257, 1000)] == [
        0, 1, 15, 16, 32, 256, 256, 320, 1024,
    ]  # fmt: skip
    assert len({padded_rows(m) for m in range(1, 1025)}) == 15 + 16 + 12
    if not BF16_PACKING:
        return
    x = torch.randn(3, 6, 37).bfloat16()  # 18 rows, run as 32
    weight, bias = torch.randn(51, 37).bfloat16(), torch.randn(51).bfloat16()
    layer = Bf16Linear(weight, bias, "relu")
    unpadded = torch.ops.mkldnn._linear_pointwise(x, layer.packed, bias, *layer.fused)
    torch.testing.assert_close(layer(x), unpadded, rtol=0, atol=0)


def test_a_gemm_reads_the_padded_output_of_the_gemm_before_it_without_a_copy():
    """A padded GEMM's output sliced to its rows is the next GEMM's input (the feed-forward
    block's second): that GEMM reads the padded buffer as it is, and its rows are the unpadded
    GEMM's, bitwise. An input without room past its rows is copied into padded ones."""
    if not BF16_PACKING:
        return
    x = torch.randn(3, 6, 37).bfloat16()  # 18 rows, run as 32
    first = Bf16Linear(torch.randn(64, 37).bfloat16(), None, "gelu")
    second = Bf16Linear(torch.randn(51, 64).bfloat16(), torch.randn(51).bfloat16(), None)
    hidden = first(x)
    with HostOps() as host:
        out = second(hidden)
    assert "copy_" not in host.aten, host.aten
    gemm = torch.ops.mkldnn._linear_pointwise
    unpadded = gemm(hidden, second.packed, second.packed_bias, *second.fused)
    torch.testing.assert_close(out, unpadded, rtol=0, atol=0)
    with HostOps() as host:
        copied = second(hidden.clone())
    assert "copy_" in host.aten, host.aten
    torch.testing.assert_close(copied, unpadded, rtol=0, atol=0)


@pytest.mark.parametrize("overrides", MODEL_VARIANTS)
def test_a_bf16_packed_model_keeps_its_state_dict_and_predictions(overrides):
    model = _model(**overrides)
    exact = _outputs(copy.deepcopy(model).double())[0]
    model = model.to(torch.bfloat16)
    unpacked = _outputs(model)[0]
    if not BF16_PACKING:
        with _refused_here():
            pack_bf16(model)
        return
    packed, step, last = _packed_outputs(model, pack_bf16)
    assert isinstance(model.packed_output, Bf16Linear)
    assert_error_within(packed, unpacked, exact, 2, 1e-3)
    if not overrides:  # ReLU commutes with rounding: the same GEMMs give the same results
        torch.testing.assert_close(packed, unpacked, rtol=0, atol=0)
    torch.testing.assert_close(step, last, rtol=0, atol=0)


def test_bf16_packing_refusals_are_one_line():
    assert "CPUs (oneDNN), not on cuda" in bf16_packing_supported("cuda")[0]
    refusal = "the model must be bfloat16" if BF16_PACKING else "this CPU has no native bf16"
    with pytest.raises(ValueError, match=f"pack_bf16: {refusal}"):
        pack_bf16(_model())  # float32


def test_the_translator_packs_bf16_gemms_where_the_cpu_has_bf16(tmp_path):
    """Same translations as the unpacked bf16 model (a ReLU model: the same GEMMs)."""
    directory = tiny_checkpoint(tmp_path / "ckpt")
    translator = Translator.from_checkpoint(directory, precision="bf16", device="cpu")
    unpacked = Translator(*load_checkpoint(directory), dtype=torch.bfloat16)
    packed = isinstance(translator.model.packed_output, Bf16Linear)
    assert packed == BF16_PACKING and unpacked.model.packed_output is None
    lines = ["a small test", "another line of text here", "", "two dogs play in the snow ."]
    assert translator.translate(lines, beam=2) == unpacked.translate(lines, beam=2)
    fp32 = Translator.from_checkpoint(directory, precision="fp32")
    assert fp32.model.packed_output is None
