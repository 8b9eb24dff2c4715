"""Draft-LM drafter: a small causal LM with its own static KV cache and rollback."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.llama import KVCache, Llama
from services.common.sampling import probs_from_logits, sample
from services.common.types import Draft, SamplingParams
from services.drafter.base import common_prefix, register


@dataclass
class _State:
    tokens: list[int]
    cache: KVCache
    sp: SamplingParams
    rng: torch.Generator
    cache_len: int = 0
    drafted: list[int] = field(default_factory=list)


@register("draft-lm")
class DraftLMDrafter:
    """Autoregressive chain drafts of ``budget`` tokens.

    Greedy requests draft argmax tokens (q one-hot); sampled requests sample from the
    draft's q under the request's sampling transform and return q for rejection sampling.
    """

    name = "draft-lm"

    def __init__(self, model: Llama):
        self.model = model
        self.states: dict[str, _State] = {}

    def start(self, req_id: str, prompt: list[int], sp: SamplingParams, rng: torch.Generator,
              max_new_tokens: int = 0) -> None:
        self.states[req_id] = _State(list(prompt), self.model.new_cache(1), sp, rng)

    @torch.inference_mode()
    def propose(self, req_id: str, budget: int) -> Draft:
        st = self.states[req_id]
        # K/V of an earlier draft that was never committed is stale; at least one token stays pending.
        st.cache_len = min(st.cache_len, len(st.tokens) - 1)
        budget = min(budget, st.cache.capacity - len(st.tokens))
        feed, pos = st.tokens[st.cache_len:], st.cache_len
        out: list[int] = []
        qs: list[torch.Tensor] = []
        for _ in range(max(0, budget)):
            ids = torch.tensor([feed], dtype=torch.long, device=self.model.rope_cos.device)
            logits, _ = self.model(ids, pos, st.cache)
            pos += len(feed)
            last = logits[0, -1]
            if st.sp.greedy:
                tok = int(last.argmax())
            else:
                q = probs_from_logits(last, st.sp).cpu()
                tok = sample(q, st.rng)
                qs.append(q)
            out.append(tok)
            feed = [tok]
        st.cache_len = pos if out else st.cache_len
        st.drafted = out
        return Draft(token_ids=out, probs=torch.stack(qs) if qs else None, source=self.name)

    def observe(self, req_id: str, tokens: list[int], target_states=None) -> None:
        st = self.states[req_id]
        # K/V stay valid for the committed prefix of what was fed: old tokens + drafts that survived.
        kept = common_prefix(st.drafted, tokens)
        st.cache_len = min(st.cache_len, len(st.tokens) + kept)
        st.tokens.extend(tokens)
        st.drafted = []

    def stop(self, req_id: str) -> None:
        self.states.pop(req_id, None)
