"""Pooled K/V slots, so that one ragged forward attends for all its sessions in one call per layer.

A session's cache stays a batch-1 ``KVCache``, but its per-layer buffers are views of one slot
of a segment: per-layer tensors ``[slots, kv_heads, capacity, head_dim]`` shared by up to
``slots`` sessions. Every per-session read and write (prefill, rollback by length, prefix-cache
loads, tree path moves) is unchanged. What changes is the ragged forward: rows whose caches sit
in the same segment write their new K/V with one indexed store and attend with one padded,
masked attention call over the segment's slots, instead of one call per session and layer.

Rules:
- capacities round up to a power of two (at least ``min_capacity``); each rounded capacity has
  its own segments; a new segment is allocated when every slot of the existing ones is taken,
  and segments are kept once allocated (the pool's memory is its high-water mark);
- a slot is free again when its cache is garbage-collected (``weakref.finalize``), so no close
  path has to remember it; the lowest free slot is taken first, which keeps the live sessions
  of a segment in a short run of slots (the attention call spans lowest to highest);
- buffers start zeroed and hold only finite values: a masked position's score is finite before
  the mask sets it to -inf, so a slot's stale K/V never reaches another session;
- a cache above ``max_capacity`` positions, or whose slot would exceed ``max_slot_bytes``, is
  not pooled: it keeps its own buffers and attends alone.
"""

from __future__ import annotations

import heapq
import threading
import weakref

import torch


class Segment:
    """Per-layer K/V buffers of ``slots`` batch-1 caches of one capacity."""

    def __init__(self, s, slots: int, capacity: int, dtype, device):
        shape = (slots, s.kv_heads, capacity, s.head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(s.layers)
        ]
        self.slots = slots
        self._free = list(range(slots))
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            return heapq.heappop(self._free) if self._free else None

    def give(self, slot: int) -> None:
        with self._lock:
            heapq.heappush(self._free, slot)

    @property
    def used(self) -> int:
        return self.slots - len(self._free)


class KVPool:
    """Segments of pooled slots for one model's batch-1 caches (``Llama.kv_pool``)."""

    def __init__(
        self,
        s,
        dtype,
        device,
        slots: int = 8,
        min_capacity: int = 128,
        max_capacity: int = 8192,
        max_slot_bytes: int = 256 * 2**20,
    ):
        self.s, self.dtype, self.device = s, dtype, device
        self.slots, self.min_capacity, self.max_capacity, self.max_slot_bytes = (
            slots,
            min_capacity,
            max_capacity,
            max_slot_bytes,
        )
        self.segments: dict[int, list[Segment]] = {}
        self._lock = threading.Lock()

    def bucket(self, capacity: int) -> int:
        """The rounded capacity a cache of ``capacity`` positions is pooled at."""
        return max(self.min_capacity, 1 << max(0, capacity - 1).bit_length())

    def slot_bytes(self, capacity: int) -> int:
        return 2 * self.s.layers * self.s.kv_heads * capacity * self.s.head_dim * self.dtype.itemsize

    def take(self, capacity: int) -> tuple[Segment, int] | None:
        """A free slot able to hold ``capacity`` positions, or None when such caches are not pooled."""
        size = self.bucket(capacity)
        if capacity > self.max_capacity or self.slot_bytes(size) > self.max_slot_bytes:
            return None
        with self._lock:
            segs = self.segments.setdefault(size, [])
            for seg in segs:
                slot = seg.take()
                if slot is not None:
                    return seg, slot
            seg = Segment(self.s, self.slots, size, self.dtype, self.device)
            segs.append(seg)
            first = seg.take()
            assert first is not None  # a new segment has every slot free
            return seg, first

    @property
    def used(self) -> int:
        """Slots held by live caches."""
        return sum(seg.used for segs in self.segments.values() for seg in segs)


def pooled_cache(cache_cls, seg: Segment, slot: int, capacity: int):
    """A ``cache_cls`` (``KVCache``) whose layers are views of ``seg``'s slot, freed with it."""
    cache = cache_cls.__new__(cache_cls)
    cache.capacity, cache.segment, cache.slot = capacity, seg, slot
    cache.layers = [(k[slot : slot + 1, :, :capacity], v[slot : slot + 1, :, :capacity]) for k, v in seg.layers]
    weakref.finalize(cache, seg.give, slot)
    return cache


