"""Shared Triton helpers: dot precision, device guard, GPU tiles, the Launcher
(fastnmt/ops/triton/common.py)."""

import contextlib
import gc
import weakref

import pytest
import torch

import fastnmt
from fastnmt.ops.feed_forward import feed_forward_triton
from fastnmt.ops.triton import common as triton_common
from fastnmt.ops.triton import tl
from tests.helpers import TRITON_DEVICE, StandInCompiled, StandInDriver, device_of


@pytest.mark.parametrize(
    ("precision", "expected"), [("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")]
)
def test_fp32_dots_follow_torch_float32_matmul_precision(monkeypatch, precision, expected):
    monkeypatch.setattr(triton_common, "INTERPRETER", False)  # as on a GPU
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert triton_common.dot_precision(torch.float32) == expected
        assert triton_common.dot_precision(torch.bfloat16) == "ieee"  # half: no TF32 question
    finally:
        torch.set_float32_matmul_precision(previous)


def test_the_interpreter_computes_fp32_dots_exactly(monkeypatch):
    monkeypatch.setattr(triton_common, "INTERPRETER", True)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert triton_common.dot_precision(torch.float32) == "ieee"
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("interpreter", [False, True])
@pytest.mark.parametrize(
    ("shape", "strides"), [((), None), ((5,), None), ((3, 4), None), ((2, 3), (1, 2))]
)
def test_new_output_has_the_shape_strides_dtype_and_device_asked_for(
    monkeypatch, interpreter, shape, strides
):
    """On a GPU (no interpreter) as in the tests, which poison it."""
    monkeypatch.setattr(triton_common, "INTERPRETER", interpreter)
    out = triton_common.new_output(shape, torch.float16, torch.device("cpu"), strides)
    expected_strides = torch.empty(shape).stride() if strides is None else strides
    assert (out.shape, out.stride(), out.dtype, out.device.type) == (
        torch.Size(shape),
        expected_strides,
        torch.float16,
        "cpu",
    )
    if interpreter:
        assert out.isnan().all()


def test_device_guard_is_a_no_op_off_cuda():
    assert isinstance(triton_common.device_guard(torch.device("cpu")), contextlib.nullcontext)


def test_gpu_tiles_is_scoped():
    outside = triton_common.use_gpu_tiles()
    with triton_common.gpu_tiles():
        assert triton_common.use_gpu_tiles()
    assert triton_common.use_gpu_tiles() == outside == torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# Launcher: the compiled path, driven by a stand-in kernel on any machine (the interpreter has no
# compiled kernels; on a GPU every op test runs it for real).
# ---------------------------------------------------------------------------------------------


def _signature(X, Y, n, stride, p, FLAG: tl.constexpr, BLOCK: tl.constexpr = 16):
    """The parameters of the stand-in kernel: pointers, ints, a float, constexprs (one with a
    default)."""


class _Kernel:
    """A JITFunction's interface: ``fn``, and ``kernel[grid](*args, **options)`` compiling."""

    fn = staticmethod(_signature)

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.launches.append(("jit", grid, args, options))
            compiled = StandInCompiled(self.launches)
            compiled.function = f"function {self.paths.count('jit')}"  # which compile
            return compiled

        return launch

    @property
    def paths(self):
        return [launch[0] for launch in self.launches]


