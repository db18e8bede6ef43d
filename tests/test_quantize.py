import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastnmt.model import Transformer, preset
from fastnmt.quantize import (
    INT8_LINEARS,
    Bf16Linear,
    Int8Bf16Linear,
    Int8Linear,
    bf16_packing_supported,
    int8_activation_dtype,
    int8_bf16_supported,
    int8_supported,
    pack_bf16,
    padded_rows,
    quantize_int8,
)
from fastnmt.translator import Translator, load_checkpoint

from .helpers import HostOps, assert_error_within, tiny_checkpoint

ACTIVATIONS = {None: lambda y: y, "relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def quantization_bound(x, weight, steps=127):
    """Largest |int8 GEMM - exact| per output (M, N): per-channel symmetric weights (step s_w),
    activations per tensor over [min, max] in ``steps`` steps (7 bits: 127; s_x), each rounded
    by at most half a step: |x dW + dx W + dx dW| summed over K."""
    x = x.reshape(-1, x.shape[-1]).double()
    weight = weight.double()
    s_w = weight.abs().amax(dim=1) / 127  # (N,)
    s_x = (x.max().clamp_min(0) - x.min().clamp_max(0)) / steps
    k = x.shape[1]
    return (
        0.5 * x.abs().sum(1, keepdim=True) * s_w
        + 0.5 * s_x * weight.abs().sum(1)
        + 0.25 * s_x * s_w * k
    )


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("shape", [(1, 1, 8), (3, 5, 37), (2, 70, 256)])
def test_int8_linear_is_within_the_quantization_bound(shape, activation):
    *lead, k = shape
    n = 51
    x, weight, bias = torch.randn(*lead, k) * 2, torch.randn(n, k) / k**0.5, torch.randn(n)
    layer = Int8Linear(weight, bias, activation)
    out = layer(x)
    exact = ACTIVATIONS[activation](F.linear(x.double(), weight.double(), bias.double()))
    # ReLU, GELU and SiLU change by at most 1.13x what their input changes (GELU's steepest).
    bound = 1.13 * quantization_bound(x, weight).view(*lead, n) + 1e-5
    error = (out.double() - exact).abs()
    assert out.shape == (*lead, n) and out.dtype == torch.float32
    assert (error <= bound).all(), f"error {error.max():.3g} over the bound"
    assert error.max() > 0  # really quantized, not an fp32 GEMM


# int8 GEMMs between bf16 activations run where the CPU computes in bf16 (and fastnmt's C++
# kernels, which quantize their inputs, are built); elsewhere quantize_int8 refuses a bf16 model.
INT8_BF16 = not int8_bf16_supported("cpu")


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("shape", [(1, 1, 8), (3, 5, 37), (2, 70, 256)])
def test_int8_bf16_linear_is_within_the_quantization_bound(shape, activation):
    *lead, k = shape
    n = 51
    x = (torch.randn(*lead, k) * 2).bfloat16()
    weight, bias = torch.randn(n, k) / k**0.5, torch.randn(n)
    if not INT8_BF16:
        with pytest.raises(ValueError, match="quantize_int8: "):
            quantize_int8(nn.Sequential(nn.Linear(k, n).bfloat16()))
        return
    layer = Int8Bf16Linear(weight, bias, activation)
    out = layer(x)
    before = F.linear(x.double(), weight.double(), bias.double())
    exact = ACTIVATIONS[activation](before)
    # The quantization's bound, then bf16's rounding of the GEMM's output and of the activation's
    # (each at most 2^-9 relative), the activations changing by at most 1.13x their input's.
    steps = 127 if layer.reduce_range else 255
    bound = quantization_bound(x, weight, steps).view(*lead, n) + 2**-9 * before.abs()
    bound = 1.13 * bound + 2**-9 * exact.abs() + 1e-5
    error = (out.double() - exact).abs()
    assert out.shape == (*lead, n) and out.dtype == torch.bfloat16
    assert (error <= bound).all(), f"error {error.max():.3g} over the bound"
    assert error.max() > 0
    rows = torch.tensor([0, 7, 50])
    narrow = Int8Bf16Linear(weight, bias, activation).rows(rows)
    torch.testing.assert_close(narrow(x), out[..., rows], rtol=0, atol=0)


def _activation_oracle(x: torch.Tensor, steps: int) -> tuple[float, int]:
    """quantize_activations' scale and zero point, in float32 as it computes them."""
    lo, hi = min(x.float().min().item(), 0.0), max(x.float().max().item(), 0.0)
    scale = (torch.tensor(hi) - torch.tensor(lo)).div(steps).item() or 1.0
    return scale, int(min(max(round(-lo / scale), 0), steps))


@pytest.mark.parametrize("reduce_range", [False, True], ids=["8-bit", "7-bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "values",
    ["normal", "positive", "negative", "zeros", "one"],
)
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (70, 256)], ids=str)
def test_activations_are_quantized_to_within_half_a_step(shape, values, dtype, reduce_range):
    """Every value within half a step once dequantized, 0.0 exactly at the zero point, the
    range [min(x, 0), max(x, 0)] in 255 steps (127 with reduce_range), the padded rows there."""
    x = {
        "normal": lambda: torch.randn(shape) * 3,
        "positive": lambda: torch.rand(shape) + 0.5,
        "negative": lambda: -torch.rand(shape) - 0.5,
        "zeros": lambda: torch.zeros(shape),
        "one": lambda: torch.ones(shape),
    }[values]().to(dtype)
    if values == "normal":
        x.view(-1)[0] = 0.0
    steps = 127 if reduce_range else 255
    padded = padded_rows(shape[0]) + 3
    q, scale, zero_point = torch.ops.fastnmt.quantize_activations(x, padded, reduce_range)
    assert q.shape == (padded, shape[1]) and q.dtype == torch.uint8
    assert (scale.dtype, zero_point.dtype) == (torch.float32, torch.int64)
    expected_scale, expected_zero = _activation_oracle(x, steps)
    assert scale.item() == pytest.approx(expected_scale, rel=1e-6)
    assert zero_point.item() == expected_zero
    q = q[: shape[0]].double()
    assert q.max() <= steps
    dequantized = (q - zero_point.item()) * scale.item()
    error = (dequantized - x.double()).abs()
    assert (error <= 0.5 * scale.item() * (1 + 1e-5)).all(), error.max()
    assert torch.equal(q[x == 0], torch.full_like(q[x == 0], float(zero_point.item())))


