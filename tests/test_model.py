"""The translation Transformer: shapes, tied embeddings, pre/post-norm, KV-cache decoding."""

import pytest
import torch

import fastnmt
from fastnmt.attention import Packed
from fastnmt.model import (
    BlockedOutputLayer,
    LayerCache,
    ModelConfig,
    Transformer,
    preset,
    reorder_self_attention,
    sinusoidal_positions,
)
from fastnmt.training.trainer import label_smoothed_loss
from tests.helpers import HostOps, device_of, require_backend

SMALL = ModelConfig(vocab_size=50, d_model=32, heads=4, d_ff=64, encoder_layers=2, decoder_layers=2)


def _batch(batch=3, src_len=7, tgt_len=5, vocab=50):
    src = torch.randint(4, vocab, (batch, src_len))
    src_lengths = torch.tensor([src_len] + [max(1, src_len - 2 - i) for i in range(batch - 1)])
    for row, length in enumerate(src_lengths.tolist()):
        src[row, length:] = 0
    return src, src_lengths, torch.randint(4, vocab, (batch, tgt_len))


@pytest.mark.parametrize("prenorm", [True, False])
def test_forward_shapes_and_gradients(prenorm):
    model = Transformer(ModelConfig(**{**SMALL.to_dict(), "prenorm": prenorm}))
    src, src_lengths, tgt = _batch()
    states = model(src, src_lengths, tgt)
    assert states.shape == (3, 5, 32)
    logits = model.logits(states)
    assert logits.shape == (3, 5, 50)
    logits.logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_shape_only_training_step_on_the_meta_device():
    """Meta tensors (a model built under ``torch.device("meta")``, as for memory planning or
    FLOP counting) run forward, the fused loss and backward: shapes, no data."""
    src, src_lengths, tgt = (x.to("meta") for x in _batch())
    with torch.device("meta"):
        model = Transformer(SMALL)
        states = model(src, src_lengths, tgt)
        loss, _, _ = label_smoothed_loss(model, states, tgt, torch.arange(15), 0.1)
        loss.backward()
    assert states.shape == (3, 5, 32) and states.device.type == "meta"
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_embeddings_are_tied_and_padding_is_zero():
    model = Transformer(SMALL)
    assert sum(p.shape == (50, 32) for p in model.parameters()) == 1
    assert (model.embedding.weight[0] == 0).all()


