"""The cases ``python -m fastnmt.compile_check`` compiles: every Triton kernel of the ops with
every launch configuration a GPU uses, each with its compile signature.

The tooling reads the ops' kernels and configuration tables; the ops know nothing of it. A
signature type "*DTYPE" is replaced by the case's data type (fp16, bf16) by the compile check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastnmt.ops.triton import add_layer_norm as norm_triton
from fastnmt.ops.triton import attention as attention_triton
from fastnmt.ops.triton import attention_kernels
from fastnmt.ops.triton import common as triton_common
from fastnmt.ops.triton import feed_forward as ffn_triton
from fastnmt.ops.triton import linear_cross_entropy as loss_triton


@dataclass(frozen=True)
class CompileCase:
    """One kernel with one launch configuration."""

    kernel: Any  # the @triton.jit function
    signature: dict[str, str]  # argument -> Triton type ("*fp16", "i32", "fp32", "constexpr")
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    needs_wgmma: bool = False  # a tl.dot kernel: sm_90 must use warpgroup MMA
    label: str = field(default="")  # the configuration, for the table

    @property
    def name(self) -> str:
        return self.kernel.__name__


# ---------------------------------------------------------------------------------------------
# Attention: every kernel x every GPU launch config.
# ---------------------------------------------------------------------------------------------

_ATTENTION_POINTERS = {"LSE": "*fp32", "DELTA": "*fp32", "GRAD_LSE": "*fp32", "PADDING": "*u8"}
_ATTENTION_POINTERS |= {"KEY_LENGTHS": "*i64", "SEED": "*i64", "KEEP": "*u8", "CACHE_ROWS": "*i64"}
_ATTENTION_POINTERS |= {"CU_SEQLENS_Q": "*i64", "CU_SEQLENS_K": "*i64"}


def _attention_argument_type(name: str, constexprs: dict) -> str:
    """The compile signature type of a kernel argument, from its name."""
    if name in constexprs:
        return "constexpr"
    if name.startswith("stride_") or name in ("H", "Lq", "Lk", "D", "Dv", "total_q"):
        return "i32"
    if name in ("scale", "dropout_p"):
        return "fp32"
    return _ATTENTION_POINTERS.get(name, "*DTYPE")  # inputs and outputs have the inputs' dtype


def attention_cases() -> list[CompileCase]:
    """Every kernel x every GPU launch config, for ``python -m fastnmt.compile_check``, at the
    widest head dim each config serves, all mask features and dropout on: the most registers;
    and each over packed sequences (``attention_varlen``: causal and dropout, no other mask)."""
    flags = dict(CAUSAL=True, HAS_LENGTHS=True, HAS_PADDING=True, DROPOUT=True)
    flags["DOT_PRECISION"] = "ieee"  # what fp16 and bf16 get: TF32 is for fp32 operands

    def case(kernel, config, needs_wgmma: bool, label: str, **constexprs) -> CompileCase:
        signature = {name: _attention_argument_type(name, constexprs) for name in kernel.arg_names}
        return CompileCase(
            kernel, signature, constexprs, config.num_warps, config.num_stages, needs_wgmma, label
        )

    kernels = {
        "forward": attention_kernels._attention_forward_kernel,
        "dkdv": attention_kernels._attention_backward_dkdv_kernel,
        "dq": attention_kernels._attention_backward_dq_kernel,
    }
    cases = []
    for name, kernel in kernels.items():
        for bucket, configs in attention_triton._GPU_CONFIGS[name].items():
            # each kernel's own flags: decoding steps read caches through their rows
            own = {
                "forward": dict(HAS_CACHE_ROWS=bucket == "decode"),
                "dkdv": {},
                "dq": dict(HAS_GRAD_LSE=True),
            }
            for widest, config in configs.items():
                sizes = dict(flags, BLOCK_M=config.block_m, BLOCK_N=config.block_n)
                sizes |= dict(BLOCK_D=widest, BLOCK_DV=widest, UPCAST=False)
                label = f"{bucket} D<={widest} {config.label}"
                # Every backward dot product has a 64-row side (wgmma's tile); the 16-row decoding
                # forward uses mma.sync.
                wgmma = name in ("dkdv", "dq") or (name == "forward" and config.block_m >= 64)
                cases.append(case(kernel, config, wgmma, label, **sizes, **own[name], VARLEN=False))
                packed = dict(HAS_LENGTHS=False, HAS_PADDING=False, VARLEN=True)
                packed |= {flag: False for flag in own[name]}  # no cache rows; the LSE unused
                cases.append(case(kernel, config, wgmma, f"{label} varlen", **sizes | packed))
    keep = attention_triton._KEEP_CONFIG
    blocks = dict(BLOCK_M=keep.block_m, BLOCK_N=keep.block_n)
    cases.append(case(attention_kernels._dropout_keep_kernel, keep, False, keep.label, **blocks))
    return cases


# ---------------------------------------------------------------------------------------------
# Residual + LayerNorm: both kernels at small, middle and largest widths.
# ---------------------------------------------------------------------------------------------

_LAYER_NORM_FLAGS = ("HAS_RESIDUAL", "HAS_WEIGHT", "HAS_BIAS", "HAS_DROPOUT")


def _layer_norm_case(kernel, tensors: tuple[str, ...], flags: tuple[str, ...], width: int):
    with triton_common.gpu_tiles():  # what a GPU launches, whatever this process runs on
        block_m, block_n, num_warps = norm_triton._tile(1 << 20, width)
    constexprs = {**dict.fromkeys(flags, True), "BLOCK_M": block_m, "BLOCK_N": block_n}
    signature = {
        **{
            name: "*fp32" if name in ("MEAN", "RSTD") or "PARTIAL" in name else "*DTYPE"
            for name in tensors
        },
        "SEED": "*i64",
        "rows": "i32",
        "N": "i32",
        **({"eps": "fp32"} if kernel is norm_triton._add_layer_norm_forward_kernel else {}),
        "dropout_p": "fp32",
        **dict.fromkeys(constexprs, "constexpr"),
    }
    label = f"width {width}: {block_m}x{block_n} w{num_warps}"
    return CompileCase(kernel, signature, constexprs, num_warps=num_warps, label=label)


def layer_norm_cases() -> list[CompileCase]:
    """Forward and backward with every input and dropout, at the tiles of widths 64, 1024 and
    the widest row (MAX_WIDTH); the sums of dweight and dbias over the backward's programs."""
    forward = ("X", "R", "W", "B", "Y", "H", "MEAN", "RSTD")
    backward = ("DY", "DH_OUT", "H", "W", "MEAN", "RSTD", "DX", "DH", "DW_PARTIAL", "DB_PARTIAL")
    block_p, block = norm_triton._SUM_TILE
    sums = CompileCase(
        norm_triton._sum_partials_kernel,
        dict.fromkeys(("DW_PARTIAL", "DB_PARTIAL"), "*fp32")
        | dict.fromkeys(("DW", "DB"), "*DTYPE")  # the parameters' dtype
        | {"programs": "i32", "N": "i32"}
        | dict.fromkeys(("HAS_WEIGHT", "HAS_BIAS", "BLOCK_P", "BLOCK"), "constexpr"),
        {"HAS_WEIGHT": True, "HAS_BIAS": True, "BLOCK_P": block_p, "BLOCK": block},
        label=f"{block_p}x{block}",
    )
    return [sums] + [
        case
        for width in (64, 1024, norm_triton.MAX_WIDTH)
        for case in (
            _layer_norm_case(
                norm_triton._add_layer_norm_forward_kernel,
                forward,
                (*_LAYER_NORM_FLAGS, "HAS_STATISTICS"),
                width,
            ),
            _layer_norm_case(
                norm_triton._add_layer_norm_backward_kernel,
                backward,
                (*_LAYER_NORM_FLAGS, "HAS_DH_OUT"),
                width,
            ),
        )
    ]


