"""EAGLE-3 drafter: chain drafts from the head, fed by the target's own verification pass.

Per request: ``feats`` holds fused target features f_i (3·H_t) for every position the
target has verified (its KV-cache prefix); they arrive with ``observe(..., target_states)``
— no extra target pass. ``propose`` first runs the head over positions it has not yet seen
with real features (overwriting its own earlier chain entries there: that is its rollback),
then chains k−1 steps on its own hidden state. Position i pairs f_i with token i+1.

With ``prefix`` (a ``PrefixCache`` of its own), a request's first catch-up starts after the
longest cached run of the head's blocks. Head position i depends on the tokens up to i + 1,
so its blocks are keyed by the tokens one position on (the first token is the chain's root).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.llama import KVCache
from services.common.prefix_cache import ROOT, PrefixCache, kv_block, kv_bytes_per_position, load_kv, root_key
from services.common.sampling import apply_bias, apply_penalties, ban_columns, banned_tokens, probs_from_logits, sample
from services.common.structured import GrammarCursor
from services.common.types import Draft, Sampling
from services.drafter.base import ModelDrafter, draw_on_device, kept, read_chains, register
from services.drafter.eagle3 import Eagle3Head


@dataclass(frozen=True)
class TreeShape:
    """EAGLE draft trees (SGLang's speculative_eagle_topk / num_steps): ``topk`` children per
    expanded node and nodes expanded per depth, ``steps`` depths; the verifier's budget caps
    the nodes kept."""

    topk: int = 2
    steps: int = 4
    min_score: float = 0.0  # nodes scoring below it are neither expanded nor kept (the best child always is)


@dataclass
class _State:
    tokens: list[int]
    cache: KVCache
    sp: Sampling
    rng: torch.Generator | None
    feats: list[torch.Tensor] = field(default_factory=list)  # unprocessed [n, 3·H_t] chunks
    n_feats: int = 0  # target positions with features (processed or not)
    real_len: int = 0  # head cache positions computed from real features
    last_feat: torch.Tensor | None = None
    keys: list[bytes] | None = None  # prefix-cache keys of the head blocks stored (None: not looked up yet)
    root: bytes = ROOT  # the head blocks' chain root: the cache salt and the first token
    prompt_len: int = 0  # tokens after it are output (the penalties count them)
    grammar: GrammarCursor | None = None  # structured output: drafts stay inside the grammar
    trees: bool = False  # its drafts may be token trees (the session walks them)
    device_rng: torch.Generator | None = None  # draws of device drafts (``base.device_generator``)


@dataclass
class _Row:
    st: _State
    budget: int
    drafted: list[int] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    h: torch.Tensor | None = None  # the head's last prenorm output, input of the next step
    confident: bool = True
    state: int | None = None  # the grammar's state after the output and ``drafted``

    def take(self, pick: tuple[int, torch.Tensor | None, float] | None, h: torch.Tensor, min_confidence: float) -> None:
        if pick is None:  # the grammar allows none of the head's tokens: the chain ends
            self.budget = len(self.drafted)
            return
        tok, q, p_max = pick
        self.drafted.append(tok)
        if q is not None:
            self.qs.append(q)
        self.h = h
        self.confident = p_max >= min_confidence
        if self.st.grammar is not None:
            self.state = self.st.grammar.automaton.next(self.state, tok)

    def last_output(self) -> torch.Tensor:
        assert self.h is not None, "a row still drafting has taken a step"
        return self.h

    @property
    def unconstrained(self) -> bool:
        """No penalties, bias, bad words or grammar: its logits need no host step (the target's
        own transforms of ``sp``, temperature to top-p, run on the device)."""
        sp = self.st.sp
        return not (sp.penalized or sp.biased or sp.bad_words or self.st.grammar is not None)

    @property
    def drafting(self) -> bool:
        return (
            self.confident and len(self.drafted) < self.budget and (self.st.grammar is None or self.state is not None)
        )


@dataclass
class _Tree:
    """One request's draft tree as it grows (``Eagle3Drafter._grow``): node j is token
    toks[j] under parent parents[j] (-1: the root), scoring scores[j]; feeds[j] is the head's
    prenorm output that proposed it, its expansion's input. Expanded nodes take cache slots
    after the request's real positions, in order; the next catch-up overwrites them."""

    st: _State
    budget: int
    shape: TreeShape
    toks: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    feeds: list[torch.Tensor] = field(default_factory=list)
    slot_of: dict[int, int] = field(default_factory=dict)
    frontier: list[int] = field(default_factory=list)

    def add(self, parent: int, probs: list[float], tokens: list[int], h: torch.Tensor) -> None:
        score = self.scores[parent] if parent >= 0 else 1.0
        for p, tok in zip(probs, tokens):
            self.frontier.append(len(self.toks))
            self.toks.append(tok)
            self.parents.append(parent)
            self.scores.append(score * p)
            self.feeds.append(h)

    def to_expand(self, depth: int) -> list[int]:
        """The newest nodes worth a step at ``depth`` (the ``topk`` best); none once the best
        scores below the floor, the budget's depth is reached, or the cache is full."""
        grow = sorted(self.frontier, key=lambda j: (-self.scores[j], j))[: self.shape.topk]
        self.frontier = []
        base = self.st.n_feats + len(self.slot_of)
        if (
            not grow
            or depth >= self.budget
            or self.scores[grow[0]] < self.shape.min_score
            or base + len(grow) > self.st.cache.capacity
        ):
            return []
        self.slot_of.update(zip(grow, range(base, base + len(grow))))
        return grow

    def expansion(self, grow: list[int]) -> tuple[list[int], torch.Tensor]:
        """The slots of ``grow`` and the mask [len(grow), S] each attends by: the real
        prefix, its ancestors' slots and its own."""
        slots = [self.slot_of[j] for j in grow]
        mask = torch.zeros(len(grow), slots[-1] + 1, dtype=torch.bool)
        mask[:, : self.st.n_feats] = True
        for r, j in enumerate(grow):
            while j >= 0:
                mask[r, self.slot_of[j]] = True
                j = self.parents[j]
        return slots, mask

    def draft(self, source: str) -> Draft:
        """The ``budget`` best-scoring nodes, those below the floor left out (the best one
        kept). A node scores no more than its parent, so they form a tree (ties go to the
        parent, the lower index)."""
        ranked = sorted(range(len(self.toks)), key=lambda j: (-self.scores[j], j))[: self.budget]
        keep = sorted(j for n, j in enumerate(ranked) if n == 0 or self.scores[j] >= self.shape.min_score)
        index = {j: n for n, j in enumerate(keep)}
        return Draft(
            token_ids=[self.toks[j] for j in keep],
            parents=[index.get(self.parents[j], -1) for j in keep],
            token_probs=[self.scores[j] for j in keep],
            source=source,
        )


@dataclass
class _Expansion:
    """One depth's expansion of a device tree: the nodes expanded (device indices), their cache
    slots and their attention rows [m, S] (the real prefix, their ancestors' slots, their own)."""

    nodes: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass
class _DeviceTree:
    """``_Tree`` on the device (``Eagle3Drafter._grow_on_device``): per node its score
    (float64), target token, parent (-1: the root), the prenorm output it is fed, and the
    slots of its expanded ancestors it may attend to [n, W]; ``fresh``: the nodes added last
    (the frontier), ``expanded``: the nodes given cache slots so far. Only counts live on the
    host: nothing here reads the device."""

    scores: torch.Tensor
    toks: torch.Tensor
    parents: torch.Tensor
    feeds: torch.Tensor
    ancestors: torch.Tensor
    topk: int  # children per expanded node, nodes expanded per depth
    fresh: int
    expanded: int = 0

    @classmethod
    def root(cls, top: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor, width: int) -> "_DeviceTree":
        """The root's children: ``top`` (probabilities [1, k], target ids [1, k]) from its logits,
        ``out`` its prenorm output [1, H]; attention rows up to ``width``."""
        probs, ids = top
        k, dev = probs.shape[1], probs.device
        return cls(
            probs[0],
            ids[0],
            torch.full((k,), -1, dtype=torch.long, device=dev),
            out.repeat_interleave(k, 0),
            torch.zeros(k, width, dtype=torch.bool, device=dev),
            k,
            k,
        )

    def to_expand(self, st: _State, depth: int, budget: int) -> _Expansion | None:
        """``_Tree.to_expand`` on the device: the frontier's ``topk`` best (a stable sort: ties to
        the older node); None once the budget's depth is reached or the cache is full, for good."""
        n, g = len(self.scores), min(self.topk, self.fresh)
        base = st.n_feats + self.expanded
        if not g or depth >= budget or base + g > st.cache.capacity:
            self.fresh = 0
            return None
        nodes = torch.sort(self.scores[n - self.fresh :], descending=True, stable=True).indices[:g] + (n - self.fresh)
        self.expanded += g
        slots = torch.arange(base, base + g, device=nodes.device)
        mask = self.ancestors[nodes, : base + g]  # a copy: indexed by a tensor
        mask[:, : st.n_feats] = True
        mask[torch.arange(g, device=nodes.device), slots] = True
        return _Expansion(nodes, slots, mask)

    def add(self, grown: _Expansion, top: tuple[torch.Tensor, torch.Tensor], outs: torch.Tensor) -> None:
        """The ``topk`` children of each expanded node: a child scores its parent's score times its
        probability (float64, as the host's), is fed its parent's output, and may attend to
        what its parent attends to."""
        probs, ids = top
        k = probs.shape[1]
        ancestors = torch.zeros(len(grown.nodes), self.ancestors.shape[1], dtype=torch.bool, device=probs.device)
        ancestors[:, : grown.mask.shape[1]] = grown.mask
        self.scores = torch.cat([self.scores, (self.scores[grown.nodes][:, None] * probs).reshape(-1)])
        self.toks = torch.cat([self.toks, ids.reshape(-1)])
        self.parents = torch.cat([self.parents, grown.nodes.repeat_interleave(k)])
        self.feeds = torch.cat([self.feeds, outs.repeat_interleave(k, 0)])
        self.ancestors = torch.cat([self.ancestors, ancestors.repeat_interleave(k, 0)])
        self.fresh = len(grown.nodes) * k


@register("eagle3")
class Eagle3Drafter(ModelDrafter):
    """Chains of at most ``budget`` tokens; like the draft LM's, a chain ends after a token
    whose head probability (max q) is below ``min_confidence``. With ``tree``, a request
    started with ``trees=True`` gets token trees instead (``_grow``). With ``device_drafts``,
    a batch of unconstrained chains (greedy, or sampled with q drawn on the device) keeps its
    tokens on the device and is read once per draft (``_device_chains``), not once per position, and trees are grown on the device
    and read once (``_grow_on_device``), not once per level."""

    name = "eagle3"
    needs_target_states = True

    def __init__(
        self,
        head: Eagle3Head,
        min_confidence: float = 0.0,
        prefix: PrefixCache | None = None,
        tree: TreeShape | None = None,
        name: str = "eagle3",
        device_drafts: bool = False,
    ):
        self.head = head
        self.min_confidence = min_confidence
        self.device_drafts = device_drafts
        self.prefix = prefix
        self.tree = tree
        self.name = name
        self.states: dict[str, _State] = {}
        self._columns: torch.Tensor | None = None  # target ids of the draft vocabulary (penalties)

    def start(
        self,
        req_id: str,
        prompt: list[int],
        sp: Sampling,
        rng: torch.Generator | None,
        max_new_tokens: int = 0,
        cache_root: bytes = ROOT,
        grammar: GrammarCursor | None = None,
        trees: bool = False,
        *,
        scope: str | None = None,
    ) -> None:
        """``trees``: the session walks token trees (lossless policy, no per-row reshaping of logits)."""
        self.states[req_id] = _State(
            list(prompt),
            self.head.new_cache(self.head.s.max_positions),
            sp,
            rng,
            root=root_key("eagle3", cache_root, prompt[0]),
            prompt_len=len(prompt),
            grammar=grammar,
            trees=trees and self.tree is not None,
        )

    def verified(self, req_id: str, n: int) -> None:
        """Its drafts follow the request's grammar and bad words already, so none is cut."""

    def observe(self, req_id: str, tokens: list[int], target_states: torch.Tensor | None = None) -> None:
        st = self.states[req_id]
        st.tokens.extend(tokens)
        if target_states is not None and len(target_states):
            st.feats.append(target_states)
            st.n_feats += len(target_states)

    def _pick(
        self, st: _State, logits: torch.Tensor, drafted: list[int], state: int | None = None
    ) -> tuple[int, torch.Tensor | None, float] | None:
        """Draft-vocabulary logits → (target token, q over the target vocabulary for sampled
        requests, max q; 1.0 when no confidence cut is set). Drafts follow the request's
        penalties, as the target will, counting the chain's tokens so far as output, its logit
        bias, its bad words and its grammar (at ``state``): None when they allow none of the
        head's tokens."""
        if st.sp.penalized:
            logits = apply_penalties(
                logits[None], st.tokens + drafted, st.prompt_len, [], st.sp, self._target_columns(logits.device)
            )[0]
        if st.sp.biased:
            logits = apply_bias(logits, st.sp, self._target_columns(logits.device))
        if st.sp.bad_words:
            logits = ban_columns(
                logits,
                banned_tokens(st.tokens[st.prompt_len :] + drafted, st.sp.bad_words),
                self._target_columns(logits.device),
            )
        # Only an allow-list can leave no token (bias is finite; bad words ban a few): checked
        # only then, as the check waits for the device.
        if st.sp.allowed_token_ids and not bool(torch.isfinite(logits).any()):
            return None  # none of the allowed tokens is left in the draft vocabulary
        if st.grammar is not None:
            assert state is not None, "a grammar's row has its state"
            masked = st.grammar.automaton.mask_columns(logits, state, self._target_columns(logits.device))
            if masked is None:
                return None
            logits = masked
        if st.sp.greedy:  # on the draft vocabulary: its max q is the head's own confidence
            tok = self.head.greedy(logits)
            if self.min_confidence <= 0:
                return tok, None, 1.0
            return tok, None, float(torch.softmax(logits.float(), -1).max())
        q = probs_from_logits(self.head.target_logits(logits), st.sp).cpu()
        return sample(q, st.rng), q, float(q.max())

    def _target_columns(self, device) -> torch.Tensor:
        """The target ids of the draft vocabulary's columns."""
        if self._columns is None:
            self._columns = self.head.to_target_ids(torch.arange(self.head.draft_vocab, device=device))
        return self._columns

    def kv_bytes_per_position(self) -> int:
        return kv_bytes_per_position(self.head.new_cache(1))

    def propose(self, req_id: str, budget: int) -> Draft:
        return self.propose_batch([(req_id, budget)])[0]

    @torch.inference_mode()
    def absorb(self, req_id: str, upto: int) -> None:
        """Run the head over the positions observed since it last ran (their K/V into its
        cache) without drafting; they are those before ``upto``, whose features the target
        has given. A chunked prefill calls it per chunk, so the first draft does not catch up
        over a whole prompt inside one step."""
        st = self.states[req_id]
        if st.feats:
            h, tokens, start = self._catch_up(st)
            self.head.step_ragged([h], [tokens], [start], [st.cache])
            self._keep(st)

    def _attach(self, st: _State) -> None:
        """Before the first catch-up: take the cached head blocks of the positions whose
        features have come (all but the newest, which the catch-up runs)."""
        st.keys = []
        if self.prefix is None or st.real_len or not st.feats:
            return
        keys, blocks = self.prefix.match(st.tokens[1:], st.n_feats - 1, st.root)
        if blocks:
            m = load_kv(st.cache, blocks)
            f = torch.cat(st.feats)
            st.feats, st.real_len, st.keys = [f[m:]], m, keys

    def _keep(self, st: _State) -> None:
        """Store the head blocks computed from real features (positions before ``real_len``)."""
        prefix = self.prefix
        if prefix is None or st.keys is None or (len(st.keys) + 1) * prefix.block > st.real_len:
            return  # no block completed (the usual cycle): no copy of the tokens
        prefix.store(st.keys, st.tokens[1:], st.real_len, lambda b0: kv_block(st.cache, b0, prefix.block), st.root)

    def _catch_up(self, st: _State) -> tuple[torch.Tensor, list[int], int]:
        """Head inputs for the positions not yet run on real features: fc(f), tokens, start."""
        head = self.head
        if st.keys is None:
            self._attach(st)
        if st.feats:  # positions real_len .. n_feats-1
            st.last_feat = st.feats[-1][-1:]
            f, start = torch.cat(st.feats), st.real_len
            st.feats = []
        else:  # nothing verified since the last draft: recompute the last real position
            assert st.last_feat is not None, "a drafted session has run the head on a real feature"
            f, start = st.last_feat, st.n_feats - 1
        st.real_len = st.n_feats
        h = head.fc(f.to(head.fc.weight.device, head.fc.weight.dtype))
        return h, st.tokens[start + 1 : st.n_feats + 1], start

    @torch.inference_mode()
    def propose_batch(self, asks: list[tuple[str, int]]) -> list[Draft]:
        """Chain drafts for several requests: a ragged catch-up step on real features, then
        k−1 ragged steps on the head's own hidden states."""
        rows = []
        for req_id, budget in asks:
            st = self.states[req_id]
            budget = min(budget, st.cache.capacity - st.n_feats)
            rows.append(
                _Row(st, budget, state=st.grammar.state if st.grammar else None)
                if st.n_feats > 0 and budget > 0
                else None
            )
        active = [r for r in rows if r is not None]
        if active:
            inputs = [self._catch_up(r.st) for r in active]
            logits, outs = self.head.step_ragged(
                [i[0] for i in inputs], [i[1] for i in inputs], [i[2] for i in inputs], [r.st.cache for r in active]
            )
            for r in active:
                self._keep(r.st)
            grown = [(r, lg[-1], out[-1:]) for r, lg, out in zip(active, logits, outs) if r.st.trees]
            grow = self._grow_on_device if self.device_drafts else self._grow
            trees = dict(
                zip(
                    (id(r) for r, _, _ in grown),
                    grow([(r.st, lg, out, r.budget) for r, lg, out in grown]) if grown else [],
                )
            )
            logits, outs = (
                [lg for r, lg in zip(active, logits) if not r.st.trees],
                [out for r, out in zip(active, outs) if not r.st.trees],
            )
            active = [r for r in active if not r.st.trees]
            if self.device_drafts and active and all(r.unconstrained for r in active):
                self._device_chains(active, logits, outs)
                active = []
        while active:
            for r, lg, out in zip(active, logits, outs):
                r.take(self._pick(r.st, lg[-1], r.drafted, r.state), out[-1:], self.min_confidence)
            active = [r for r in active if r.drafting]
            if active:
                logits, outs = self.head.step_ragged(
                    [r.last_output() for r in active],
                    [[r.drafted[-1]] for r in active],
                    [r.st.n_feats + len(r.drafted) - 1 for r in active],
                    [r.st.cache for r in active],
                )
        return [
            Draft.empty()
            if r is None
            else trees[id(r)]
            if r.st.trees
            else Draft(token_ids=r.drafted, probs=torch.stack(r.qs) if r.qs else None, source=self.name)
            for r in rows
        ]

    def _device_chains(self, rows: list[_Row], logits: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Unconstrained rows from their catch-up step's ``logits`` and prenorm ``outs``: each
        step feeds the rows' tokens where they lie (a greedy row's argmax; a sampled row's draw
        from q on the device, with a generator of its own), and the host reads every chain once,
        at the end, with the sampled rows' q. A chain is then cut after its first token below
        ``min_confidence``, where the host loop would have stopped (the steps past it were
        drafted in vain)."""
        cur, lg, hs = rows, torch.stack([x[-1] for x in logits]), [o[-1:] for o in outs]
        picks: list[tuple[list[_Row], torch.Tensor, torch.Tensor]] = []
        qs: list[torch.Tensor] = []
        for n in range(max(r.budget for r in rows)):
            d = lg.argmax(-1)  # the draft vocabulary's first maximum, as ``head.greedy``
            if self.min_confidence > 0:
                p_max = torch.softmax(lg.float(), -1).amax(-1)
            else:
                p_max = torch.ones(d.shape, device=d.device)
            tok = self.head.to_target_ids(d) if self.head.remaps_vocab else d
            for j, r in enumerate(cur):
                if not r.st.sp.greedy:  # q as the host loop's (``_pick``), drawn on the device
                    q = probs_from_logits(self.head.target_logits(lg[j]), r.st.sp)
                    draw_on_device(r.st, q, tok, p_max, j, qs)
            picks.append((cur, tok, p_max))
            nxt = [j for j, r in enumerate(cur) if r.budget > n + 1]
            if not nxt:
                break
            step, outs = self.head.step_ragged(
                [hs[j] for j in nxt],
                [tok[j : j + 1] for j in nxt],
                [cur[j].st.n_feats + n for j in nxt],
                [cur[j].st.cache for j in nxt],
            )
            cur, lg, hs = [cur[j] for j in nxt], torch.stack([x[-1] for x in step]), [o[-1:] for o in outs]
        chains = read_chains(picks, qs)
        for r in rows:
            r.drafted, r.qs = kept(chains[id(r)], self.min_confidence)

    def _grow(self, rows: list[tuple[_State, torch.Tensor, torch.Tensor, int]]) -> list[Draft]:
        """EAGLE-2's dynamic draft trees (as SGLang's ``speculative_eagle_topk``) for several
        requests in lockstep: ``rows`` are (state, root logits [V_d], root prenorm [1, H],
        budget). From the root, each expanded node proposes its ``topk`` most likely tokens,
        each node's score being the product of the head's probabilities along its path; at
        each depth every request's ``topk`` best-scoring new nodes are expanded, all
        requests' in one head step (``step_tree``); after ``steps`` depths each request's
        ``budget`` best-scoring nodes are its draft. The nodes are the head's top-k, not
        samples (no q), so a sampled session verifies them by drawing the target's tokens."""
        d2t = self.head._d2t_list() if self.head.remaps_vocab else None
        shape = self.tree
        assert shape is not None, "a tree drafter"
        trees = [_Tree(st, budget, shape) for st, _, _, budget in rows]
        self._children(
            trees, [[-1]] * len(trees), torch.stack([lg for _, lg, _, _ in rows]), [out for _, _, out, _ in rows], d2t
        )
        for depth in range(1, shape.steps):
            work = [(t, g) for t in trees if (g := t.to_expand(depth))]
            if not work:
                break
            dev = rows[0][2].device
            h = torch.cat([t.feeds[j] for t, g in work for j in g])
            tokens = torch.tensor([t.toks[j] for t, g in work for j in g], device=dev)
            positions = torch.tensor([t.st.n_feats - 1 + depth for t, g in work for _ in g], device=dev)
            spans, off = [], 0
            for t, g in work:
                slots, mask = t.expansion(g)
                spans.append((off, torch.tensor(slots, device=dev), mask.to(dev), t.st.cache))
                off += len(g)
            logits, outs = self.head.step_tree(h, tokens, positions, spans)
            per = [len(g) for _, g in work]
            self._children([t for t, _ in work], [g for _, g in work], logits, list(torch.split(outs, per)), d2t)
        return [t.draft(self.name) for t in trees]

    def _grow_on_device(self, rows: list[tuple[_State, torch.Tensor, torch.Tensor, int]]) -> list[Draft]:
        """``_grow``'s trees with every node kept on the device and the host reading them once, at
        the end. Which nodes expand depends on their scores, so the selection is a stable sort
        on the device (ties to the older node, as ``_Tree.to_expand``); what depends only on
        counts (the depths, each node's cache slot, the attention width) stays on the host. A
        floor (``min_score``) cannot stop the expansion without a read: the trees grow to full
        depth, and the nodes below it are left out by ``_Tree.draft`` as before (a node scores
        no more than its parent, so a frontier below the floor has only such descendants)."""
        shape = self.tree
        assert shape is not None, "a tree drafter"
        dev = rows[0][2].device
        trees = [
            _DeviceTree.root(self._top(lg[None]), out, st.n_feats + shape.steps * shape.topk) for st, lg, out, _ in rows
        ]
        for depth in range(1, shape.steps):
            work = [(i, g) for i, (st, _, _, budget) in enumerate(rows) if (g := trees[i].to_expand(st, depth, budget))]
            if not work:
                break
            h = torch.cat([trees[i].feeds[g.nodes] for i, g in work])
            tokens = torch.cat([trees[i].toks[g.nodes] for i, g in work])
            positions = torch.cat(
                [torch.full((len(g.nodes),), rows[i][0].n_feats - 1 + depth, device=dev) for i, g in work]
            )
            spans, off = [], 0
            for i, g in work:
                spans.append((off, g.slots, g.mask, rows[i][0].cache))
                off += len(g.nodes)
            logits, outs = self.head.step_tree(h, tokens, positions, spans)
            off = 0
            for i, g in work:
                n = len(g.nodes)
                trees[i].add(g, self._top(logits[off : off + n]), outs[off : off + n])
                off += n
        # the one read: every tree's tokens, parents and scores (float64 holds ids and scores exactly)
        flat = torch.cat([torch.cat([t.toks.double(), t.parents.double(), t.scores]) for t in trees]).tolist()
        drafts, at = [], 0
        for (st, _, _, budget), t in zip(rows, trees):
            n = len(t.scores)
            tree = _Tree(st, budget, shape)
            tree.toks = [int(x) for x in flat[at : at + n]]
            tree.parents = [int(x) for x in flat[at + n : at + 2 * n]]
            tree.scores = flat[at + 2 * n : at + 3 * n]
            drafts.append(tree.draft(self.name))
            at += 3 * n
        return drafts

    def _top(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``topk`` head probabilities (float64) and their target ids, on the device."""
        assert self.tree is not None, "a tree drafter"
        top = torch.softmax(logits.float(), -1).topk(self.tree.topk)
        ids = self.head.to_target_ids(top.indices) if self.head.remaps_vocab else top.indices
        return top.values.double(), ids

    def _children(
        self,
        trees: list["_Tree"],
        parents: list[list[int]],
        logits: torch.Tensor,
        outs: list[torch.Tensor],
        d2t: list[int] | None,
    ) -> None:
        """Each tree's ``parents[i]`` nodes get their ``topk`` children, from their head logits
        (rows of ``logits``, in order) and prenorm outputs (``outs[i]`` [m_i, H])."""
        assert self.tree is not None, "a tree drafter"
        top = torch.softmax(logits.float(), -1).topk(self.tree.topk)
        # one read of the device per level: probabilities and ids together (float64 holds both exactly)
        values, read_ids = torch.stack([top.values.double(), top.indices.double()]).tolist()
        ids = [[int(i) for i in r] for r in read_ids]
        row = 0
        for t, nodes, h in zip(trees, parents, outs):
            for r, parent in enumerate(nodes):
                t.add(parent, values[row], [i + d2t[i] if d2t else i for i in ids[row]], h[r : r + 1])
                row += 1

    def stop(self, req_id: str) -> None:
        self.states.pop(req_id, None)
