"""Prefix cache on the engine: prompts that share a start reuse its verified blocks, outputs
do not change, the hit is reported, and drafters fed by the target's states get theirs."""

from __future__ import annotations

import threading

import pytest

from services.common.config import EngineConfig
from services.drafter.base import common_prefix
from services.router.engine import Engine, GenerationRequest
from tests.conftest import wait_for

SHARED = "import os\nimport sys\n\n" + "".join(f"def helper{i}(x):\n    return x * {i} + 1\n\n" for i in range(8))
PROMPTS = [SHARED + f"def f{i}(a, b):\n    return a" for i in range(3)]
METHODS = ("vanilla", "sd", "suffix", "eagle3", "hybrid-rule")


@pytest.fixture(scope="module")
def engine(tiny_dirs, tiny_eagle3):
    """Every method's drafter beside the target: the draft LM and an EAGLE-3 head."""
    return Engine(
        EngineConfig(
            target=tiny_dirs[0],
            draft=tiny_dirs[1],
            eagle3=tiny_eagle3,
            num_speculative_tokens=4,
            draft_confidence=0.0,
            max_new_tokens_limit=200,
            predictor=None,
            ocm_snapshot=None,
            prefix_block=16,
        )
    )


def generate(eng, text: str, method: str, n: int = 32) -> dict:
    return eng.generate(GenerationRequest(eng.encode(text), n, method=method)).result()