@pytest.fixture
def compiled_path(monkeypatch):
    """As on a GPU whose current device is cuda:0, with no launch hooks."""
    monkeypatch.setattr(triton_common, "INTERPRETER", False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    stream = lambda index: 7 + index  # noqa: E731
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", stream, raising=False)
    guarded = []

    def guard(device):
        guarded.append(device)
        return contextlib.nullcontext()

    monkeypatch.setattr(triton_common, "device_guard", guard)
    return guarded


CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
OPTIONS = triton_common.launch_options(FLAG=True, num_warps=4)


def _args(x=None, n=32, stride=48, p=0.5):
    x = torch.zeros(64) if x is None else x
    return (x, None, n, stride, p)


def test_launcher_compiles_once_then_launches_the_compiled_kernel(compiled_path):
    kernel = _Kernel()
    launcher = triton_common.Launcher(kernel)
    x = torch.zeros(64)
    launcher(CUDA0, (3, 2, 1), _args(x), OPTIONS)
    assert kernel.launches == [("jit", (3, 2, 1), _args(x), OPTIONS)]
    y = torch.ones(64)  # another tensor and other ints of the same specialization
    launcher(CUDA0, (5, 1, 1), _args(y, n=64, stride=16, p=0.25), OPTIONS)
    launch = (5, 1, 1, 7, "function 1", "metadata", None, None, None)
    # the arguments, then FLAG and BLOCK's default:
    expected = (*launch, *_args(y, n=64, stride=16, p=0.25), True, 16)
    assert kernel.launches[1] == ("run", expected)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (dict(), dict(x=torch.zeros(64, dtype=torch.float16))),  # dtype
        (dict(), dict(x=torch.zeros(64)[1:])),  # not 16-byte aligned
        (dict(), dict(n=1)),  # 1 is a constexpr to Triton
        (dict(), dict(n=33)),  # not divisible by 16
        (dict(), dict(stride=2**31)),  # i32 -> i64
        (dict(stride=2**40), dict(stride=2**63)),  # i64 -> u64
        (dict(), dict(p=None)),  # a constexpr None
    ],
    ids=["dtype", "alignment", "one", "divisibility", "i64", "u64", "none"],
)
def test_launcher_compiles_again_for_another_specialization(compiled_path, before, after):
    kernel = _Kernel()
    launcher = triton_common.Launcher(kernel)
    launcher(CUDA0, (1, 1, 1), _args(**before), OPTIONS)
    launcher(CUDA0, (1, 1, 1), _args(**{**before, **after}), OPTIONS)
    assert kernel.paths == ["jit", "jit"]


def test_launcher_keys_by_the_options_dict_and_the_device(compiled_path):
    kernel = _Kernel()
    launcher = triton_common.Launcher(kernel)
    launcher(CUDA0, (1, 1, 1), _args(), OPTIONS)
    launcher(CUDA0, (1, 1, 1), _args(), triton_common.launch_options(FLAG=False, num_warps=4))
    assert triton_common.launch_options(FLAG=True, num_warps=4) is OPTIONS  # interned
    launcher(CUDA1, (1, 1, 1), _args(), OPTIONS)
    assert kernel.paths == ["jit", "jit", "jit"]
    assert compiled_path == [CUDA0, CUDA0, CUDA1]  # each compile under its device's guard


def test_launcher_launches_off_the_current_device_under_its_guard(compiled_path):
    kernel = _Kernel()
    launcher = triton_common.Launcher(kernel)
    for _ in range(2):
        launcher(CUDA1, (1, 1, 1), _args(), OPTIONS)
    assert kernel.paths == ["jit", "jit"] and compiled_path == [CUDA1, CUDA1]


def test_launcher_leaves_launches_to_triton_while_a_launch_hook_is_registered(
    compiled_path, monkeypatch
):
    kernel = _Kernel()
    launcher = triton_common.Launcher(kernel)
    launcher(CUDA0, (1, 1, 1), _args(), OPTIONS)
    hooks = triton_common.knobs.runtime.launch_enter_hook
    monkeypatch.setattr(hooks, "calls", [lambda metadata: None])  # e.g. a profiler's
    launcher(CUDA0, (1, 1, 1), _args(), OPTIONS)
    assert kernel.paths == ["jit", "jit"]


def test_launcher_under_the_interpreter_always_goes_through_the_kernel(monkeypatch):
    monkeypatch.setattr(triton_common, "INTERPRETER", True)
    kernel = _Kernel()
    launcher = triton_common.Launcher(kernel)
    for _ in range(2):
        launcher(torch.device("cpu"), (1, 1, 1), _args(), OPTIONS)
    assert kernel.paths == ["jit", "jit"]


