"""Target runner: owns the target model, each session's KV cache and its rollback.

Invariant per session: ``cache_len`` tokens of ``tokens`` have K/V in the cache; at least
the newest committed token is still pending. A verification pass feeds the pending tokens
plus the draft in one forward; committing a verdict keeps the K/V of the accepted draft
prefix and drops the rest (rollback = not advancing ``cache_len``).

The runner is not thread-safe: one caller at a time (the verifier's ``CycleBatcher``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from services.common.llama import KVCache, Llama
from services.common.metrics import KV_CACHE_TOKENS, PREFILL_CHUNKS, PREFIX_CACHE, PREFIX_CACHE_BYTES, VERIFY_BATCH
from services.common.prefix_cache import ROOT, PrefixCache, kv_block, load_kv
from services.common.sampling import token_logprobs
from services.common.tensor_parallel import VocabParallel, greedy_reads
from services.common.types import Verdict


@dataclass
class TargetSession:
    tokens: list[int]
    cache: KVCache
    cache_len: int = 0
    attached: bool = False  # the prefix cache was looked up (first step)
    cached: int = 0  # prompt positions taken from the prefix cache
    keys: list[bytes] | None = field(default_factory=list)  # prefix-cache keys of blocks 0.. (None: stores none)
    feats: list[torch.Tensor] = field(default_factory=list)  # fused features from block len(keys) on
    root: bytes = ROOT  # the first block's parent: the request's cache salt
    prompt_top: int | None = None  # prompt logprobs wanted, with this many alternatives
    prompt_len: int = 0
    prompt_lps: list = field(default_factory=list)  # prompt logprobs computed, not yet reported
    sid: int = -1  # a tensor-parallel replica's name for it on every rank (services/verifier/sharded.py)

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.cache_len :]


@dataclass
class StepRows:
    """A step's verification logits, left where the step ran: ``logits`` [N, V] holds every
    row the LM head produced, session i's verification rows at ``spans[i]`` (start, k + 1);
    ``hidden[i]``: session i's captured states [1, T_i, H] per capture layer. A step's policy
    reads what it needs of them for every session at once (``policies.read_greedy``)."""

    logits: torch.Tensor | None
    spans: list[tuple[int, int]]
    hidden: list[list[torch.Tensor]]
    # a vocabulary-split step's greedy reads, taken where its logits were split (and not kept):
    # (every row's argmax, the gated draft rows' gaps and top-k tests), as ``read_greedy`` reads them
    reads: tuple[list[int], list[float], list[bool]] | None = None

    def rows(self, i: int) -> torch.Tensor:
        assert self.logits is not None, "a step that kept its logits (no gates given to TargetRunner.step)"
        start, n = self.spans[i]
        return self.logits[start : start + n]

    def host(self, i: int) -> torch.Tensor:
        """Session i's rows [k+1, V] as fp32 on the host (a per-row rule reshapes them)."""
        return self.rows(i).float().cpu()


def split_head(model: Llama) -> VocabParallel | None:
    """The model's LM head if split by vocabulary (a tensor-parallel shard's), else None."""
    head = model.lm_head
    return head if isinstance(head, VocabParallel) else None


def keep_path(cache: KVCache, at: int, path: tuple[int, ...]) -> None:
    """Move the K/V of tree nodes ``path`` (written at ``at`` + node) to ``at``, ``at`` + 1, ...
    Their K carry the RoPE of their depth, which is where they land."""
    if all(node == j for j, node in enumerate(path)):
        return
    src = torch.tensor([at + node for node in path], device=cache.layers[0][0].device)
    dst = slice(at, at + len(path))
    for kc, vc in cache.layers:
        kc[:, :, dst] = kc[:, :, src]
        vc[:, :, dst] = vc[:, :, src]


