"""fastnmt.data.batches: padded batches, token-bucketed batching, DataLoader workers, ranks."""

import random

import numpy as np
import pytest
import torch

from fastnmt.data import (
    Batch,
    EncodedCorpus,
    ParallelCorpus,
    TokenBatches,
    collate,
    encode_corpus,
    make_batch,
    pack_by_tokens,
)
from tests.data.helpers import as_lists, random_sequences, write_mapped


def test_make_batch_pads_and_adds_bos_eos():
    batch = make_batch([[5, 6, 7], [8]], [[9], [10, 11]], [4, 0], pad_id=0, bos_id=1, eos_id=2)
    assert torch.equal(batch.src, torch.tensor([[5, 6, 7, 2], [8, 2, 0, 0]]))
    assert torch.equal(batch.src_lengths, torch.tensor([4, 2]))
    assert torch.equal(batch.tgt_in, torch.tensor([[1, 9, 0], [1, 10, 11]]))
    assert torch.equal(batch.tgt_out, torch.tensor([[9, 2, 0], [10, 11, 2]]))
    assert torch.equal(batch.tgt_lengths, torch.tensor([2, 3]))
    assert torch.equal(batch.indices, torch.tensor([4, 0]))
    assert batch.num_tgt_tokens == 5
    assert all(t.dtype == torch.int64 for t in (batch.src, batch.tgt_in, batch.src_lengths))


def test_make_batch_without_target_for_translation():
    batch = make_batch([[5], [6, 7]], None, [0, 1])
    assert batch.tgt_in.shape == batch.tgt_out.shape == (2, 0)
    assert batch.num_tgt_tokens == 0
    assert torch.equal(batch.src, torch.tensor([[5, 2, 0], [6, 7, 2]]))


def test_batch_to_moves_every_tensor():
    batch = make_batch([[5]], [[6]], [0])
    moved = batch.to("meta")
    assert isinstance(moved, Batch)
    assert all(t.device.type == "meta" for t in vars(moved).values())
    assert batch.src.device.type == "cpu"


def test_pack_by_tokens_counts_padding_and_keeps_order():
    sizes = np.array([2, 3, 3, 4, 9, 2])  # a pair larger than max_tokens gets a batch alone
    assert pack_by_tokens(sizes, max_tokens=8).tolist() == [0, 2, 4, 5, 6]


def greedy_packing(sizes, max_tokens):
    """The packing rule written pair by pair: add a pair while count x largest fits."""
    bounds, count, largest = [0], 0, 0
    for position, size in enumerate(sizes):
        if count and (count + 1) * max(largest, size) > max_tokens:
            bounds.append(position)
            count, largest = 0, 0
        count, largest = count + 1, max(largest, size)
    return [*bounds, len(sizes)]


@pytest.mark.parametrize("max_tokens", [7, 64, 1000])
def test_pack_by_tokens_equals_the_pair_by_pair_rule(max_tokens):
    rng = np.random.default_rng()
    sizes = np.sort(rng.integers(2, 90, size=int(rng.integers(1, 3000))))
    sizes[rng.random(len(sizes)) < 0.2] += rng.integers(0, 30)  # not quite sorted, as real data
    assert pack_by_tokens(sizes, max_tokens).tolist() == greedy_packing(sizes.tolist(), max_tokens)


OVER_LONG = 300  # longer than MAX_TOKENS below: must still be batched, alone
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def synthetic():
    rng = random.Random(0)
    src = [[rng.randrange(4, 90) for _ in range(rng.randint(1, 60))] for _ in range(499)]
    tgt = [[rng.randrange(4, 90) for _ in range(rng.randint(1, 60))] for _ in range(499)]
    return EncodedCorpus.from_lists([*src, [7] * OVER_LONG], [*tgt, [8] * 5], dropped=0)


def padded_size(batch):
    return batch.src.shape[0] * max(batch.src.shape[1], batch.tgt_in.shape[1])


