"""fastnmt.attention: the drop-in API against torch.nn.MultiheadAttention and torch's SDPA."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastnmt
from fastnmt.attention import (
    KVCache,
    MultiheadAttention,
    Packed,
    scaled_dot_product_attention,
    swap_multihead_attention,
)
from tests.helpers import TRITON_DEVICE, HostOps, assert_error_within, device_of, random_lengths

E, HEADS = 24, 4


def _pair(device="cpu", **kwargs):
    """A torch.nn.MultiheadAttention and fastnmt's, loaded from the same state_dict."""
    theirs = nn.MultiheadAttention(E, HEADS, **kwargs).to(device)
    ours = MultiheadAttention(E, HEADS, **kwargs).to(device)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _padding(batch, length, min_length=1, device="cpu"):
    lengths = random_lengths(batch, length, low=min_length).to(device)
    return lengths, torch.arange(length, device=device)[None, :] >= lengths[:, None]


def _assert_same(theirs, ours, inputs, **forward):
    """Outputs, weights and all gradients (inputs and parameters) agree within 1e-5."""
    inputs_theirs = [x.clone().requires_grad_() for x in inputs]
    inputs_ours = [x.clone().requires_grad_() for x in inputs]
    out_theirs, weights_theirs = theirs(*inputs_theirs, **forward)
    out_ours, weights_ours = ours(*inputs_ours, **forward)
    torch.testing.assert_close(out_ours, out_theirs, atol=1e-5, rtol=1e-5)
    if weights_theirs is not None:
        torch.testing.assert_close(weights_ours, weights_theirs, atol=1e-5, rtol=1e-5)
    upstream = torch.randn_like(out_theirs)
    out_theirs.backward(upstream)
    out_ours.backward(upstream)
    for x_theirs, x_ours in zip(inputs_theirs, inputs_ours, strict=True):
        torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=1e-5, rtol=1e-5)
    grads_theirs = {n: p.grad for n, p in theirs.named_parameters()}
    for name, parameter in ours.named_parameters():
        torch.testing.assert_close(parameter.grad, grads_theirs[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("average_attn_weights", [False, True])
def test_self_attention_with_key_padding(batch_first, average_attn_weights):
    theirs, ours = _pair(batch_first=batch_first)
    _, padding = _padding(3, 7)
    x = torch.randn(3, 7, E) if batch_first else torch.randn(7, 3, E)
    _assert_same(
        theirs,
        ours,
        [x, x, x],
        key_padding_mask=padding,
        average_attn_weights=average_attn_weights,
    )


@pytest.mark.parametrize("mask_kind", ["bool", "float", "is_causal"])
def test_causal_self_attention(mask_kind):
    theirs, ours = _pair(batch_first=True)
    _, padding = _padding(2, 6)
    x = torch.randn(2, 6, E)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    forward = dict(key_padding_mask=padding, need_weights=False)
    if mask_kind == "bool":
        forward["attn_mask"] = causal.isinf()
    else:
        forward["attn_mask"] = causal
        forward["is_causal"] = mask_kind == "is_causal"
    _assert_same(theirs, ours, [x, x, x], **forward)


def test_cross_attention_with_other_key_and_value_dims():
    theirs, ours = _pair(kdim=10, vdim=14, batch_first=True)
    _, padding = _padding(3, 9)
    inputs = [torch.randn(3, 5, E), torch.randn(3, 9, 10), torch.randn(3, 9, 14)]
    _assert_same(theirs, ours, inputs, key_padding_mask=padding)


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_cross_attention_weights_are_torch_s_to_fp32_rounding(fused, scale):
    """need_weights: the weights are torch's to fp32 rounding (not merely 1e-5), at E 64 with 4
    heads and key lengths [17, 5, 1] (a key of its own gives a weight of exactly 1), also with
    larger scores, where the log-sum-exp they are recomputed from carries more rounding. On a
    GPU, where the scores sum in Triton's order, not cuBLAS's: within twice torch's error of
    the float64 oracle."""
    device = device_of(fused)
    theirs = nn.MultiheadAttention(64, 4, batch_first=True, device=device)
    ours = MultiheadAttention(64, 4, batch_first=True, device=device)
    ours.load_state_dict(theirs.state_dict())
    query = scale * torch.randn(3, 11, 64, device=device)
    memory = scale * torch.randn(3, 17, 64, device=device)
    padding = torch.arange(17, device=device) >= torch.tensor([17, 5, 1], device=device)[:, None]
    forward = dict(key_padding_mask=padding, average_attn_weights=False)
    out_theirs, weights_theirs = theirs(query, memory, memory, **forward)
    out_ours, weights_ours = ours(query, memory, memory, **forward)
    # On a GPU the attention sums in another order than torch's (Triton's tiles against cuBLAS's)
    # and the out-projection mixes that over E features: a few float32 ulps at scale 3.
    torch.testing.assert_close(out_ours, out_theirs, atol=4e-6, rtol=1e-5)
    eps = torch.finfo(torch.float32).eps
    if device.type == "cpu":
        torch.testing.assert_close(weights_ours, weights_theirs, atol=2 * eps, rtol=0)
    _, weights_oracle = copy.deepcopy(theirs).double()(query.double(), memory.double(),
                                                       memory.double(), **forward)  # fmt: skip
    assert_error_within(weights_ours, weights_theirs, weights_oracle, 2, 2 * eps, "weights")


def test_per_head_attn_mask_and_float_key_padding_mask():
    theirs, ours = _pair()
    query, memory = torch.randn(4, 2, E), torch.randn(6, 2, E)
    attn_mask = torch.rand(2 * HEADS, 4, 6) < 0.3
    attn_mask[..., 0] = False  # every query keeps a key: torch gives NaN otherwise
    additive_padding = torch.zeros(2, 6).masked_fill(torch.tensor([[0] * 5 + [1]] * 2).bool(), -1e4)
    _assert_same(
        theirs,
        ours,
        [query, memory, memory],
        attn_mask=attn_mask,
        key_padding_mask=additive_padding,
    )


@pytest.mark.parametrize("option", ["add_bias_kv", "add_zero_attn"])
def test_extra_key_options(option):
    theirs, ours = _pair(**{option: True})
    _, padding = _padding(2, 5)
    x = torch.randn(5, 2, E)
    _assert_same(theirs, ours, [x, x, x], key_padding_mask=padding)


def test_unbatched_input_and_no_bias():
    theirs, ours = _pair(bias=False)
    x = torch.randn(5, E)
    _assert_same(theirs, ours, [x, x, x], key_padding_mask=torch.tensor([0, 0, 0, 1, 1]).bool())


def test_key_lengths_equal_key_padding_mask():
    _, ours = _pair(batch_first=True)
    lengths, padding = _padding(3, 8, min_length=0)
    x = torch.randn(3, 8, E)
    by_mask, weights_by_mask = ours(x, x, x, key_padding_mask=padding)
    by_lengths, weights_by_lengths = ours(x, x, x, key_lengths=lengths)
    torch.testing.assert_close(by_lengths, by_mask)
    torch.testing.assert_close(weights_by_lengths, weights_by_mask)


def test_fully_padded_sequence_gives_zero_weights_and_finite_output():
    _, ours = _pair(batch_first=True)
    x = torch.randn(2, 4, E, requires_grad=True)
    out, weights = ours(x, x, x, key_lengths=torch.tensor([4, 0]))
    out.sum().backward()
    assert (weights[1] == 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(out[1], ours.out_proj.bias.expand(4, E))  # attention output 0


def test_dropout_is_used_in_training_only():
    _, ours = _pair(dropout=0.5, batch_first=True)
    x = torch.randn(2, 16, E)
    ours.eval()
    torch.testing.assert_close(ours(x, x, x)[0], ours(x, x, x)[0])
    ours.train()
    assert not torch.allclose(ours(x, x, x)[0], ours(x, x, x)[0])


class TestIncrementalDecoding:
    def test_self_attention_cache_step_by_step_equals_causal_full(self):
        _, ours = _pair(batch_first=True)
        x = torch.randn(3, 9, E)
        full, _ = ours(x, x, x, is_causal=True, need_weights=False)
        cache = KVCache()
        steps = [
            ours(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], cache=cache)[0]
            for t in range(9)
        ]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-6, rtol=1e-6)
        assert cache.length == 9

    def test_self_attention_cache_with_multi_step_chunks(self):
        _, ours = _pair(batch_first=True)
        x = torch.randn(2, 40, E)  # grows the cache past its first capacity
        full, _ = ours(x, x, x, is_causal=True, need_weights=False)
        cache = KVCache()
        chunks = [
            ours(x[:, a:b], x[:, a:b], x[:, a:b], cache=cache, is_causal=True)[0]
            for a, b in [(0, 3), (3, 4), (4, 20), (20, 40)]
        ]
        torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-6, rtol=1e-6)

    def test_cross_attention_cache_projects_memory_once(self):
        _, ours = _pair(batch_first=True)
        lengths, _ = _padding(3, 7)
        query, memory = torch.randn(3, 5, E), torch.randn(3, 7, E)
        full, _ = ours(query, memory, memory, key_lengths=lengths)
        cache = KVCache(static=True)
        steps = []
        for t in range(5):
            # memory is only read on the first call: later calls may pass anything of its shape
            source = memory if t == 0 else torch.full_like(memory, float("nan"))
            steps.append(
                ours(query[:, t : t + 1], source, source, key_lengths=lengths, cache=cache)[0]
            )
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-6, rtol=1e-6)

    @pytest.mark.parametrize("read", ["through rows", "weights", "with grad"])
    def test_decoding_through_reordered_caches_equals_recomputing(self, read):
        """A beam search's steps: hypotheses reordered (repeated, dropped) between steps, then
        each step's output against attention over its whole history, recomputed. Without
        gradients attention reads through the cache rows; weights and gradients gather."""
        _, ours = _pair(batch_first=True)
        cache, need_weights = KVCache(), read == "weights"
        history = torch.randn(4, 1, E)
        ours(history, history, history, cache=cache)
        for index in ([0, 0, 2, 3], [1, 1, 1, 0], [3, 2], [1, 0, 0]):
            index = torch.tensor(index)
            cache.reorder(index)
            step = torch.randn(len(index), 1, E)
            history = torch.cat([history[index], step], dim=1)
            with torch.set_grad_enabled(read == "with grad"):
                out, weights = ours(step, step, step, cache=cache, need_weights=need_weights)
            full, full_weights = ours(history, history, history, is_causal=True)
            torch.testing.assert_close(out, full[:, -1:], atol=1e-6, rtol=1e-6)
            assert out.requires_grad == (read == "with grad")
            if need_weights:
                torch.testing.assert_close(weights, full_weights[:, -1:], atol=1e-6, rtol=1e-6)