# ---------------------------------------------------------------------------------------------
# Feed-forward: every GEMM configuration with each epilogue, and the elementwise kernels.
# ---------------------------------------------------------------------------------------------

_MATMUL_SIGNATURE = {
    **dict.fromkeys(("A", "B", "C", "BIAS", "SAVED"), "*DTYPE"),
    "SEED": "*i64",
    **dict.fromkeys(("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn"), "i32"),
    "dropout_p": "fp32",
}
_EPILOGUES = {
    "forward": dict(EPILOGUE="activation", SAVE_PREACTIVATION=True),
    "backward": dict(EPILOGUE="activation_grad", SAVE_PREACTIVATION=False),
    "bias": dict(EPILOGUE="bias", SAVE_PREACTIVATION=False),
}
# The activations that keep the most values live (erf or sigmoid, and the saved a); ReLU's
# epilogue is a subset of either.
_ACTIVATIONS = ("gelu", "silu")
# (epilogue, activation) per GEMM configuration: the bias-only epilogue applies no activation, so
# one serves it.
_MATMUL_VARIANTS = (
    *(
        (epilogue, activation)
        for epilogue in ("forward", "backward")
        for activation in _ACTIVATIONS
    ),
    ("bias", "gelu"),
)


def _matmul_case(config: triton_common.LaunchConfig, epilogue: str, activation: str) -> CompileCase:
    constexprs = {
        "ACTIVATION": activation,
        "HAS_BIAS": True,
        "HAS_DROPOUT": True,
        "UPCAST": False,
        "INPUT_PRECISION": "ieee",  # dot_precision of half-precision operands
        **_EPILOGUES[epilogue],
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "GROUP_M": config.group_m,
    }
    signature = {**_MATMUL_SIGNATURE, **dict.fromkeys(constexprs, "constexpr")}
    return CompileCase(
        ffn_triton._matmul_kernel,
        signature,
        constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        needs_wgmma=True,
        label=f"{epilogue} {activation} {config.label}",
    )