def test_padding_does_not_change_encoder_outputs():
    model = Transformer(SMALL).eval()
    src, src_lengths, _ = _batch()
    padded = torch.cat([src, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    short, long = model.encode(src, src_lengths), model.encode(padded, src_lengths)
    for row, length in enumerate(src_lengths.tolist()):
        torch.testing.assert_close(long[row, :length], short[row, :length], atol=1e-5, rtol=1e-5)


def _packed(tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, Packed]:
    """The rows' first ``lengths`` tokens end to end, and their layout."""
    valid = torch.arange(tokens.shape[1]) < lengths[:, None]
    return tokens[valid], Packed.of_lengths(lengths.tolist())


@pytest.mark.parametrize("prenorm", [True, False])
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_packed_forward_equals_the_padded_forward_at_its_tokens(prenorm, backend):
    require_backend(backend)
    model = Transformer(ModelConfig(**{**SMALL.to_dict(), "prenorm": prenorm})).eval()
    src, src_lengths, tgt = _batch(batch=4, src_len=9, tgt_len=6)
    tgt_lengths = torch.tensor([6, 1, 4, 5])
    padded = model(src, src_lengths, tgt)
    with torch.no_grad(), fastnmt.backend(backend):
        packed = model.forward_packed(*_packed(src, src_lengths), *_packed(tgt, tgt_lengths))
    valid = torch.arange(6) < tgt_lengths[:, None]
    torch.testing.assert_close(packed, padded[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_packed_training_gradients_equal_the_padded_ones(backend):
    """Without dropout a packed training step is the padded one at its tokens."""
    require_backend(backend)
    no_dropout = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = Transformer(ModelConfig(**{**SMALL.to_dict(), **no_dropout})).train()
    src, src_lengths, tgt = _batch(batch=3, src_len=8, tgt_len=5)
    tgt_lengths = torch.tensor([5, 2, 4])
    valid = torch.arange(5) < tgt_lengths[:, None]
    upstream = torch.randn(int(tgt_lengths.sum()), 32)
    grads = []
    with fastnmt.backend(backend):
        for states in (
            lambda: model(src, src_lengths, tgt)[valid],
            lambda: model.forward_packed(*_packed(src, src_lengths), *_packed(tgt, tgt_lengths)),
        ):
            model.zero_grad()
            (states() * upstream).sum().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[1].items():
        torch.testing.assert_close(grad, grads[0][name], atol=1e-4, rtol=1e-4, msg=name)


def test_cached_decoding_equals_full_recomputation():
    model = Transformer(SMALL).eval()
    src, src_lengths, tgt = _batch()
    memory = model.encode(src, src_lengths)
    full = model.decode(tgt, memory, src_lengths)
    caches = model.new_caches()
    steps = [
        model.decode(tgt[:, t : t + 1], memory, src_lengths, caches, start=t)
        for t in range(tgt.shape[1])
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_sinusoidal_positions():
    table = sinusoidal_positions(10, 8)
    torch.testing.assert_close(table[:, 0], torch.sin(torch.arange(10.0)))
    torch.testing.assert_close(table[:, 1], torch.cos(torch.arange(10.0)))


def test_presets_and_bad_names():
    assert preset("base").d_model == 512 and preset("iwslt").heads == 4
    assert preset("tiny", vocab_size=100).vocab_size == 100
    with pytest.raises(ValueError, match="preset must be one of"):
        preset("huge")


def test_too_long_input_is_a_clear_error():
    model = Transformer(ModelConfig(**{**SMALL.to_dict(), "max_positions": 4}))
    src, src_lengths, _ = _batch(src_len=6)
    with pytest.raises(ValueError, match="exceeds max_positions"):
        model.encode(src, src_lengths)


@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("output_bias", [False, True])
def test_the_output_layer_for_decoding_equals_the_logits(output_bias, blocks, monkeypatch):
    """In one block, and in vocabulary blocks (the last one partial) as for a weight larger than
    the cache; with its reused buffer: calls of fewer and then more rows than before."""
    if blocks > 1:
        monkeypatch.setattr(BlockedOutputLayer, "CACHED_BYTES", 0)
    vocab_size = (blocks - 1) * BlockedOutputLayer.BLOCK + 452
    sizes = dict(vocab_size=vocab_size, d_model=32, heads=2, d_ff=64)
    model = Transformer(preset("tiny", output_bias=output_bias, **sizes))
    if output_bias:
        model.output_bias.normal_()
    layer = model.output_layer()
    assert len(layer.blocks) == blocks
    for rows in (7, 3, 9):
        states = torch.randn(rows, 32)
        torch.testing.assert_close(layer(states), model.logits(states), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("prenorm", "dropout", "attention_dropout", "activation_dropout"),
    [(True, 0.1, 0.1, 0.0), (False, 0.1, 0.0, 0.2), (True, 0.0, 0.1, 0.2), (True, 0.0, 0.0, 0.0)],
)
@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_a_training_forward_draws_all_its_dropout_seeds_at_once(
    backend, prenorm, dropout, attention_dropout, activation_dropout, monkeypatch
):
    """One draw of seeds per forward (one kernel on a GPU, where each fused op drew its own), and
    ``dropout_sites`` counts exactly the ops that take one: every seed drawn is used."""
    require_backend(backend)
    options = dict(dropout=dropout, attention_dropout=attention_dropout, prenorm=prenorm)
    cfg = ModelConfig(**{**SMALL.to_dict(), **options, "activation_dropout": activation_dropout})
    model = Transformer(cfg).to(device_of(backend))
    drawn = []
    draw = Transformer.dropout_seeds

    def recording(self, device):
        drawn.append(draw(self, device))
        return drawn[-1]

    monkeypatch.setattr(Transformer, "dropout_seeds", recording)
    src, src_lengths, tgt = (x.to(device_of(backend)) for x in _batch())
    with fastnmt.backend(backend), HostOps() as host:
        model(src, src_lengths, tgt)
    assert host.aten.count("randint") == (cfg.dropout_sites() > 0)
    assert drawn[0] is None if cfg.dropout_sites() == 0 else next(drawn[0], "spent") == "spent"


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_a_checkpointed_training_forward_recomputes_the_same_dropout(backend):
    """``torch.utils.checkpoint`` recomputes a forward with the random state it started with: the
    seeds drawn inside it come out the same, so its gradients are the plain forward's. One layer
    a side has every kind of dropout site (the interpreter runs three forwards and two backwards
    of each attention here)."""
    require_backend(backend)
    layers = dict(encoder_layers=1, decoder_layers=1)
    model = Transformer(ModelConfig(**{**SMALL.to_dict(), "activation_dropout": 0.1, **layers}))
    model = model.to(device_of(backend))
    src, src_lengths, tgt = (x.to(device_of(backend)) for x in _batch())
    gradients = []
    for checkpointed in (False, True):
        torch.manual_seed(3)
        with fastnmt.backend(backend):
            if checkpointed:
                states = torch.utils.checkpoint.checkpoint(
                    model, src, src_lengths, tgt, use_reentrant=False
                )
            else:
                states = model(src, src_lengths, tgt)
            model.logits(states).logsumexp(-1).sum().backward()
        gradients.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    for plain, recomputed in zip(*gradients, strict=True):
        torch.testing.assert_close(recomputed, plain)


@pytest.mark.parametrize("shared", [True, False], ids=["new_caches", "own rows"])
def test_reorder_self_attention_gathers_each_rows_table_once(shared):
    """The search's reorder: caches sharing their rows (``new_caches``) and caches with rows of
    their own all end up reordered, each table exactly once."""
    model = Transformer(SMALL)
    caches = model.new_caches(4) if shared else [LayerCache(), LayerCache()]
    keys = torch.randn(3, 2, 1, 8)
    for cache in caches:
        cache.self_attn.append(keys, keys + 1)
    reorder_self_attention(caches, torch.tensor([2, 0, 0]))
    for cache in caches:
        torch.testing.assert_close(cache.self_attn.key, keys[[2, 0, 0]])
