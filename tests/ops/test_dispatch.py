"""Backend choice, forcing and explanations; the cached choice of a call seen before."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F

import fastnmt
from fastnmt.ops import dispatch
from tests.helpers import TRITON_DEVICE, device_of, python_calls, require_backend


def _toy_op(unsupported_by_cpp=()):
    """An op with cpp and reference implementations that report which one ran."""
    op = dispatch.Op("toy", lambda x: (x.device, {"x": x}))
    op.register("reference")(lambda x: "reference")
    op.register("cpp", lambda x: list(unsupported_by_cpp))(lambda x: "cpp")
    return op


@pytest.fixture
def extension_built(monkeypatch):
    monkeypatch.setattr(dispatch, "extension_available", lambda: True)


def test_first_backend_without_reasons_runs(extension_built):
    assert _toy_op()(torch.zeros(1)) == "cpp"
    assert _toy_op(["no fp64"])(torch.zeros(1)) == "reference"


def test_explain_lists_every_backend_and_the_choice(extension_built):
    reasons = _toy_op(["no fp64"]).explain(torch.zeros(1))
    assert reasons["cpp"] == ["no fp64"]
    assert reasons["reference"] == []
    assert "no triton implementation of toy" in reasons["triton"][0]
    assert reasons["chosen"] == "reference"


def test_missing_extension_is_a_reason():
    reasons = _toy_op().explain(torch.zeros(1))
    if not fastnmt.extension_available():
        assert reasons["cpp"] == [fastnmt.extension_status()]


def test_context_manager_forces_and_restores(extension_built):
    op = _toy_op()
    with fastnmt.backend("reference"):
        assert op(torch.zeros(1)) == "reference"
        with fastnmt.backend("auto"):
            assert op(torch.zeros(1)) == "cpp"
    assert op(torch.zeros(1)) == "cpp"


def test_environment_variable_forces(monkeypatch, extension_built):
    monkeypatch.setenv("FASTNMT_BACKEND", "reference")
    fastnmt.ops.settings.reload()
    assert _toy_op()(torch.zeros(1)) == "reference"
    with fastnmt.backend("cpp"):  # the context manager wins over the environment
        assert _toy_op()(torch.zeros(1)) == "cpp"


def test_forcing_a_backend_that_cannot_run_raises_with_reasons(extension_built):
    with fastnmt.backend("cpp"), pytest.raises(fastnmt.BackendUnavailableError, match="no fp64"):
        _toy_op(["no fp64"])(torch.zeros(1))
    q = torch.randn(1, 1, 2, 4, dtype=torch.float64, device=TRITON_DEVICE)  # no kernel takes it
    with fastnmt.backend("triton"), pytest.raises(fastnmt.BackendUnavailableError, match="float64"):
        fastnmt.ops.attention(q, q, q)


def test_forcing_some_ops_leaves_the_others_alone(monkeypatch, extension_built):
    x = torch.randn(4, 8)
    loss_args = (x, torch.randn(11, 8), None, torch.tensor([1, 2, 3, 4]))
    with fastnmt.backend("reference", ops=["linear_cross_entropy"]):
        assert fastnmt.explain("linear_cross_entropy", *loss_args)["chosen"] == "reference"
        assert fastnmt.explain("add_layer_norm", x)["chosen"] == "cpp"
        with fastnmt.backend("auto"):  # an inner block for every op wins
            assert fastnmt.explain("linear_cross_entropy", *loss_args)["chosen"] == "cpp"
    monkeypatch.setenv("FASTNMT_BACKEND", "reference")
    fastnmt.ops.settings.reload()
    with fastnmt.backend("cpp", ops="add_layer_norm"):  # the environment covers the rest
        assert fastnmt.explain("add_layer_norm", x)["chosen"] == "cpp"
        assert (
            fastnmt.explain("feed_forward", x, torch.randn(16, 8), None, torch.randn(8, 16), None)[
                "chosen"
            ]
            == "reference"
        )
    with pytest.raises(ValueError, match=r"ops must be among .* got \['softmax'\]"):
        fastnmt.backend("cpp", ops=["softmax"]).__enter__()


def test_unknown_backend_names_are_rejected(monkeypatch):
    with pytest.raises(ValueError, match="backend\\(\\)'s name must be one of"):
        fastnmt.backend("cuda").__enter__()
    monkeypatch.setenv("FASTNMT_BACKEND", "fast")
    fastnmt.ops.settings.reload()
    with pytest.raises(ValueError, match="FASTNMT_BACKEND must be one of"):
        dispatch.forced_backend("toy")


def test_triton_needs_cuda_or_the_interpreter_and_force(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reasons = dispatch._triton_device_reasons(torch.device("cpu"), forced=True)
    assert "triton runs CUDA tensors" in reasons[0]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch._triton_device_reasons(torch.device("cpu"), forced=True) == []
    reasons = dispatch._triton_device_reasons(torch.device("cpu"), forced=False)
    assert "only when triton is forced" in reasons[0]


def test_every_op_explains_itself():
    q = torch.randn(1, 2, 3, 8)
    x = torch.randn(4, 8)
    calls = {
        "attention": ((q, q, q), {"key_lengths": torch.tensor([2])}),
        "attention_varlen": (
            (*[x[:, None]] * 3, torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4),
            {},
        ),
        "add_layer_norm": ((x, x), {}),
        "feed_forward": ((x, torch.randn(16, 8), None, torch.randn(8, 16), None), {}),
        "linear_cross_entropy": ((x, torch.randn(11, 8), None, torch.tensor([1, 2, 3, 4])), {}),
        "log_softmax_topk": ((x, 3), {"banned": torch.tensor([0])}),
        "sample_token": ((x, torch.rand(4)), {"topp": 0.5}),
    }
    assert set(calls) == set(dispatch.OPS)
    for name, (args, kwargs) in calls.items():
        assert fastnmt.explain(name, *args, **kwargs)["chosen"] in fastnmt.BACKENDS
    with pytest.raises(ValueError, match="op_name must be one of"):
        fastnmt.explain("softmax", x)


# ---------------------------------------------------------------------------------------------
# The cached path: a call whose signature was seen is a lookup, then the implementation.
# ---------------------------------------------------------------------------------------------


def _counting_op():
    """A toy op that counts its argument checks and normalizes ``scale`` to a float."""
    checked = []

    def prepare(x, scale=1):
        checked.append(tuple(x.shape))
        return x.device, {"x": x, "scale": float(scale)}

    op = dispatch.Op("toy", prepare)
    op.register("reference")(lambda x, scale: ("reference", x, scale))
    op.register("cpp")(lambda x, scale: ("cpp", x, scale))
    return op, checked


def test_a_seen_signature_skips_the_checks_and_keeps_the_normalized_arguments(extension_built):
    op, checked = _counting_op()
    first, second = torch.zeros(2), torch.ones(2)
    assert op(first, 2) == ("cpp", first, 2.0)
    backend, x, scale = op(second, 2)
    assert (backend, scale, len(checked)) == ("cpp", 2.0, 1)
    assert x is second  # the call's own tensor, not the first call's
    op(torch.zeros(3), 2)  # a new shape, a new scale, a dtype, grad mode: checked afresh
    op(torch.zeros(3), 3)
    op(torch.zeros(3, dtype=torch.float64), 3)
    with torch.no_grad():
        op(torch.zeros(3), 3)
    assert len(checked) == 5


def test_the_cached_choice_follows_forcing_and_the_environment(monkeypatch, extension_built):
    op, _ = _counting_op()
    x = torch.zeros(2)
    assert op(x)[0] == "cpp"
    with fastnmt.backend("reference"):
        assert op(x)[0] == "reference"
    with fastnmt.backend("reference", ops=["attention"]):  # another op's forcing
        assert op(x)[0] == "cpp"
    monkeypatch.setenv("FASTNMT_BACKEND", "reference")
    assert op(x)[0] == "cpp"  # read at import ...
    fastnmt.ops.settings.reload()  # ... and when asked
    assert op(x)[0] == "reference"


def test_every_call_is_checked_while_values_are(monkeypatch, extension_built):
    op, checked = _counting_op()
    monkeypatch.setattr(fastnmt.ops.settings, "check_values", True)
    op(torch.zeros(2))
    op(torch.zeros(2))
    assert len(checked) == 2


def test_an_unhashable_argument_is_decided_afresh(extension_built):
    op = dispatch.Op("toy", lambda x, sizes: (x.device, {"x": x, "sizes": sizes}))
    op.register("reference")(lambda x, sizes: sizes)
    assert op(torch.zeros(1), [1, 2]) == [1, 2]


def test_cached_choices_are_what_explain_says():
    q = torch.randn(2, 2, 3, 8)
    x = torch.randn(4, 8)
    calls = [
        ("attention", (q, q, q), {"key_lengths": torch.tensor([2, 3])}),
        ("attention", (q.double(), q.double(), q.double()), {}),
        ("add_layer_norm", (x, x), {}),
        ("add_layer_norm", (x.double(), x.double()), {}),
        ("linear_cross_entropy", (x, torch.randn(11, 8), None, torch.tensor([1, 2, 3, 4])), {}),
    ]
    for name, args, kwargs in calls:
        op = dispatch.OPS[name]
        op._decisions.clear()
        getattr(fastnmt.ops, name)(*args, **kwargs)
        ((implementation, _),) = op._decisions.values()
        chosen = fastnmt.explain(name, *args, **kwargs)["chosen"]
        assert implementation is op.implementation(chosen, autograd=False)  # no grad required


def test_calls_autograd_records_nothing_for_take_the_inference_implementation(extension_built):
    op = dispatch.Op("toy", lambda x, scale=1.0: (x.device, {"x": x, "scale": scale}))
    op.register("reference", inference=lambda x, scale: "inference")(lambda x, scale: "autograd")
    leaf = torch.zeros(2, requires_grad=True)
    for call in (lambda x: op(x, 1.0), lambda x: op(x, scale=1.0)):  # cached, and not
        assert call(leaf) == "autograd"
        assert call(leaf.detach()) == "inference"
        with torch.no_grad():
            assert call(leaf) == "inference"
        with torch.inference_mode():
            assert call(leaf) == "inference"
        assert call(leaf) == "autograd"  # the grad mode is part of the signature


@pytest.mark.parametrize("fused", ["cpp", "triton"])
@pytest.mark.filterwarnings("ignore:`torch.jit.script`:DeprecationWarning")  # make_dual's own
def test_forward_mode_ad_runs_on_the_reference_ops(fused):
    """The fused kernels have no jvp: a tangent would be dropped silently (the C++ ops did) or
    refused deep inside autograd. A call with one runs on the reference ops, tangent and all."""
    require_backend(fused)
    device = device_of(fused)
    x, tangent = torch.randn(4, 16, device=device), torch.randn(4, 16, device=device)
    weight = torch.rand(16, device=device)
    unforced = "cpp" if device.type == "cpu" else "triton"  # the fused backend of these tensors
    with fastnmt.backend(fused):
        fastnmt.ops.add_layer_norm(x, None, weight)  # a cached choice for this signature
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, tangent)
        reasons = fastnmt.explain("add_layer_norm", dual, None, weight)
        assert reasons["chosen"] == "reference" and "forward-mode AD" in reasons[unforced][0]
        y, _ = fastnmt.ops.add_layer_norm(dual, None, weight)
        refused = pytest.raises(fastnmt.BackendUnavailableError, match="x carries a forward-mode")
        with fastnmt.backend(fused), refused:
            fastnmt.ops.add_layer_norm(dual, None, weight)
        with fastnmt.backend(fused):  # no tangent, no reason
            fastnmt.ops.add_layer_norm(x, None, weight)
        expected = F.layer_norm(dual, (16,), weight)  # torch's own forward-mode derivative
        got, expected = (forward_ad.unpack_dual(t).tangent for t in (y, expected))
    torch.testing.assert_close(got, expected)


def test_an_op_without_an_inference_implementation_runs_its_eager_one(extension_built):
    op = dispatch.Op("toy", lambda x: (x.device, {"x": x}))
    op.register("reference")(lambda x: "eager")
    with torch.no_grad():
        assert op(torch.zeros(1)) == "eager"
    assert op.implementation("reference", autograd=False) is op.implementation("reference")


TRAINED_OPS = ("attention", "add_layer_norm", "feed_forward", "linear_cross_entropy")


def _op_steps(device="cpu"):
    """Forward + backward of each op with gradients on tiny tensors (only host work), as
    ``out.sum().backward()``: the way the issue and benchmarks/ops/bench_dispatch.py count them."""
    grad = dict(requires_grad=True, device=device)
    q, k, v = (torch.randn(2, 2, 4, 8, **grad) for _ in range(3))
    lengths = torch.tensor([4, 3], device=device)
    x, residual, weight, bias = (torch.randn(*s, **grad) for s in ((4, 16), (4, 16), (16,), (16,)))
    w1, b1, w2, b2 = (torch.randn(*s, **grad) for s in ((32, 16), (32,), (16, 32), (16,)))
    hidden, embedding = torch.randn(8, 16, **grad), torch.randn(50, 16, **grad)
    target = torch.randint(0, 50, (8,), device=device)
    ops = fastnmt.ops
    return {
        "attention": lambda: ops.attention(q, k, v, key_lengths=lengths),
        "add_layer_norm": lambda: ops.add_layer_norm(x, residual, weight, bias)[0],
        "feed_forward": lambda: ops.feed_forward(x, w1, b1, w2, b2),
        "linear_cross_entropy": lambda: (
            ops.linear_cross_entropy(hidden, embedding, None, target).loss
        ),
    }


@pytest.mark.parametrize("name", TRAINED_OPS)
def test_an_op_call_with_its_backward_takes_few_python_calls(name):
    """Python calls cost ~1 µs each on a CPU and more on a slow GPU host: the fused path is a
    lookup, the implementation and an autograd.Function (torch's own ``sum`` and ``backward``
    take 13-17 of the 30)."""
    forward = _op_steps()[name]
    assert python_calls(lambda: forward().sum().backward()) <= 30


@pytest.mark.parametrize("name", TRAINED_OPS)
def test_triton_calls_without_grad_launch_without_an_autograd_function(name):
    """Decoding and validation: the launchers straight away, the same outputs as with autograd."""
    forward = _op_steps(TRITON_DEVICE)[name]
    op = dispatch.OPS[name]
    with fastnmt.backend("triton"):
        recorded = forward()
        op._decisions.clear()
        with torch.no_grad():
            inferred = forward()
    ((implementation, _),) = op._decisions.values()
    assert implementation is op.implementation("triton", autograd=False)
    assert implementation is not op.implementation("triton")
    assert recorded.grad_fn is not None and inferred.grad_fn is None
    torch.testing.assert_close(inferred, recorded.detach(), rtol=0, atol=0)


def _torch_backend_calls():
    """Each op's call on odd shapes: padding with an all-padded row, causal with Lq != Lk."""
    q, k = torch.randn(3, 2, 5, 8), torch.randn(3, 2, 7, 8)
    v = torch.randn(3, 2, 7, 6)
    x, r = torch.randn(2, 5, 12), torch.randn(2, 5, 12)
    w, b = torch.randn(12), torch.randn(12)
    target = torch.tensor([1, 2, -100, 4, 0, 10, 3, 3, 9, 5])
    bool_mask = torch.rand(5, 7) > 0.3
    return {
        "attention padded": ("attention", (q, k, v), {"key_lengths": torch.tensor([7, 0, 3])}),
        "attention causal": ("attention", (q, k, v), {"causal": True}),
        "attention masks": (
            "attention",
            (q, k, v),
            {"attn_mask": bool_mask, "key_padding_mask": torch.rand(3, 7) > 0.5},
        ),
        "attention float mask": (
            "attention",
            (q, k, v),
            {"attn_mask": torch.randn(5, 7), "key_lengths": torch.tensor([1, 7, 4])},
        ),
        "add_layer_norm": ("add_layer_norm", (x, r, w, b), {}),
        "feed_forward": (
            "feed_forward",
            (x, torch.randn(20, 12), torch.randn(20), torch.randn(12, 20), None, "gelu"),
            {},
        ),
        "linear_cross_entropy": (
            "linear_cross_entropy",
            (x.reshape(10, 12), torch.randn(11, 12), torch.randn(11), target, 0.1),
            {},
        ),
        "log_softmax_topk": ("log_softmax_topk", (x.reshape(10, 12), 3), {}),
    }