class Group:
    """Rows of one ragged forward whose caches share a segment: the indices every layer's
    batched attention needs, built once per forward."""

    def __init__(
        self,
        seg: Segment,
        rows: list[int],
        offsets: list[int],
        lens: list[int],
        starts: list[int],
        slots: list[int],
        masks: list[torch.Tensor | None],
        n_tokens: int,
        device,
    ):
        self.seg = seg
        lo, hi = min(slots), max(slots) + 1
        self.lo, self.hi = lo, hi
        self.tmax = max(lens[r] for r in rows)
        self.lmax = max(starts[r] + lens[r] for r in rows)
        tokens: list[int] = []
        slot_idx: list[int] = []
        pos_idx: list[int] = []
        qpos: list[int] = []
        mask = torch.zeros(hi - lo, 1, self.tmax, self.lmax, dtype=torch.bool, device=device)
        mask[..., 0] = True  # padding queries see one finite key (their outputs are dropped), never none
        for r, slot in zip(rows, slots):
            n, st, g = lens[r], starts[r], slot - lo
            tokens += range(offsets[r], offsets[r] + n)
            slot_idx += [slot] * n
            pos_idx += range(st, st + n)
            qpos += range(g * self.tmax, g * self.tmax + n)
            own = masks[r]
            mask[g, 0, :n, : st + n] = True if own is None else own  # on the device already
        whole = tokens == list(range(n_tokens))
        as_index = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        self.tokens = None if whole else as_index(tokens)
        self.slot_idx, self.pos_idx, self.qpos = as_index(slot_idx), as_index(pos_idx), as_index(qpos)
        self.mask = mask

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        """q [heads, N, d], k/v [kv_heads, N, d] of the whole forward → this group's outputs
        [heads, n, d] in its token order: its K/V are written to the slots first."""
        if self.tokens is not None:
            q, k, v = q.index_select(1, self.tokens), k.index_select(1, self.tokens), v.index_select(1, self.tokens)
        kc, vc = self.seg.layers[layer]
        kc[self.slot_idx, :, self.pos_idx] = k.transpose(0, 1)
        vc[self.slot_idx, :, self.pos_idx] = v.transpose(0, 1)
        heads, _, d = q.shape
        g = self.hi - self.lo
        qp = q.new_zeros(heads, g * self.tmax, d).index_copy_(1, self.qpos, q)
        o = torch.nn.functional.scaled_dot_product_attention(
            qp.view(heads, g, self.tmax, d).transpose(0, 1),
            kc[self.lo : self.hi, :, : self.lmax],
            vc[self.lo : self.hi, :, : self.lmax],
            attn_mask=self.mask,
            enable_gqa=gqa,
        )
        return o.transpose(0, 1).reshape(heads, g * self.tmax, d).index_select(1, self.qpos)


GROUP_MAX_ROW = 16  # longer rows (prompt chunks) attend alone: a group pads every row to its longest


def plan_groups(caches, offsets, lens, starts, masks, n_tokens: int, device) -> tuple[list[Group], list[int]]:
    """Rows grouped by the segment their cache sits in (two or more rows per group), and the
    rows that attend alone: unpooled caches, rows alone in their segment, and rows of more than
    ``GROUP_MAX_ROW`` tokens, whose queries would pad every other row of their group (a decoding
    row has a few; a prefill chunk beside them, a hundred)."""
    by_seg: dict[int, list[int]] = {}
    for r, c in enumerate(caches):
        seg = getattr(c, "segment", None)
        if seg is not None and lens[r] <= GROUP_MAX_ROW:
            by_seg.setdefault(id(seg), []).append(r)
    groups, grouped = [], set()
    for rows in by_seg.values():
        if len(rows) > 1:
            groups.append(
                Group(
                    caches[rows[0]].segment,
                    rows,
                    offsets,
                    lens,
                    starts,
                    [caches[r].slot for r in rows],
                    masks,
                    n_tokens,
                    device,
                )
            )
            grouped.update(rows)
    return groups, [r for r in range(len(caches)) if r not in grouped]
