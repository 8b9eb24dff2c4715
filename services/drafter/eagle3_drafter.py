"""EAGLE-3 drafter: chain drafts from the head, fed by the target's own verification pass.

Per request: ``feats`` holds fused target features f_i (3·H_t) for every position the
target has verified (its KV-cache prefix); they arrive with ``observe(..., target_states)``
— no extra target pass. ``propose`` first runs the head over positions it has not yet seen
with real features (overwriting its own earlier chain entries there: that is its rollback),
then chains k−1 steps on its own hidden state. Position i pairs f_i with token i+1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.llama import KVCache
from services.common.sampling import probs_from_logits, sample
from services.common.types import Draft, SamplingParams
from services.drafter.base import register
from services.drafter.eagle3 import Eagle3Head


@dataclass
class _State:
    tokens: list[int]
    cache: KVCache
    sp: SamplingParams
    rng: torch.Generator | None
    feats: list[torch.Tensor] = field(default_factory=list)   # unprocessed [n, 3·H_t] chunks
    n_feats: int = 0          # target positions with features (processed or not)
    real_len: int = 0         # head cache positions computed from real features
    last_feat: torch.Tensor | None = None


@register("eagle3")
class Eagle3Drafter:
    name = "eagle3"
    needs_target_states = True

    def __init__(self, head: Eagle3Head):
        self.head = head
        self.states: dict[str, _State] = {}

    def start(self, req_id: str, prompt: list[int], sp: SamplingParams, rng: torch.Generator | None,
              max_new_tokens: int = 0) -> None:
        self.states[req_id] = _State(list(prompt), self.head.new_cache(self.head.s.max_positions), sp, rng)

    def observe(self, req_id: str, tokens: list[int], target_states: torch.Tensor | None = None) -> None:
        st = self.states[req_id]
        st.tokens.extend(tokens)
        if target_states is not None and len(target_states):
            st.feats.append(target_states)
            st.n_feats += len(target_states)

    def _pick(self, st: _State, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if st.sp.greedy:
            return int(logits.argmax()), None
        q = probs_from_logits(logits, st.sp).cpu()
        return sample(q, st.rng), q

    @torch.inference_mode()
    def propose(self, req_id: str, budget: int) -> Draft:
        st = self.states[req_id]
        budget = min(budget, st.cache.capacity - st.n_feats)
        if st.n_feats == 0 or budget <= 0:
            return Draft.empty()
        head, dev = self.head, self.head.fc.weight.device
        if st.feats:  # catch up on real features: positions real_len .. n_feats-1
            st.last_feat = st.feats[-1][-1:]
            f, start = torch.cat(st.feats), st.real_len
            st.feats = []
        else:  # nothing verified since the last draft: recompute the last real position
            f, start = st.last_feat, st.n_feats - 1
        toks = torch.tensor([st.tokens[start + 1:st.n_feats + 1]], device=dev)
        logits, out = head.step(head.fc(f.to(dev, head.fc.weight.dtype))[None], toks, start, st.cache)
        st.real_len = st.n_feats
        drafted, qs = [], []
        h, row = out[:, -1:], logits[0, -1]
        for j in range(budget):
            tok, q = self._pick(st, row)
            drafted.append(tok)
            if q is not None:
                qs.append(q)
            if j + 1 == budget:
                break
            logits, h = head.step(h, torch.tensor([[tok]], device=dev), st.n_feats + j, st.cache)
            row = logits[0, -1]
        return Draft(token_ids=drafted, probs=torch.stack(qs) if qs else None, source=self.name)

    def stop(self, req_id: str) -> None:
        self.states.pop(req_id, None)