def test_swap_inside_torch_transformer_keeps_outputs_and_gradients():
    torch.manual_seed(1)
    model = nn.Transformer(E, HEADS, 2, 2, 48, dropout=0.0, batch_first=True)
    swapped = swap_multihead_attention(copy.deepcopy(model))
    assert not any(isinstance(m, nn.MultiheadAttention) for m in swapped.modules())
    assert sum(isinstance(m, MultiheadAttention) for m in swapped.modules()) == 6
    _, src_padding = _padding(2, 7)
    src, tgt = torch.randn(2, 7, E), torch.randn(2, 5, E)
    forward = dict(
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(5),
        src_key_padding_mask=src_padding,
        memory_key_padding_mask=src_padding,
    )
    expected, actual = model(src, tgt, **forward), swapped(src, tgt, **forward)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    expected.sum().backward()
    actual.sum().backward()
    grads = dict(model.named_parameters())
    for name, parameter in swapped.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name].grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_in_projection_gradients_are_not_zero_filled_slices(kind):
    """The parts of in_proj_weight a call projects by (qkv; or q and kv) are the weight itself
    or one split, whose backward concatenates their gradients: a slice per part gave each part
    a zero-filled gradient of the whole weight and then a sum (three kernels a part on a GPU).
    Their values: test_swap_inside_torch_transformer_keeps_outputs_and_gradients."""
    module = MultiheadAttention(E, HEADS, batch_first=True)
    x, memory = torch.randn(2, 5, E), torch.randn(2, 7, E)
    key = x if kind == "self" else memory
    with HostOps() as host:
        module(x, key, key, need_weights=False)[0].sum().backward()
    assert "slice_backward" not in host.aten and "slice" not in host.aten, host.aten


