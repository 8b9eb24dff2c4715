"""A lean Llama-family forward pass with a static KV cache (gpt-fast style).

Weights load from a local Hugging Face directory (config.json + safetensors) under the
same names `transformers` uses, so a user's own Llama, Qwen2, Qwen3 or Mistral checkpoint
works unchanged (``SUPPORTED``); `tests/unit/test_llama.py` checks logits against
`transformers`. Anything else is refused at load, by model type, by a sliding window, or
by weights this forward would not use, rather than run wrong.

Why our own forward: at small sizes Python overhead dominates, and owning the pass makes
rollback (a length reset), ragged batching and capturing EAGLE-3's hidden states simple.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.common import invariant
from services.common.kv_pool import Group, KVPool, plan_groups, pooled_cache
from services.common.token_tree import depths


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: row i is True at i and at each of its ancestors (what node i attends to
    among the tree's nodes)."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m


@dataclass(frozen=True)
class LlamaShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    max_positions: int
    tie_embeddings: bool
    attention_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE

    @classmethod
    def from_hf(cls, cfg) -> "LlamaShape":
        heads = cfg.num_attention_heads
        return cls(
            vocab=cfg.vocab_size,
            hidden=cfg.hidden_size,
            layers=cfg.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate=cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            max_positions=cfg.max_position_embeddings,
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without declaring `attention_bias`.
            attention_bias=bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2",
            qk_norm=cfg.model_type == "qwen3",
        )


SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")  # config.json model_type this forward runs exactly
# Single-session steps of at most this many tokens (decodes, verifications) may run as static
# steps (``Llama.static_steps``); longer ones (prompt chunks) run the eager forward: a graph per
# prompt length would be captured once and replayed never.
STATIC_ROWS = 16
# A static step attends over the cache's first multiple of this many positions that holds the
# step: a session's steps then take a few shapes as it grows, not one per position, and a short
# context does not pay for the whole cache.
STATIC_BUCKET = 256


def static_width(end: int, capacity: int) -> int:
    """The keys a static step ending before position ``end`` attends over (``STATIC_BUCKET``)."""
    return min(capacity, -(-end // STATIC_BUCKET) * STATIC_BUCKET)


def shares_target_embedding(cfg) -> bool:
    """A draft made from its target's first layers keeps the target's input embedding (and, tied,
    its LM head) and does not store it: ``shares_target_embedding`` in its config.json."""
    return bool(getattr(cfg, "shares_target_embedding", False))


def check_supported(cfg, path) -> None:
    """ValueError for a checkpoint this forward would run wrong: another architecture, or
    attention over a sliding window shorter than the context."""
    if cfg.model_type not in SUPPORTED:
        raise ValueError(
            f"{path}: model_type {cfg.model_type!r} is not supported; the target and draft must be one "
            f"of {', '.join(SUPPORTED)} (Llama-family attention and MLP)"
        )
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", cfg.model_type == "mistral")
    if uses_window and window is not None and window < cfg.max_position_embeddings:
        raise ValueError(
            f"{path}: sliding-window attention ({window} of {cfg.max_position_embeddings} positions) is "
            "not supported; serve a checkpoint with full attention"
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused kernel, same values
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Llama attention; ``in_features`` and ``bias`` default to the shape's (EAGLE-3's layer
    projects a 2H-wide input without biases)."""

    def __init__(self, s: LlamaShape, in_features: int | None = None, bias: bool | None = None):
        super().__init__()
        self.s = s
        d_in, bias = in_features or s.hidden, s.attention_bias if bias is None else bias
        self.q_proj = nn.Linear(d_in, s.heads * s.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_in, s.kv_heads * s.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_in, s.kv_heads * s.head_dim, bias=bias)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        if s.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(s.head_dim, s.eps), RMSNorm(s.head_dim, s.eps)
        self.qkv: nn.Module | None = None  # inference: one fused q|k|v GEMM (packed_linear.pack_linears)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., T, hidden] → rotated q [..., heads, T, d], rotated k and v [..., kv_heads, T, d].
        With the fused q|k|v GEMM, q and k are rotated in one pass over their adjacent columns
        (the same elementwise ops per value, so the same values)."""
        s = self.s
        *lead, t, _ = x.shape
        heads = lambda y, n: y.view(*lead, t, n, s.head_dim).transpose(-3, -2)  # noqa: E731
        if self.qkv is None or s.qk_norm:
            if self.qkv is None:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            else:
                q, k, v = self.qkv(x).split(
                    [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1
                )
            q, k, v = heads(q, s.heads), heads(k, s.kv_heads), heads(v, s.kv_heads)
            if s.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v
        qkv = self.qkv(x)
        n_qk = (s.heads + s.kv_heads) * s.head_dim
        qk = heads(qkv[..., :n_qk], s.heads + s.kv_heads)
        qk = qk * cos + rotate_half(qk) * sin
        return qk[..., : s.heads, :, :], qk[..., s.heads :, :, :], heads(qkv[..., n_qk:], s.kv_heads)

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor] | None, start: int, mask):
        """x: [B, T, H]; cos/sin: [T, D]; kv: this layer's cache ([B, kvh, S, D] each) or None."""
        b, t, _ = x.shape
        s = self.s
        q, k, v = self.project(x, cos, sin)
        if kv is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=s.kv_heads != s.heads)
        else:
            kc, vc = kv
            kc[:, :, start : start + t] = k
            vc[:, :, start : start + t] = v
            k, v = kc[:, :, : start + t], vc[:, :, : start + t]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=s.kv_heads != s.heads)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))


