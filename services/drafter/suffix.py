"""SuffixDecoding drafter: a per-request tree over prompt + output, and a global tree over
past outputs (and live ones); each cycle both speculate and the higher-scoring draft wins."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.config import SuffixConfig
from services.common.types import Draft, Sampling
from services.drafter.base import Drafter, register
from services.drafter.suffix_tree import Candidate, CompiledMatches, grow_live, new_tree, step_batch
from services.drafter.suffix_tree import Draft as SpecDraft


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

    With ``background`` (a serving router's cache, compiled), an eviction's rebuild runs on a
    thread of its own over the deque as it was, while the old tree serves; the outputs that
    finish meanwhile are added to the new tree before it replaces the old one. (A rebuild of
    the last 1,000 outputs takes tens of milliseconds: on the router's step path, every
    session would wait it out.)
    """

    def __init__(
        self, max_depth: int = 64, max_cached_requests: int = 1000, compiled: bool = True, background: bool = False
    ):
        self.max_depth = max_depth
        self.capacity = max_cached_requests
        self.compiled = compiled
        self.background = background and compiled
        self.outputs: deque[tuple[int, ...]] = deque()
        self.tree = new_tree(max_depth, compiled)
        self.version = 0
        self._evicted = 0
        self._held: list[tuple[int, ...]] | None = None
        self._building: list[tuple[int, ...]] | None = None  # finished while a rebuild builds
        self._epoch = 0  # a background rebuild's tree is kept only if no rebuild or clear came first
        self.lock = threading.Lock()  # writers' (and a batched step's: SuffixDrafter._step_batch)

    @classmethod
    def of(cls, cfg: SuffixConfig, background: bool = False) -> GlobalSuffixCache:
        return cls(cfg.max_depth, cfg.max_cached_requests, cfg.compiled, background)

    def insert(self, output: list[int]) -> None:
        if not output:
            return
        with self.lock:
            if self._held is not None:
                self._held.append(tuple(output))
                return
            self._append(tuple(output), in_tree=False)

    def _append(self, output: tuple[int, ...], in_tree: bool) -> None:
        """A finished output joins the deque (and the tree unless it is there): under the lock."""
        self.outputs.append(output)
        if self._building is not None:
            self._building.append(output)
        if len(self.outputs) > self.capacity:
            self.outputs.popleft()
            self._evicted += 1
        if self._evicted >= max(1, self.capacity // 4) and self._building is None:
            if not self.background:
                self._rebuild()
                return
            self._rebuild_later()
        if not in_tree:
            self.tree.add(output)
            self.version += 1

    def _rebuild(self) -> None:
        """A new tree over the deque; live outputs follow at their next ``grow``."""
        self._replace(self._tree_of(self.outputs))

    def _tree_of(self, outputs):
        """A new tree holding ``outputs``. (The compiled tree takes a long output without the GIL.)"""
        tree = new_tree(self.max_depth, self.compiled)
        for out in outputs:
            tree.add(out)
        return tree

    def _replace(self, tree, evicted: int = 0) -> None:
        """``tree`` serves from now on; it holds ``evicted`` outputs the deque no longer does."""
        self.tree, self._evicted, self._building = tree, evicted, None
        self._epoch += 1
        self.version += 1

    def _rebuild_later(self) -> None:
        """``_rebuild`` on a thread of its own (under the lock: it starts it)."""
        outputs, self._building, self._evicted = list(self.outputs), [], 0
        # not a daemon: an exit waits for it rather than ending it inside the compiled tree
        threading.Thread(target=self._build, args=(outputs, self._epoch), name="suffix-rebuild").start()

    def _build(self, outputs: list[tuple[int, ...]], epoch: int) -> None:
        tree = self._tree_of(outputs)
        with self.lock:
            if self._epoch != epoch:  # rebuilt or cleared meanwhile: that tree stands
                return
            for out in self._building or ():
                tree.add(out)
            self._replace(tree, self._evicted)  # (those evicted while it built are in it)

    def grow(self, live: LiveOutput, tokens: list[int]) -> None:
        """Append a live output's new tokens to the tree."""
        with self.lock:
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
        with self.lock:
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
        with self.lock:
            self._held = []
        try:
            yield
        finally:
            with self.lock:
                held, self._held = self._held, None
            for out in dict.fromkeys(held if keep else []):
                self.insert(list(out))

    def clear(self) -> None:
        with self.lock:
            self.outputs.clear()
            self._replace(new_tree(self.max_depth, self.compiled))


MAX_SCOPES = 64  # tenants' suffix caches kept (the least recently used beyond are dropped)


@dataclass
class _Req:
    tree: Any  # the request's own tree over prompt + output; its sequence is ``seq_id``
    seq_id: int
    seq: list[int]
    prompt_len: int
    cache: GlobalSuffixCache  # its scope's global cache (the shared one unless it has a scope)
    scope: str | None = None
    gmatches: Any = ()  # the context's matches in the global tree ``gtree``, as of ``gversion``
    gversion: int = -1
    gtree: Any = None
    drafted: list[int] = field(default_factory=list)
    live: LiveOutput | None = None  # its output in the global tree as it grows (cfg.live_outputs)
    pending: list[int] = field(default_factory=list)  # observed, not yet in the trees (``_absorb``)


def _live_entry(st: _Req, tree, tokens: list[int]) -> tuple[int, list[int]]:
    """``step_batch``'s (``grow_live``'s) entry for a request's live output in ``tree``, about to
    take ``tokens``: its sequence there, or -1 with the tokens it had when it enters a tree it
    is new to (new, or the tree was rebuilt: it enters as it grows, so only with tokens to
    add), or -2 when there is none to grow."""
    live = st.live
    if live is None:
        return -2, []
    if live.tree is tree:
        return live.seq_id, []
    return (-1, live.tokens) if tokens else (-2, [])


def _grew(st: _Req, tree, seq_id: int, tokens: list[int]) -> None:
    """A live output took ``tokens`` in ``tree`` as sequence ``seq_id`` (-2: it has none)."""
    if st.live is not None and seq_id >= 0:
        st.live.tree, st.live.seq_id = tree, seq_id
        st.live.tokens.extend(tokens)


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
        self._pending: dict[str, _Req] = {}  # requests with observed tokens not yet in the trees
        self.scoped: OrderedDict[str, GlobalSuffixCache] = OrderedDict()  # per tenant, recent first out
        self._scopes_lock = threading.Lock()
        # a step's drafting in one compiled call (``_step_batch``) where every tree is compiled
        self.batched = cfg.compiled and self.global_cache.compiled and step_batch is not None
        # lagged global writes (cfg.lag_live): per global cache, its sessions' tokens not yet
        # in it as (request, tokens, its step_batch mode, its context when re-matched)
        self._lagged: list[tuple[GlobalSuffixCache, list[tuple[_Req, list[int], int, list[int]]]]] = []
        self._lag_lock = threading.Lock()  # taken before a global cache's lock

    def start(
        self,
        req_id: str,
        prompt: list[int],
        sp: Sampling | None = None,
        rng: torch.Generator | None = None,
        max_new_tokens: int = 0,
        *,
        scope: str | None = None,
    ) -> None:
        """A request of ``scope`` (a tenant's cache salt) drafts from its scope's outputs only,
        and its output joins only those (and is not published to the replicas' feed)."""
        tree = new_tree(self.cfg.max_depth, self.cfg.compiled)
        seq_id = tree.new_seq()
        tree.extend(seq_id, prompt)
        live = LiveOutput() if self.cfg.live_outputs else None
        self.states[req_id] = _Req(
            tree, seq_id, list(prompt), len(prompt), self._cache_of(scope), scope or None, live=live
        )

    def _cache_of(self, scope: str | None) -> GlobalSuffixCache:
        """The global cache of ``scope``: the shared one for None; a scope's own, made on first
        use, the least recently used of more than MAX_SCOPES dropped (its live requests keep it)."""
        if not scope:  # (an empty salt is none)
            return self.global_cache
        with self._scopes_lock:
            cache = self.scoped.get(scope)
            if cache is None:
                cache = self.scoped[scope] = GlobalSuffixCache.of(self.cfg)
                while len(self.scoped) > MAX_SCOPES:
                    self.scoped.popitem(last=False)
            self.scoped.move_to_end(scope)
            return cache

    def _global_matches(self, st: _Req):
        g = st.cache
        if st.gversion != g.version or st.gtree is not g.tree:
            st.gtree, st.gversion = g.tree, g.version
            st.gmatches = g.tree.match(st.seq[-self.cfg.max_depth :])
        return st.gmatches

    def speculate(self, req_id: str, budget: int, tree: bool | None = None) -> tuple[Candidate, str]:
        """The better of the request's own tree's draft and the global tree's; a speculation
        tree with ``tree`` (default: the config's), else a path."""
        st = self.states[req_id]
        self._absorb_pending()
        tree = self.cfg.tree if tree is None else tree
        local = st.tree.speculate(st.seq_id, budget, *self._limits, tree)
        gm = self._global_matches(st)
        if gm and (glob := st.gtree.speculate_matches(gm, budget, *self._limits, tree))[3] > local[3]:
            return Candidate.of(glob), "global"
        return Candidate.of(local), "local"

    def propose(self, req_id: str, budget: int, tree: bool | None = None) -> Draft:
        cand, which = self.speculate(req_id, budget, tree)
        return self._draft(req_id, cand.as_tuple(), which)

    def propose_batch(self, asks: list[tuple[str, int]]) -> list[Draft]:
        """One step's drafts; the tokens every request observed since its last step enter the
        trees first, request by request (``_absorb``). With compiled trees, all of it is one
        call (``_step_batch``)."""
        if self.batched:
            drafted = self._step_batch(asks)
        else:
            self._absorb_pending()
            drafted = [(cand.as_tuple(), which) for cand, which in (self.speculate(r, b) for r, b in asks)]
        return [self._draft(req_id, spec, which) for (req_id, _), (spec, which) in zip(asks, drafted)]

    def _step_batch(self, asks: list[tuple[str, int]]) -> list[tuple[SpecDraft, str]]:
        """``propose_batch`` in one compiled call per global cache (a scope's, the shared one)
        without the GIL (``step_batch``: what the per-request calls would do, in their order)."""
        budgets = dict(asks)
        reqs = {**self._pending, **{r: self.states[r] for r, _ in asks}}
        self._pending = {}
        groups: dict[int, dict[str, _Req]] = {}
        for req_id, st in reqs.items():
            groups.setdefault(id(st.cache), {})[req_id] = st
        drafted: dict[str, tuple] = {}
        for group in groups.values():
            drafted.update(self._step_cache(next(iter(group.values())).cache, group, budgets))
        return [(drafted[r][0], "global" if drafted[r][1] else "local") for r, _ in asks]

    def _step_cache(self, g: GlobalSuffixCache, reqs: dict[str, _Req], budgets: dict[str, int]) -> dict[str, tuple]:
        """One ``step_batch`` over requests of one global cache; its writers wait meanwhile, so
        its tree and version stay put. Lagged (``cfg.lag_live`` with live outputs), the global
        tree's writes wait for ``after_step``: the step's drafts go out first."""
        states = list(reqs.values())
        lag = self.cfg.lag_live and self.cfg.live_outputs
        with self._lag_lock:
            self._catch_up()
            with g.lock:
                gt, live, carries, modes, contexts = g.tree, [], [], [], []
                for req_id, st in reqs.items():
                    current = st.gversion == g.version and st.gtree is gt
                    if not current and budgets.get(req_id, 0) > 0:
                        st.gmatches, st.gtree, st.gversion = CompiledMatches(), gt, g.version
                        modes.append(2)  # re-match (the context holds the new tokens)
                        contexts.append(st.seq[-self.cfg.max_depth :])
                    else:
                        modes.append(1 if current else 0)  # advance with the new tokens, or leave stale
                        contexts.append([])
                    seq_id, carry = (-2, []) if lag else _live_entry(st, gt, st.pending)
                    live.append(seq_id)
                    carries.append(carry)
                drafts, seq_ids = step_batch(
                    gt,
                    [st.tree for st in states],
                    [st.seq_id for st in states],
                    [st.pending for st in states],
                    live,
                    carries,
                    [self._matches(st) for st in states],
                    modes,
                    contexts,
                    [budgets.get(r, 0) for r in reqs],
                    *self._limits,
                    self.cfg.tree,
                    lag,
                )
                if lag:
                    self._lagged.append((g, list(zip(states, [st.pending for st in states], modes, contexts))))
                else:
                    for st, seq_id in zip(states, seq_ids):
                        _grew(st, gt, seq_id, st.pending)
                for st in states:
                    st.pending = []
        return dict(zip(reqs, drafts))

    @staticmethod
    def _matches(st: _Req):
        if not isinstance(st.gmatches, CompiledMatches):
            st.gmatches = CompiledMatches()
        return st.gmatches

    def after_step(self) -> None:
        """The lagged global writes of the steps drafted so far (``_catch_up``); the router runs
        it once the step is sent, while the verifier works."""
        with self._lag_lock:  # (also when none is left: another thread may be writing them)
            self._catch_up()

    def _catch_up(self) -> None:
        """Lagged global writes, in the order they were drafted (``_lag_lock`` held), as the
        unlagged step would have made them: each live output takes its tokens (entering a
        rebuilt tree whole), and where the tree is still the one drafted from, matches advance
        over them or (re-matched for the draft) re-match."""
        lagged, self._lagged = self._lagged, []
        for g, entries in lagged:
            with g.lock:
                gt, live, carries = g.tree, [], []
                for st, tokens, _, _ in entries:
                    seq_id, carry = _live_entry(st, gt, tokens)
                    live.append(seq_id)
                    carries.append(carry)
                seq_ids = grow_live(
                    gt,
                    live,
                    carries,
                    [tokens for _, tokens, _, _ in entries],
                    [self._matches(st) for st, _, _, _ in entries],
                    [mode if st.gversion == g.version and st.gtree is gt else 0 for st, _, mode, _ in entries],
                    [context for _, _, _, context in entries],
                )
                for (st, tokens, _, _), seq_id in zip(entries, seq_ids):
                    _grew(st, gt, seq_id, tokens)

    def _draft(self, req_id: str, spec: SpecDraft, which: str) -> Draft:
        """A tree's speculation (its lists are the call's own: the Draft takes them) as a Draft."""
        ids, probs, parents, score, match_len = spec
        st = self.states[req_id]
        st.drafted = ids
        return Draft(
            token_ids=list(ids),
            parents=parents,
            score=score,
            source=self.name,
            match_len=match_len,
            token_probs=probs,
            features={"tree": which, "prompt_len": st.prompt_len, "generated_len": len(st.seq) - st.prompt_len},
        )

    def verified(self, req_id: str, n: int) -> None:
        st = self.states[req_id]
        st.drafted = st.drafted[:n]

    def observe(self, req_id: str, tokens: list[int], target_states=None) -> None:
        """The tokens join the request's context now, and its trees (its own, its live output in
        the global one) at the next step (``propose_batch``) or its next draft: a live output's
        tokens are in the global tree from the step after they were committed."""
        st = self.states[req_id]
        st.drafted = []
        st.seq.extend(tokens)  # (stale matches are redone from it at the next draft)
        st.pending.extend(tokens)
        self._pending[req_id] = st

    def _absorb_pending(self) -> None:
        """Every request's observed tokens into the trees, in the order they were observed."""
        self.after_step()
        pending, self._pending = self._pending, {}
        for st in pending.values():
            self._absorb(st)

    def _absorb(self, st: _Req) -> None:
        """The request's observed tokens into its own tree, its live output and its matches."""
        tokens, st.pending = st.pending, []
        if not tokens:
            return
        st.tree.extend(st.seq_id, tokens)
        if st.live is not None:  # first into the global tree, so the matches below can extend into it
            st.cache.grow(st.live, tokens)
        g = st.cache
        if st.gversion == g.version and st.gtree is g.tree:
            st.gtree.advance(st.gmatches, tokens)

    def stop(self, req_id: str) -> list[int]:
        """Ends the request; its output enters its scope's global tree. Returns that output."""
        self.after_step()  # its lagged tokens first
        st = self.states.pop(req_id, None)
        if st is None:
            return []
        self._pending.pop(req_id, None)
        self._absorb(st)
        output = st.seq[st.prompt_len :]
        if st.live is not None:
            st.cache.close(st.live)
        else:
            st.cache.insert(output)
        if self.on_finish is not None and st.scope is None:  # a tenant's output stays in its scope
            self.on_finish(output)
        return output
