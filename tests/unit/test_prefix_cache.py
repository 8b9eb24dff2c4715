"""Prefix cache: chained block keys, longest-run lookup, LRU eviction by bytes, collisions."""

from __future__ import annotations

import pytest
import torch

from services.common import prefix_cache
from services.common.prefix_cache import ROOT, PrefixCache


def store(cache: PrefixCache, tokens: list[int], nbytes: int = 64) -> list[int]:
    """Insert every full block of ``tokens``; each payload is a tensor filled with the block's start."""
    keys, parent = [], ROOT
    for b0 in range(0, len(tokens) - cache.block + 1, cache.block):
        parent = cache.insert(parent, tuple(tokens[b0 : b0 + cache.block]), (torch.full((nbytes // 4,), float(b0)),))
        keys.append(parent)
    return keys


def starts(payloads) -> list[int]:
    return [int(p[0][0]) for p in payloads]


def test_match_finds_the_longest_run_of_whole_blocks_within_the_limit():
    cache = PrefixCache(block=4, budget_bytes=1 << 20)
    keys = store(cache, list(range(14)))  # blocks at 0, 4, 8; the last 2 tokens make no block
    assert len(cache) == 3
    got, payloads = cache.match(list(range(20)), limit=19)
    assert got == keys and starts(payloads) == [0, 4, 8]
    assert starts(cache.match(list(range(20)), limit=11)[1]) == [0, 4]  # a block must end by the limit
    assert cache.match(list(range(20)), limit=3) == ([], [])


def test_a_block_matches_only_after_the_same_prefix():
    cache = PrefixCache(block=4, budget_bytes=1 << 20)
    store(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    # the second block's tokens after another first block: a different prefix, no hit past it
    assert starts(cache.match([1, 2, 3, 9, 5, 6, 7, 8], limit=8)[1]) == []
    assert starts(cache.match([1, 2, 3, 4, 5, 6, 7, 0], limit=8)[1]) == [0]


def test_lru_eviction_keeps_the_budget_and_a_looked_up_prefix_start():
    cache = PrefixCache(block=2, budget_bytes=4 * 64)
    store(cache, [1, 2, 3, 4, 5, 6])  # 3 blocks
    cache.match([1, 2, 3, 4, 5, 6], limit=6)  # refreshed last block first: the start is newest
    store(cache, [9, 9, 8, 8])  # 2 more: one must go, the oldest is [5, 6]'s
    assert cache.bytes <= cache.budget and len(cache) == 4
    assert starts(cache.match([1, 2, 3, 4, 5, 6], limit=6)[1]) == [0, 2]
    assert starts(cache.match([9, 9, 8, 8], limit=4)[1]) == [0, 2]


def test_a_hash_collision_is_a_miss_never_another_prefix_state(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens: b"7")  # every key collides
    cache = PrefixCache(block=2, budget_bytes=1 << 20)
    store(cache, [1, 2])
    assert cache.match([3, 4], limit=2) == ([], [])
    store(cache, [3, 4])  # the newer block takes the key
    assert starts(cache.match([3, 4], limit=2)[1]) == [0] and cache.match([1, 2], limit=2) == ([], [])
    assert len(cache) == 1 and cache.bytes == 64


def test_a_block_larger_than_the_budget_is_not_kept_and_bad_settings_are_refused():
    cache = PrefixCache(block=2, budget_bytes=32)
    store(cache, [1, 2], nbytes=64)
    assert len(cache) == 0 and cache.bytes == 0
    with pytest.raises(ValueError, match="holds 2 tokens"):
        cache.insert(ROOT, (1, 2, 3), (torch.zeros(1),))
    with pytest.raises(ValueError, match="block must be"):
        PrefixCache(block=0, budget_bytes=1)