class TargetRunner:
    """Verification forwards: many sessions' drafts in one ragged pass (shared weight reads,
    per-session attention and KV cache)."""

    def __init__(self, model: Llama, capture_layers: tuple[int, ...] = (), prefix: PrefixCache | None = None):
        self.model = model
        self.capture_layers = capture_layers
        self.prefix = prefix
        self.device = next(model.parameters()).device

    @property
    def max_positions(self) -> int:
        return self.model.s.max_positions

    def use_static_steps(self, graphs: bool) -> None:
        """Single-session steps in static shapes (``Llama.static_steps``), replayed from CUDA
        graphs with ``graphs``."""
        from services.common.graphs import StaticSteps

        self.model.static_steps = StaticSteps(self.model, graphs=graphs)

    def open(
        self, prompt: list[int], capacity: int, root: bytes = ROOT, prompt_top: int | None = None
    ) -> TargetSession:
        return TargetSession(
            tokens=list(prompt),
            cache=self.model.new_cache(1, min(capacity, self.max_positions)),
            root=root,
            prompt_top=prompt_top,
            prompt_len=len(prompt),
        )

    def verify(self, st: TargetSession, draft: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Target logits [k+1, V] for the draft positions (row k = bonus) and the captured
        hidden states [1, len(pending) + k, H] of the fed positions, one per capture layer."""
        return self.verify_batch([(st, draft)])[0]

    def verify_batch(
        self, items: list[tuple[TargetSession, list[int]]]
    ) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        rows = self.step(items, [])[0]
        return [(rows.host(i), rows.hidden[i]) for i in range(len(items))]

    @torch.inference_mode()
    def step(
        self,
        verify: list[tuple[TargetSession, list[int]]],
        prefill: list[tuple[TargetSession, int]],
        trees: list[list[int] | None] | None = None,
        gates: list[int] | None = None,
    ) -> tuple[StepRows, list[torch.Tensor | None]]:
        """One ragged forward over every session. ``verify`` sessions feed their pending tokens
        plus a draft → their target logits, [k+1, V] each (the draft positions and the bonus),
        left on the device in one tensor (``StepRows``), and captured states
        [1, len(pending) + k, H] per capture layer; ``trees[i]``, when not None, are the parents
        of verify[i]'s draft, a token tree (row j+1 of its logits follows draft node j;
        ``commit`` keeps the accepted path's K/V). ``prefill`` sessions feed the next n of their
        pending (prompt) tokens only and keep them (chunked prefill: no logits, no verdict) →
        their captured states fused across capture layers, [n, ΣH] (None without capture layers).
        ``gates``: every verification's verdict needs only the step's greedy reads, with its
        calibrated gate's top-k (0: none); an LM head split by vocabulary then reads them where
        the logits are (``tensor_parallel.greedy_reads``) instead of gathering them (``reads``)."""
        VERIFY_BATCH.observe(len(verify) + len(prefill))
        seqs = [st.pending + draft for st, draft in verify] + [st.pending[:n] for st, n in prefill]
        sessions = [st for st, _ in verify] + [st for st, _ in prefill]
        # Rows before a verification's (its pending prompt tokens but the newest) and a prefill
        # chunk's get the LM head too when the session wants its prompt's logprobs.
        extra = [self._prompt_rows(st, len(st.pending) - 1) for st, _ in verify] + [
            self._prompt_rows(st, n) for st, n in prefill
        ]
        tails = [len(draft) + 1 + e for (_, draft), e in zip(verify, extra)] + extra[len(verify) :]
        split = split_head(self.model) if gates is not None and not any(extra) else None
        logits, hidden = self.model.forward_joined(
            seqs,
            [st.cache_len for st in sessions],
            [st.cache for st in sessions],
            self.capture_layers,
            head=split.linear if split is not None else None,
            tails=tails,
            trees=trees and trees + [None] * len(prefill),
        )
        offsets = [0, *itertools.accumulate(tails)][:-1]
        for st, off, e in zip(sessions, offsets, extra):
            if e:
                self._prompt_logprobs(st, logits[off : off + e])
        v = len(verify)
        fused = [torch.cat(hs, dim=-1) if hs else None for hs in hidden[v:]]
        if prefill:
            for (st, n), states in zip(prefill, fused):
                st.cache_len += n
                self._keep(st, states)
            PREFILL_CHUNKS.inc(len(prefill))
        KV_CACHE_TOKENS.set(sum(st.cache_len for st in sessions))
        spans = [(off + e, len(draft) + 1) for off, e, (_, draft) in zip(offsets, extra, verify)]
        hidden_rows = [[h[None] for h in hs] for hs in hidden[:v]]
        if split is not None and gates is not None:
            gated = [
                (s + j, d[j], k) for (s, _), (_, d), k in zip(spans, verify, gates) if k > 0 for j in range(len(d))
            ]
            return StepRows(None, spans, hidden_rows, greedy_reads(logits, split, gated)), fused
        return StepRows(logits, spans, hidden_rows), fused

    @staticmethod
    def _prompt_rows(st: TargetSession, fed: int) -> int:
        """How many of the ``fed`` positions before a session's verification rows predict a
        prompt token: rows the LM head must run on for its prompt logprobs (else none)."""
        if st.prompt_top is None:
            return 0
        return max(0, min(fed, st.prompt_len - 1 - st.cache_len))

    @staticmethod
    def _prompt_logprobs(st: TargetSession, logits: torch.Tensor) -> None:
        """Logits of positions cache_len.. predict the prompt tokens after them."""
        nxt = st.tokens[st.cache_len + 1 : st.cache_len + 1 + len(logits)]
        assert st.prompt_top is not None  # called only for sessions that asked
        st.prompt_lps += token_logprobs(logits.float().cpu(), nxt, st.prompt_top)

    def commit(self, st: TargetSession, verdict: Verdict, states: torch.Tensor | None = None) -> None:
        """Keep the K/V of the pending tokens and the accepted draft prefix. ``states``: their
        captured states fused across capture layers ([kept, ΣH]), for the prefix cache. A tree
        draft's accepted path moves to the positions after the pending tokens."""
        if verdict.path is not None:
            keep_path(st.cache, st.cache_len + len(st.pending), verdict.path)
        st.cache_len += len(st.pending) + verdict.accepted
        st.tokens.extend(verdict.tokens)
        self._keep(st, states)

    def close(self, st: TargetSession) -> None:
        """The session is over (its K/V go with it; a sharded runner tells its other ranks)."""

    # -- prefix cache: full blocks of verified positions outlive their session -------------
    def attach(self, st: TargetSession) -> tuple[int, torch.Tensor | None]:
        """On a session's first step: copy the longest cached run of its prompt's blocks into
        its cache (leaving at least the newest token pending: its logits are the first
        verification's). → (positions taken, their fused features or None)."""
        if st.attached:
            return 0, None
        st.attached = True
        if self.prefix is None:  # a session that started without the cache stores nothing
            st.keys = None
            return 0, None
        if st.prompt_top is not None:  # its prompt's logprobs need every position's logits
            return 0, None
        keys, blocks = self.prefix.match(st.tokens, min(len(st.tokens) - 1, st.cache.capacity), st.root)
        PREFIX_CACHE.labels("queried").inc(len(st.tokens) - 1)
        if not blocks:
            return 0, None
        st.cache_len = st.cached = load_kv(st.cache, blocks)
        st.keys = keys
        PREFIX_CACHE.labels("hit").inc(st.cache_len)
        return st.cache_len, torch.cat([b[2] for b in blocks]) if self.capture_layers else None

    def clear_prefix(self) -> None:
        """Forget every cached prompt block (its gauge reads 0 at once)."""
        if self.prefix is not None:
            self.prefix.clear()
            PREFIX_CACHE_BYTES.set(0)

    def _keep(self, st: TargetSession, states: torch.Tensor | None) -> None:
        """Verified positions up to ``cache_len``: store each block they complete. ``states``
        holds the newly verified positions' fused captured states."""
        if self.prefix is None or st.keys is None:
            return
        if self.capture_layers:
            if states is None:  # no features for these positions: this session stores no more
                st.keys = None
                return
            st.feats.append(states)
        stored = len(st.keys)
        self.prefix.store(st.keys, st.tokens, st.cache_len, lambda b0: self._block(st, b0), st.root)
        if len(st.keys) > stored:
            PREFIX_CACHE_BYTES.set(self.prefix.bytes)

    def _block(self, st: TargetSession, b0: int) -> tuple[torch.Tensor, ...]:
        """The payload of the block at b0: K, V and (with capture layers) its features, the
        oldest staged ones."""
        assert self.prefix is not None  # called only with a prefix cache
        n = self.prefix.block
        kv = kv_block(st.cache, b0, n)
        if not self.capture_layers:
            return kv
        f = torch.cat(st.feats) if len(st.feats) > 1 else st.feats[0]
        st.feats = [f[n:]]
        return kv + (f[:n].clone(),)
