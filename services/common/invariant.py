"""Batch-invariant attention: a query row's output does not depend on what else shares its step.

A lossless method equals plain greedy decoding only if the target's logits for a position are
the same whether that position is decoded alone, verified as row 3 of a 6-token draft, sits in
a token tree, or shares the step with other sessions. In float32 the rounding differences
between those shapes stay below what flips a greedy choice; in bfloat16 they do not
(``bench/bf16_lossless``). A linear layer's GEMM may sum a row differently with the rows beside
it, as the library picks its kernel by shape (oneDNN's AMX tiles from 33 rows; a wide input);
``linear`` runs such a layer in blocks of rows and chunks of inputs that ``row_block`` probes as
safe. Attention is not invariant either: a decode at position p attends over p + 1 keys, a verification over
p + k + 1 (masked), a tree node finds its ancestors scattered among the keys, and the fused
``scaled_dot_product_attention`` kernel also rounds some rows differently with the number
of queries beside them (measured: docs/decisions.md).

The rule: a query at position p attends over its visible keys laid out in position order
(the cache's 0..p for a chain; the committed prefix, then its ancestors, then itself for a
tree node), padded to ``bucket_len(p + 1)`` keys with the padding masked, by plain matmul and
float32 softmax, whose reductions run along that padded length only. Its key length and
layout are functions of p alone, so every reduction runs in the same order whatever the step.

Pure torch: no gRPC, Redis or Ray.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("specmesh.invariant")

KV_BUCKET = 64  # keys are padded to a multiple of this: the waste per query is under one bucket
# A CPU bfloat16 GEMM rounds a row the same whatever rows share the call in every shape tried up
# to this many inputs; over it (SmolLM2's 1,536-wide MLP input) a row can round differently beside
# another (docs/decisions.md, Verification)
K_CHUNK = 768
# row counts ``row_block`` probes: each up to PROBE_ROWS, then these larger ones
PROBE_ROWS, PROBE_BEYOND = 64, (96, 128, 256, 512)


@functools.cache
def row_block(out_features: int, in_features: int, dtype: torch.dtype, device: str) -> int:
    """The most rows one GEMM of this shape takes while summing every row as it sums that row
    alone; 0 when every row count probed does. Probed once per shape (``_probe_data``): whether
    a kernel's reduction order depends on the row count is the library's choice, by CPU (oneDNN
    takes AMX tiles from 33 rows, rounding rows differently from its one-row kernel:
    docs/decisions.md) and by GPU."""
    block = _probe(out_features, in_features, dtype, device)
    if block:  # said once per shape: on a GPU, blocks of few rows cost much of its batching
        log.info(
            "batch-invariant GEMMs of %d inputs to %d outputs (%s, %s): in blocks of at most %d rows",
            in_features,
            out_features,
            dtype,
            device,
            block,
        )
    return block


def _probe(out_features: int, in_features: int, dtype: torch.dtype, device: str) -> int:
    x, w = _probe_data(out_features, in_features, max(PROBE_BEYOND), dtype, torch.Generator().manual_seed(0))
    x, w = x.to(device), w.to(device)
    with torch.inference_mode():
        alone = torch.cat([F.linear(x[j : j + 1], w) for j in range(PROBE_ROWS)])
        for m in range(2, PROBE_ROWS + 1):
            if not torch.equal(F.linear(x[:m], w), alone[:m]):
                return m - 1
        if all(torch.equal(F.linear(x[:m], w)[:PROBE_ROWS], alone) for m in PROBE_BEYOND):
            return 0
    return PROBE_ROWS


def _probe_data(out_features: int, k: int, rows: int, dtype: torch.dtype, gen: torch.Generator):
    """Inputs whose dot products cancel: terms of many magnitudes (2^-8..2^8), each row's second
    half of the inputs repeating its first against weights of nearly the opposite sign, so a
    result is mostly its partial sums' rounding and any other summation order shows in it (on
    plain random data a kernel change can leave every rounded row the same)."""
    h = k // 2
    scale = lambda *shape: torch.exp2(torch.randint(-8, 9, shape, generator=gen).float())  # noqa: E731
    xa = torch.randn(rows, h, generator=gen) * scale(rows, h)
    wa = torch.randn(out_features, h, generator=gen) * scale(out_features, h)
    near = -wa * (1 + 2**-7 * torch.randn(out_features, h, generator=gen))
    x = torch.cat([xa, xa, torch.randn(rows, k - 2 * h, generator=gen)], 1)
    w = torch.cat([wa, near, torch.randn(out_features, k - 2 * h, generator=gen)], 1)
    return x.to(dtype), w.to(dtype)


def _block(weight: torch.Tensor) -> int:
    """``row_block`` for the GEMMs ``linear`` makes of ``weight`` (its input chunks' widths)."""
    out_features, k = weight.shape
    widths = {min(k, K_CHUNK)} | ({k % K_CHUNK} if k > K_CHUNK and k % K_CHUNK else set())
    blocks = [row_block(out_features, w, weight.dtype, weight.device.type) for w in widths]
    return min((b for b in blocks if b), default=0)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block: int | None = None
) -> torch.Tensor:
    """``F.linear`` whose rows do not depend on the rows beside them: in blocks of at most
    ``row_block`` rows (``block``, when the caller knows it), and over more than ``K_CHUNK``
    inputs in chunks of at most that many, the partial products summed in float32 in input order."""
    if block is None:
        block = _block(weight)
    rows = x.reshape(-1, x.shape[-1])
    if not block or rows.shape[0] <= block:
        return _chunked(x, weight, bias)
    out = torch.cat([_chunked(rows[i : i + block], weight, bias) for i in range(0, rows.shape[0], block)])
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _chunked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` over inputs in chunks of at most ``K_CHUNK``, summed in float32 in order."""
    k = weight.shape[1]
    if k <= K_CHUNK:
        return F.linear(x, weight, bias)
    out = F.linear(x[..., :K_CHUNK], weight[:, :K_CHUNK]).float()
    for s in range(K_CHUNK, k, K_CHUNK):
        out += F.linear(x[..., s : s + K_CHUNK], weight[:, s : s + K_CHUNK]).float()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def needs_invariant(plain: nn.Linear) -> bool:
    """Whether ``plain`` rounds a row differently with the rows beside it (``linear`` fixes it)."""
    return plain.in_features > K_CHUNK or bool(_block(plain.weight))


class Linear(nn.Module):
    """An ``nn.Linear``'s parameters (the same tensors, under the same names) through ``linear``;
    ``plain`` gives the ``nn.Linear`` back."""

    def __init__(self, plain: nn.Linear):
        super().__init__()
        self.weight, self.bias = plain.weight, plain.bias
        self.in_features, self.out_features = plain.in_features, plain.out_features
        self._plain = [plain]  # (in a list: not a submodule, so no parameter is listed twice)
        self._rows: tuple[torch.dtype, torch.device, int] | None = None  # row_block for the weight as it is

    @property
    def plain(self) -> nn.Linear:
        return self._plain[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self._rows is None or self._rows[:2] != (w.dtype, w.device):  # looked up once, not per call
            self._rows = (w.dtype, w.device, _block(w))
        return linear(x, w, self.bias, self._rows[2])


def use_invariant_linears(model: nn.Module, on: bool) -> None:
    """Run (``on``) every ``nn.Linear`` of ``model`` that ``needs_invariant`` through ``linear``,
    or give the plain ones back."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if on and type(child) is nn.Linear and needs_invariant(child):
                setattr(parent, name, Linear(child))
            elif not on and isinstance(child, Linear):
                setattr(parent, name, child.plain)


def bucket_len(n: int, bucket: int = KV_BUCKET) -> int:
    return -(-n // bucket) * bucket


def ancestry(parents: Sequence[int]) -> list[list[int]]:
    """Per node, the nodes from the root's child down to itself."""
    out: list[list[int]] = []
    for i, p in enumerate(parents):
        out.append((out[p] if p >= 0 else []) + [i])
    return out


@dataclass
class Call:
    """One attention call: ``queries`` (indices into the step's tokens) of row ``row`` over
    ``length`` keys; ``gather`` (the cache indices of its keys) for a tree node, None for
    chain queries, which read the cache's prefix."""

    row: int
    queries: torch.Tensor
    length: int
    bias: torch.Tensor  # [queries, length], float32: 0 where the key is visible, else -inf
    gather: torch.Tensor | None = None  # a tree node's [length] cache indices (padding: 0, masked)


def plan(
    offsets: list[int],
    starts: list[int],
    lens: list[int],
    trees: Sequence[Sequence[int] | None],
    device,
    bucket: int = KV_BUCKET,
) -> list[Call]:
    """The calls of one forward, built once and shared by every layer."""
    calls: list[Call] = []
    for r, (off, start, n, tree) in enumerate(zip(offsets, starts, lens, trees)):
        lead = n - len(tree) if tree else n
        by_len: dict[int, list[int]] = {}
        for i in range(lead):  # chain queries: query i sits at position start + i
            by_len.setdefault(bucket_len(start + i + 1, bucket), []).append(i)
        for length, idx in by_len.items():
            pos = torch.tensor([start + i for i in idx], device=device)
            visible = torch.arange(length, device=device)[None, :] <= pos[:, None]
            calls.append(Call(r, torch.tensor([off + i for i in idx], device=device), length, _bias(visible)))
        if tree:
            calls += _tree_calls(r, off, start, lead, tree, device, bucket)
    return calls


def _tree_calls(r: int, off: int, start: int, lead: int, tree: Sequence[int], device, bucket: int) -> list[Call]:
    """Tree node j (K/V written at start + lead + j) at depth d sits at position
    start + lead - 1 + d; it sees the cache's 0..start + lead - 1, then its ancestors in
    depth order, then itself. One call per node, shaped as a decoding query's: batching the
    nodes into one call rounded some differently (measured: docs/decisions.md)."""
    base = list(range(start + lead))
    calls = []
    for j, path in enumerate(ancestry(tree)):
        keys = base + [start + lead + a for a in path]
        length = bucket_len(len(keys), bucket)
        gather = torch.zeros(length, dtype=torch.long)  # padding reads position 0, masked
        gather[: len(keys)] = torch.tensor(keys)
        visible = torch.arange(length)[None, :] < len(keys)
        query = torch.tensor([off + lead + j], device=device)
        calls.append(Call(r, query, length, _bias(visible.to(device)), gather.to(device)))
    return calls


def _bias(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def _padded(cache: torch.Tensor, length: int) -> torch.Tensor:
    """cache [kv_heads, capacity, d] → its first ``length`` positions, zero-padded past capacity."""
    cap = cache.shape[1]
    if length <= cap:
        return cache[:, :length]
    return F.pad(cache, (0, 0, 0, length - cap))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: Sequence[tuple[int, int, tuple[torch.Tensor, torch.Tensor]]],
    lens: list[int],
    calls: list[Call],
) -> torch.Tensor:
    """q [heads, N, d], k/v [kv_heads, N, d] of concatenated rows; ``rows`` = (offset, start,
    (k_cache, v_cache)) with batch-1 caches. Writes each row's K/V into its cache, then runs
    ``calls`` → [heads, N, d]."""
    for (off, start, (kc, vc)), n in zip(rows, lens):
        kc[0, :, start : start + n] = k[:, off : off + n]
        vc[0, :, start : start + n] = v[:, off : off + n]
    o = q.new_empty(q.shape)
    groups = q.shape[0] // k.shape[0]  # query heads per K/V head
    for c in calls:
        kc, vc = (t[0] for t in rows[c.row][2])
        if c.gather is None:
            kk, vv = _padded(kc, c.length), _padded(vc, c.length)
        else:
            kk, vv = kc[:, c.gather], vc[:, c.gather]
        o[:, c.queries] = _math_attention(q[:, c.queries], kk, vv, c.bias, groups)
    return o


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, groups: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v with a float32 softmax; q [..., heads, m, d], k/v
    [..., kv_heads, L, d], bias [m, L] (0 or -inf) broadcast over the heads."""
    if groups > 1:
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    return torch.matmul((scores + bias).softmax(-1).to(q.dtype), v)