def ragged_attention(
    attn: "Attention",
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]],
    layer: int = 0,
    groups: Sequence[Group] = (),
    alone: list[int] | None = None,
    lens: list[int] | None = None,
    calls: list[invariant.Call] | None = None,
) -> torch.Tensor:
    """Attention for concatenated rows: x [N, H]; rows = (offset, start, (k_cache, v_cache), mask).

    Projections run once over all N tokens. With ``calls`` (batch-invariant mode), queries
    attend as ``invariant`` plans them. Else rows of each pooled ``groups`` entry attend in one
    call over their segment (``kv_pool``); the others (``alone``, all rows when there are no
    groups) each attend to their own batch-1 cache."""
    s = attn.s
    n = x.shape[0]
    gqa = s.kv_heads != s.heads
    q, k, v = attn.project(x, cos, sin)  # [heads, N, d]
    if calls is not None:
        assert lens is not None, "an invariant plan comes with the rows' lengths"
        o = invariant.attend(q, k, v, [(off, st, kv) for off, st, kv, _ in rows], lens, calls)
    elif not groups:
        o = attend_rows(q, k, v, rows, gqa)  # [heads, N, d]
    else:
        assert alone is not None and lens is not None, "pooled groups come with the rows left alone"
        o = q.new_empty(q.shape)
        for g in groups:
            out = g.attend(layer, q, k, v, gqa)
            o = out if g.tokens is None else o.index_copy_(1, g.tokens, out)
        for r in alone:
            off, st, kv, mask = rows[r]
            end = off + lens[r]
            o[:, off:end] = attend_rows(q[:, off:end], k[:, off:end], v[:, off:end], [(0, st, kv, mask)], gqa)
    return attn.o_proj(o.transpose(0, 1).reshape(n, s.heads * s.head_dim))


def attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: Sequence[tuple[int, int, tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]],
    gqa: bool,
    last_only: bool = False,
) -> torch.Tensor:
    """q [heads, N, d], k/v [kv_heads, N, d] of concatenated rows; row r's tokens start at
    ``offset`` and sit at positions ``start``.. of its batch-1 cache: write its K/V there and
    attend over the cache prefix with ``mask`` (None for one token). Returns [heads, N, d].
    With ``last_only``, q holds only each row's last query ([heads, rows, d]), which sees the
    whole prefix (no mask): K/V of every position are written, attention runs for one."""
    outs = []
    ends = [row[0] for row in rows[1:]] + [k.shape[1]]
    for r, ((off, start, (kc, vc), mask), end) in enumerate(zip(rows, ends)):
        t = end - off
        kc[0, :, start : start + t] = k[:, off:end]
        vc[0, :, start : start + t] = v[:, off:end]
        qr, mask = (q[None, :, r : r + 1], None) if last_only else (q[None, :, off:end], mask)
        outs.append(
            F.scaled_dot_product_attention(
                qr, kc[:, :, : start + t], vc[:, :, : start + t], attn_mask=mask, enable_gqa=gqa
            )[0]
        )
    return torch.cat(outs, dim=1)