def _triton_specializations():
    """Triton's own binder of ``_signature`` for an sm_90 GPU, built without one: args ->
    the specialization a compiled kernel is cached under."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jitted = JITFunction(_signature)
    binder = create_function_from_signature(
        jitted.signature, jitted.params, make_backend(GPUTarget("cuda", 90, 32))
    )
    return lambda args: tuple(binder(*args, FLAG=True)[1])


def test_launcher_compiles_again_whenever_triton_would_specialize_differently(compiled_path):
    """Random argument pairs: when Triton's binder specializes them differently, the Launcher
    must not reuse the first one's compiled kernel for the second."""
    specialization = _triton_specializations()
    generator = torch.Generator().manual_seed(0)
    storage = torch.zeros(64, dtype=torch.float16)
    ints = [0, 1, 2, 15, 16, 17, 48, -1, -16, 2**31 - 16, 2**31, 2**31 + 1, -(2**31)]
    ints += [-(2**31) - 1, -(2**31) - 16, 2**40, 2**40 + 3, 2**63, 2**63 + 16, 2**63 + 5]

    choices = [
        (storage, storage[1:], storage[8:], storage.float()),
        (None, storage),
        ints,
        ints,
        (0.5, 1.0, None),
    ]
    pick = lambda n: int(torch.randint(n, (), generator=generator))  # noqa: E731
    for _ in range(500):  # pairs that differ in one argument
        first = [options[pick(len(options))] for options in choices]
        second, position = list(first), pick(len(choices))
        second[position] = choices[position][pick(len(choices[position]))]
        kernel = _Kernel()
        launcher = triton_common.Launcher(kernel)
        compiled = []  # the compiled kernel each call launches
        for args in (first, second, first, second):  # then each looked up by its values
            launcher(CUDA0, (1, 1, 1), tuple(args), OPTIONS)
            path, *launch = kernel.launches[-1]
            compiled.append(
                f"function {kernel.paths.count('jit')}" if path == "jit" else launch[0][4]
            )
        if specialization(first) != specialization(second):
            assert kernel.paths[:2] == ["jit", "jit"], (first[2:], second[2:])
        assert compiled[2:] == compiled[:2], (first[2:], second[2:])


def test_launcher_looks_up_values_seen_before_without_specializing_them(compiled_path, monkeypatch):
    """The fast path: a call repeating the sizes and strides of one before (its tensors may be
    others) is found by its values, no specialization key computed (a Python step per argument);
    other values are specialized once."""
    kernel = _Kernel()
    launcher = triton_common.Launcher(kernel)
    specialized = []
    specialization = triton_common.Launcher._specialization

    def counted(*args):
        specialized.append(args)
        return specialization(*args)

    monkeypatch.setattr(triton_common.Launcher, "_specialization", staticmethod(counted))
    for n in (32, 32, 64):
        launcher(CUDA0, (1, 1, 1), _args(n=n), OPTIONS)
    before = len(specialized)
    for x in (torch.zeros(64), torch.ones(64), torch.zeros(64)):
        for n in (32, 64):
            launcher(CUDA0, (1, 1, 1), _args(x, n=n), OPTIONS)
    assert len(specialized) == before
    assert kernel.paths == ["jit"] + ["run"] * 8


def _interleaved(X, n, Y, stride, Z):
    """A stand-in kernel's parameters with pointers after ints (as the loss's gradient scaling)."""


class _InterleavedKernel(_Kernel):
    fn = staticmethod(_interleaved)


def test_launcher_looks_up_values_around_tensors_anywhere(compiled_path, monkeypatch):
    """Tensors (or None) where the first compile had them are keyed by dtype and alignment
    wherever they lie, the numbers between them by value: repeats take the fast path."""
    kernel = _InterleavedKernel()
    launcher = triton_common.Launcher(kernel)
    calls = []
    specialization = triton_common.Launcher._specialization
    monkeypatch.setattr(
        triton_common.Launcher,
        "_specialization",
        staticmethod(lambda *args: calls.append(args) or specialization(*args)),
    )
    for _ in range(2):
        launcher(CUDA0, (1, 1, 1), (torch.zeros(8), 3, torch.zeros(8), 16, None), OPTIONS)
    before = len(calls)
    for z in (None, torch.ones(8), None):
        launcher(CUDA0, (1, 1, 1), (torch.ones(8), 3, torch.zeros(8), 16, z), OPTIONS)
    assert len(calls) == before + 2  # the tensor where None was: looked up, compiled, kept
    assert kernel.paths == ["jit", "run", "run", "jit", "run"]