@pytest.mark.parametrize("case", list(_torch_backend_calls()))
def test_the_torch_backend_runs_pytorchs_builtins_only_when_forced(case):
    """PyTorch's built-ins (SDPA, F.cross_entropy, ...), the baseline of the benchmarks: never
    chosen by itself, forced it computes what the reference does (all-padded rows 0)."""
    name, args, kwargs = _torch_backend_calls()[case]
    leaves = [
        a.requires_grad_() for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()
    ]
    op = getattr(fastnmt.ops, name)
    assert fastnmt.explain(name, *args, **kwargs)["chosen"] != "torch"
    results = {}
    for backend in ("reference", "torch"):
        with fastnmt.backend(backend):
            out = op(*args, **kwargs)
        first = out[0]
        grads = ()
        if first.requires_grad:
            grads = torch.autograd.grad(first.float().sum(), leaves, allow_unused=True)
        results[backend] = (out, grads)
    (expected, expected_grads), (got, got_grads) = results["reference"], results["torch"]
    for want, have in zip([*expected, *expected_grads], [*got, *got_grads], strict=True):
        if want is None:
            assert have is None
        else:
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)


def test_the_torch_backend_gives_reasons_for_what_sdpa_cannot_do():
    q = torch.randn(1, 2, 3, 8)
    reasons = fastnmt.explain("attention", q, q, q, return_lse=True)["torch"]
    assert reasons == ["return_lse: F.scaled_dot_product_attention returns no log-sum-exp"]
    forced = fastnmt.backend("torch")
    with forced, pytest.raises(fastnmt.BackendUnavailableError, match="returns no log-sum-exp"):
        fastnmt.ops.attention(q, q, q, return_lse=True)


