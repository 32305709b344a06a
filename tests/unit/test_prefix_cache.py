"""PrefixCache (inference/prefix_cache.py): the longest entry every prompt extends, least
recently used evicted by bytes."""

import pytest
import torch

from flywheel.inference.decoder import KVCache
from flywheel.inference.prefix_cache import PrefixCache


def kv(length: int) -> KVCache:
    return KVCache(torch.zeros(1, 2, 1, 1, length, 2), length)  # 4 float32 numbers a token: 16 bytes


def test_the_longest_entry_every_prompt_extends_wins():
    cache = PrefixCache(1 << 20)
    short, long = kv(2), kv(4)
    cache.put([1, 2], short)
    cache.put([1, 2, 3, 4], long)
    cache.put([9, 9, 9], kv(3))
    assert cache.longest([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]]) is long
    assert cache.longest([[1, 2, 3, 4, 5], [1, 2, 7]]) is short  # the second prompt leaves [1, 2, 3, 4]
    assert cache.longest([[1, 2, 3, 4]]) is short  # a prompt keeps >= 1 token of its own
    assert cache.longest([[1, 5]]) is None


def test_least_recently_used_entries_leave_first_once_over_budget():
    cache = PrefixCache(3 * 16 * 4)  # three 4-token entries
    for t in range(3):
        cache.put([t] * 4, kv(4))
    assert cache.longest([[0, 0, 0, 0, 1]]) is not None  # 0 is now the most recent
    cache.put([7] * 4, kv(4))
    assert len(cache) == 3 and cache.bytes == 3 * 64
    assert cache.longest([[1, 1, 1, 1, 1]]) is None  # 1 was the least recent
    assert cache.longest([[0, 0, 0, 0, 1]]) is not None


def test_an_entry_over_the_budget_is_not_kept_and_a_zero_budget_keeps_nothing():
    cache = PrefixCache(63)
    cache.put([1, 2, 3, 4], kv(4))
    assert len(cache) == 0 and cache.bytes == 0
    cache = PrefixCache(0)
    cache.put([1], kv(1))
    assert len(cache) == 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_bytes must be >= 0, got -1"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="a prefix of 3 tokens with a cache of length 2"):
        PrefixCache(1 << 20).put([1, 2, 3], kv(2))


def test_clear_forgets_everything():
    cache = PrefixCache(1 << 20)
    cache.put([1, 2], kv(2))
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0 and cache.longest([[1, 2, 3]]) is None


def test_each_owner_finds_only_its_own_entries():
    cache = PrefixCache(1 << 20)
    base, adapter = kv(2), kv(2)
    cache.put([1, 2], base)
    cache.put([1, 2], adapter, owner=7)  # the same tokens under an adapter: other keys and values
    assert len(cache) == 2
    assert cache.longest([[1, 2, 3]]) is base and cache.longest([[1, 2, 3]], owner=7) is adapter
    assert cache.longest([[1, 2, 3]], owner=8) is None
