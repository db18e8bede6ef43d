"""Shape buckets: fixed batch shapes whose padding changes neither the loss nor the update."""

import random

import pytest
import torch
from safetensors.torch import load_file

from fastnmt import train
from fastnmt.data import make_batch
from fastnmt.model import ModelConfig, Transformer
from fastnmt.training import trainer
from fastnmt.training.buckets import ShapeBuckets
from tests.test_train import NO_DROPOUT, _arguments

PAD = 0


def _batch(rows: int, max_len: int, seed: int):
    """A batch of ``rows`` random pairs of 1..max_len tokens (ids 3..29)."""
    rng = random.Random(seed)

    def sentence():
        return [rng.randrange(3, 30) for _ in range(rng.randint(1, max_len))]

    return make_batch([sentence() for _ in range(rows)], [sentence() for _ in range(rows)],
                      list(range(rows)))  # fmt: skip


def test_shapes_are_evenly_spaced_lengths_within_the_token_budget():
    buckets = ShapeBuckets(max_tokens=400, max_len=49, count=4, pad_id=PAD)
    assert [shape.length for shape in buckets.shapes] == [13, 25, 38, 50]
    assert all(shape.rows * shape.length <= 400 for shape in buckets.shapes)
    assert [shape.rows for shape in buckets.shapes] == [30, 16, 10, 8]
    with pytest.raises(ValueError, match="count must be at least 1"):
        ShapeBuckets(400, 49, 0, PAD)


@pytest.mark.parametrize(("rows", "max_len"), [(1, 1), (7, 12), (45, 10), (8, 49)])
def test_pieces_have_their_bucket_shape_and_hold_the_batch(rows, max_len):
    buckets = ShapeBuckets(max_tokens=400, max_len=49, count=4, pad_id=PAD)
    batch = _batch(rows, max_len, seed=rows)
    pieces = buckets.split(batch)
    shape = buckets.shape_of(batch)
    assert shape.length >= max(batch.src.shape[1], batch.tgt_in.shape[1])
    for piece in pieces:
        assert piece.src.shape == piece.tgt_in.shape == piece.tgt_out.shape
        assert piece.src.shape == (shape.rows, shape.length)
        assert torch.equal(piece.tgt_positions, torch.arange(shape.rows * shape.length))
    real = [row for piece in pieces for row in range(shape.rows) if piece.indices[row] >= 0]
    assert len(real) == rows
    joined = {name: torch.cat([getattr(p, name) for p in pieces]) for name in ("src", "tgt_out")}
    kept = torch.cat([p.indices for p in pieces]) >= 0
    for name, padded in joined.items():
        original = getattr(batch, name)
        assert torch.equal(padded[kept, : original.shape[1]], original)
        assert (padded[kept, original.shape[1] :] == PAD).all()
        assert (padded[~kept] == PAD).all()
    lengths = torch.cat([p.src_lengths for p in pieces])
    assert torch.equal(lengths[kept], batch.src_lengths) and (lengths[~kept] == 0).all()


def test_a_sequence_longer_than_every_bucket_is_refused():
    buckets = ShapeBuckets(max_tokens=400, max_len=9, count=2, pad_id=PAD)
    with pytest.raises(ValueError, match="the longest bucket holds 10"):
        buckets.split(_batch(3, 30, seed=0))


def test_pieces_give_the_batch_s_loss_and_gradients():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=30, d_model=16, heads=2, d_ff=32, dropout=0.0, attention_dropout=0.0
    )
    model = Transformer(cfg)
    batch = _batch(13, 11, seed=1)
    buckets = ShapeBuckets(max_tokens=60, max_len=11, count=3, pad_id=cfg.pad_id)
    assert len(buckets.split(batch)) > 1  # rows split over pieces, each padded

    def loss_and_grads(batches):
        model.zero_grad()
        total = sum(
            trainer.label_smoothed_loss(
                model, model(b.src, b.src_lengths, b.tgt_in), b.tgt_out, b.tgt_positions, 0.1
            )[0]
            for b in batches
        )
        total.backward()
        return total.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads([batch])
    padded_loss, padded_grads = loss_and_grads(buckets.split(batch))
    torch.testing.assert_close(padded_loss, loss)
    for padded, expected in zip(padded_grads, grads, strict=True):
        torch.testing.assert_close(padded, expected, atol=1e-5, rtol=1e-4)


def test_training_with_shape_buckets_reaches_the_same_weights(corpus, tmp_path):
    """Three updates without dropout, with and without buckets: the same sentences per update,
    normalised by the same token counts."""

    def trained(output, *extra):
        args = train.build_parser().parse_args(_arguments(corpus, output, *NO_DROPOUT, *extra))
        assert train.prepare(args).run() == 0
        return load_file(str(output / "checkpoint_last" / "model.safetensors"))

    plain = trained(tmp_path / "plain")
    bucketed = trained(tmp_path / "bucketed", "--shape-buckets", "3")
    for name, expected in plain.items():
        torch.testing.assert_close(bucketed[name], expected, atol=2e-5, rtol=1e-4, msg=name)


def test_a_negative_bucket_count_is_a_usage_error(corpus, tmp_path):
    args = train.build_parser().parse_args(_arguments(corpus, tmp_path, "--shape-buckets", "-1"))
    with pytest.raises(train.UsageError, match="--shape-buckets must be >= 0, got -1"):
        train.check_arguments(args)