def _elementwise_case(kernel, pointers: tuple[str, ...], activation: str) -> CompileCase:
    constexprs = {
        "ACTIVATION": activation,
        "HAS_DROPOUT": True,
        "BLOCK": ffn_triton._GPU_ELEMENTWISE_BLOCK,
    }
    signature = {
        **dict.fromkeys(pointers, "*DTYPE"),
        "SEED": "*i64",
        "numel": "i64",
        "dropout_p": "fp32",
        **dict.fromkeys(constexprs, "constexpr"),
    }
    label = f"{activation} dropout {ffn_triton._GPU_ELEMENTWISE_BLOCK}"
    return CompileCase(kernel, signature, constexprs, label=label)


def feed_forward_cases() -> list[CompileCase]:
    """Every GPU GEMM configuration with each epilogue (GELU or SiLU and dropout: the most
    registers), and the library path's elementwise kernels with each."""
    elementwise = {
        ffn_triton._activation_forward_kernel: ("A", "Z"),
        ffn_triton._activation_backward_kernel: ("DZ", "SAVED", "DA"),
    }
    return [
        *(
            _matmul_case(config, epilogue, activation)
            for config in ffn_triton._GPU_CONFIGS
            for epilogue, activation in _MATMUL_VARIANTS
        ),
        *(
            _elementwise_case(kernel, pointers, activation)
            for kernel, pointers in elementwise.items()
            for activation in _ACTIVATIONS
        ),
    ]


# ---------------------------------------------------------------------------------------------
# Linear + cross entropy: the row kernel with and without the gradient.
# ---------------------------------------------------------------------------------------------


def linear_cross_entropy_cases() -> list[CompileCase]:
    """The row kernel at the GPU block, the statistics and the backward's scaling."""
    block_v, num_warps = (
        loss_triton._GPU_BLOCK_V,
        loss_triton._num_warps(loss_triton._GPU_BLOCK_V),
    )
    signature = {
        "Z": "*DTYPE",
        "TARGET": "*i64",
        "STATS": "*fp32",
        "V": "i32",
        "smoothing": "fp32",
        "ignore_index": "i32",
        "COMPUTE_GRAD": "constexpr",
        "BLOCK_V": "constexpr",
    }
    return [
        CompileCase(
            loss_triton._cross_entropy_rows_kernel,
            signature,
            {"COMPUTE_GRAD": grad, "BLOCK_V": block_v},
            num_warps=num_warps,
            label=f"BLOCK_V {block_v} w{num_warps} grad={grad}",
        )
        for grad in (True, False)
    ] + [
        CompileCase(
            loss_triton._sum_statistics_kernel,
            {"STATS": "*fp32", "rows": "i32", "LOSS": "*fp32", "SUMS": "*fp64"}
            | {"MEAN": "constexpr", "BLOCK_ROWS": "constexpr"},
            {"MEAN": True, "BLOCK_ROWS": loss_triton._STATISTICS_BLOCK_ROWS},
            label=f"BLOCK_ROWS {loss_triton._STATISTICS_BLOCK_ROWS}",
        ),
        CompileCase(
            loss_triton._scale_gradients_kernel,
            {"DLOSS": "*fp32", "SUMS": "*fp64", "DH": "*DTYPE", "GRAD_H": "*DTYPE", "n_h": "i32"}
            | {"DW": "*fp32", "GRAD_W": "*DTYPE", "n_w": "i32"}
            | {"DB": "*fp32", "GRAD_B": "*DTYPE", "n_b": "i32"}
            | {"MEAN": "constexpr", "BLOCK": "constexpr"},
            {"MEAN": True, "BLOCK": loss_triton._SCALE_BLOCK},
            num_warps=loss_triton._SCALE_WARPS,
            label=f"BLOCK {loss_triton._SCALE_BLOCK} w{loss_triton._SCALE_WARPS}",
        ),
    ]


def all_cases() -> list[CompileCase]:
    return [
        *attention_cases(),
        *layer_norm_cases(),
        *feed_forward_cases(),
        *linear_cross_entropy_cases(),
    ]
