"""Oracles and comparisons shared by the tests."""

import contextlib
import gzip
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch._library.custom_ops import OPDEFS
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import fastnmt
from fastnmt.ops.triton import common as triton_common

# Where Triton kernels run in the tests: compiled on a CUDA GPU when there is one, else in the
# Triton interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 first).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Why Triton does not run CPU tensors unforced: with a GPU it runs CUDA tensors only; without
# one the interpreter runs them, but only when triton is forced.
TRITON_CPU_REASON = (
    "tensors are on cpu" if torch.cuda.is_available() else "only when triton is forced"
)


def device_of(backend: str) -> torch.device:
    """The device a test's tensors live on for ``backend``: the C++ kernels take CPU tensors,
    Triton (and the reference compared with it) the Triton device."""
    return torch.device("cpu") if backend == "cpp" else TRITON_DEVICE


class ErrorCheck(NamedTuple):
    """A candidate against the float64 oracle by FlashAttention's rule (``error_check``)."""

    error: float  # the candidate's largest error
    allowed: float  # factor x plain PyTorch's largest error + atol
    where: tuple  # the index of the candidate's largest error
    over: int  # elements over ``allowed``
    shape: tuple

    @property
    def ratio(self) -> float:
        """error / allowed: over 1 fails."""
        return self.error / self.allowed


def error_check(candidate, same_dtype_torch, oracle, factor, atol) -> ErrorCheck:
    """FlashAttention's rule: the candidate is at most ``factor`` times as far from the float64
    oracle as plain PyTorch in the same dtype, plus ``atol``; with where its largest error is
    (what tells a wrong tile from rounding)."""
    oracle = oracle.double()
    errors = (candidate.double() - oracle).abs()
    allowed = factor * (same_dtype_torch.double() - oracle).abs().max().item() + atol
    where = tuple(int(i) for i in torch.unravel_index(errors.argmax(), errors.shape))
    over = int((errors > allowed).sum())
    return ErrorCheck(errors.max().item(), allowed, where, over, tuple(errors.shape))


def assert_error_within(candidate, same_dtype_torch, oracle, factor, atol, name="output"):
    """``error_check``'s rule as an assertion; the message names the tensor and where its
    largest error is."""
    check = error_check(candidate, same_dtype_torch, oracle, factor, atol)
    if check.error > check.allowed:
        raise AssertionError(
            f"{name}: error {check.error:.3g} at {check.where} > {check.allowed:.3g} allowed "
            f"({factor} x torch's error + {atol}); {check.over} of the {math.prod(check.shape)} "
            f"elements {check.shape} over"
        )


def random_lengths(batch, max_length, *, low=0, generator=None):
    """int64 (batch,) lengths in [low, max_length], always including max_length once."""
    lengths = torch.randint(low, max_length + 1, (batch,), generator=generator)
    lengths[0] = max_length
    return lengths


def attention_oracle(q, k, v, *, key_lengths=None, causal=False, scale=None, attn_mask=None):
    """float64 attention written independently of fastnmt: explicit visibility, stable softmax,
    rows that see no key give 0. attn_mask is bool (True = may attend)."""
    q, k, v = q.double(), k.double(), v.double()
    batch, _, lq, head_dim = q.shape
    lk = k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    visible = torch.ones(batch, 1, lq, lk, dtype=torch.bool, device=q.device)
    if key_lengths is not None:
        for b, length in enumerate(key_lengths.tolist()):
            visible[b, :, :, length:] = False
    if causal:
        visible = visible & torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        visible = visible & attn_mask
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).clamp_min(-1e300)  # finite even for empty rows
    weights = torch.exp(scores - row_max) * visible
    total = weights.sum(-1, keepdim=True)
    probs = torch.where(total > 0, weights / total.clamp_min(1e-300), 0.0)
    lse = torch.where(
        total.squeeze(-1) > 0, torch.log(total.squeeze(-1)) + row_max.squeeze(-1), float("-inf")
    )
    return probs @ v, lse, probs