def test_launcher_keeps_no_values_holding_a_tensor(compiled_path):
    """A tensor where the first call had a number is keyed by its specialization only: a values
    key would hold it (and never match again)."""
    kernel = _Kernel()
    launcher = triton_common.Launcher(kernel)
    launcher(CUDA0, (1, 1, 1), _args(), OPTIONS)
    stray = torch.zeros(4)
    for _ in range(2):
        launcher(CUDA0, (1, 1, 1), (torch.zeros(64), None, stray, 48, 0.5), OPTIONS)
    kernel.launches.clear()  # the stand-in's record of the arguments
    stray = weakref.ref(stray)
    gc.collect()
    assert stray() is None


def test_launcher_refuses_constexprs_among_the_arguments(compiled_path):
    """Arguments are keyed by their specialization (32 and 48 alike), a constexpr by its value:
    constexprs go in the options."""
    launcher = triton_common.Launcher(_Kernel())
    with pytest.raises(AssertionError, match="constexprs in options"):
        launcher(CUDA0, (1, 1, 1), (*_args(), True), OPTIONS)


def test_launcher_passes_what_triton_run_passes_to_the_compiled_kernel(compiled_path, monkeypatch):
    """Triton's own ``JITFunction.run`` (binding, defaults, constexprs, grid) launches the first
    call, on a driver that answers as a GPU machine's and a compile that returns a recording
    kernel; the Launcher's direct launch of the second must hand the compiled kernel the same
    arguments, but for the launch metadata and hooks (None: no hook is registered)."""
    from triton.runtime import jit

    monkeypatch.setattr(jit, "driver", StandInDriver())
    kernel = jit.JITFunction(_signature)
    runs = []
    compiled = StandInCompiled(runs)
    monkeypatch.setattr(kernel, "_do_compile", lambda *args, **kwargs: compiled)
    launcher = triton_common.Launcher(kernel)
    args = _args(torch.zeros(64, dtype=torch.float16), n=48, stride=16, p=0.25)
    for _ in range(2):
        launcher(CUDA0, (3, 2, 1), args, OPTIONS)
    (_, through_triton), (_, direct) = runs
    assert direct[:6] == through_triton[:6]  # grid, stream, function, packed metadata
    assert direct[6:9] == (None, None, None)  # launch metadata and the hooks
    assert direct[9:] == through_triton[9:] == (*args, True, 16)


def test_launches_compile_with_fp_fusion_whatever_triton_defaults_to(compiled_path, monkeypatch):
    """Triton 3.10 turns FP fusion (FMA contraction) off by default; a Launcher's first call
    compiles through Triton's own ``JITFunction.run`` with it on all the same."""
    from triton.runtime import jit

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # 3.10's default
    monkeypatch.setattr(jit, "driver", StandInDriver())
    kernel = jit.JITFunction(_signature)
    compile_options = []

    def compile_kernel(*args, **kwargs):
        compile_options.extend(a for a in args if hasattr(a, "enable_fp_fusion"))
        return StandInCompiled()

    monkeypatch.setattr(kernel, "_do_compile", compile_kernel)
    triton_common.Launcher(kernel)(CUDA0, (1, 1, 1), _args(), OPTIONS)
    assert [options.enable_fp_fusion for options in compile_options] == [True]


