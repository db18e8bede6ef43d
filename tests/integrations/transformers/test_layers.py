"""apply_fastnmt: the same outputs, loss, gradients and state_dict as the model it patched."""

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fastnmt
import fastnmt.integrations.transformers as fastnmt_hf
from tests.helpers import device_of, require_backend
from tests.integrations.transformers.models import FAMILIES, tiny_model
from tests.integrations.transformers.test_attention import padded_batch


def patched(family, **options):
    eager = tiny_model(family)
    return eager, fastnmt_hf.apply_fastnmt(copy.deepcopy(eager), **options)


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_logits_and_state_dict_unchanged(family, tmp_path):
    eager, fused = patched(family)
    batch = padded_batch("right", torch.Generator().manual_seed(4))
    torch.testing.assert_close(fused(**batch).logits, eager(**batch).logits, atol=1e-4, rtol=1e-4)
    expected = eager.state_dict()
    assert fused.state_dict().keys() == expected.keys()
    for name, tensor in fused.state_dict().items():
        assert torch.equal(tensor, expected[name])
    fused.save_pretrained(tmp_path)
    reloaded = type(eager).from_pretrained(tmp_path, attn_implementation="eager").eval()
    torch.testing.assert_close(reloaded(**batch).logits, eager(**batch).logits)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("unlabelled_sentence", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_loss_and_gradients_match_without_logits(family, unlabelled_sentence, packing):
    """Also with a sentence whose labels are all ignored: its decoder positions are all
    padding, so the packed decoder holds none of them (and the padded one masks them all)."""
    eager, fused = patched(family, packing=packing)
    batch = padded_batch("left", torch.Generator().manual_seed(5))
    if unlabelled_sentence:  # shifted first: mBART's own shift needs a label in every row
        batch["decoder_input_ids"] = fastnmt_hf.layers._decoder_inputs(eager, batch["labels"])
        batch["labels"][2] = -100
    losses, grads = [], []
    for model in (eager, fused):
        model.train()
        out = model(**batch)
        out.loss.backward()
        losses.append(out.loss)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert out.logits is None  # the fused loss never forms them
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    assert grads[1].keys() == grads[0].keys()
    for name, grad in grads[1].items():
        scale = max(1.0, grads[0][name].abs().max().item())
        torch.testing.assert_close(grad, grads[0][name], atol=1e-4 * scale, rtol=1e-4)


def test_label_smoothing_and_items_in_batch():
    eager, fused = patched("marian", label_smoothing=0.1)
    batch = padded_batch("right", torch.Generator().manual_seed(6))
    logits = eager(**batch).logits
    labels = batch["labels"]
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1)
    fused.train()
    torch.testing.assert_close(fused(**batch).loss, expected, atol=1e-5, rtol=1e-5)
    summed = expected * (labels != -100).sum()
    found = fused(**batch, num_items_in_batch=torch.tensor(7))
    torch.testing.assert_close(found.loss, summed / 7, atol=1e-5, rtol=1e-5)


def test_only_labelled_rows_reach_the_vocabulary(monkeypatch):
    _, fused = patched("marian")
    batch = padded_batch("right", torch.Generator().manual_seed(8))
    batch["labels"][0, 1] = -100  # an ignored label inside a sentence, not only at its end
    seen = []
    real = fastnmt_hf.layers.linear_cross_entropy

    def recording(hidden, weight, bias, target, *args):
        seen.append((hidden.shape[0], target))
        return real(hidden, weight, bias, target, *args)

    monkeypatch.setattr(fastnmt_hf.layers, "linear_cross_entropy", recording)
    fused.train()(**batch).loss.backward()
    (rows, target), labels = seen[0], batch["labels"]
    assert rows == int((labels != -100).sum()) < labels.numel()
    assert torch.equal(target, labels[labels != -100])


def _recorded_feed_forward_rows(monkeypatch) -> list[int]:
    rows, real = [], fastnmt_hf.layers.feed_forward

    def recording(x, *args):
        rows.append(x.flatten(0, -2).shape[0])
        return real(x, *args)

    monkeypatch.setattr(fastnmt_hf.layers, "feed_forward", recording)
    return rows


