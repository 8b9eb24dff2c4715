"""Rollback: after a partially accepted draft, the KV caches behave as if built from scratch."""

import torch

from services.common.llama import Llama
from services.common.types import Sampling, Verdict
from services.drafter.draft_lm import DraftLMDrafter
from services.verifier.runner import TargetRunner


def fresh_logits(model: Llama, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_train(torch.tensor([tokens]))[0, -1]


def test_target_rollback_matches_fresh_forward(tiny_dirs):
    model = Llama.from_pretrained(tiny_dirs[0])
    runner = TargetRunner(model)
    prompt = [5, 17, 300, 42, 9]
    st = runner.open(prompt, capacity=64)
    runner.verify(st, [11, 12, 13, 14])
    # Keep 2 of 4 draft tokens and a correction: K/V of 13, 14 must be discarded.
    runner.commit(st, Verdict(accepted=2, tokens=[11, 12, 99]))
    assert st.tokens == prompt + [11, 12, 99] and st.cache_len == len(prompt) + 2
    logits, _ = runner.verify(st, [7, 8])
    assert torch.allclose(logits[0], fresh_logits(model, st.tokens), atol=1e-4)
    assert torch.allclose(logits[2], fresh_logits(model, st.tokens + [7, 8]), atol=1e-4)


def test_draft_lm_rollback_matches_fresh_drafter(tiny_dirs):
    model = Llama.from_pretrained(tiny_dirs[1])
    sp = Sampling()
    a = DraftLMDrafter(model)
    a.start("r", [5, 17, 300], sp, torch.Generator())
    d = a.propose("r", 4).token_ids
    # Target keeps the first draft token, then corrects.
    a.observe("r", [d[0], (d[1] + 1) % 8192])
    b = DraftLMDrafter(model)
    b.start("r", [5, 17, 300, d[0], (d[1] + 1) % 8192], sp, torch.Generator())
    assert a.propose("r", 5).token_ids == b.propose("r", 5).token_ids
    # A draft that is dropped unverified (no observe) must not poison the next one.
    # All accepted + bonus: the K/V of the last draft token was never written and must be fed.
    d2 = a.propose("r", 3).token_ids
    a.observe("r", d2 + [123])
    c = DraftLMDrafter(model)
    c.start("r", a.states["r"].tokens, sp, torch.Generator())
    assert a.propose("r", 4).token_ids == c.propose("r", 4).token_ids
    a.stop("r")
    assert "r" not in a.states


def test_draft_respects_cache_capacity(tiny_dirs):
    model = Llama.from_pretrained(tiny_dirs[1])
    drafter = DraftLMDrafter(model)
    drafter.start("r", list(range(1, 254)), Sampling(), torch.Generator())  # capacity 256
    assert len(drafter.propose("r", 8)) == 3


def test_dynamic_draft_length_cuts_after_first_doubted_token(tiny_dirs):
    model = Llama.from_pretrained(tiny_dirs[1])
    prompt, sp = [5, 17, 300, 42], Sampling()
    full = DraftLMDrafter(model)
    full.start("r", prompt, sp, torch.Generator())
    chain = full.propose("r", 8).token_ids
    with torch.no_grad():
        probs = torch.softmax(model.forward_train(torch.tensor([prompt + chain]))[0, len(prompt) - 1 : -1], -1)
    p_max = probs.max(-1).values.tolist()
    threshold = sorted(p_max)[len(p_max) // 2]
    cut = next(i for i, p in enumerate(p_max) if p < threshold) + 1
    assert 1 <= cut < len(chain)
    dyn = DraftLMDrafter(model, min_confidence=threshold)
    dyn.start("r", prompt, sp, torch.Generator())
    assert dyn.propose("r", 8).token_ids == chain[:cut]