def test_swap_keeps_device_dtype_and_mode():
    module = nn.MultiheadAttention(E, HEADS, dtype=torch.float64).eval()
    swapped = swap_multihead_attention(module)
    assert isinstance(swapped, MultiheadAttention)
    assert swapped.in_proj_weight.dtype == torch.float64 and not swapped.training


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_torch_sdpa(causal):
    q, k, v = (torch.randn(2, 3, 6, 16) for _ in range(3))
    lengths, padding = _padding(2, 6)
    ours = scaled_dot_product_attention(q, k, v, is_causal=causal, key_padding_mask=padding)
    mask = ~padding[:, None, None, :]
    if causal:
        mask = mask & torch.ones(6, 6, dtype=torch.bool).tril()
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    by_lengths = scaled_dot_product_attention(q, k, v, is_causal=causal, key_lengths=lengths)
    torch.testing.assert_close(by_lengths, theirs, atol=1e-5, rtol=1e-5)


BAD_MODULE_INPUTS = [
    (dict(query=torch.randn(2, 3, 4, E)), ValueError, r"query must be \(N, L, E\) \(3 dim"),
    (dict(key=torch.randn(5, E)), ValueError, "key must be"),
    (dict(attn_mask=torch.zeros(3, 3, dtype=torch.bool)), ValueError, "attn_mask must have shape"),
    (
        dict(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
        ValueError,
        "key_padding_mask must have shape",
    ),
    (dict(key_lengths=torch.tensor([9, 1])), ValueError, "key_lengths must lie in"),
    (
        dict(query=torch.randn(2, 5, E + 1)),
        ValueError,
        rf"query must have embed_dim = {E} features in its last dimension, got shape \(2, 5,",
    ),
    (dict(value=torch.randn(2, 5, E - 1)), ValueError, f"value must have vdim = {E} features"),
]


@pytest.mark.parametrize(("override", "error", "message"), BAD_MODULE_INPUTS)
def test_bad_module_inputs_name_the_argument(override, error, message, monkeypatch):
    monkeypatch.setenv("FASTNMT_CHECK_VALUES", "1")  # key_lengths' range is checked too
    fastnmt.ops.settings.reload()
    _, ours = _pair(batch_first=True)
    x = torch.randn(2, 5, E)
    arguments = dict(query=x, key=x, value=x)
    arguments.update(override)
    with pytest.raises(error, match=message):
        ours(**arguments)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="must be divisible by num_heads"):
        MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="dropout must be in"):
        MultiheadAttention(8, 2, dropout=1.0)


