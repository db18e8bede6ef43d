"""int8 inference on CPUs: ``quantize_int8(model)`` runs a model's linear layers (attention
projections, feed-forward, output layer) as int8 GEMMs.

Math (dynamic quantization, the scheme of CTranslate2's and fbgemm's int8 GEMMs). A weight W (N, K)
is quantized once, per output channel and symmetrically: s_w[n] = max_k |W[n, k]| / 127,
Q_w = round(W / s_w) in int8. At every call the activations x (M, K) are quantized per tensor to
uint8 over [min x, max x] (scale s_x, zero point z), and

    y[m, n] = s_x s_w[n] sum_k (Q_x[m, k] - z) Q_w[n, k] + b[n],

with the sum exact in int32. fbgemm computes it with weights prepacked once into its GEMM layout.
Activations use 7 bits (``reduce_range``): without AVX512-VNNI, the u8 x s8 multiply-add
(vpmaddubsw) saturates its int16 pair sums at 8 bits; 7 bits cannot saturate.

Only inference: the fp32 parameters stay (the state_dict is unchanged), the packed int8 copies are
plain attributes, nothing here has a backward.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from fastnmt.attention import MultiheadAttention
from fastnmt.model import FeedForward, Transformer

# Post-GEMM activations; fbgemm fuses ReLU into the GEMM's output stage.
_ACTIVATIONS = {"relu": None, "gelu": F.gelu, "silu": F.silu, None: None}


def int8_supported(device: torch.device | str) -> list[str]:
    """Why int8 inference cannot run on ``device``: empty when it can."""
    reasons = []
    if torch.device(device).type != "cpu":
        reasons.append(f"int8 GEMMs run on CPUs (fbgemm), not on {torch.device(device).type}")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        reasons.append("this PyTorch build has no fbgemm int8 GEMMs")
    return reasons


def _pack(weight: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's prepacked per-channel int8 weight (and fp32 bias)."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long, device=weight.device)
    with warnings.catch_warnings():  # PyTorch marks quantized tensors for a future removal
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
    bias = None if bias is None else bias.detach().float()
    return torch.ops.quantized.linear_prepack(quantized, bias)


class Int8Linear(nn.Module):
    """``y = activation(x W^T + b)`` as an int8 GEMM; x (..., K) float32 -> (..., N) float32.

    ``activation``: None, relu (fused into the GEMM), gelu or silu.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activation=None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be relu, gelu, silu or None, got {activation!r}")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = _pack(weight, bias)
        self._source = (weight, bias, activation)  # what ``rows`` packs from (references)
        self.fused_relu = activation == "relu"
        self.activation = _ACTIVATIONS[activation]

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation=None) -> Int8Linear:
        """In ``linear``'s place: it keeps its parameters, so the state_dict is unchanged."""
        new = cls(linear.weight, linear.bias, activation)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def rows(self, index: torch.Tensor) -> Int8Linear:
        """The layer of output channels ``index`` only (a vocabulary shortlist's output layer),
        packed from the float weights: per-channel scales make it equal to these rows."""
        weight, bias, activation = self._source
        return Int8Linear(weight[index], None if bias is None else bias[index], activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized = torch.ops.quantized
        gemm = quantized.linear_relu_dynamic if self.fused_relu else quantized.linear_dynamic
        y = gemm(x.float(), self.packed, True)
        return y if self.activation is None else self.activation(y)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _attention_projections(module: MultiheadAttention) -> nn.ModuleDict:
    """Packed rows of ``in_proj_weight`` for each part ``_in_projection`` asks for."""
    bias = module.in_proj_bias
    return nn.ModuleDict(
        {
            part: Int8Linear(module.in_proj_weight[rows], None if bias is None else bias[rows])
            for part, rows in module.projection_rows.items()
        }
    )


@torch.no_grad()
def quantize_int8(model: nn.Module) -> nn.Module:
    """``model`` (fp32, on the CPU) with int8 GEMMs for inference, in place; returns it.

    fastnmt's ``Transformer`` gets int8 attention projections, feed-forward layers and output
    layer (the embedding lookup stays fp32); in any other model, every ``nn.Linear`` and fastnmt
    ``MultiheadAttention`` is converted. Raises ValueError if int8 cannot run on this machine or
    the model is not fp32 on the CPU.
    """
    weights = list(model.parameters())
    if reasons := int8_supported(weights[0].device if weights else "cpu"):
        raise ValueError(f"quantize_int8: {'; '.join(reasons)}")
    if any(p.dtype != torch.float32 for p in weights):
        raise ValueError("quantize_int8: the model must be float32 (it quantizes fp32 weights)")
    for module in list(model.modules()):
        if isinstance(module, MultiheadAttention) and module.in_proj_weight is not None:
            module.packed_projections = _attention_projections(module)
        if isinstance(module, FeedForward):
            module.linear1 = Int8Linear.from_linear(module.linear1, module.cfg.activation)
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, Int8Linear.from_linear(child))
        if isinstance(module, Transformer):
            module.packed_output = Int8Linear(module.embedding.weight, module.output_bias)
    return model
