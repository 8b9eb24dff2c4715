"""Prefix cache (automatic prefix caching, as vLLM and SGLang do it): the verified model
state of full token blocks, kept after their session and copied into later sessions whose
tokens start the same way (a shared system prompt, few-shot examples, a conversation's
earlier turns), so those positions are not prefilled again.

A block is ``block`` consecutive tokens starting at a multiple of ``block``. Its key is a
BLAKE2b digest of the key of the block before it and its own tokens, so a key names the whole
prefix up to the block's end; no one can make two prefixes share a key, so no request is ever
given another prefix's state (a plain 64-bit hash could be collided on purpose). Each entry
also keeps its parent key and tokens, and a lookup compares them. Entries are evicted least
recently used once their bytes pass the budget; a lookup refreshes a chain from its last
block back to its first, so a prefix's start outlives its ends.

The payload is the owner's (the target runner stores K/V per layer and the EAGLE-3 features
of the block's positions, the draft LM its K/V); this module keys, bounds and finds it, and
moves K/V between a model's cache and blocks. Calls from several threads are safe.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.llama import KVCache

ROOT = b""  # the parent key of a prompt's first block
MAX_CACHE_SALT = 256  # characters


@dataclass(frozen=True)
class _Entry:
    parent: bytes
    tokens: tuple[int, ...]
    payload: tuple[torch.Tensor, ...]
    nbytes: int


def block_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    return hashlib.blake2b(parent + array("I", tokens).tobytes(), digest_size=16).digest()


def root_key(*parts) -> bytes:
    """A chain's root other than ``ROOT`` (a cache keyed one token on starts from that token)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def salt_root(salt: str) -> bytes:
    """The root of a request's chains: requests share blocks only with requests of the same
    cache salt (none: ``ROOT``), so one tenant cannot tell from its TTFT what another's prompts
    start with."""
    return root_key("salt", salt) if salt else ROOT


class PrefixCache:
    def __init__(self, block: int, budget_bytes: int):
        if block < 1 or budget_bytes < 0:
            raise ValueError(f"prefix cache: block must be ≥ 1 and budget ≥ 0 (got {block}, {budget_bytes})")
        self.block, self.budget = block, budget_bytes
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(
        self, tokens: list[int], limit: int, root: bytes = ROOT
    ) -> tuple[list[bytes], list[tuple[torch.Tensor, ...]]]:
        """The longest run of cached blocks that starts ``tokens`` and ends by ``limit``:
        (their keys, their payloads), first block first. ``root``: the first block's parent."""
        keys, payloads, parent = [], [], root
        with self._lock:
            for b0 in range(0, limit - self.block + 1, self.block):
                block = tuple(tokens[b0 : b0 + self.block])
                key = block_key(parent, block)
                e = self._entries.get(key)
                if e is None or e.parent != parent or e.tokens != block:
                    break
                keys.append(key)
                payloads.append(e.payload)
                parent = key
            for key in reversed(keys):
                self._entries.move_to_end(key)
        return keys, payloads

    def insert(self, parent: bytes, tokens: tuple[int, ...], payload: tuple[torch.Tensor, ...]) -> bytes:
        """Store one full block after the block keyed ``parent`` (``ROOT`` for the first);
        returns its key (the parent of the next block)."""
        if len(tokens) != self.block:
            raise ValueError(f"a prefix-cache block holds {self.block} tokens, not {len(tokens)}")
        key = block_key(parent, tokens)
        nbytes = sum(t.numel() * t.element_size() for t in payload)
        with self._lock:
            old = self._entries.get(key)
            if old is not None and old.parent == parent and old.tokens == tokens:
                self._entries.move_to_end(key)
                return key
            if old is not None:  # a colliding key: the newer block takes it
                self._drop(key)
            if nbytes > self.budget:
                return key
            self._entries[key] = _Entry(parent, tokens, payload, nbytes)
            self.bytes += nbytes
            while self.bytes > self.budget:
                self._drop(next(iter(self._entries)))
        return key

    def _drop(self, key: bytes) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def store(
        self, keys: list[bytes], tokens: list[int], upto: int, payload: Callable[[int], tuple], root: bytes = ROOT
    ) -> None:
        """Insert each full block of ``tokens[:upto]`` after the ``len(keys)`` blocks already
        stored, appending its key to ``keys``; ``payload(b0)`` makes the block starting at b0."""
        n = self.block
        while (len(keys) + 1) * n <= upto:
            b0 = len(keys) * n
            keys.append(self.insert(keys[-1] if keys else root, tuple(tokens[b0 : b0 + n]), payload(b0)))


def kv_block(cache: KVCache, b0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of K and V at positions b0..b0+n-1 of a batch-1 cache: [layers, kv_heads, n, head_dim] each."""
    return (
        torch.stack([k[0, :, b0 : b0 + n] for k, _ in cache.layers]),
        torch.stack([v[0, :, b0 : b0 + n] for _, v in cache.layers]),
    )


def load_kv(cache: KVCache, blocks: list[tuple[torch.Tensor, ...]]) -> int:
    """Write consecutive blocks' K/V (``kv_block``'s, first in each payload) at positions 0..
    of a batch-1 cache; → the positions written."""
    k, v = torch.cat([b[0] for b in blocks], dim=2), torch.cat([b[1] for b in blocks], dim=2)
    m = k.shape[2]
    for i, (kc, vc) in enumerate(cache.layers):
        kc[0, :, :m] = k[i]
        vc[0, :, :m] = v[i]
    return m


def kv_bytes_per_position(cache: KVCache) -> int:
    """K/V bytes one position takes in a cache like ``cache``."""
    return sum(k.element_size() * k.numel() + v.element_size() * v.numel() for k, v in cache.layers) // cache.capacity
