"""CPU inference GEMMs on weights packed once: ``quantize_int8(model)`` runs a model's linear
layers (attention projections, feed-forward, output layer) as int8 GEMMs, ``pack_bf16(model)``
as bf16 GEMMs on weights in oneDNN's blocked layout.

int8 math (dynamic quantization). A weight W (N, K) is quantized once, per output channel and
symmetrically: s_w[n] = max_k |W[n, k]| / 127, Q_w = round(W / s_w) in int8, and

    y[m, n] = s_x s_w[n] sum_k (Q_x[m, k] - z) Q_w[n, k] + b[n],

with the sum exact in int32, where the activations x (M, K) are quantized at every call.

A bf16 model's GEMMs run in oneDNN (``Int8Bf16Linear``): its activations stay bf16 between the
GEMMs (attention, LayerNorm and the logits at half the memory traffic) and oneDNN's VNNI kernels
multiply 1.7-1.8x as fast as its bf16 ones at decoding shapes on an AVX512-BF16 CPU without AMX
(1,024 x 256 x 1,024: 1,690 against 1,000 GFLOP/s on 2 cores). Each row of x has its own scale
(CTranslate2's scheme): s_x[m] = max_k |x[m, k]| / 127 around the fixed zero point z = 128, so a
row's result, bit for bit, never depends on the other rows of its batch (one scale per batch
would let its largest row coarsen every other row's steps, and cost BLEU). oneDNN takes one
activation scale per call, so the GEMM runs at scale 1 and writes s_w[n] sum_k ...; each row is
then multiplied by its s_x[m] and the bias added (``fastnmt::scale_rows_``), or, between the
feed-forward block's two GEMMs, on the way into the second's quantizer (``then``).

A float32 model's GEMMs run the same way, with float32 outputs: in oneDNN where the CPU has VNNI
(``Int8VnniLinear``), elsewhere in fbgemm (``Int8Linear``, on weights prepacked once into its GEMM
layout), whose GEMM of float inputs, given each row's q - z at scale 1 and zero point z,
reproduces ``quantize_rows``' bytes. Without VNNI activations use 7 bits (``reduce_range``: 63
steps either side of z = 64 per row): there the u8 x s8 multiply-add (vpmaddubsw) saturates its
int16 pair sums at 8 bits; 7 bits cannot saturate.

bf16: the same GEMM as ``F.linear`` on bf16 tensors (oneDNN's, fp32 accumulation; equal results),
but ``F.linear`` reorders the (N, K) weight into oneDNN's blocked layout at every call, which the
packed copy does once: measured 1.4-1.8x faster per GEMM at decoding shapes on an AMX CPU (M 4 to
1,024 rows, K and N 256 to 8,000), and ReLU, GELU and SiLU fused into the GEMM's output stage.

Only inference: the parameters stay (the state_dict is unchanged), the packed copies are plain
attributes (as much memory again as the GEMMs' weights; oneDNN's int8 layers small enough to
multiply a few rows through ``torch._int_mm`` keep a second int8 copy for it), nothing here has
a backward.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from fastnmt.attention import MultiheadAttention
from fastnmt.model import FeedForward, Transformer
from fastnmt.ops.add_layer_norm import UnscaledRows
from fastnmt.ops.extension import extension_available, extension_status

# Post-GEMM activations; ReLU is applied with the int8 GEMMs' row scales (scale_rows_).
_ACTIVATIONS = {"relu": None, "gelu": F.gelu, "silu": F.silu, None: None}
# oneDNN's fused output stages (torch.ops.mkldnn._linear_pointwise's attr, scalars, algorithm).
_ONEDNN_ACTIVATIONS = {
    None: ("none", [], ""),
    "relu": ("relu", [], ""),
    "gelu": ("gelu", [], "none"),  # exact (erf) GELU, as F.gelu
    "silu": ("swish", [], ""),
}


def int8_supported(device: torch.device | str) -> list[str]:
    """Why int8 inference cannot run on ``device``: empty when it can."""
    reasons = []
    if torch.device(device).type != "cpu":
        reasons.append(f"int8 GEMMs run on CPUs (fbgemm), not on {torch.device(device).type}")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        reasons.append("this PyTorch build has no fbgemm int8 GEMMs")
    return reasons


def int8_bf16_supported(device: torch.device | str) -> list[str]:
    """Why int8 GEMMs between bf16 activations (``Int8Bf16Linear``) cannot run on ``device``:
    empty when they can."""
    reasons = bf16_packing_supported(device)
    if not extension_available():  # its activations' quantizer
        reasons.append(extension_status())
    return reasons


def int8_vnni_supported(device: torch.device | str) -> list[str]:
    """Why int8 GEMMs between float32 activations quantized row by row (``Int8VnniLinear``)
    cannot run on ``device``: empty when they can."""
    if torch.device(device).type != "cpu":
        return [f"oneDNN's int8 GEMMs run on CPUs, not on {torch.device(device).type}"]
    reasons = [] if torch.backends.mkldnn.is_available() else ["this PyTorch build has no oneDNN"]
    if not torch.cpu._is_vnni_supported():
        reasons.append("this CPU has no AVX-512 VNNI (fbgemm's int8 GEMMs run there instead)")
    if not extension_available():  # its activations' quantizer
        reasons.append(extension_status())
    return reasons


def int8_activation_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype a model quantized for ``device`` runs its activations in: bf16 (oneDNN's int8
    GEMMs, ``Int8Bf16Linear``) where they can run, else float32 (``int8_linear``'s GEMMs)."""
    return torch.float32 if int8_bf16_supported(device) else torch.bfloat16