def small_corpus(folder: Path) -> Path:
    """``folder`` with 300 training and 20 validation pairs of Multi30k en-de as
    PREFIX.{en,de} files (train.en, val.de, ...): what the tests and the GPU check's smoke run
    train on."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, lines in (("train", 300), ("val", 20)):
        for lang in ("en", "de"):
            with gzip.open(multi30k_file(split, lang), "rt", encoding="utf-8") as f:
                text = [next(f) for _ in range(lines)]
            (folder / f"{split}.{lang}").write_text("".join(text), encoding="utf-8")
    return folder


def multi30k_file(split: str, lang: str):
    """A Multi30k file found the way the package finds it: $FASTNMT_DATA_DIR (tests/conftest.py
    points it at ../shared/data/multi30k beside the repository when that exists), else the
    download cache, downloading on first use."""
    from fastnmt.data import multi30k_file as package_lookup

    return package_lookup(split, lang)


def inner_pytest_env(**extra: str) -> dict[str, str]:
    """The environment for a pytest run inside a test: the outer run's PYTEST_* variables left
    out (pytest-xdist's PYTEST_XDIST_WORKER would make the inner run a worker, and
    pytest-benchmark then disables itself)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    return {**env, **extra}


def opcheck(op, args, **options) -> None:
    """``torch.library.opcheck``, and a Python op's body traced with symbolic sizes.

    On a GPU a Triton op is a ``triton_op`` whose body opcheck's dynamic-shape test traces (as
    ``torch.compile(dynamic=True)`` does): every size the host code reads is a SymInt there. In
    the interpreter the op is a ``custom_op`` that traces keep opaque, so the body is traced here,
    each launch recorded instead of run (the interpreter cannot run data-less tensors)."""
    torch.library.opcheck(op, args, **options)
    definition = OPDEFS.get(op._schema.name)
    if definition is None or not triton_common.INTERPRETER:  # C++, or the GPU (opcheck traced it)
        return
    launches = []

    def record(launcher, device, grid, launch_args, launch_options):
        launches.append(launcher.kernel)

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():  # the body runs below autograd
        patch.setattr(triton_common.Launcher, "__call__", record)
        make_fx(definition._init_fn, tracing_mode="symbolic")(*args)
    assert launches, f"{op} launched no kernel"


def require_backend(name: str) -> None:
    """Fail (never skip) when the C++ extension a test needs is missing, unless the build was
    skipped on purpose with FASTNMT_SKIP_EXTENSION=1."""
    if name == "cpp" and not fastnmt.extension_available():
        if os.environ.get("FASTNMT_SKIP_EXTENSION") == "1":
            pytest.skip("FASTNMT_SKIP_EXTENSION=1: the C++ kernels were not built")
        pytest.fail(fastnmt.extension_status())


def tiny_checkpoint(directory, *, max_positions=1024, seed=0, pieces=300, **overrides):
    """A checkpoint directory of a random 1+1-layer model (d_model 32; ``overrides`` of its
    ModelConfig) whose sentencepiece vocabulary of ``pieces`` was trained on 300 Multi30k en/de
    sentences; returns its path. An output bias, when asked for, is random too."""
    import gzip

    from fastnmt import checkpoint
    from fastnmt.data import Vocabulary
    from fastnmt.model import Transformer, preset

    texts = []
    for lang in ("en", "de"):
        with gzip.open(multi30k_file("train", lang), "rt", encoding="utf-8") as f:
            texts += [next(f).strip() for _ in range(300)]
    vocab = Vocabulary.train(texts, pieces)
    cfg = preset(
        "tiny", d_model=32, heads=2, d_ff=64, encoder_layers=1, decoder_layers=1,
        vocab_size=len(vocab), max_positions=max_positions, **overrides,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Transformer(cfg)
    if model.output_bias is not None:
        model.output_bias.normal_()
    config = {"model": cfg.to_dict(), "data": {"src_lang": "en", "tgt_lang": "de"}}
    saved = checkpoint.Checkpoint(model.state_dict(), config, vocab.to_bytes(), {})
    return checkpoint.save(directory, 1, saved, keep_last=1)


class HostSyncs:
    """Counts the tensor calls that make the host wait for the device on a GPU (reading a value:
    ``item``, ``tolist``, ``bool``/``int``/``float``; a data-dependent shape: ``nonzero``; a copy
    to the host), whatever device the tensors are on, so a CPU test sees the syncs a GPU would
    make. The methods are wrapped on the class, not intercepted by a torch function mode, which
    would not see the calls inside registered ops' implementations. ``names`` lists them."""

    TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu")
    TENSOR_METHODS += ("numpy", "nonzero")
    FUNCTIONS = ("equal", "nonzero")

    def __init__(self):
        self.names: list[str] = []
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.names.append(name)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self):
        for name in self.TENSOR_METHODS:
            self._wrap(torch.Tensor, name)
        for name in self.FUNCTIONS:
            self._wrap(torch, name)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []


