"""attn_implementation="fastnmt" against transformers' eager attention, on tiny random models of
each family: logits, loss and every parameter gradient by FlashAttention's rule (float64 eager as
the oracle), left and right padding; generate() greedy and beam 4; output_attentions."""

import copy
import importlib

import pytest
import torch

import fastnmt.integrations.transformers as fastnmt_hf
from tests.helpers import assert_error_within
from tests.integrations.transformers.models import FAMILIES, VOCAB, tiny_model

HF_ATTENTION = importlib.import_module("fastnmt.integrations.transformers.attention")

# Relative to the largest value of the compared tensor: a whole model's outputs and gradients
# carry many kernels' rounding (the kernels alone are held to 1e-5 in tests/ops).
ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def assert_model_error_within(candidate, same_dtype, oracle, factor, dtype):
    atol = ATOL[dtype] * max(1.0, oracle.abs().max().item())
    assert_error_within(candidate, same_dtype, oracle, factor, atol)


def padded_batch(padding: str, generator):
    """Sources of 7, 4 and 1 tokens (eos last) padded on one side, and labels with -100 after
    each target's end."""
    lengths = [7, 4, 1]
    src = torch.randint(3, VOCAB, (3, 7), generator=generator)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for row, length in enumerate(lengths):
        keep = slice(0, length) if padding == "right" else slice(7 - length, 7)
        mask[row, keep] = 1
    src = src.masked_fill(mask == 0, 1)
    labels = torch.randint(3, VOCAB, (3, 5), generator=generator)
    labels[1, 3:] = -100
    return dict(input_ids=src, attention_mask=mask, labels=labels)