@pytest.mark.parametrize("family", ["marian", "mbart"])
def test_layers_compute_only_the_kept_positions(family, monkeypatch):
    """Training: the encoder's unpadded positions and the decoder's up to each last label (an
    ignored label inside a sentence still feeds the later ones); the loss and gradients are the
    padded model's (test_training_loss_and_gradients_match_without_logits)."""
    _, fused = patched(family)
    batch = padded_batch("right", torch.Generator().manual_seed(10))
    batch["labels"][0, 1] = -100
    rows = _recorded_feed_forward_rows(monkeypatch)
    fused.train()(**batch).loss.backward()
    encoder, decoder = int(batch["attention_mask"].sum()), 5 + 3 + 5  # row 1 ends at 3 labels
    assert rows == [encoder] * 2 + [decoder] * 2  # two layers each
    rows.clear()
    fused.eval()(**batch)  # with a KV cache the decoder stays padded
    assert rows == [encoder] * 2 + [batch["labels"].numel()] * 2
    rows.clear()
    padded = fastnmt_hf.apply_fastnmt(copy.deepcopy(fused), packing=False)
    padded.train()(**batch).loss.backward()
    assert rows == [batch["input_ids"].numel()] * 2 + [batch["labels"].numel()] * 2


def test_layers_pack_on_cpus_unless_told():
    packs, cpu, cuda = fastnmt_hf.layers.packs, torch.device("cpu"), torch.device("cuda", 1)
    assert packs(None, cpu) and not packs(None, cuda)
    assert packs(True, cuda) and not packs(False, cpu)
    with pytest.raises(ValueError, match=r"^packing must be True, False or None .*'yes'$"):
        fastnmt_hf.apply_fastnmt(tiny_model("marian"), packing="yes")


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _step_aten_ops(model, batch) -> list[str]:
    """The aten ops of a training step (forward and backward), after a first one."""
    model.train()(**batch).loss.backward()
    with _AtenOps() as recorded:
        model(**batch).loss.backward()
    return recorded.ops


def test_padded_layers_dispatch_fewer_ops_than_sdpa_and_sync_once():
    """What a GPU pays for: a training step's host work grows with its ops (the packed layers
    dispatch more than SDPA's model: index_put and transposes to unpack q, k and v for each
    attention call, and their backward), and each nonzero() waits for the device."""
    sdpa, padded = patched("marian", packing=False)
    sdpa.set_attn_implementation("sdpa")
    batch = padded_batch("right", torch.Generator().manual_seed(12))
    ops = _step_aten_ops(padded, batch)
    assert len(ops) < len(_step_aten_ops(sdpa, batch))
    assert ops.count("nonzero") == 1  # the fused loss's labelled rows
    # Attention outputs and gradients in the layouts transformers' reshapes want: no copies
    # (one per attention call each way before), only shift_tokens_right's clone of the labels.
    assert ops.count("clone") == 1, ops.count("clone")
    packed = fastnmt_hf.apply_fastnmt(copy.deepcopy(padded), packing=True)
    # and one per mask the layers of a stack share: the encoder's, the decoder's, the memory's
    assert _step_aten_ops(packed, batch).count("nonzero") == 1 + 3


@pytest.mark.parametrize("padding", ["right", "left"])
def test_packed_eval_without_cache_equals_eager_at_kept_positions(padding):
    eager, fused = patched("bart")
    batch = padded_batch(padding, torch.Generator().manual_seed(11))
    labels = batch.pop("labels")
    decoder_mask = labels != -100
    inputs = dict(batch, decoder_input_ids=labels.clamp(min=3), use_cache=False)
    inputs["decoder_attention_mask"] = decoder_mask
    expected, found = eager(**inputs), fused(**inputs)
    torch.testing.assert_close(
        found.logits[decoder_mask], expected.logits[decoder_mask], atol=1e-4, rtol=1e-4
    )
    source = batch["attention_mask"].bool()
    torch.testing.assert_close(
        found.encoder_last_hidden_state[source],
        expected.encoder_last_hidden_state[source],
        atol=1e-4,
        rtol=1e-4,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_after_apply_matches(family):
    """Beam search reorders the KV cache the patched decoder layers pass on (under the keyword
    of this transformers version: past_key_values, or cache from 5.24)."""
    eager, fused = patched(family)
    batch = padded_batch("right", torch.Generator().manual_seed(7))
    del batch["labels"]
    options = dict(num_beams=4, max_new_tokens=10, do_sample=False)
    assert torch.equal(fused.generate(**batch, **options), eager.generate(**batch, **options))


def test_unsupported_models_are_refused_in_one_line():
    transformers = pytest.importorskip("transformers")
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1)
    )
    with pytest.raises(fastnmt_hf.UnsupportedModelError, match="model types"):
        fastnmt_hf.apply_fastnmt(t5)
    with pytest.raises(fastnmt_hf.UnsupportedModelError, match="activation_function"):
        fastnmt_hf.apply_fastnmt(tiny_model("bart", activation_function="tanh"))
    with pytest.raises(fastnmt_hf.UnsupportedModelError, match="expected a 'marian' model"):
        fastnmt_hf.apply_fastnmt_to_marian(tiny_model("bart"))
    with pytest.raises(ValueError, match="label_smoothing"):
        fastnmt_hf.apply_fastnmt(tiny_model("bart"), label_smoothing=1.0)


