"""Draft-LM drafter: a small causal LM with its own static KV cache and rollback."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from services.common.llama import KVCache, Llama
from services.common.prefix_cache import ROOT, PrefixCache, kv_block, kv_bytes_per_position, load_kv
from services.common.sampling import apply_bias, apply_penalties, ban_columns, banned_tokens, probs_from_logits, sample
from services.common.structured import GrammarCursor
from services.common.types import Draft, Sampling
from services.drafter.base import ModelDrafter, common_prefix, draw_on_device, kept, read_chains, register


@dataclass
class _State:
    tokens: list[int]
    cache: KVCache
    sp: Sampling
    rng: torch.Generator | None  # None: the global generator
    vocab_size: int
    cache_len: int = 0
    drafted: list[int] = field(default_factory=list)
    keys: list[bytes] | None = None  # prefix-cache keys of the blocks stored (None: not looked up yet)
    root: bytes = ROOT  # the first block's parent: the request's cache salt
    prompt_len: int = 0  # tokens after it are output (the penalties count them)
    grammar: GrammarCursor | None = None  # structured output: drafts stay inside the grammar
    device_rng: torch.Generator | None = None  # draws of device drafts (``base.device_generator``)


@dataclass
class _Row:
    """One request's draft in progress: tokens to feed next at ``pos``, tokens drafted."""

    st: _State
    budget: int
    feed: list[int]
    pos: int
    out: list[int] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    confident: bool = True
    state: int | None = None  # the grammar's state after the output and ``out``

    @classmethod
    def of(cls, st: _State, budget: int) -> "_Row":
        # K/V of an earlier draft that was never committed is stale; at least one token stays pending.
        st.cache_len = min(st.cache_len, len(st.tokens) - 1)
        budget = max(0, min(budget, st.cache.capacity - len(st.tokens)))
        return cls(st, budget, st.tokens[st.cache_len :], st.cache_len, state=st.grammar.state if st.grammar else None)

    def constrain(self, logits: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor | None:
        """The row's logits under its request's penalties, bias, bad words and grammar (None:
        they allow none of the columns, so the chain ends)."""
        st = self.st
        if st.sp.penalized:  # drafts follow the request's penalties and bias, as the target will
            logits = apply_penalties(logits[None], st.tokens + self.out, st.prompt_len, [], st.sp, columns)[0]
        if st.sp.biased:
            logits = apply_bias(logits, st.sp, columns)
        if st.sp.bad_words:  # nor do they complete a bad word the target would ban
            logits = ban_columns(logits, banned_tokens(st.tokens[st.prompt_len :] + self.out, st.sp.bad_words), columns)
        # Only an allow-list can leave no token (bias is finite; bad words ban a few): checked
        # only then, as the check waits for the device.
        if st.sp.allowed_token_ids and not bool(torch.isfinite(logits).any()):
            return None  # none of the allowed tokens is left in the draft vocabulary
        if st.grammar is not None:
            assert self.state is not None, "a grammar's row has its state"
            return st.grammar.automaton.mask_columns(logits, self.state, columns)
        return logits

    def take(
        self,
        greedy_tok: int | None,
        logits: torch.Tensor,
        p_max: float,
        min_confidence: float,
        vocab: torch.Tensor | None = None,
    ) -> None:
        """Greedy requests draft argmax tokens (q one-hot); sampled ones sample from q, which
        lives on the draft vocabulary ``vocab`` when the logits cover only it (zero elsewhere).
        The chain ends after a token whose draft probability (max of q) is below ``min_confidence``."""
        if greedy_tok is None:
            q = probs_from_logits(logits, self.st.sp)
            if vocab is not None:
                q = q.new_zeros(self.st.vocab_size).index_copy_(0, vocab, q)
            q = q.cpu()
            greedy_tok = sample(q, self.st.rng)
            self.qs.append(q)
            p_max = float(q.max())
        self.out.append(greedy_tok)
        self.feed = [greedy_tok]
        self.confident = p_max >= min_confidence
        if self.st.grammar is not None:
            self.state = self.st.grammar.automaton.next(self.state, greedy_tok)

    @property
    def unconstrained(self) -> bool:
        """No penalties, bias, bad words or grammar: its logits need no host step (the target's
        own transforms of ``sp``, temperature to top-p, run on the device)."""
        sp = self.st.sp
        return not (sp.penalized or sp.biased or sp.bad_words or self.st.grammar is not None)

    @property
    def drafting(self) -> bool:
        return self.confident and len(self.out) < self.budget and (self.st.grammar is None or self.state is not None)

    def finish(self, source: str) -> Draft:
        if self.out:
            self.st.cache_len = self.pos
        self.st.drafted = self.out
        return Draft(token_ids=self.out, probs=torch.stack(self.qs) if self.qs else None, source=source)


@register("draft-lm")
class DraftLMDrafter(ModelDrafter):
    """Autoregressive chain drafts of at most ``budget`` tokens.

    Greedy requests draft argmax tokens (q one-hot); sampled requests sample from the
    draft's q under the request's sampling transform and return q for rejection sampling.
    Dynamic draft length: the chain stops after a token the draft itself doubts
    (max q < ``min_confidence``), since later tokens are then unlikely to be accepted and
    each costs a draft forward. Verification stays lossless either way.

    With ``vocab`` (ascending target ids), the LM head covers only those tokens (FR-Spec,
    ``services/drafter/vocab.py``): drafts come from them, q is zero elsewhere.

    With ``prefix`` (a ``PrefixCache`` of its own), a request's first feed starts after the
    longest cached run of its prompt's blocks, and committed blocks are stored for later ones.

    With ``device_drafts``, a batch of unconstrained requests (greedy, or sampled with q drawn
    on the device) drafts with its tokens left on the device and read once per draft
    (``_device_chains``), not once per position.
    """

    name = "draft-lm"

    def __init__(
        self,
        model: Llama,
        min_confidence: float = 0.0,
        vocab: torch.Tensor | None = None,
        prefix: PrefixCache | None = None,
        device_drafts: bool = False,
    ):
        self.model = model
        self.min_confidence = min_confidence
        self.device_drafts = device_drafts
        self.vocab = vocab
        self.prefix = prefix
        self.head = None
        if vocab is not None:
            self.head = restricted_head(model.lm_head, vocab)
        self.states: dict[str, _State] = {}

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
        """Chains only: ``trees`` is not taken up."""
        self.states[req_id] = _State(
            list(prompt),
            self.model.new_cache(1),
            sp,
            rng,
            self.model.s.vocab,
            root=cache_root,
            prompt_len=len(prompt),
            grammar=grammar,
        )

    def kv_bytes_per_position(self) -> int:
        return kv_bytes_per_position(self.model.new_cache(1, 1))

    def propose(self, req_id: str, budget: int) -> Draft:
        return self.propose_batch([(req_id, budget)])[0]

    @torch.inference_mode()
    def propose_batch(self, asks: list[tuple[str, int]]) -> list[Draft]:
        """Drafts for several requests, one ragged draft-model forward per draft position."""
        rows = [_Row.of(self._attached(req_id), budget) for req_id, budget in asks]
        active = [r for r in rows if r.budget > 0]
        if self.device_drafts and active and all(r.unconstrained for r in active):
            self._device_chains(active)
            active = []
        while active:
            logits, _ = self.model.forward_ragged(
                [r.feed for r in active],
                [r.pos for r in active],
                [r.st.cache for r in active],
                last_only=True,
                head=self.head,
            )
            stacked = torch.stack([lg[-1] for lg in logits])
            for j, r in enumerate(active):
                if r.st.sp.penalized or r.st.sp.biased or r.st.sp.bad_words or r.st.grammar is not None:
                    row = r.constrain(stacked[j], self.vocab)
                    if row is None:
                        r.budget = len(r.out)  # nothing allowed: the chain ends here
                    else:
                        stacked[j] = row
            ended = {id(r) for r in active if not r.drafting}
            greedy, p_max = self._argmax(stacked)
            # one read of the device per draft position: the tokens and their confidences together
            # (float64 holds every token id exactly)
            read = torch.stack([greedy.to(torch.float64), p_max.to(torch.float64)]).tolist()
            for r, lg, g, p in zip(active, stacked, map(int, read[0]), read[1]):
                r.pos += len(r.feed)
                if id(r) not in ended:
                    r.take(g if r.st.sp.greedy else None, lg, p, self.min_confidence, self.vocab)
            active = [r for r in active if r.drafting]
        return [r.finish(self.name) for r in rows]

    def _argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's argmax (a target id) and its draft probability (1 without a confidence cut)."""
        if self.min_confidence > 0:  # the softmax is needed only for the confidence cut
            p_max, greedy = torch.softmax(logits.float(), -1).max(-1)
        else:
            greedy, p_max = logits.argmax(-1), torch.ones(len(logits), device=logits.device)
        return (greedy if self.vocab is None else self.vocab[greedy]), p_max

    def _device_chains(self, rows: list[_Row]) -> None:
        """Unconstrained rows: each step feeds the rows' tokens where they lie (a greedy row's
        argmax; a sampled row's draw from q on the device, with a generator of its own), and
        the host reads every chain once, at the end, with the sampled rows' q. A chain is then
        cut after its first token below ``min_confidence``, as the host loop would have stopped
        there (the steps past it were drafted in vain: the price of not reading each token)."""
        feed: dict[int, list[int] | torch.Tensor] = {id(r): r.feed for r in rows}
        picks: list[tuple[list[_Row], torch.Tensor, torch.Tensor]] = []
        qs: list[torch.Tensor] = []  # sampled rows' q, in the order they are drawn
        for n in range(max(r.budget for r in rows)):
            live = [r for r in rows if r.budget > n]
            logits, _ = self.model.forward_ragged(
                [feed[id(r)] for r in live],
                [r.pos if n == 0 else r.pos + len(r.feed) + n - 1 for r in live],
                [r.st.cache for r in live],
                last_only=True,
                head=self.head,
            )
            stacked = torch.stack([lg[-1] for lg in logits])
            tokens, p_max = self._argmax(stacked)
            for j, r in enumerate(live):
                if not r.st.sp.greedy:  # q as the host loop's (``_Row.take``), drawn on the device
                    q = probs_from_logits(stacked[j], r.st.sp)
                    if self.vocab is not None:
                        q = q.new_zeros(r.st.vocab_size).index_copy_(0, self.vocab, q)
                    draw_on_device(r.st, q, tokens, p_max, j, qs)
            picks.append((live, tokens, p_max))
            feed.update((id(r), tokens[j : j + 1]) for j, r in enumerate(live))
        chains = read_chains(picks, qs)
        for r in rows:
            r.out, r.qs = kept(chains[id(r)], self.min_confidence)
            r.pos += len(r.feed) + len(r.out) - 1

    @torch.inference_mode()
    def absorb(self, req_id: str, upto: int) -> None:
        """Feed the request's tokens before position ``upto`` (their K/V into the cache) without
        drafting. A chunked prefill calls it per chunk, so the first draft does not prefill a
        whole prompt inside one step; the newest token always stays pending."""
        st = self._attached(req_id)
        upto = min(upto, len(st.tokens) - 1)
        if upto > st.cache_len:
            self.model.forward_ragged([st.tokens[st.cache_len : upto]], [st.cache_len], [st.cache], tails=[0])
            st.cache_len = upto
            self._keep(st)

    def _attached(self, req_id: str) -> _State:
        """The request's state; on its first feed, with what the prefix cache holds of its prompt."""
        st = self.states[req_id]
        if st.keys is None:
            st.keys = []
            if self.prefix is not None and st.cache_len == 0:
                keys, blocks = self.prefix.match(st.tokens, min(len(st.tokens) - 1, st.cache.capacity), st.root)
                if blocks:
                    st.cache_len, st.keys = load_kv(st.cache, blocks), keys
        return st

    def _keep(self, st: _State) -> None:
        prefix = self.prefix
        if prefix is not None and st.keys is not None:
            prefix.store(st.keys, st.tokens, st.cache_len, lambda b0: kv_block(st.cache, b0, prefix.block), st.root)

    def verified(self, req_id: str, n: int) -> None:
        """Its drafts follow the request's grammar and bad words already, so none is cut."""

    def observe(self, req_id: str, tokens: list[int], target_states=None) -> None:
        st = self.states[req_id]
        # K/V stay valid for the committed prefix of what was fed: old tokens + drafts that survived.
        kept = common_prefix(st.drafted, tokens)
        st.cache_len = min(st.cache_len, len(st.tokens) + kept)
        st.tokens.extend(tokens)
        st.drafted = []
        self._keep(st)

    def stop(self, req_id: str) -> None:
        self.states.pop(req_id, None)


def restricted_head(lm_head: torch.nn.Module, vocab: torch.Tensor) -> torch.nn.Module:
    """An LM head over the rows ``vocab`` of ``lm_head`` (packed like it when it is packed)."""
    from services.common.packed_linear import PackedLinear

    w = cast(torch.Tensor, lm_head.weight).detach()[vocab]
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    return PackedLinear(lin, persistent=False) if isinstance(lm_head, PackedLinear) else lin.eval()