def test_traced_by_torch_compile_without_graph_breaks():
    _, ours = _pair(batch_first=True)
    x = torch.randn(2, 5, E)
    lengths = torch.tensor([5, 3])
    call = lambda x, lengths: ours(x, x, x, key_lengths=lengths, is_causal=True)  # noqa: E731
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    out, weights = compiled(x, lengths)
    expected_out, expected_weights = call(x, lengths)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(weights, expected_weights)


class TestTritonBackend:
    """The module forced onto the Triton kernels (on TRITON_DEVICE: the interpreter without a
    GPU) against torch's, unchanged API."""

    def test_padded_self_attention_matches_torch(self):
        theirs, ours = _pair(TRITON_DEVICE, batch_first=True)
        _, padding = _padding(3, 7, device=TRITON_DEVICE)
        x = torch.randn(3, 7, E, device=TRITON_DEVICE)
        with fastnmt.ops.dispatch.backend("triton"):
            _assert_same(theirs, ours, [x, x, x], key_padding_mask=padding)

    def test_padded_causal_self_attention_matches_torch(self):
        theirs, ours = _pair(TRITON_DEVICE)
        _, padding = _padding(2, 6, device=TRITON_DEVICE)
        x = torch.randn(6, 2, E, device=TRITON_DEVICE)
        causal = nn.Transformer.generate_square_subsequent_mask(6, device=TRITON_DEVICE)
        forward = dict(key_padding_mask=padding, attn_mask=causal, is_causal=True)
        with fastnmt.ops.dispatch.backend("triton"):
            _assert_same(theirs, ours, [x, x, x], **forward)

    def test_padded_cross_attention_matches_torch(self):
        theirs, ours = _pair(TRITON_DEVICE, kdim=10, vdim=14, batch_first=True)
        _, padding = _padding(3, 9, device=TRITON_DEVICE)
        inputs = [
            torch.randn(3, 5, E, device=TRITON_DEVICE),
            torch.randn(3, 9, 10, device=TRITON_DEVICE),
            torch.randn(3, 9, 14, device=TRITON_DEVICE),
        ]
        with fastnmt.ops.dispatch.backend("triton"):
            _assert_same(theirs, ours, inputs, key_padding_mask=padding, average_attn_weights=False)

    def test_decoding_steps_read_the_cache_in_place(self):
        """Lq = 1 steps against a growing KVCache (a strided view of its storage, no copy)."""
        _, ours = _pair(TRITON_DEVICE, batch_first=True)
        x = torch.randn(3, 9, E, device=TRITON_DEVICE)
        full, _ = ours(x, x, x, is_causal=True, need_weights=False)
        cache = KVCache()
        with fastnmt.ops.dispatch.backend("triton"):
            steps = [
                ours(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], cache=cache)[0]
                for t in range(9)
            ]
        assert not cache.key.is_contiguous()
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-6, rtol=1e-6)

    def test_traced_by_torch_compile_without_graph_breaks(self):
        _, ours = _pair(TRITON_DEVICE, batch_first=True)
        x = torch.randn(2, 5, E, requires_grad=True, device=TRITON_DEVICE)
        lengths = torch.tensor([5, 3], device=TRITON_DEVICE)
        call = lambda x, lengths: ours(x, x, x, key_lengths=lengths, is_causal=True)  # noqa: E731
        with fastnmt.ops.dispatch.backend("triton"):
            compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
            out, weights = compiled(x, lengths)
            (grad,) = torch.autograd.grad(out.sum(), x)
            expected_out, expected_weights = call(x, lengths)
            (expected_grad,) = torch.autograd.grad(expected_out.sum(), x)
        torch.testing.assert_close(out, expected_out)
        torch.testing.assert_close(weights, expected_weights)
        torch.testing.assert_close(grad, expected_grad)


