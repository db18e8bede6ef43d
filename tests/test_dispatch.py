"""Backend choice, forcing and explanations."""

import pytest
import torch

import fastnmt
from fastnmt import dispatch


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
    assert _toy_op()(torch.zeros(1)) == "reference"
    with fastnmt.backend("cpp"):  # the context manager wins over the environment
        assert _toy_op()(torch.zeros(1)) == "cpp"


def test_forcing_a_backend_that_cannot_run_raises_with_reasons(extension_built):
    with fastnmt.backend("cpp"), pytest.raises(fastnmt.BackendUnavailableError, match="no fp64"):
        _toy_op(["no fp64"])(torch.zeros(1))
    q = torch.randn(1, 1, 2, 4, dtype=torch.float64)  # no Triton kernel takes float64
    with fastnmt.backend("triton"), pytest.raises(fastnmt.BackendUnavailableError, match="triton"):
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
        "add_layer_norm": ((x, x), {}),
        "feed_forward": ((x, torch.randn(16, 8), None, torch.randn(8, 16), None), {}),
        "linear_cross_entropy": ((x, torch.randn(11, 8), None, torch.tensor([1, 2, 3, 4])), {}),
        "log_softmax_topk": ((x, 3), {"banned": torch.tensor([0])}),
    }
    assert set(calls) == set(dispatch.OPS)
    for name, (args, kwargs) in calls.items():
        assert fastnmt.explain(name, *args, **kwargs)["chosen"] in fastnmt.BACKENDS
    with pytest.raises(ValueError, match="op_name must be one of"):
        fastnmt.explain("softmax", x)