def causal_masks(starts: list[int], lens: list[int], device) -> list[torch.Tensor | None]:
    """Per-row masks for rows of ``lens`` new tokens after ``starts`` cached ones."""
    return [
        torch.ones(n, st + n, dtype=torch.bool, device=device).tril(st) if n > 1 else None
        for st, n in zip(starts, lens)
    ]


def token_ids(seqs: Sequence[list[int] | torch.Tensor], device) -> torch.Tensor:
    """The rows' tokens in one long tensor on ``device``: host lists are copied in one go,
    device tensors (a chain's tokens that the host has not read) are joined where they are."""
    if not any(isinstance(t, torch.Tensor) for t in seqs):
        return torch.tensor([t for row in seqs for t in row], dtype=torch.long, device=device)
    return torch.cat(
        [
            t.to(device, torch.long)
            if isinstance(t, torch.Tensor)
            else torch.tensor(t, dtype=torch.long, device=device)
            for t in seqs
        ]
    )


def row_positions(start: int, n: int, tree: list[int] | None, device) -> torch.Tensor:
    """Positions of a row's n new tokens after ``start`` cached ones; a tree's last
    len(tree) sit at the position of their depth (``token_tree.depths``)."""
    if tree is None:
        return torch.arange(start, start + n, device=device)
    lead = n - len(tree)
    return torch.tensor(list(range(start, start + lead)) + [start + lead - 1 + d for d in depths(tree)], device=device)


def tree_mask(start: int, n: int, tree: list[int], device) -> torch.Tensor:
    """[n, start + n] bool: causal over the cache and the row's leading tokens; a tree token
    sees those and its ancestors."""
    m = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    k = len(tree)
    m[n - k :, start + n - k :] = ancestor_mask(tree)
    return m.to(device)