def test_packed_layout_of_lengths():
    packed = Packed.of_lengths([2, 0, 3])
    assert packed.cu_seqlens.tolist() == [0, 2, 2, 5] and packed.longest == 3
    assert packed.positions.tolist() == [0, 1, 0, 1, 2]
    assert Packed.of_lengths([]).cu_seqlens.tolist() == [0]


def test_attend_to_packed_sequences_equals_the_padded_batch():
    """Cross-attention from packed queries to packed keys, each sequence as in a padded batch."""
    _, ours = _pair(batch_first=True)
    query_lengths, key_lengths = torch.tensor([3, 1, 4]), torch.tensor([5, 2, 1])
    query, key = torch.randn(3, 4, E), torch.randn(3, 5, E)
    padded = ours.attend(query, key, key_lengths=key_lengths)
    queries, keys = (
        Packed.of_lengths(lengths.tolist()) for lengths in (query_lengths, key_lengths)
    )
    rows = [
        torch.arange(x.shape[1]) < n[:, None]
        for x, n in ((query, query_lengths), (key, key_lengths))
    ]
    with torch.no_grad():
        packed = ours.attend(query[rows[0]], key[rows[1]], packed=(queries, keys))
    torch.testing.assert_close(packed, padded[rows[0]], atol=1e-5, rtol=1e-5)


def test_packed_sequences_take_attention_dropout_in_training():
    _, ours = _pair(batch_first=True, dropout=0.5)
    layout = Packed.of_lengths([3, 2])
    x = torch.randn(5, E)
    seed = torch.tensor([7, 0])
    train = [ours.attend(x, x, packed=(layout, layout), dropout_seed=seed) for _ in range(2)]
    torch.testing.assert_close(train[0], train[1])  # the seed decides the mask
    evaluated = ours.eval().attend(x, x, packed=(layout, layout))
    assert not torch.allclose(train[0], evaluated)