def test_the_constant_mark_is_the_one_torchs_decorator_sets():
    """A compiled graph keeps the forced backend as a constant: the mark is torch.compiler's."""

    def ours():
        pass

    def torchs():
        pass

    dispatch.assume_constant_result(ours)
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) != {}


@pytest.mark.parametrize("interpreter", [True, False])
def test_the_commands_import_without_dynamo(interpreter):
    """Importing torch._dynamo takes over a second: no process should pay it before it
    compiles (the tests start dozens). Also without the interpreter, as on a GPU, where the ops
    are triton_ops. The server's module needs its extra (fastapi)."""
    commands = ["fastnmt.train", "fastnmt.evaluate", "fastnmt.translate"]
    commands += ["fastnmt.serve"] * (importlib.util.find_spec("fastapi") is not None)
    code = (
        f"import sys, {', '.join(commands)}; "
        "print([name for name in sys.modules if name.startswith('torch._dynamo')])"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update({"TRITON_INTERPRET": "1"} if interpreter else {})
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout == "[]\n", result.stderr


def test_autocasting_asks_torch_about_cpu_and_cuda_only_at_import(monkeypatch):
    """torch.compile of torch 2.11 cannot trace torch.amp.is_autocast_available: the ops' checks
    read a dict for the common devices, and ask (once) only about others (meta: never)."""
    from fastnmt.ops import checks

    asked = []
    # As at import: an earlier test on the meta device (any order under pytest-xdist) added it.
    known = {kind: checks._AUTOCAST_AVAILABLE[kind] for kind in ("cpu", "cuda")}
    monkeypatch.setattr(checks, "_AUTOCAST_AVAILABLE", known)
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda kind: asked.append(kind) or 0)
    with torch.autocast("cpu", torch.bfloat16):
        assert checks.autocasting(torch.device("cpu"))
    assert not checks.autocasting(torch.device("cuda"))
    for _ in range(2):
        assert not checks.autocasting(torch.device("meta"))
    assert asked == ["meta"]