def run(model, batch, dtype):
    """Logits, loss and parameter gradients (name -> grad) of one training-mode pass."""
    model = model.to(dtype).train()
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_gradients_match_eager(family, padding, dtype):
    seed = FAMILIES.index(family) * 2 + (padding == "left")
    batch = padded_batch(padding, torch.Generator().manual_seed(seed))
    eager = tiny_model(family)
    fused = copy.deepcopy(eager)
    fused.set_attn_implementation(fastnmt_hf.NAME)
    oracle = run(copy.deepcopy(eager), batch, torch.float64)
    same_dtype = run(eager, batch, dtype)
    candidate = run(fused, batch, dtype)
    assert_model_error_within(candidate[0], same_dtype[0], oracle[0], 2, dtype)
    assert_model_error_within(candidate[1], same_dtype[1], oracle[1], 2, dtype)
    assert candidate[2].keys() == oracle[2].keys()
    for name, grad in candidate[2].items():
        assert_model_error_within(grad, same_dtype[2][name], oracle[2][name], 3, dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_greedy_and_beam_match_eager(family):
    eager = tiny_model(family)
    fused = copy.deepcopy(eager)
    fused.set_attn_implementation(fastnmt_hf.NAME)
    batch = padded_batch("right", torch.Generator().manual_seed(1))
    del batch["labels"]
    for beams in (1, 4):
        options = dict(num_beams=beams, max_new_tokens=12, do_sample=False)
        expected = eager.generate(**batch, **options)
        assert torch.equal(fused.generate(**batch, **options), expected)
        assert len(set(map(tuple, expected.tolist()))) > 1  # the sentences differ: a real test


@pytest.mark.parametrize("family", ["marian", "m2m_100"])
def test_output_attentions_are_the_probabilities(family):
    eager = tiny_model(family)
    fused = copy.deepcopy(eager)
    fused.set_attn_implementation(fastnmt_hf.NAME)
    batch = padded_batch("right", torch.Generator().manual_seed(2))
    expected = eager(**batch, output_attentions=True)
    found = fused(**batch, output_attentions=True)
    for kind in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        assert len(found[kind]) == 2
        for got, want in zip(found[kind], expected[kind], strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # Padded keys get no probability.
    assert (found.cross_attentions[0][2, :, :, 1:] == 0).all()


@pytest.mark.parametrize("fill", [False, True])
def test_unpacking_keeps_only_the_row_indices_for_backward(fill):
    """The packed rows are the layer's activations: keeping them for the backward (index_copy
    did, for their shape) doubled what a layer saved of them. The gradient still reaches them,
    and the fill's kept positions."""
    packing = fastnmt_hf.Packing.of(torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool))
    packed = torch.randn(1, 3, 4, requires_grad=True)
    padded = torch.randn(2, 3, 4, requires_grad=True) if fill else None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        unpacked = packing.unpack(packed, fill=padded)
    assert [tuple(t.shape) for t in saved] == [(3,)] and saved[0].dtype == torch.int64
    upstream = torch.randn(2, 3, 4)
    (unpacked * upstream).sum().backward()
    torch.testing.assert_close(packed.grad[0], upstream.flatten(0, 1)[packing.rows])
    if fill:
        dropped = torch.tensor([[0, 0, 1], [0, 1, 1]], dtype=torch.bool)
        torch.testing.assert_close(padded.grad, upstream * dropped[..., None])


class _Module(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.is_causal = causal


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("kind", ["self, causal", "cross", "cross, keys packed only"])
def test_packed_calls_equal_padded_ones(kind, need_weights):
    """A packed call (what apply_fastnmt's layers make) gives the padded call's outputs and
    gradients at the kept positions, and its probabilities."""
    torch.manual_seed(9)
    b, h, d, lq = 3, 2, 8, 6
    lk = lq if kind.startswith("self") else 5
    query_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5], dtype=torch.bool)
    key_mask = query_mask if lk == lq else torch.tensor([[1] * 5, [0, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    queries = None if kind.endswith("only") else fastnmt_hf.Packing.of(query_mask)
    keys = fastnmt_hf.Packing.of(key_mask)
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for n in (lq, lk, lk))
    module = _Module(causal=kind.startswith("self"))
    mask = key_mask.long()
    options = dict(output_attentions=need_weights, scaling=0.3)
    padded, padded_weights = fastnmt_hf.fastnmt_attention_forward(module, q, k, v, mask, **options)

    def packed_heads(packing, x):
        return x if packing is None else packing.pack(x.transpose(1, 2)).transpose(1, 2)

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    inputs = [packed_heads(queries, leaves[0])] + [packed_heads(keys, x) for x in leaves[1:]]
    packing = dict(fastnmt_query_packing=queries, fastnmt_key_packing=keys)
    forward = fastnmt_hf.fastnmt_attention_forward
    packed, weights = forward(module, *inputs, mask, **options, **packing)
    kept = query_mask.flatten() if queries is not None else torch.ones(b * lq, dtype=torch.bool)
    expected = padded.flatten(0, 1)[kept]
    torch.testing.assert_close(packed.flatten(0, 1), expected, atol=1e-6, rtol=1e-5)
    if need_weights:  # (B, H, Lq, Lk), padded: the kept queries' rows are the padded call's
        assert weights.shape == padded_weights.shape == (b, h, lq, lk)
        kept_rows = [x.transpose(1, 2).flatten(0, 1)[kept] for x in (weights, padded_weights)]
        torch.testing.assert_close(*kept_rows, atol=1e-6, rtol=1e-5)
    upstream = torch.randn_like(expected)
    (packed.flatten(0, 1) * upstream).sum().backward()
    (expected * upstream).sum().backward()
    for leaf, original in zip(leaves, (q, k, v), strict=True):
        torch.testing.assert_close(leaf.grad, original.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("dropout", "need_weights", "varlen"),
    [(0.0, False, True), (0.1, False, True), (0.0, True, False)],
    ids=["packed", "attention dropout", "weights"],
)
def test_packed_calls_run_attention_varlen_on_the_packed_rows(
    dropout, need_weights, varlen, monkeypatch
):
    """No unpacking around the kernels, unless the call asks for what attention_varlen does not
    give (the probabilities)."""
    calls = []

    def recorded(name):
        original = getattr(HF_ATTENTION, name)
        return lambda *args, **kwargs: calls.append(name) or original(*args, **kwargs)

    for name in ("attention_varlen", "attention"):
        monkeypatch.setattr(HF_ATTENTION, name, recorded(name))
    packing = fastnmt_hf.Packing.of(torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool))
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    packed = dict(fastnmt_query_packing=packing, fastnmt_key_packing=packing)
    out, _ = fastnmt_hf.fastnmt_attention_forward(
        _Module(causal=True), q, k, v, None, dropout=dropout, output_attentions=need_weights,
        **packed,
    )  # fmt: skip
    assert out.shape == (1, 5, 2, 8)
    assert calls == (["attention_varlen"] if varlen else ["attention"])


def test_dropout_in_training_is_seeded_and_off_in_eval():
    model = tiny_model("bart", attention_dropout=0.5)
    model.set_attn_implementation(fastnmt_hf.NAME)
    batch = padded_batch("right", torch.Generator().manual_seed(3))
    model.train()
    losses = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        losses.append(model(**batch).loss)
    assert losses[0] == losses[1] != losses[2]
    model.eval()
    assert model(**batch).loss == model(**batch).loss


class _Handed(Exception):
    """Raised by the recording attention function: whether it was handed a position bias."""


def _t5_position_bias_route(model, ids) -> str:
    """How this transformers hands T5's position bias to an attention function: "argument" (a
    position_bias keyword, 5.17 and 5.24), "mask" (folded into an additive attention_mask), or
    "none": T5 computes its attention itself (before 5.15), or the setting does not reach its
    layers (5.17: T5's stacks keep their own config copies, so T5 goes on with sdpa)."""
    from transformers import AttentionInterface

    def recording(module, query, key, value, attention_mask, **kwargs):
        raise _Handed(kwargs.get("position_bias") is not None)

    AttentionInterface.register("fastnmt-test-recording", recording)
    model.set_attn_implementation("fastnmt-test-recording")
    try:
        model(input_ids=ids, labels=ids)
    except _Handed as handed:
        return "argument" if handed.args[0] else "mask"
    return "none"


def test_t5_position_bias_is_refused_in_one_line_or_added_exactly():
    """A bias handed as an argument the kernels cannot add: a one-line error. One folded into
    the additive mask is added like any additive mask, and one T5 adds itself is not fastnmt's
    business: in both the loss is eager's. Never a loss without the bias."""
    transformers = pytest.importorskip("transformers")

    # decoder_start_token_id as T5 checkpoints give it: some transformers 5.x T5Configs have no
    # default, and T5's own right shift needs it.
    config = transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
        decoder_start_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(0, 50, (2, 5))
    model.set_attn_implementation("eager")
    expected = model(input_ids=ids, labels=ids).loss
    route = _t5_position_bias_route(model, ids)
    model.set_attn_implementation(fastnmt_hf.NAME)
    if route != "argument":
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, expected)
        return
    with pytest.raises(fastnmt_hf.UnsupportedModelError, match="position bias") as error:
        model(input_ids=ids, labels=ids)
    assert "\n" not in str(error.value)
