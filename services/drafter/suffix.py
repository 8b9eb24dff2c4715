"""SuffixDecoding drafter: a per-request tree over prompt + output, and a global tree over
past outputs (and live ones); each cycle both speculate and the higher-scoring draft wins."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.config import SuffixConfig
from services.common.types import Draft, SamplingParams
from services.drafter.base import Drafter, register
from services.drafter.suffix_tree import Candidate, new_tree


class LiveOutput:
    """An output still being generated, held in the global tree so that every request (this
    one included) drafts from it with counts merged with the past outputs' (as ArcticInference
    does). ``tree``/``seq_id``: where it is, until the tree is rebuilt."""

    __slots__ = ("tokens", "tree", "seq_id")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.tree: Any = None
        self.seq_id = -1


class GlobalSuffixCache:
    """Suffix tree over the outputs of finished requests and of live ones, FIFO-evicted by
    request count.

    Eviction rule: finished outputs live in a deque of ``max_cached_requests``; the tree is
    rebuilt from the deque once evicted outputs reach a quarter of the capacity, so it always
    covers the last N outputs and at most 25 % more. A live output enters the tree as it grows
    (``grow``) and the deque when it closes; after a rebuild it is carried into the new tree at
    its next ``grow``. ``version`` changes when readers must re-match their contexts (a finished
    output added, a rebuild); a live output's growth needs none: a reader's matches advance with
    its own context through the grown tree (a suffix another live output creates meanwhile is
    found at the next re-match). Writers serialize on a lock; readers never wait.
    """

    def __init__(self, max_depth: int = 64, max_cached_requests: int = 1000, compiled: bool = True):
        self.max_depth = max_depth
        self.capacity = max_cached_requests
        self.compiled = compiled
        self.outputs: deque[tuple[int, ...]] = deque()
        self.tree = new_tree(max_depth, compiled)
        self.version = 0
        self._evicted = 0
        self._held: list[tuple[int, ...]] | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, cfg: SuffixConfig) -> GlobalSuffixCache:
        return cls(cfg.max_depth, cfg.max_cached_requests, cfg.compiled)

    def insert(self, output: list[int]) -> None:
        if not output:
            return
        with self._lock:
            if self._held is not None:
                self._held.append(tuple(output))
                return
            self._append(tuple(output), in_tree=False)

    def _append(self, output: tuple[int, ...], in_tree: bool) -> None:
        """A finished output joins the deque (and the tree unless it is there): under the lock."""
        self.outputs.append(output)
        if len(self.outputs) > self.capacity:
            self.outputs.popleft()
            self._evicted += 1
        if self._evicted >= max(1, self.capacity // 4):
            self._rebuild()
        elif not in_tree:
            self.tree.add(output)
            self.version += 1

    def _rebuild(self) -> None:
        """A new tree over the deque; live outputs follow at their next ``grow``."""
        tree = new_tree(self.max_depth, self.compiled)
        for out in self.outputs:
            tree.add(out)
        self.tree, self._evicted = tree, 0
        self.version += 1

    def grow(self, live: LiveOutput, tokens: list[int]) -> None:
        """Append a live output's new tokens to the tree."""
        with self._lock:
            if live.tree is not self.tree:  # new, or the tree was rebuilt: carry it over
                live.tree, live.seq_id = self.tree, self.tree.new_seq()
                self.tree.extend(live.seq_id, live.tokens)
            live.tokens.extend(tokens)
            self.tree.extend(live.seq_id, tokens)

    def close(self, live: LiveOutput) -> None:
        """The live output is finished: it joins the deque. Inside ``deferred`` it leaves the
        tree (a rebuild without it) and waits for the block's end like any insert."""
        if not live.tokens:
            return
        with self._lock:
            output, in_tree = tuple(live.tokens), live.tree is self.tree
            live.tree = None
            if self._held is not None:
                self._held.append(output)
                if in_tree:
                    self._rebuild()
                return
            self._append(output, in_tree)

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
            self.tree, self._evicted = new_tree(self.max_depth, self.compiled), 0
            self.version += 1


@dataclass
class _Req:
    tree: Any  # the request's own tree over prompt + output; its sequence is ``seq_id``
    seq_id: int
    seq: list[int]
    prompt_len: int
    gmatches: Any = ()  # the context's matches in the global tree ``gtree``, as of ``gversion``
    gversion: int = -1
    gtree: Any = None
    drafted: list[int] = field(default_factory=list)
    live: LiveOutput | None = None  # its output in the global tree as it grows (cfg.live_outputs)


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
        self.global_cache = global_cache if global_cache is not None else GlobalSuffixCache.of(cfg)
        p = cfg.spec
        self._limits = (p.max_spec_tokens, p.max_spec_factor, p.max_spec_offset, p.min_token_prob)
        self.states: dict[str, _Req] = {}

    def start(
        self,
        req_id: str,
        prompt: list[int],
        sp: SamplingParams | None = None,
        rng: torch.Generator | None = None,
        max_new_tokens: int = 0,
    ) -> None:
        tree = new_tree(self.cfg.max_depth, self.cfg.compiled)
        seq_id = tree.new_seq()
        tree.extend(seq_id, prompt)
        live = LiveOutput() if self.cfg.live_outputs else None
        self.states[req_id] = _Req(tree, seq_id, list(prompt), len(prompt), live=live)

    def _global_matches(self, st: _Req):
        g = self.global_cache
        if st.gversion != g.version or st.gtree is not g.tree:
            st.gtree, st.gversion = g.tree, g.version
            st.gmatches = g.tree.match(st.seq[-self.cfg.max_depth :])
        return st.gmatches

    def speculate(self, req_id: str, budget: int, tree: bool | None = None) -> tuple[Candidate, str]:
        """The better of the request's own tree's draft and the global tree's; a speculation
        tree with ``tree`` (default: the config's), else a path."""
        st = self.states[req_id]
        tree = self.cfg.tree if tree is None else tree
        local = st.tree.speculate(st.seq_id, budget, *self._limits, tree)
        gm = self._global_matches(st)
        if gm and (glob := st.gtree.speculate_matches(gm, budget, *self._limits, tree))[3] > local[3]:
            return Candidate.of(glob), "global"
        return Candidate.of(local), "local"

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
        st.drafted = []
        st.tree.extend(st.seq_id, tokens)
        if st.live is not None:  # first into the global tree, so the matches below can extend into it
            self.global_cache.grow(st.live, tokens)
        g = self.global_cache
        if st.gversion == g.version and st.gtree is g.tree:
            st.gtree.advance(st.gmatches, tokens)
        st.seq.extend(tokens)  # (stale matches are redone from it at the next draft)

    def stop(self, req_id: str) -> list[int]:
        """Ends the request; its output enters the global tree. Returns that output."""
        st = self.states.pop(req_id, None)
        if st is None:
            return []
        output = st.seq[st.prompt_len :]
        if st.live is not None:
            self.global_cache.close(st.live)
        else:
            self.global_cache.insert(output)
        if self.on_finish is not None:
            self.on_finish(output)
        return output