def test_every_launch_of_every_op_states_the_compile_options(monkeypatch):
    """Forward and backward of each op (feed_forward on both GEMM paths): a launcher that built
    its options without ``launch_options`` would compile with Triton's defaults."""
    launched = []
    launch = triton_common.Launcher.__call__

    def recording(self, device, grid, args, options):
        launched.append((self.kernel, options))
        launch(self, device, grid, args, options)

    monkeypatch.setattr(triton_common.Launcher, "__call__", recording)
    device = TRITON_DEVICE
    q = torch.randn(2, 2, 5, 16, device=device, requires_grad=True)
    x = torch.randn(6, 16, device=device, requires_grad=True)
    w1, w2 = torch.randn(32, 16, device=device), torch.randn(16, 32, device=device)
    embedding = torch.randn(50, 16, device=device, requires_grad=True)
    target = torch.randint(0, 50, (6,), device=device)
    calls = [
        lambda: fastnmt.ops.attention(q, q, q, dropout_p=0.1),
        lambda: fastnmt.ops.add_layer_norm(x, x, x[0], x[1], dropout_p=0.1)[0],
        lambda: feed_forward_triton(x, w1, None, w2, None, "gelu", 0.1, fused_gemm=False),
        lambda: feed_forward_triton(x, w1, None, w2, None, "gelu", 0.1, fused_gemm=True),
        lambda: fastnmt.ops.linear_cross_entropy(x, embedding, None, target).loss,
    ]
    with fastnmt.backend("triton"):
        for call in calls:
            call().sum().backward()
    kernels = {kernel for kernel, _ in launched}
    assert len(kernels) == 12  # all of the four ops but _dropout_keep_kernel (a returned mask)
    compile_options = triton_common.COMPILE_OPTIONS.items()
    assert all(compile_options <= options.items() for _, options in launched)


def _dropout_call(op: str, device: torch.device):
    """``run(seed)``: op ``op`` with dropout 0.5 on fixed inputs of ones (every element kept or
    dropped shows), keyed by ``seed``."""
    ones = torch.ones(4, 32, 16, device=device)
    eye = torch.eye(16, device=device)
    values = torch.eye(32, device=device).expand(4, 1, 32, 32)  # out_ij: key j's kept P_ij
    calls = {
        "attention": lambda seed: fastnmt.ops.attention(
            ones[:, None], ones[:, None], values, dropout_p=0.5, dropout_seed=seed
        ),
        "add_layer_norm": lambda seed: fastnmt.ops.add_layer_norm(
            ones, dropout_p=0.5, dropout_seed=seed
        )[1],
        "feed_forward": lambda seed: fastnmt.ops.feed_forward(
            ones, eye, None, eye, None, dropout_p=0.5, dropout_seed=seed
        ),
    }
    return calls[op]


@pytest.mark.parametrize("op", ["attention", "add_layer_norm", "feed_forward"])
def test_a_given_dropout_seed_keys_the_fused_dropout_mask(fused, op):
    """``dropout_seeds``' one draw gives each op call its own mask, and an op given a seed drops
    the same elements whatever torch's generator did in between."""
    run = _dropout_call(op, device_of(fused))
    first, second = triton_common.dropout_seeds(2, device_of(fused))
    masks = [run(first) != 0]
    torch.rand(1000, device=device_of(fused))  # the generator (of the op's device) moves on
    masks += [run(first) != 0, run(second) != 0]
    assert 0.4 < masks[0].float().mean().item() < 0.6
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])


@pytest.mark.parametrize(
    ("seed", "message"),
    [
        (torch.zeros(2, dtype=torch.int32), "int64 tensor of shape \\(2,\\)"),
        (torch.zeros(3, dtype=torch.int64), "int64 tensor of shape \\(2,\\)"),
        (torch.zeros(1, 2, dtype=torch.int64), "dropout_seed must have 1 dimensions"),
        (torch.zeros(2, dtype=torch.int64, device="meta"), "dropout_seed is on meta"),
    ],
)
@pytest.mark.parametrize("op", ["attention", "add_layer_norm", "feed_forward"])
def test_a_bad_dropout_seed_is_refused_by_name(op, seed, message):
    with pytest.raises(ValueError, match=message):
        _dropout_call(op, torch.device("cpu"))(seed)
