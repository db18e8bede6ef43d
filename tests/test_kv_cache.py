"""fastnmt.kv_cache: a KVCache's storage, reorders through its rows table, and rows shared by
several caches. Decoding through a cache with MultiheadAttention is tested in test_attention."""

import torch

import fastnmt.attention
import fastnmt.kv_cache
from fastnmt.kv_cache import CacheRows, FixedKVCache, KVCache, StepClock


def test_reorder_selects_batch_entries():
    cache = KVCache()
    keys = torch.randn(3, 2, 4, 8)
    cache.append(keys, keys + 1)
    cache.reorder(torch.tensor([2, 2, 0]))
    torch.testing.assert_close(cache.key, keys[[2, 2, 0]])
    torch.testing.assert_close(cache.value, keys[[2, 2, 0]] + 1)
    # Appending after a reorder (into the capacity it kept) and reordering again.
    step = torch.randn(3, 2, 1, 8)
    cache.append(step, step - 1)
    cache.reorder(torch.tensor([1, 0]))
    expected = torch.cat([keys[[2, 2, 0]], step], dim=2)[[1, 0]]
    torch.testing.assert_close(cache.key, expected)
    torch.testing.assert_close(cache.value, torch.cat([keys[[2, 2, 0]] + 1, step - 1], 2)[[1, 0]])


def test_reorder_and_reserved_appends_move_no_keys():
    cache = KVCache(reserve=6)
    cache.append(torch.randn(4, 2, 2, 8), torch.randn(4, 2, 2, 8))
    storage = cache.stored()[0].data_ptr()
    for index in ([3, 3, 0, 1], [0, 2], [1, 1, 0]):
        cache.reorder(torch.tensor(index))
        step = torch.randn(len(index), 2, 1, 8)
        cache.append(step, step)
    assert cache.length == 5 and cache.stored()[0].data_ptr() == storage
    assert cache.rows.shape == (3, 6)


def test_more_entries_keep_the_reserved_positions():
    """A beam search's first step has one entry per sentence, then K: the storage gains
    entries, not positions (reserved ones are not doubled)."""
    cache = KVCache(reserve=6)
    keys = torch.randn(2, 2, 1, 8)
    cache.append(keys, keys + 1)
    cache.reorder(torch.tensor([0, 0, 0, 1, 1, 1]))
    step = torch.randn(6, 2, 1, 8)
    cache.append(step, step + 1)
    assert cache.stored()[0].shape[2] == 2 and cache._key.shape[2] == 6
    expected = torch.cat([keys.repeat_interleave(3, 0), step], dim=2)
    torch.testing.assert_close(cache.key, expected)
    torch.testing.assert_close(cache.value, expected + 1)


def test_caches_sharing_rows_write_and_reorder_them_once():
    """Two layers' caches sharing their rows, reordered once through one of them, read what
    two caches of their own, each reordered, read; and a step writes the shared rows once
    (the second cache's append and any growth leave them as the first wrote them)."""
    shared = CacheRows()
    pair, own = [KVCache(reserve=2, shared_rows=shared) for _ in "ab"], [KVCache(), KVCache()]
    for index in (None, [2, 2, 0], [1, 0, 0, 2], [3, 1]):
        if index is not None:
            pair[0].reorder(torch.tensor(index))
            for cache in own:
                cache.reorder(torch.tensor(index))
        rows = 3 if index is None else len(index)
        for shared_cache, own_cache in zip(pair, own, strict=True):
            step = torch.randn(rows, 2, 1, 8)
            shared_cache.append(step, step + 1)
            own_cache.append(step, step + 1)
            torch.testing.assert_close(shared_cache.key, own_cache.key)
            torch.testing.assert_close(shared_cache.value, own_cache.value)
    assert pair[0].rows is pair[1].rows is shared.table and shared.capacity == 4


def test_the_caches_stay_importable_from_fastnmt_attention():
    names = ("CacheRows", "FixedKVCache", "KVCache", "StepClock")
    for name in names:
        assert getattr(fastnmt.attention, name) is getattr(fastnmt.kv_cache, name)


def test_a_fixed_cache_starts_from_zeros_not_uninitialised_memory(monkeypatch):
    """The static search's caches are read at positions not yet written (masked by key lengths):
    memory left over as NaN must not be there, or the reference attention's output is NaN."""
    monkeypatch.setattr(
        torch.Tensor, "new_empty", lambda self, *size, **kw: torch.full(size, float("nan"))
    )
    cache = FixedKVCache(StepClock(2, 5, torch.device("cpu")))
    cache.append(torch.ones(2, 3, 1, 4), torch.ones(2, 3, 1, 4))
    key, value, _ = cache.stored()
    assert torch.isfinite(key).all() and torch.isfinite(value).all()