def test_every_pair_once_per_epoch_within_max_tokens(synthetic):
    batches = TokenBatches(synthetic, MAX_TOKENS)
    seen = []
    for batch in batches.iterate(epoch=1):
        seen += batch.indices.tolist()
        if len(batch.indices) > 1:
            assert padded_size(batch) <= MAX_TOKENS
        else:
            assert padded_size(batch) <= MAX_TOKENS or batch.indices.tolist() == [499]
        for row, i in enumerate(batch.indices.tolist()):  # rows are the right pairs
            assert batch.src[row, : len(synthetic.src[i])].tolist() == synthetic.src[i].tolist()
            assert batch.tgt_out[row, : len(synthetic.tgt[i])].tolist() == synthetic.tgt[i].tolist()
    assert sorted(seen) == list(range(500))
    assert [499] in [batch.tolist() for batch in batches.epoch_batches(1)]
    assert len(batches) == len(batches.epoch_batches(1))


def test_batches_are_bucketed_by_length(synthetic):
    batches = TokenBatches(synthetic, MAX_TOKENS, shuffle=False).epoch_batches(1)
    src_lengths = [synthetic.src.lengths[i] for batch in batches for i in batch]
    assert src_lengths == sorted(src_lengths)
    assert len(batches) < 500 / 3  # packed, not one pair per batch


def epoch(batches: TokenBatches, number: int) -> list[list[int]]:
    return [batch.tolist() for batch in batches.epoch_batches(number)]


def test_epoch_order_is_deterministic_per_seed_and_epoch(synthetic):
    first = TokenBatches(synthetic, MAX_TOKENS, seed=1)
    assert epoch(first, 3) == epoch(TokenBatches(synthetic, MAX_TOKENS, seed=1), 3)
    assert epoch(first, 3) != epoch(first, 4)
    assert epoch(first, 3) != epoch(TokenBatches(synthetic, MAX_TOKENS, seed=2), 3)
    assert sorted(epoch(first, 3)) == sorted(epoch(first, 4))  # same batches


def test_two_ranks_share_the_epoch_with_equal_counts(synthetic):
    single = epoch(TokenBatches(synthetic, MAX_TOKENS), 2)
    ranks = [TokenBatches(synthetic, MAX_TOKENS, rank=r, world_size=2) for r in (0, 1)]
    rank0, rank1 = (epoch(r, 2) for r in ranks)
    assert len(rank0) == len(rank1) == len(ranks[0]) == len(ranks[1]) == (len(single) + 1) // 2
    interleaved = [batch for pair in zip(rank0, rank1, strict=True) for batch in pair]
    # The single-process order, padded to an even count by repeating its first batch.
    assert interleaved == (single + single[:1])[: len(interleaved)]
    assert len(interleaved) in (len(single), len(single) + 1)