@pytest.mark.parametrize("method", METHODS)
def test_prompts_sharing_a_start_reuse_its_blocks_and_keep_their_outputs(engine, method):
    core = engine.verifier
    cold = []
    for p in PROMPTS:
        core.clear_prefix_cache()
        r = generate(engine, p, method)
        assert r["cached_prompt_tokens"] == 0
        cold.append(r)
    core.clear_prefix_cache()
    warm = [generate(engine, p, method) for p in PROMPTS]
    assert [r["token_ids"] for r in warm] == [r["token_ids"] for r in cold]
    if method in ("sd", "eagle3"):  # model drafters draft as they did cold (the suffix cache has learnt since)
        drafts = lambda runs: [(r["stats"]["cycles"], r["stats"]["accepted_tokens"]) for r in runs]  # noqa: E731
        assert drafts(warm) == drafts(cold)
    # whole blocks of the start a prompt shares with an earlier one, never past where they differ
    ids = [engine.encode(p) for p in PROMPTS]
    common = [0] + [max(common_prefix(ids[i], ids[j]) for j in range(i)) for i in range(1, len(ids))]
    assert [r["cached_prompt_tokens"] for r in warm] == [c // 16 * 16 for c in common]
    assert common[1] >= len(engine.encode(SHARED)) - 2 >= 32
    # the same prompt again: everything but its newest token (whose logits start the first cycle)
    again = generate(engine, PROMPTS[0], method)
    assert again["token_ids"] == cold[0]["token_ids"]
    n = len(engine.encode(PROMPTS[0]))
    assert again["cached_prompt_tokens"] == (n - 1) // 16 * 16


def test_eagle3_gets_the_cached_positions_target_features(engine):
    """A hit hands EAGLE-3 the fused target features of the cached positions: the same ones,
    position for position, that a cold prefill gives it."""
    import torch

    core, drafter = engine.verifier, engine.verifier.drafters["eagle3"]
    seen: list[torch.Tensor] = []
    observe = drafter.observe

    def spy(req_id, tokens, target_states=None):
        if target_states is not None:
            seen.append(target_states.clone())
        return observe(req_id, tokens, target_states)

    def features(text: str) -> torch.Tensor:
        seen.clear()
        r = generate(engine, text, "eagle3", n=4)
        return r["cached_prompt_tokens"], torch.cat(seen)

    drafter.observe = spy
    try:
        core.clear_prefix_cache()
        _, cold = features(PROMPTS[1])
        generate(engine, PROMPTS[0], "eagle3", n=4)
        hit, warm = features(PROMPTS[1])
    finally:
        drafter.observe = observe
    n = len(engine.encode(PROMPTS[1]))
    assert hit >= 32 and len(warm) >= n - 1 and len(cold) >= n - 1
    torch.testing.assert_close(warm[: n - 1], cold[: n - 1], rtol=1e-4, atol=1e-5)


def test_a_hybrid_session_leaves_its_eagle3_head_idle_until_it_delegates(engine):
    """On a prefix hit an `eagle3` session's head takes the cached positions in at once (its
    first draft is due next cycle); a hybrid's does not, since it may never be asked to draft:
    its first draft catches up instead."""
    drafter = engine.verifier.drafters["eagle3"]
    absorb, absorbed = drafter.absorb, []
    drafter.absorb = lambda req_id, upto: (absorbed.append(req_id), absorb(req_id, upto))
    try:
        engine.verifier.clear_prefix_cache()
        generate(engine, PROMPTS[0], "eagle3", n=4)
        absorbed.clear()
        assert generate(engine, PROMPTS[1], "hybrid-rule", n=4)["cached_prompt_tokens"] >= 32
        assert absorbed == []
        assert generate(engine, PROMPTS[2], "eagle3", n=4)["cached_prompt_tokens"] >= 32
        assert len(absorbed) == 1
    finally:
        del drafter.absorb
    assert drafter.absorb == absorb


def test_generated_blocks_are_kept_too(engine):
    """A conversation's next turn repeats the earlier answer: its blocks come from the cache."""
    core = engine.verifier
    core.clear_prefix_cache()
    first = generate(engine, PROMPTS[0], "vanilla", n=64)
    ids = engine.encode(PROMPTS[0]) + first["token_ids"]
    follow = engine.generate(GenerationRequest(ids + engine.encode("\n\nprint(1)"), 8, method="vanilla")).result()
    assert follow["cached_prompt_tokens"] >= (len(ids) - 1) // 16 * 16 - 16
    assert follow["cached_prompt_tokens"] > len(engine.encode(PROMPTS[0]))


def test_concurrent_sessions_with_chunked_prefill_keep_every_output(engine):
    """Hits, misses and chunked prompts in the same steps: each output equals the cold one."""
    core = engine.verifier
    refs = {}
    for p in PROMPTS:
        for m in ("vanilla", "sd", "eagle3"):
            core.clear_prefix_cache()
            refs[p, m] = generate(engine, p, m)["token_ids"]
    core.clear_prefix_cache()
    core.prefill_chunk, chunk = 8, core.prefill_chunk
    out, hits = {}, {}

    def run(p, m):
        r = generate(engine, p, m)
        out[p, m], hits[p, m] = r["token_ids"], r["cached_prompt_tokens"]

    try:
        threads = {k: threading.Thread(target=run, args=k) for k in refs}
        first = [k for k in refs if k[0] == PROMPTS[0]]
        for k in first:
            threads[k].start()
        # the rest join the steps once the first prompt's blocks are stored (sessions that start in
        # the same step cannot find each other's blocks: none is stored before its prefill ends)
        assert wait_for(lambda: core.runner.prefix.bytes > 0, timeout=60)
        for k, t in threads.items():
            if k not in first:
                t.start()
        for t in threads.values():
            t.join(120)
    finally:
        core.prefill_chunk = chunk
    assert out == refs
    assert sum(hits.values()) > 0  # later sessions found blocks the earlier ones had stored


def test_off_keeps_nothing_and_the_budget_bounds_what_is_kept(tiny_dirs):
    off = Engine(
        EngineConfig(target=tiny_dirs[0], draft=None, eagle3=None, predictor=None, ocm_snapshot=None, prefix_cache_mb=0)
    )
    assert off.verifier.runner.prefix is None
    assert generate(off, PROMPTS[0], "vanilla")["cached_prompt_tokens"] == 0
    assert generate(off, PROMPTS[0], "vanilla")["cached_prompt_tokens"] == 0
    small = Engine(
        EngineConfig(target=tiny_dirs[0], draft=None, eagle3=None, predictor=None, ocm_snapshot=None, prefix_block=16)
    )
    cache = small.verifier.runner.prefix
    generate(small, PROMPTS[0], "vanilla")
    per_block = cache.bytes // len(cache)
    cache.budget = 3 * per_block
    for p in PROMPTS:
        generate(small, p + " + b", "vanilla")
    assert cache.bytes <= cache.budget and len(cache) == 3


def test_the_draft_lm_starts_from_the_cached_blocks_kv(engine):
    """The draft LM's own cache: a request that shares a start with an earlier one begins
    with that start's K/V, equal to what a cold feed computes, and drafts the same tokens."""
    import torch

    from services.common.prefix_cache import PrefixCache
    from services.common.types import Sampling
    from services.drafter.draft_lm import DraftLMDrafter

    model = engine.verifier.drafters["draft-lm"].model
    cached = DraftLMDrafter(model, prefix=PrefixCache(16, 1 << 24))
    cold = DraftLMDrafter(model)
    a, b = (engine.encode(p) for p in PROMPTS[:2])
    rng = torch.Generator()
    cached.start("a", a, Sampling(), rng)
    cached.propose("a", 4)
    cached.observe("a", [7])  # commits no draft: the prompt's K/V stay, stored as blocks
    for d in (cached, cold):
        d.start("b", b, Sampling(), rng)
    drafts = [d.propose("b", 4).token_ids for d in (cached, cold)]
    assert drafts[0] == drafts[1]
    st, ref = cached.states["b"], cold.states["b"]
    m = (common_prefix(a, b) // 16) * 16
    assert st.keys and len(st.keys) * 16 >= m >= 32
    for (k, v), (rk, rv) in zip(st.cache.layers, ref.cache.layers):
        torch.testing.assert_close(k[0, :, :m], rk[0, :, :m], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v[0, :, :m], rv[0, :, :m], rtol=1e-4, atol=1e-5)


def test_the_eagle3_head_starts_from_the_cached_blocks_kv(engine):
    """The EAGLE-3 head's own cache: head position i pairs the target's features at i with
    token i + 1, so its blocks are keyed one token on. A request that shares a start with an
    earlier one begins with that start's head K/V, equal to a cold catch-up's, and drafts the
    same tokens."""
    import torch

    from services.common.prefix_cache import PrefixCache
    from services.common.types import Sampling
    from services.drafter.eagle3_drafter import Eagle3Drafter

    head = engine.verifier.drafters["eagle3"].head
    width = head.fc.weight.shape[1]
    table = torch.randn(8192, width, generator=torch.Generator().manual_seed(3))

    def features(ids):  # stand-in target features: any function of the prefix up to each position
        return table[torch.tensor(ids)]

    cached = Eagle3Drafter(head, prefix=PrefixCache(16, 1 << 24))
    cold = Eagle3Drafter(head)
    a, b = (engine.encode(p) for p in PROMPTS[:2])
    cached.start("a", a, Sampling(), None)
    cached.observe("a", [], features(a[:-1]))  # the target verified all but the newest token
    cached.propose("a", 4)
    for d in (cached, cold):
        d.start("b", b, Sampling(), None)
        d.observe("b", [], features(b[:-1]))
    drafts = [d.propose("b", 4).token_ids for d in (cached, cold)]
    assert drafts[0] == drafts[1]
    st, ref = cached.states["b"], cold.states["b"]
    m = min(common_prefix(a, b) - 1, len(b) - 2) // 16 * 16
    assert m >= 32 and len(st.keys) * 16 >= m
    for (k, v), (rk, rv) in zip(st.cache.layers, ref.cache.layers):
        torch.testing.assert_close(k[0, :, :m], rk[0, :, :m], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v[0, :, :m], rv[0, :, :m], rtol=1e-4, atol=1e-5)
