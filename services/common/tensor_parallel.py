"""Tensor parallelism for our Llama forward (Megatron style, as vLLM's linear layers and
gpt-fast's ``tp.py`` do it): one rank's shard of a target, run in step with the others.

- Query/key/value and gate/up projections are split by output columns: each rank holds its
  heads and its share of the MLP's width and computes them with no communication.
- The attention output and MLP down projections are split by input rows: each rank's product
  is a partial sum, added across ranks by one all-reduce each (``RowParallel``).
- KV heads are split with their query heads. With fewer KV heads than ranks (GQA), each rank
  keeps the one KV head its query heads read (replicated across the ranks that share it).
- The LM head is split by vocabulary: each rank scores its rows and the logits are gathered
  (``VocabParallel``), so every rank holds the same full logits as one device would. A step
  whose verdicts need only greedy reads (each row's argmax; a calibrated gate's gap and top-k
  test at its draft rows) skips the gather: ``greedy_reads`` gathers a few columns per row
  instead of the vocabulary, and reads what one device would have read.

After each all-reduce every rank holds the same residual stream, so the layers' inputs that
EAGLE-3 reads are captured on every rank as on one device. The collectives are
``torch.distributed``'s (gloo on the CPU, NCCL on GPUs); the caller sets up the group.
No gRPC, Redis or Ray here.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from services.common.llama import Llama


class RowParallel(nn.Module):
    """A linear layer split by its input rows: this rank's partial product, summed over ranks."""

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        self.linear, self.group = linear, group

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallel(nn.Module):
    """An LM head split by vocabulary rows: this rank's logits, gathered into the full vocabulary.
    ``linear`` alone scores this rank's ids, ``offset`` on (``greedy_reads`` reads from them)."""

    def __init__(self, linear: nn.Linear, world: int, offset: int = 0, group=None):
        super().__init__()
        self.linear, self.world, self.offset, self.group = linear, world, offset, group

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, -1)


def greedy_reads(
    local: torch.Tensor, head: VocabParallel, gated: list[tuple[int, int, int]]
) -> tuple[list[int], list[float], list[bool]]:
    """``policies.read_greedy``'s reads of a step from this rank's logits [N, V / world] (ids
    ``head.offset`` on), without gathering the vocabulary: every row's argmax (the first of equal
    maxima, as one device's), and at each ``gated`` (row, draft id, k) the gap logit(d) −
    max and whether d ranks within the top k. Each rank sends its rows' maxima and their ids,
    the gated rows' draft logits (−inf where another rank holds d) and their k largest logits:
    one all-gather of N × 2 + G × (1 + k) values; every rank reads the same answer."""
    n, v = local.shape
    ids = local.argmax(-1)
    mine = [local.gather(1, ids[:, None])[:, 0].float(), (ids + head.offset).float()]
    top_k = max((k for *_, k in gated), default=0)
    if gated:
        r = torch.tensor([g[0] for g in gated], device=local.device)
        d = torch.tensor([g[1] for g in gated], device=local.device) - head.offset
        held = (d >= 0) & (d < v)
        at_d = torch.where(held, local[r, d.clamp(0, v - 1)].float(), float("-inf"))
        top = local[r].topk(min(top_k, v), dim=-1).values.float()
        mine += [at_d, top.flatten()]
    packed = torch.cat([x.double() for x in mine])
    parts = [torch.empty_like(packed) for _ in range(head.world)]
    dist.all_gather(parts, packed, group=head.group)
    every = torch.stack(parts)  # [world, ...]: rank r holds ids r·V/world..
    best = every[:, :n].argmax(0)  # the first rank holding a row's maximum: the first maximal id
    rows = torch.arange(n, device=local.device)
    peak, targets = every[best, rows], every[best, n + rows]
    if not gated:
        return [int(t) for t in targets.tolist()], [], []
    g = len(gated)
    at_d = every[:, 2 * n : 2 * n + g].max(0).values  # the one rank that holds d
    tops = every[:, 2 * n + g :].reshape(head.world, g, -1).permute(1, 0, 2).reshape(g, -1)
    k = torch.tensor([x[2] for x in gated], device=local.device)
    kth = tops.topk(top_k, dim=-1).values.gather(1, (k - 1)[:, None])[:, 0]
    gaps = (at_d.float() - peak[r].float()).double()  # in fp32, as one device's read
    return [int(t) for t in targets.tolist()], gaps.tolist(), (at_d >= kth).tolist()


def _rows(linear: nn.Linear, lo: int, hi: int) -> nn.Linear:
    """The output rows lo:hi of ``linear`` (a column-parallel shard)."""
    w = linear.weight
    out = nn.Linear(linear.in_features, hi - lo, bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[lo:hi])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[lo:hi])
    return out


def _cols(linear: nn.Linear, lo: int, hi: int) -> nn.Linear:
    """The input columns lo:hi of ``linear`` (a row-parallel shard; no bias in Llama's)."""
    w = linear.weight
    out = nn.Linear(hi - lo, linear.out_features, bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w[:, lo:hi])
    return out


def split_check(model: Llama, world: int) -> None:
    """Why ``model`` cannot be split over ``world`` ranks (a ValueError saying what to set)."""
    s = model.s
    for what, n in (("attention heads", s.heads), ("MLP width", s.intermediate), ("vocabulary", s.vocab)):
        if n % world:
            raise ValueError(
                f"tensor parallel {world}: the target's {n} {what} do not split evenly over {world} ranks; "
                f"use a tensor-parallel size that divides {s.heads} heads, {s.intermediate} and {s.vocab}"
            )
    if s.kv_heads % world and world % s.kv_heads:
        raise ValueError(
            f"tensor parallel {world}: {s.kv_heads} KV heads neither split over {world} ranks nor replicate "
            f"evenly across them; use a size that divides or is a multiple of {s.kv_heads}"
        )


def shard(model: Llama, rank: int, world: int, group=None) -> Llama:
    """``model`` reduced, in place, to rank ``rank``'s shard of ``world``; returns it. Its shape
    (``model.s``) becomes the rank's: heads, KV heads and MLP width divided (the vocabulary,
    hidden size and layers as they were)."""
    split_check(model, world)
    s = model.s
    heads, d = s.heads // world, s.head_dim
    kv = s.kv_heads // world if s.kv_heads >= world else 1
    kv_first = rank * kv if s.kv_heads >= world else (rank * heads) // (s.heads // s.kv_heads)
    width = s.intermediate // world
    local = replace(s, heads=heads, kv_heads=kv, intermediate=width)
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        a.q_proj = _rows(a.q_proj, rank * heads * d, (rank + 1) * heads * d)
        a.k_proj = _rows(a.k_proj, kv_first * d, (kv_first + kv) * d)
        a.v_proj = _rows(a.v_proj, kv_first * d, (kv_first + kv) * d)
        a.o_proj = RowParallel(_cols(a.o_proj, rank * heads * d, (rank + 1) * heads * d), group)
        a.s = local
        m.gate_proj = _rows(m.gate_proj, rank * width, (rank + 1) * width)
        m.up_proj = _rows(m.up_proj, rank * width, (rank + 1) * width)
        m.down_proj = RowParallel(_cols(m.down_proj, rank * width, (rank + 1) * width), group)
    v = s.vocab // world
    head = _rows(model.lm_head, rank * v, (rank + 1) * v)
    model.lm_head = VocabParallel(head, world, rank * v, group)  # (untied from the embedding, which stays whole)
    model.s = local
    return model