@contextlib.contextmanager
def count_host_syncs(*, none_allowed: bool = False):
    """``with count_host_syncs() as syncs:`` counts syncs (``syncs.names``). With
    ``none_allowed`` on a GPU, torch's own check is on too: ``set_sync_debug_mode("error")``
    raises at the first sync of a CUDA tensor."""
    counter = HostSyncs()
    debug = none_allowed and torch.cuda.is_available()
    if debug:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with counter:
            yield counter
    finally:
        if debug:
            torch.cuda.set_sync_debug_mode("default")


class HostOps(TorchDispatchMode):
    """``with HostOps(module, launcher_names) as host:`` records the aten ops a call dispatches
    (``host.aten``) and the Triton kernels it launches through the module's ``Launcher``s
    (``host.launches``, by launcher name; ``HostOps()``: the aten ops only), on any device. The
    launches run outside the recording: the Triton interpreter moves tensors with aten ops of its
    own, which a GPU launch does not make."""

    def __init__(self, module=None, launcher_names=()):
        super().__init__()
        self.aten: list[str] = []
        self.launches: list[str] = []
        self._module = module
        self._launchers = {name: getattr(module, name) for name in launcher_names}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.aten.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def _counted(self, name, launcher):
        def launch(*args):
            self.launches.append(name)
            with _disable_current_modes():
                return launcher(*args)

        return launch

    def __enter__(self):
        for name, launcher in self._launchers.items():
            setattr(self._module, name, self._counted(name, launcher))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, launcher in self._launchers.items():
            setattr(self._module, name, launcher)
        return super().__exit__(*exc)


def python_calls(step) -> int:
    """Python function calls (frames entered) while ``step()`` runs, after a first warm-up run."""
    step()
    calls = 0

    def count(_frame, event, _arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


class NoLaunch:
    """A kernel whose launches do nothing: what is left of a call is its host work."""

    def __getitem__(self, grid):
        return lambda *args, **options: None


def host_python_calls(monkeypatch, module, launcher_names, step) -> int:
    """``python_calls(step)`` on the Triton path at the GPU's tiles, with the launches of the
    module's ``Launcher``s taken out (through ``kernel[grid]``: two Python calls each)."""
    monkeypatch.setattr(triton_common, "INTERPRETER", True)  # kernel[grid] on a GPU too
    for name in launcher_names:
        monkeypatch.setattr(getattr(module, name), "kernel", NoLaunch())
    with triton_common.gpu_tiles(), fastnmt.backend("triton"):
        return python_calls(step)


class StandInDriver:
    """Triton's ``driver`` (``triton.runtime.jit.driver``) as a GPU machine's: device 0, its
    stream 7, an sm_90 target, so that Triton's own ``JITFunction.run`` runs without a GPU up to
    the compiled kernel's launch (which the caller stands in for too)."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.active = self
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 7 + device

    def get_current_target(self):
        return self.target


class StandInCompiled:
    """What Triton's ``kernel[grid](...)`` returns on a GPU (a ``CompiledKernel``): the handles
    a launch passes and its launcher ``run``, which records each launch's arguments as
    ("run", args) in ``launches`` when given one."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, launches: list | None = None):
        self.launches = launches

    def run(self, *args):
        if self.launches is not None:
            self.launches.append(("run", args))

    def launch_metadata(self, grid, stream, *args):
        return "metadata of the hooks"