def test_equal_lengths_are_grouped_by_the_seed_not_by_position():
    same_length = EncodedCorpus.from_lists([[7, 7]] * 40, [[8, 8]] * 40)
    seed1, seed2 = (
        epoch(TokenBatches(same_length, 30, seed=seed, shuffle=False), 1) for seed in (1, 2)
    )
    assert seed1 == epoch(TokenBatches(same_length, 30, seed=1, shuffle=False), 1)
    assert seed1 != seed2
    assert seed1[0] != list(range(10))


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_ranks_pad_an_uneven_epoch_by_repeating_batches(world_size):
    five_batches = EncodedCorpus.from_lists([[7] * 9] * 5, [[8] * 9] * 5)  # 10 tokens: one a batch
    single = epoch(TokenBatches(five_batches, 10), 1)
    ranks = [
        TokenBatches(five_batches, 10, rank=r, world_size=world_size) for r in range(world_size)
    ]
    steps = -(-5 // world_size)  # ceil: every rank runs the same number of steps
    assert [len(rank) for rank in ranks] == [steps] * world_size
    per_rank = [epoch(rank, 1) for rank in ranks]
    assert [len(batches) for batches in per_rank] == [steps] * world_size
    interleaved = [per_rank[r][step] for step in range(steps) for r in range(world_size)]
    assert interleaved == [single[i % 5] for i in range(steps * world_size)]


def test_resume_mid_epoch_yields_the_remaining_batches(synthetic):
    batches = TokenBatches(synthetic, MAX_TOKENS, rank=1, world_size=2)
    full = list(batches.iterate(epoch=5))
    resumed = list(batches.iterate(epoch=5, start=7))
    assert len(resumed) == len(full) - 7
    for expected, got in zip(full[7:], resumed, strict=True):
        assert vars(expected).keys() == vars(got).keys()
        assert all(torch.equal(vars(expected)[k], vars(got)[k]) for k in vars(expected))


def test_invalid_rank(synthetic):
    with pytest.raises(ValueError):
        TokenBatches(synthetic, MAX_TOKENS, rank=2, world_size=2)


def test_real_batches_decode_to_the_target_text(vocab, train_slice):
    pairs = ParallelCorpus(train_slice.src[:300], train_slice.tgt[:300], "slice")
    encoded = encode_corpus(pairs, vocab)
    assert encoded.dropped == 0
    batch = next(TokenBatches(encoded, 1024).iterate(epoch=1))
    expected = [" ".join(pairs.tgt[i].split()) for i in batch.indices.tolist()]
    assert vocab.decode(batch.tgt_out.tolist()) == expected
    assert vocab.decode(batch.tgt_in[:, 1:].tolist()) == expected  # bos, then the same text


def test_collate_from_arrays_equals_make_batch_from_lists():
    rng = np.random.default_rng()
    src = [[*s, 5] for s in random_sequences(rng, 37)]  # a source is never empty
    tgt = random_sequences(rng, 37)
    rows = rng.permutation(37)[:23]
    from_lists = make_batch([src[r] for r in rows], [tgt[r] for r in rows], rows.tolist())
    corpus = EncodedCorpus.from_lists(src, tgt)
    from_arrays = collate(corpus.src, corpus.tgt, rows, rows)
    for name, expected in vars(from_lists).items():
        assert torch.equal(getattr(from_arrays, name), expected), name
    width = from_lists.tgt_out.shape[1]
    positions = [r * width + c for r, row in enumerate(rows) for c in range(len(tgt[row]) + 1)]
    assert from_lists.tgt_positions.tolist() == positions


def test_a_worker_collates_the_same_batches_and_the_global_rng_is_untouched(synthetic):
    in_process = TokenBatches(synthetic, MAX_TOKENS, seed=3)
    worker = TokenBatches(synthetic, MAX_TOKENS, seed=3, workers=1)
    state = torch.get_rng_state()
    for first in (0, 5):  # a second pass of the same worker, resuming mid-epoch
        expected, got = list(in_process.iterate(2, first)), list(worker.iterate(2, first))
        assert len(expected) == len(got) == len(in_process) - first
        for a, b in zip(expected, got, strict=True):
            assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in vars(a))
    assert torch.equal(torch.get_rng_state(), state)  # a DataLoader's seed comes from its own
    worker.close()


def test_batches_over_a_mapped_corpus_cover_it_once(synthetic, tmp_path):
    sides = []
    for side in ("src", "tgt"):
        (tmp_path / side).mkdir()
        sides.append(write_mapped(tmp_path / side, as_lists(getattr(synthetic, side))))
    mapped = EncodedCorpus(*sides, dropped=0)
    expected = epoch(TokenBatches(synthetic, MAX_TOKENS, seed=5, world_size=3, rank=2), 4)
    batches = TokenBatches(mapped, MAX_TOKENS, seed=5, world_size=3, rank=2, workers=1)
    assert epoch(batches, 4) == expected
    got = list(batches.iterate(4))
    assert [b.indices.tolist() for b in got] == expected
    for batch in got:
        for row, i in enumerate(batch.indices.tolist()):
            assert batch.src[row, : len(synthetic.src[i])].tolist() == synthetic.src[i].tolist()