def bf16_packing_supported(device: torch.device | str) -> list[str]:
    """Why packed bf16 GEMMs cannot run on ``device``: empty when they can."""
    if torch.device(device).type != "cpu":
        return [f"packed bf16 GEMMs run on CPUs (oneDNN), not on {torch.device(device).type}"]
    if not torch.backends.mkldnn.is_available():
        return ["this PyTorch build has no oneDNN"]
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return ["this CPU has no native bf16 (AVX512-BF16 or AMX)"]
    return []


class PackedLinear(nn.Module):
    """``y = activation(x W^T + b)`` with W packed once, by a subclass's ``_pack``.

    ``activation``: None, relu, gelu or silu.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activation=None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be relu, gelu, silu or None, got {activation!r}")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self._source = (weight, bias, activation)  # what ``rows`` packs from (references)
        self._pack(weight.detach(), None if bias is None else bias.detach(), activation)

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None, activation) -> None:
        raise NotImplementedError

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation=None) -> PackedLinear:
        """In ``linear``'s place: it keeps its parameters, so the state_dict is unchanged."""
        new = cls(linear.weight, linear.bias, activation)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def rows(self, index: torch.Tensor) -> PackedLinear:
        """The layer of output channels ``index`` only (a vocabulary shortlist's output layer),
        packed from the float weights (int8: per-channel scales make it equal to these rows)."""
        weight, bias, activation = self._source
        return type(self)(weight[index], None if bias is None else bias[index], activation)

    def then(self, second: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        """``second(self(x))``: two layers in a row (a feed-forward block), which a subclass may
        fuse."""
        return second(self(x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (N, K) quantized per output channel, symmetrically: a qint8 tensor of scales
    max_k |W[n, k]| / 127 and zero points 0."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long, device=weight.device)
    with warnings.catch_warnings():  # PyTorch marks quantized tensors for a future removal
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)


class RowInt8Linear(PackedLinear):
    """An int8 GEMM between activations of ``activation_dtype``: x (..., K) -> (..., N), the input
    quantized row by row at every call (``fastnmt::quantize_rows``), the rows' scales, the bias
    and ReLU applied after the GEMM (``fastnmt::scale_rows_``). A subclass packs the weight
    (``_pack_weight``) and multiplies (``_gemm_of``)."""

    activation_dtype: torch.dtype
    as_float = False  # whether the GEMM takes q - z as float32 (fbgemm's) rather than bytes
    # Whether the layer hands its output over unfinished (UnscaledRows) to the add_layer_norm
    # that adds it to the residual stream (set by _finish_in_norms).
    finish_in_norm = False

    def _pack(self, weight, bias, activation) -> None:
        """The per-channel int8 weight (``_pack_weight``) and the fp32 bias."""
        self._pack_weight(_int8_weight(weight))
        self.packed_bias = None if bias is None else bias.float()
        self.relu = activation == "relu"
        self.activation = _ACTIVATIONS[activation]
        self.reduce_range = not torch.cpu._is_vnni_supported()
        self.zero_point = 64 if self.reduce_range else 128  # quantize_rows' z (h + 1)

    def _pack_weight(self, quantized: torch.Tensor) -> None:
        raise NotImplementedError

    def _padded_rows(self, rows: int) -> int:
        """The row count the GEMM runs ``rows`` rows at."""
        return padded_rows(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        y, scales = self._gemm(x.reshape(rows, self.in_features))
        return self._finished(y, scales, x.shape[:-1])

    def then(self, second: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        """``second(self(x))``; when ``second`` quantizes rows too, this layer's output is
        scaled, biased and activated on the way into ``second``'s quantizer (one pass over it
        less)."""
        if not isinstance(second, RowInt8Linear) or self.activation is not None:
            return second(self(x))
        rows = x.numel() // self.in_features
        y, scales = self._gemm(x.reshape(rows, self.in_features))
        quantized = second._quantize(_unpadded(y, rows), scales, self.packed_bias, self.relu)
        return second._finished(*second._gemm_of(quantized), x.shape[:-1])

    def unscaled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (M, K) -> (y, scales): the layer's output is y (M, N) times each row's scale, or y
        itself when scales is None (a layer with a bias or an activation): for a consumer that
        applies the scales as it reads y (scoring's row kernel), one pass over y less."""
        if self.packed_bias is not None or self.relu or self.activation is not None:
            return self(x), None
        y, scales = self._gemm(x)
        return _unpadded(y, x.shape[0]), scales

    def _quantize(self, x: torch.Tensor, scales=None, bias=None, relu=False):
        """x (rows, K) quantized row by row (after act(x scales + bias), a previous GEMM's
        unscaled output, when ``scales`` is given): (q, the rows' scales) for ``_gemm_of``."""
        padded = self._padded_rows(x.shape[0])
        quantize = torch.ops.fastnmt.quantize_rows
        return quantize(x, padded, self.reduce_range, scales, bias, relu, self.as_float)

    def _gemm(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (rows, K) quantized row by row and multiplied: ``_gemm_of``'s (y, scales)."""
        return self._gemm_of(self._quantize(x))

    def _gemm_of(self, quantized: tuple[torch.Tensor, torch.Tensor]):
        """The GEMM of ``_quantize``'s rows: (y, their scales), y (padded rows, N) still to be
        multiplied by each row's scale (the weight's are applied)."""
        raise NotImplementedError

    def _finished(self, y: torch.Tensor, scales: torch.Tensor, lead: torch.Size):
        """The layer's output (*lead, N) from ``_gemm_of``'s; with ``finish_in_norm``, as
        UnscaledRows."""
        y = _unpadded(y, scales.shape[0])
        if self.finish_in_norm:
            return UnscaledRows(y.view(*lead, self.out_features), scales, self.packed_bias)
        torch.ops.fastnmt.scale_rows_(y, scales, self.packed_bias, self.relu)
        y = y.view(*lead, self.out_features)
        return y if self.activation is None else self.activation(y)


def _unpadded(y: torch.Tensor, rows: int) -> torch.Tensor:
    """A padded GEMM's output's first ``rows`` rows (y itself when it has no more)."""
    return y if y.shape[0] == rows else y[:rows]


class Int8Linear(RowInt8Linear):
    """An int8 GEMM (fbgemm) between float32 activations (CPUs without VNNI). fbgemm's GEMM of
    float inputs quantizes them itself: given the rows' q - z (integers) at scale 1 and zero
    point z, it rebuilds ``quantize_rows``' bytes exactly."""

    activation_dtype = torch.float32
    as_float = True

    def _pack_weight(self, quantized: torch.Tensor) -> None:
        self.packed = torch.ops.quantized.linear_prepack(quantized, None)

    def _padded_rows(self, rows: int) -> int:
        return rows  # fbgemm compiles no kernel per row count

    def _gemm_of(self, quantized: tuple[torch.Tensor, torch.Tensor]):
        q, scales = quantized
        gemm = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
        return gemm(q, 1.0, self.zero_point, self.packed), scales


# GEMMs of up to this many multiply-adds take ``fastnmt::int8_mm`` (torch._int_mm), larger ones
# oneDNN's qlinear_pointwise, which builds its primitive descriptor at every call: about 20 us
# whatever the shape, against 4-8 us for one row (a greedy step's GEMMs), 8-14 us for four (a
# sentence's beam) on a Zen 5 core; from 2^22 on (64 x 256 x 256, 16 x 256 x 1024,
# 4 x 256 x 8000) qlinear's blocked kernels are as fast or faster.
FEW_ROWS_MACS = 1 << 22


class OnednnInt8Linear(RowInt8Linear):
    """An int8 GEMM (oneDNN) between activations of ``activation_dtype`` (a subclass's): a GEMM
    of a few rows through ``torch._int_mm`` (``FEW_ROWS_MACS``; the same results, bit for bit),
    others through oneDNN's qlinear_pointwise on the weight in oneDNN's layout."""

    def _pack_weight(self, quantized: torch.Tensor) -> None:
        """The weight in oneDNN's layout, and as int8 (K, N) for ``torch._int_mm``."""
        self.few_rows = FEW_ROWS_MACS // max(self.in_features * self.out_features, 1)
        weight = quantized.int_repr()
        self.packed = torch.ops.onednn.qlinear_prepack(weight, None)
        self.int8_weight = weight.t() if self.few_rows else None
        self.scales = quantized.q_per_channel_scales().float()
        self.zero_points = quantized.q_per_channel_zero_points()

    def _padded_rows(self, rows: int) -> int:
        return rows if rows <= self.few_rows else padded_rows(rows)  # no kernel per row count

    def _gemm_of(self, quantized: tuple[torch.Tensor, torch.Tensor]):
        q, scales = quantized
        if q.shape[0] <= self.few_rows:
            y = torch.ops.fastnmt.int8_mm(
                q, self.int8_weight, self.scales, self.zero_point, self.activation_dtype
            )
            return y, scales
        y = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, self.zero_point, self.packed, self.scales, self.zero_points, None,
            1.0, 0, self.activation_dtype, "none", [], "",
        )  # fmt: skip
        return y, scales


class Int8Bf16Linear(OnednnInt8Linear):
    """An int8 GEMM (oneDNN) between bf16 activations (CPUs with native bf16)."""

    activation_dtype = torch.bfloat16


class Int8VnniLinear(OnednnInt8Linear):
    """An int8 GEMM (oneDNN) between float32 activations (CPUs with VNNI but no native bf16)."""

    activation_dtype = torch.float32


def int8_linear(dtype: torch.dtype) -> type[PackedLinear]:
    """The int8 GEMM of a model whose activations are ``dtype`` (``int8_activation_dtype``):
    float32 ones multiplied by oneDNN where it has VNNI kernels (beam 4 1.03-1.17x as fast as
    fbgemm's on a Zen 5 EPYC), else by fbgemm."""
    if dtype == torch.bfloat16:
        return Int8Bf16Linear
    return Int8Linear if int8_vnni_supported("cpu") else Int8VnniLinear


class Bf16Linear(PackedLinear):
    """A bf16 GEMM on a weight in oneDNN's blocked layout, activation fused; x (..., K) bf16 ->
    (..., N) bf16."""

    def _pack(self, weight, bias, activation) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.packed_bias = bias
        self.fused = _ONEDNN_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        padded = padded_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.packed_bias, *self.fused)
        flat = _padded_input(x, rows, padded, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.packed_bias, *self.fused)
        return y[:rows].view(*x.shape[:-1], self.out_features)


def _padded_input(x: torch.Tensor, rows: int, padded: int, width: int) -> torch.Tensor:
    """x's ``rows`` rows as the first of ``padded``: a view of the buffer x starts, where it has
    the room (a padded GEMM's output, sliced: the next GEMM's input, as between the feed-forward
    block's two), else a copy. The other rows hold whatever is there: a GEMM's output rows each
    depend on their own input row only, and those rows' outputs are sliced off."""
    room = x.untyped_storage().nbytes() // x.element_size()
    if x.is_contiguous() and x.storage_offset() == 0 and room >= padded * width:
        return x.as_strided((padded, width), (width, 1))
    flat = x.new_empty(padded, width)
    flat[:rows] = x.reshape(rows, width)
    return flat


def padded_rows(rows: int) -> int:
    """The row count a GEMM of ``rows`` rows runs at: oneDNN compiles a kernel for each distinct
    shape (2.3 ms, against 80 us for a cached 240 x 256 x 768 GEMM), and a beam search's row
    count takes every value as sentences finish; padding to a multiple of 16 (64 past 256) keeps
    that to a few dozen shapes per weight. Fewer than 16 rows (a sentence or a few decoded at a
    time) run as they are: 15 more shapes, and no copy into a padded input and slice of the
    output at every GEMM (beam 4 on one sentence: 2,182 top-level aten ops against 3,640)."""
    if rows < 16:
        return rows
    step = 16 if rows <= 256 else 64
    return -(-rows // step) * step


def _attention_projections(module: MultiheadAttention, linear: type[PackedLinear]):
    """Packed rows of ``in_proj_weight`` for each part ``_in_projections`` asks for."""
    bias = module.in_proj_bias
    return nn.ModuleDict(
        {
            part: linear(module.in_proj_weight[rows], None if bias is None else bias[rows])
            for part, rows in module.projection_rows.items()
        }
    )


def _pack_model(model: nn.Module, linear: type[PackedLinear]) -> nn.Module:
    """fastnmt's ``Transformer`` gets packed attention projections, feed-forward layers and
    output layer (the embedding lookup stays as it is); in any other model, every ``nn.Linear``
    and fastnmt ``MultiheadAttention`` is packed."""
    for module in list(model.modules()):
        if isinstance(module, MultiheadAttention) and module.in_proj_weight is not None:
            module.packed_projections = _attention_projections(module, linear)
        if isinstance(module, FeedForward):
            module.linear1 = linear.from_linear(module.linear1, module.cfg.activation)
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, linear.from_linear(child))
        if isinstance(module, Transformer):
            module.packed_output = linear(module.embedding.weight, module.output_bias)
    if issubclass(linear, RowInt8Linear):
        for module in model.modules():
            if isinstance(module, Transformer):
                _finish_in_norms(module)
    return model


def _finish_in_norms(model: Transformer) -> None:
    """The int8 GEMMs whose output the residual stack adds and normalises, each attention's
    output projection and each feed-forward block's second layer, hand it over unfinished: the
    add_layer_norm applies its rows' scales and its bias as it reads it (no pass of their own,
    ``scale_rows_``)."""
    for layer in [*model.encoder, *model.decoder]:
        for module in layer.modules():
            if isinstance(module, MultiheadAttention):
                module.out_proj.finish_in_norm = True
            if isinstance(module, FeedForward):
                module.linear2.finish_in_norm = True


def _check_model(name: str, model: nn.Module, supported, dtype: torch.dtype) -> None:
    weights = list(model.parameters())
    if reasons := supported(weights[0].device if weights else "cpu"):
        raise ValueError(f"{name}: {'; '.join(reasons)}")
    if any(p.dtype != dtype for p in weights):
        kind = str(dtype).removeprefix("torch.")
        raise ValueError(f"{name}: the model must be {kind} (it packs {kind} weights)")


@torch.no_grad()
def quantize_int8(model: nn.Module) -> nn.Module:
    """``model`` (on the CPU) with int8 GEMMs for inference, in place; returns it. A bf16
    model's run in oneDNN between bf16 activations (``Int8Bf16Linear``, where the CPU computes
    bf16 natively: ``int8_activation_dtype``), a float32 model's in oneDNN where the CPU has VNNI
    (``Int8VnniLinear``), else in fbgemm (``Int8Linear``).

    Which layers: see ``_pack_model``. Raises ValueError if int8 cannot run on this machine or
    the model is neither float32 nor (where supported) bf16 on the CPU.
    """
    weights = list(model.parameters())
    if weights and weights[0].dtype == torch.bfloat16:
        _check_model("quantize_int8", model, int8_bf16_supported, torch.bfloat16)
    else:
        _check_model("quantize_int8", model, int8_supported, torch.float32)
    return _pack_model(model, int8_linear(weights[0].dtype if weights else torch.float32))


@torch.no_grad()
def pack_bf16(model: nn.Module) -> nn.Module:
    """``model`` (bf16, on a CPU with native bf16) with packed bf16 GEMMs for inference, in
    place; returns it. Same layers as ``quantize_int8``, same results as the unpacked model.
    Raises ValueError if this machine cannot run them or the model is not bf16 on the CPU.
    """
    _check_model("pack_bf16", model, bf16_packing_supported, torch.bfloat16)
    return _pack_model(model, Bf16Linear)