class MLP(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)
        self.gate_up: nn.Module | None = None  # inference: one fused gate|up GEMM (packed_linear.pack_linears)

    def forward(self, x):
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = MLP(s)

    def forward(self, x, cos, sin, kv, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """Static per-layer K/V buffers ``[batch, kv_heads, capacity, head_dim]``.

    Rollback is free: a row's valid length lives with its owner; positions past it are
    overwritten by the next forward. A pooled cache's layers are views of one slot of a
    ``kv_pool.Segment`` (``segment``, ``slot``); an unpooled one has its own buffers.
    """

    segment = None
    slot = 0

    def __init__(self, s: LlamaShape, batch: int, capacity: int, dtype, device):
        shape = (batch, s.kv_heads, capacity, s.head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(s.layers)
        ]
        self.capacity = capacity


class Llama(nn.Module):
    """Llama-architecture causal LM. Parameter names mirror HF's minus the ``model.`` prefix."""

    rope_cos: torch.Tensor  # buffers, [positions, head_dim]
    rope_sin: torch.Tensor

    def __init__(self, hf_config):
        super().__init__()
        s = LlamaShape.from_hf(hf_config)
        self.s = s
        self.hf_config = hf_config
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.eps)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = _rope_tables(hf_config, s.max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # -- training / scoring: full causal sequence, no cache ------------------------------
    def forward_train(self, ids: torch.Tensor, capture: tuple[int, ...] = ()):
        """Logits [B, T, V]; with ``capture``, also the residual streams entering those layers."""
        t = ids.shape[1]
        x = self.embed_tokens(ids)
        cos, sin = self.rope_cos[:t].to(x.dtype), self.rope_sin[:t].to(x.dtype)
        seen = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                seen[i] = x
            x = layer(x, cos, sin, None, 0, None)
        logits = self.lm_head(self.norm(x))
        return (logits, [seen[i] for i in capture]) if capture else logits

    # -- inference: T new tokens at positions start..start+T-1 of every row ---------------
    def forward(
        self,
        ids: torch.Tensor,
        start: int,
        cache: KVCache,
        capture: tuple[int, ...] = (),
        last_only: bool = False,
        head: nn.Module | None = None,
        tail: int | None = None,
        tree: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits ``[B, T, V]`` (of the last ``tail`` positions only when given, ``[B, 1, V]``
        with ``last_only``; from ``head`` instead of the LM head when given) and the residual
        stream entering each layer in ``capture``. ``tree``: the last len(tree) tokens are a
        token tree with those parents (``forward_ragged``)."""
        t = ids.shape[1]
        x = self.embed_tokens(ids)
        where = slice(start, start + t) if tree is None else row_positions(start, t, tree, ids.device)
        cos, sin = self.rope_cos[where].to(x.dtype), self.rope_sin[where].to(x.dtype)
        mask = None
        if tree is not None:
            mask = tree_mask(start, t, tree, ids.device)
        elif t > 1:  # new token i sees the cache plus new tokens 0..i
            mask = torch.ones(t, start + t, dtype=torch.bool, device=ids.device).tril(start)
        seen = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                seen[i] = x
            x = layer(x, cos, sin, cache.layers[i], start, mask)
        tail = 1 if last_only else tail
        if tail is not None:
            x = x[:, t - tail :]
        return (head or self.lm_head)(self.norm(x)), [seen[i] for i in capture]

    def forward_static(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        width: int,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``forward`` in static shapes, for CUDA graphs: ``ids`` [B, T] at ``positions`` [T]
        (a device tensor) of ``cache`` → logits [B, T, V] and the residual stream entering each
        layer in ``capture``. No shape depends on where the step is within the cache's first
        ``width`` positions (``static_width``): K/V are written by index, and every query
        attends over those ``width`` keys, masked to the ones at or before its position (a
        rolled-back draft's stale K/V past it are masked too). So one graph, captured per
        (B, T, width), replays at every position the width holds; the price is attention over
        up to a bucket more keys than the filled part."""
        x = self.embed_tokens(ids)
        cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
        visible = torch.arange(width, device=ids.device)[None, :] <= positions[:, None]  # [T, width]
        seen = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                seen[i] = x
            attn, h = layer.self_attn, layer.input_layernorm(x)
            q, k, v = attn.project(h, cos, sin)
            kc, vc = cache.layers[i]
            kc.index_copy_(2, positions, k)
            vc.index_copy_(2, positions, v)
            o = F.scaled_dot_product_attention(
                q, kc[:, :, :width], vc[:, :, :width], attn_mask=visible, enable_gqa=self.s.kv_heads != self.s.heads
            )
            x = x + attn.o_proj(o.transpose(1, 2).reshape(*x.shape[:2], self.s.heads * self.s.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x)), [seen[i] for i in capture]

    def forward_ragged(
        self,
        seqs: Sequence[list[int] | torch.Tensor],
        starts: list[int],
        caches: list[KVCache],
        capture: tuple[int, ...] = (),
        last_only: bool = False,
        head: nn.Module | None = None,
        tails: list[int] | None = None,
        trees: list[list[int] | None] | None = None,
    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """``forward_joined``, each row's logits split off: per-row logits [T_r, V]."""
        if last_only:
            tails = [1] * len(seqs)
        logits, hidden = self.forward_joined(seqs, starts, caches, capture, head, tails, trees)
        return list(torch.split(logits, tails or [len(t) for t in seqs])), hidden

    def forward_joined(
        self,
        seqs: Sequence[list[int] | torch.Tensor],
        starts: list[int],
        caches: list[KVCache],
        capture: tuple[int, ...] = (),
        head: nn.Module | None = None,
        tails: list[int] | None = None,
        trees: list[list[int] | None] | None = None,
    ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Several sequences in one pass: row r feeds ``seqs[r]`` at positions starts[r].. of
        ``caches[r]`` (batch-1 caches). Returns the logits of every row's last ``tails[r]``
        positions (without ``tails``: all its positions), joined in row order [Σ tails, V],
        and per-row captured states [T_r, H]. The LM head runs only where logits are wanted: a
        verification needs the draft's and the bonus position's, not a prompt's; a drafter
        its last (``forward_ragged``'s ``last_only``). ``trees[r]``, when given
        and not None, makes row r's last len(trees[r]) tokens a token tree with those parents
        (``token_tree``): each sits at its depth's position and attends to its ancestors; its
        K/V go to the cache in row order (the caller keeps the accepted path's). A single
        row takes the plain batched path (no per-row bookkeeping), unless ``batch_invariant``.
        A row's tokens may be a device tensor (a drafter's chain feeds its last argmax without
        reading it)."""
        dev = self.embed_tokens.weight.device
        trees = trees if trees and any(t is not None for t in trees) else None
        if len(seqs) == 1 and not self.batch_invariant and self._static(seqs[0], head, trees):
            assert self.static_steps is not None, "checked by _static"
            ids, t = token_ids(seqs[:1], dev)[None], len(seqs[0])
            positions = torch.arange(starts[0], starts[0] + t, device=dev)
            width = static_width(starts[0] + t, caches[0].capacity)
            logits, captured = self.static_steps(ids, positions, caches[0], width, capture)
            if tails:
                logits = logits[:, t - tails[0] :]
            return logits[0], [[h[0] for h in captured]]
        if len(seqs) == 1 and not self.batch_invariant:
            logits, hidden = self(
                token_ids(seqs[:1], dev)[None],
                starts[0],
                caches[0],
                capture,
                head=head,
                tail=tails[0] if tails else None,
                tree=trees[0] if trees else None,
            )
            return logits[0], [[h[0] for h in hidden]]
        lens = [len(t) for t in seqs]
        ids = token_ids(seqs, dev)
        trees = trees or [None] * len(seqs)
        pos = torch.cat([row_positions(st, n, tree, dev) for st, n, tree in zip(starts, lens, trees)])
        x = self.embed_tokens(ids)
        cos, sin = self.rope_cos[pos].to(x.dtype), self.rope_sin[pos].to(x.dtype)
        offsets = [sum(lens[:r]) for r in range(len(lens))]
        calls = invariant.plan(offsets, starts, lens, trees, dev) if self.batch_invariant else None
        masks: list[torch.Tensor | None] = [None] * len(seqs)
        groups: list[Group] = []
        alone: list[int] | None = None
        if calls is None:
            masks = [
                tree_mask(st, n, tree, dev) if tree is not None else mk  # built once, shared by every layer
                for st, n, tree, mk in zip(starts, lens, trees, causal_masks(starts, lens, dev))
            ]
            groups, alone = plan_groups(caches, offsets, lens, starts, masks, len(ids), dev)
        seen = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                seen[i] = x
            rows = [(off, st, c.layers[i], mk) for off, st, c, mk in zip(offsets, starts, caches, masks)]
            x = x + ragged_attention(
                layer.self_attn, layer.input_layernorm(x), cos, sin, rows, i, groups, alone, lens, calls
            )
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        per_layer = [list(torch.split(seen[i], lens)) for i in capture]
        hidden = [[h[r] for h in per_layer] for r in range(len(lens))]
        head = head or self.lm_head
        if tails is None:
            return head(self.norm(x)), hidden
        keep = torch.tensor(
            [j for off, n, t in zip(offsets, lens, tails) for j in range(off + n - t, off + n)],
            dtype=torch.long,
            device=dev,
        )
        return head(self.norm(x[keep])), hidden

    # Single-session steps of at most STATIC_ROWS tokens run here when set (``--static-steps``):
    # forward_static, replayed from CUDA graphs on a GPU (services/common/graphs.py). Not in the
    # batch-invariant mode, whose plan attends otherwise.
    static_steps: Callable[..., tuple[torch.Tensor, list[torch.Tensor]]] | None = None

    def _static(self, seq: list[int] | torch.Tensor, head: nn.Module | None, trees) -> bool:
        """Whether a single-row step goes through ``static_steps``: a chain (not a tree) of at
        most STATIC_ROWS tokens through the model's own LM head."""
        return self.static_steps is not None and head is None and not trees and len(seq) <= STATIC_ROWS

    kv_pool: KVPool | None = None  # set (``use_kv_pool``): batch-1 caches come from pooled slots
    _batch_invariant = False

    @property
    def batch_invariant(self) -> bool:
        """A row's logits do not depend on the rows beside it (``invariant``): every ragged
        forward, one row included, attends through the invariant plan, and the linear layers
        over more than ``invariant.K_CHUNK`` inputs sum their inputs in fixed chunks."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        invariant.use_invariant_linears(self, on)
        self._batch_invariant = on

    def use_kv_pool(self, **kwargs) -> KVPool:
        """Serve batch-1 caches from pooled slots (``kv_pool``), so that the ragged forward
        attends for all rows of a segment in one call per layer."""
        p = next(self.parameters())
        self.kv_pool = KVPool(self.s, p.dtype, p.device, **kwargs)
        return self.kv_pool

    def new_cache(self, batch: int = 1, capacity: int | None = None) -> KVCache:
        p = next(self.parameters())
        capacity = capacity or self.s.max_positions
        if self.kv_pool is not None and batch == 1:
            where = self.kv_pool.take(capacity)
            if where is not None:
                return pooled_cache(KVCache, *where, capacity)
        return KVCache(self.s, batch, capacity, p.dtype, p.device)

    # -- Hugging Face directory I/O --------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype=torch.float32, device="cpu", target_embed: torch.Tensor | None = None
    ) -> "Llama":
        """``target_embed``: the target's input embedding, for a draft that shares it
        (``shares_target_embedding``: it is not stored with the draft, as an EAGLE-3 head's is not)."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        path = Path(path)
        cfg = AutoConfig.from_pretrained(str(path))
        check_supported(cfg, path)
        with torch.device("meta"):
            model = cls(cfg)
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(f)))
        state = {k.removeprefix("model."): v for k, v in state.items()}
        if shares_target_embedding(cfg):
            if target_embed is None or tuple(target_embed.shape) != (model.s.vocab, model.s.hidden):
                raise ValueError(
                    f"{path}: this draft shares its target's embedding ({model.s.vocab} x {model.s.hidden}), "
                    "which is not stored with it; load it beside that target (--target)"
                )
            state["embed_tokens.weight"] = target_embed.detach()
        if model.s.tie_embeddings or "lm_head.weight" not in state:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        unused = model.load_state_dict(state, strict=False, assign=True).unexpected_keys
        unused = [k for k in unused if not k.endswith("rotary_emb.inv_freq")]
        if unused:
            raise ValueError(
                f"{path}: the checkpoint has weights this Llama-family forward does not use "
                f"({', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''}); it would run wrong"
            )
        if model.s.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        cos, sin = _rope_tables(cfg, model.s.max_positions)
        model.rope_cos, model.rope_sin = cos, sin
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"{path}: checkpoint lacks weights {missing[:5]}")
        return model.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, path: str | Path, dtype=torch.float16, max_shard_bytes: int = 15 * 2**20) -> None:
        """HF layout: one model.safetensors, or shards + model.safetensors.index.json past
        ``max_shard_bytes`` (transfers here cap files at 16 MB). Each file is written to a
        temporary name and renamed, so readers never see a half-written file."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {}
        shared = shares_target_embedding(self.hf_config)
        for k, v in self.state_dict().items():
            if (k == "lm_head.weight" and self.s.tie_embeddings) or (k == "embed_tokens.weight" and shared):
                continue
            name = k if k.startswith("lm_head.") else f"model.{k}"
            state[name] = v.detach().to("cpu", dtype).contiguous()
        shards: list[dict] = [{}]
        size = 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        for old in path.glob("model*.safetensors*"):
            old.unlink()
        names = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        for fname, shard in zip(names, shards):
            save_file(shard, str(path / (fname + ".tmp")), metadata={"format": "pt"})
            os.replace(path / (fname + ".tmp"), path / fname)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                "weight_map": {n: f for f, sh in zip(names, shards) for n in sh},
            }
            (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        self.hf_config.dtype = str(dtype).removeprefix("torch.")
        self.hf_config.save_pretrained(str(path))


def _rope_tables(hf_config, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[n, head_dim]`` from transformers' rotary embedding (all rope types)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("cpu"):
        rope = LlamaRotaryEmbedding(hf_config)
        pos = torch.arange(n)[None]
        cos, sin = rope(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0], sin[0]


def load_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
