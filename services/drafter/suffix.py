"""SuffixDecoding drafter: a per-request tree over prompt + output, and a global tree over
past outputs; each cycle both speculate and the higher-scoring draft wins."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from services.common.config import SuffixConfig
from services.common.types import Draft, SamplingParams
from services.drafter.base import Drafter, register
from services.drafter.suffix_tree import Candidate, Match, Node, SuffixTree


class GlobalSuffixCache:
    """Suffix tree over the outputs of finished requests, FIFO-evicted by request count.

    Eviction rule: outputs live in a deque of ``max_cached_requests``; the tree is rebuilt
    from the deque once evicted outputs reach a quarter of the capacity, so it always covers
    the last N outputs and at most 25 % more. ``version`` changes on every insert so readers
    re-match their contexts. Writers serialize on a lock; readers never wait.
    """

    def __init__(self, max_depth: int = 64, max_cached_requests: int = 1000):
        self.max_depth = max_depth
        self.capacity = max_cached_requests
        self.outputs: deque[tuple[int, ...]] = deque()
        self.tree = SuffixTree(max_depth)
        self.version = 0
        self._evicted = 0
        self._held: list[tuple[int, ...]] | None = None
        self._lock = threading.Lock()

    def insert(self, output: list[int]) -> None:
        if not output:
            return
        with self._lock:
            if self._held is not None:
                self._held.append(tuple(output))
                return
            self.outputs.append(tuple(output))
            if len(self.outputs) > self.capacity:
                self.outputs.popleft()
                self._evicted += 1
            if self._evicted >= max(1, self.capacity // 4):
                tree = SuffixTree(self.max_depth)
                for out in self.outputs:
                    tree.extend([], list(out))
                self.tree, self._evicted = tree, 0
            else:
                self.tree.extend([], list(output))
            self.version += 1

    def __len__(self) -> int:
        return len(self.outputs)

    @contextmanager
    def deferred(self, keep: bool = True):
        """Hold inserts until the block ends, then insert each distinct output once (or none,
        ``keep=False``). A benchmark runs every method on one prompt inside such a block: no
        method drafts from another method's output of that prompt, and later prompts see the
        outputs as later requests would."""
        with self._lock:
            self._held = []
        try:
            yield
        finally:
            with self._lock:
                held, self._held = self._held, None
            for out in dict.fromkeys(held if keep else []):
                self.insert(list(out))

    def clear(self) -> None:
        with self._lock:
            self.outputs.clear()
            self.tree, self._evicted = SuffixTree(self.max_depth), 0
            self.version += 1


@dataclass
class _Req:
    seq: list[int]
    prompt_len: int
    actives: list[Node]
    gmatches: list[Match] = field(default_factory=list)
    gversion: int = -1
    gtree: SuffixTree | None = None
    drafted: list[int] = field(default_factory=list)


@register("suffix")
class SuffixDrafter(Drafter):
    """Drafts are deterministic (q one-hot), so verification is exact or rejection sampling."""

    name = "suffix"

    def __init__(
        self,
        cfg: SuffixConfig = SuffixConfig(),
        global_cache: GlobalSuffixCache | None = None,
        on_finish: Callable[[list[int]], None] | None = None,
    ):
        self.cfg = cfg
        self.on_finish = on_finish  # e.g. publish to the replicas' shared feed
        self.global_cache = (
            global_cache if global_cache is not None else GlobalSuffixCache(cfg.max_depth, cfg.max_cached_requests)
        )
        self.trees: dict[str, SuffixTree] = {}
        self.states: dict[str, _Req] = {}

    def start(
        self,
        req_id: str,
        prompt: list[int],
        sp: SamplingParams | None = None,
        rng: torch.Generator | None = None,
        max_new_tokens: int = 0,
    ) -> None:
        tree = SuffixTree(self.cfg.max_depth)
        seq: list[int] = []
        actives = tree.extend(seq, prompt)
        self.trees[req_id] = tree
        self.states[req_id] = _Req(seq=seq, prompt_len=len(prompt), actives=actives)

    def _global_matches(self, st: _Req) -> list[Match]:
        g = self.global_cache
        if st.gversion != g.version or st.gtree is not g.tree:
            st.gtree, st.gversion = g.tree, g.version
            st.gmatches = g.tree.match_context(st.seq)
        return st.gmatches

    def speculate(self, req_id: str, budget: int, tree: bool | None = None) -> tuple[Candidate, str]:
        """The better of the request's own tree's draft and the global tree's; a speculation
        tree with ``tree`` (default: the config's), else a path."""
        st = self.states[req_id]
        p, tree = self.cfg.spec, self.cfg.tree if tree is None else tree
        local = self.trees[req_id].speculate(st.actives, budget, p, tree)
        gm = self._global_matches(st)
        glob = st.gtree.speculate(gm, budget, p, tree) if gm else Candidate()
        return (glob, "global") if glob.score > local.score else (local, "local")

    def propose(self, req_id: str, budget: int, tree: bool | None = None) -> Draft:
        cand, which = self.speculate(req_id, budget, tree)
        st = self.states[req_id]
        st.drafted = cand.token_ids
        return Draft(
            token_ids=list(cand.token_ids),
            parents=list(cand.parents),
            score=cand.score,
            source=self.name,
            match_len=cand.match_len,
            token_probs=list(cand.probs),
            features={"tree": which, "prompt_len": st.prompt_len, "generated_len": len(st.seq) - st.prompt_len},
        )

    def verified(self, req_id: str, n: int) -> None:
        st = self.states[req_id]
        st.drafted = st.drafted[:n]

    def observe(self, req_id: str, tokens: list[int], target_states=None) -> None:
        st = self.states[req_id]
        tree = self.trees[req_id]
        gm = self._global_matches(st)
        for t in tokens:
            st.actives = tree.append(st.seq, st.actives, t)
            gm = st.gtree.advance(gm, t)
        st.gmatches = gm
        st.drafted = []

    def stop(self, req_id: str) -> list[int]:
        """Ends the request; its output enters the global tree. Returns that output."""
        st = self.states.pop(req_id, None)
        self.trees.pop(req_id, None)
        if st is None:
            return []
        output = st.seq[st.prompt_len :]
        self.global_cache.insert(output)
        if self.on_finish is not None:
            self.on_finish(output)
        return output