class _NewLayer(torch.nn.Module):
    def forward(self, hidden_states, cache=None, **kwargs):
        return hidden_states


class _OldLayer(torch.nn.Module):
    def forward(self, hidden_states, past_key_values=None, use_cache=True):
        return hidden_states


class _UnknownLayer(torch.nn.Module):
    def forward(self, hidden_states, kv=None):
        return hidden_states


def test_the_cache_keyword_follows_the_layer_signature():
    assert fastnmt_hf.layers._cache_keyword(_NewLayer()) == "cache"
    assert fastnmt_hf.layers._cache_keyword(_OldLayer()) == "past_key_values"
    with pytest.raises(fastnmt_hf.UnsupportedModelError, match=r"_UnknownLayer\.forward") as error:
        fastnmt_hf.layers._cache_keyword(_UnknownLayer())
    assert "\n" not in str(error.value) and fastnmt_hf._version.SUPPORTED in str(error.value)


@pytest.mark.parametrize(
    ("version", "supported"),
    [("4.57.6", False), ("5.5.0", False), ("5.6.0", True), ("5.24.0", True), ("5.30.0.dev0", True),
     ("6.0.0", False)],
)  # fmt: skip
def test_transformers_out_of_range_is_a_one_line_import_error(monkeypatch, version, supported):
    monkeypatch.setattr(fastnmt_hf._version.transformers, "__version__", version)
    if supported:
        fastnmt_hf._version.check()
        return
    with pytest.raises(ImportError, match=f"found {re.escape(version)}") as error:
        fastnmt_hf._version.check()
    assert "\n" not in str(error.value) and "transformers>=5.6,<6" in str(error.value)


def test_the_supported_range_is_the_one_in_pyproject():
    """The transformers and dev extras ask for the range the import accepts."""
    pyproject = (Path(__file__).parents[3] / "pyproject.toml").read_text()
    requirements = re.findall(r'"transformers([^"]*)"', pyproject)
    assert requirements == [fastnmt_hf._version.SUPPORTED] * 2


def _saved_bytes(model, batch) -> int:
    """Bytes a training step keeps for its backward besides the parameters (each storage once):
    what bounds its peak memory. The forward saves them all (a backward without create_graph
    saves nothing), so the backward itself, most of the step's time in the interpreter, is not
    run."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        assert model(**batch).loss.requires_grad
    return sum(storages.values())


@pytest.mark.parametrize(
    ("packing", "bound"), [(True, 0.75), (False, 0.78)], ids=["packed", "padded"]
)
@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_a_training_step_keeps_less_for_backward_than_sdpa(backend, packing, bound):
    """No logits, and packed: only the kept positions, and no packed copies kept by the
    unpacking: the fused step saves well under transformers' SDPA step (at Marian-base, about
    half), on each fused backend; padded (a GPU's default), still under it."""
    require_backend(backend)
    device = device_of(backend)
    sdpa = tiny_model("marian", vocab_size=1000).train().to(device)
    sdpa.set_attn_implementation("sdpa")
    fused = fastnmt_hf.apply_fastnmt(copy.deepcopy(sdpa), packing=packing)
    generator = torch.Generator().manual_seed(6)
    lengths = torch.randint(6, 17, (8, 2), generator=generator)
    positions = torch.arange(16)
    batch = dict(
        input_ids=torch.randint(3, 1000, (8, 16), generator=generator),
        attention_mask=(positions < lengths[:, :1]).long(),
        labels=torch.randint(3, 1000, (8, 16), generator=generator).masked_fill(
            positions >= lengths[:, 1:], -100
        ),
    )
    batch = {name: tensor.to(device) for name, tensor in batch.items()}
    with fastnmt.backend(backend):
        fused_bytes = _saved_bytes(fused, batch)
    # packed 0.68 (0.84 when unpacking kept rows); padded 0.73 (0.79 when the attention output
    # was (B, H, Lq, Dv)-contiguous: the output projection then kept a copy of it)
    assert fused_bytes < bound * _saved_bytes(sdpa, batch)