def test_activation_quantizer_refusals_are_one_line():
    quantize = torch.ops.fastnmt.quantize_activations
    for x, padded, reason in [
        (torch.zeros(2, 3, 4), 2, "must be \\(rows, K\\)"),
        (torch.zeros(2, 4, dtype=torch.float16), 2, "float32 or bfloat16"),
        (torch.zeros(5, 4), 4, "padded_rows must be >= 5"),
    ]:
        with pytest.raises(RuntimeError, match=reason) as error:
            quantize(x, padded, False)
        assert len(str(error.value).strip().splitlines()) == 1


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
    assert isinstance(model.packed_output, INT8_LINEARS[dtype])
    # The yardstick: the same model with bf16 weights (int8 measured 2.7x to 2.8x its error;
    # int8 between bf16 activations, up to 3.5x).
    error, bf16_error = ((x.float() - exact).abs().max() for x in (quantized, bf16))
    assert 0 < error <= 5 * bf16_error, (error, bf16_error)
    assert (quantized.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(step, last, rtol=0, atol=0)


def test_other_models_get_every_linear_layer_quantized():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    exact = model(x)
    quantize_int8(model)
    assert all(isinstance(model[i], Int8Linear) for i in (0, 2))
    torch.testing.assert_close(model(x), exact, rtol=0.05, atol=0.05)


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match="must be float32"):
        quantize_int8(_model().to(torch.float16))
    assert int8_supported("cpu") == []
    assert "CPUs" in int8_supported("cuda")[0]
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
    assert isinstance(int8.model.packed_output, INT8_LINEARS[int8_activation_dtype("cpu")])
    lines = ["a small test", "another line of text here", ""]
    translated = int8.translate_full(lines, beam=2)
    assert [len(t.candidates) for t in translated] == [1, 1, 0]
    assert len(fp32.translate(lines, beam=2)) == 3


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
