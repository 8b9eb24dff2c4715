"""Lossless methods reproduce vanilla greedy exactly; sampling stays distribution-preserving."""

import pytest
import torch

from bench.workloads import load
from services.common.sampling import probs_from_logits
from services.common.types import Sampling
from services.router.engine import GenerationRequest

PROMPTS = [
    "def add(a, b):\n",
    "import os\n\nclass Config:\n    def __init__(self",
    "x = [",
    "# utils\n",
    "for i in range(10):\n    ",
    '"""Docstring."""\n',
    "return",
    "try:\n    import json\nexcept",
    "with open(path) as f:\n",
    "lambda x:",
]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_sd_equals_vanilla_tiny(tiny_engine, k):
    """Draft-LM drafts of k tokens, verified exactly, reproduce vanilla greedy output."""
    eng = tiny_engine
    accepted = drafted = 0
    for i, text in enumerate(PROMPTS):
        n = [5, 17, 40, 64][i % 4]
        ids = eng.encode(text)
        van = eng.generate(GenerationRequest(ids, n, method="vanilla")).result()
        old = eng.max_draft["draft-lm"]
        eng.max_draft["draft-lm"] = k
        try:
            sd = eng.generate(GenerationRequest(ids, n, method="sd")).result()
        finally:
            eng.max_draft["draft-lm"] = old
        assert sd["token_ids"] == van["token_ids"], text
        assert sd["stats"]["cycles"] <= van["stats"]["cycles"]
        accepted += sd["stats"]["accepted_tokens"]
        drafted += sd["stats"]["draft_tokens"]
    assert 0.2 * drafted < accepted < drafted  # rollback really exercised, drafts really used


def test_suffix_equals_vanilla_tiny(tiny_engine):
    """Suffix drafts (local tree over a repetitive prompt, then the global tree) are lossless."""
    eng = tiny_engine
    hits = 0
    for text in PROMPTS[:6]:
        ids = eng.encode(text * 3)
        van = eng.generate(GenerationRequest(ids, 48, method="vanilla")).result()
        for _ in range(2):  # second pass drafts from the first pass's output in the global tree
            out = eng.generate(GenerationRequest(ids, 48, method="suffix")).result()
            assert out["token_ids"] == van["token_ids"], text
            hits += out["stats"]["accepted_tokens"]
    assert hits > 0


def test_lossless_methods_equal_vanilla_bundled_humaneval_and_stdlib(bundled_engine):
    """On the shipped models (the fixture fails, never skips, if they are missing): every
    lossless method, the EAGLE-3 head and the trained yield predictor included."""
    eng = bundled_engine
    lossless = (
        "sd",
        "suffix",
        "eagle3",
        "hybrid",
        "hybrid-rule",
        "hybrid-lm",
        "suffix-tree",
        "eagle3-tree",
        "hybrid-tree",
        "ngram",
    )
    assert set(lossless) <= set(eng.methods())
    prompts = load("humaneval", 12) + load("stdlib-heldout", 10)
    for i, p in enumerate(prompts):
        ids = eng.encode(p.text)
        n = [16, 48, 96][i % 3]
        van = eng.generate(GenerationRequest(ids, n, method="vanilla")).result()
        for method in lossless:
            out = eng.generate(GenerationRequest(ids, n, method=method)).result()
            assert out["token_ids"] == van["token_ids"], (method, p.id)
            assert out["text"] == van["text"]


@pytest.fixture(scope="module")
def bundled_bf16_engine():
    """The bundled models in bfloat16, where batch-invariant verification is on by default."""
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    engine = Engine(EngineConfig(dtype="bfloat16"))
    assert engine.verifier.runner.model.batch_invariant
    yield engine
    engine.close()


def test_lossless_methods_equal_vanilla_bit_for_bit_in_bfloat16(bundled_bf16_engine):
    """In bfloat16 a verification's rows and a one-row decode round differently unless the
    verification is batch-invariant (bench/results/bf16_lossless.md: without it sd left
    vanilla's tokens on half the prompts): chains and trees, every lossless method."""
    eng = bundled_bf16_engine
    lossless = ("sd", "suffix", "eagle3", "hybrid", "suffix-tree", "eagle3-tree", "hybrid-tree", "ngram")
    for p in load("humaneval", 4) + load("stdlib-heldout", 3):
        ids = eng.encode(p.text)
        van = eng.generate(GenerationRequest(ids, 96, method="vanilla")).result()["token_ids"]
        for method in lossless:
            out = eng.generate(GenerationRequest(ids, 96, method=method)).result()
            assert out["token_ids"] == van, (method, p.id)
            assert out["stats"]["accepted_tokens"] > 0 or method == "ngram", (method, p.id)


@pytest.mark.parametrize(
    "min_confidence,sp",
    [
        (0.0, Sampling(temperature=1.5, top_k=6)),
        (0.2, Sampling(temperature=1.5, top_k=6)),
        (0.0, Sampling(temperature=1.5, min_p=0.02)),
    ],
)
def test_sd_sampling_first_token_matches_target_distribution(tiny_engine, min_confidence, sp, monkeypatch):
    """Empirical distribution of sd's first sampled token equals the target's p (chi-square),
    with fixed and with dynamic (confidence-cut) draft lengths, under top-k and under min-p
    (the draft's q goes through the same transform)."""
    from dataclasses import replace

    eng = tiny_engine
    monkeypatch.setattr(eng.verifier.drafters["draft-lm"], "min_confidence", min_confidence)
    ids = eng.encode("def f(x):\n    return")
    with torch.no_grad():
        p = probs_from_logits(eng.verifier.runner.model.forward_train(torch.tensor([ids]))[0, -1], sp)
    n = 1500
    counts = torch.zeros_like(p)
    for seed in range(n):
        out = eng.generate(GenerationRequest(ids, 3, replace(sp, seed=seed), method="sd")).result()
        counts[out["token_ids"][0]] += 1
    keep = p > 0
    assert counts[~keep].sum() == 0
    expected = p[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum()) / (int(keep.sum()) - 1)
    assert stat < 3.0, (counts[keep] / n, p[keep])


def test_seeded_sampling_is_reproducible_and_vanillas_own(tiny_engine):
    """A seeded sd request (a draft LM's drafts, with q) emits vanilla's seeded tokens."""
    ids = tiny_engine.encode("class A:")
    sp = Sampling(temperature=0.9, top_p=0.95, seed=11)
    a = tiny_engine.generate(GenerationRequest(ids, 30, sp, method="sd")).result()
    assert a["token_ids"] == tiny_engine.generate(GenerationRequest(ids, 30, sp, method="sd")).result()["token_ids"]
    assert (
        a["token_ids"] == tiny_engine.generate(GenerationRequest(ids, 30, sp, method="vanilla")).result()["token_ids"]
    )
    assert a["stats"]["accepted_tokens"] > 0


@pytest.fixture
def eos_in_output(tiny_engine):
    """The tiny engine with its end-of-sequence id set to the 11th token of a greedy output
    (restored after): (engine, prompt ids, that 40-token greedy output, the new EOS id)."""
    eng = tiny_engine
    ids = eng.encode(PROMPTS[1])
    ref = eng.generate(GenerationRequest(ids, 40, method="vanilla")).result()["token_ids"]
    old = eng.eos_id, eng.verifier.eos_id
    eng.eos_id = eng.verifier.eos_id = ref[10]
    yield eng, ids, ref, ref[10]
    eng.eos_id, eng.verifier.eos_id = old


def test_ignore_eos_runs_to_the_length_limit_and_stays_lossless(eos_in_output):
    """A request stops at the end-of-sequence token; with ignore_eos it streams that token
    like any other and runs to max_new_tokens, each method equal to vanilla's output."""
    eng, ids, ref, eos = eos_in_output
    for method in ("vanilla", "sd", "suffix"):
        stopped = eng.generate(GenerationRequest(ids, 40, method=method)).result()
        assert stopped["finish_reason"] == "eos" and stopped["token_ids"] == ref[: ref.index(eos)]
        full = eng.generate(GenerationRequest(ids, 40, method=method, ignore_eos=True)).result()
        assert full["finish_reason"] == "length" and full["token_ids"] == ref, method


def test_min_tokens_holds_eos_back_and_stays_lossless(eos_in_output):
    """min_tokens 20 makes the target's second choice take the 11th token's place (the EOS
    logit is −inf before token 20), and every method verifies against that same
    distribution: equal outputs, no EOS before 20, for sampling too."""
    eng, ids, ref, eos = eos_in_output
    outs = {
        m: eng.generate(GenerationRequest(ids, 40, method=m, min_tokens=20)).result()
        for m in ("vanilla", "sd", "suffix")
    }
    van = outs["vanilla"]["token_ids"]
    assert len(van) >= 20 and eos not in van[:20] and van[:10] == ref[:10] and van[10] != eos
    assert all(o["token_ids"] == van for o in outs.values())
    sampled = [
        eng.generate(GenerationRequest(ids, 24, sampling=Sampling(1.0, seed=s), method="sd", min_tokens=24)).result()
        for s in range(4)
    ]
    assert all(len(r["token_ids"]) == 24 and eos not in r["token_ids"] for r in sampled)


PENALTIES = Sampling(repetition_penalty=1.3, presence_penalty=0.3, frequency_penalty=0.4)


def penalized_greedy(model, ids: list[int], n: int, sp: Sampling) -> list[int]:
    """A plain decoding loop, apart from the verifier: the target's full forward, HF's
    repetition-penalty processor over prompt and output, presence and frequency over the output."""
    from transformers import RepetitionPenaltyLogitsProcessor

    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            x = model.forward_train(torch.tensor([ids + out]))[0, -1:].float()
        x = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(torch.tensor([ids + out]), x)[0]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0]).float()
        out.append(int((x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).float()).argmax()))
    return out


def test_penalties_stay_lossless_and_equal_a_plain_penalized_loop(tiny_engine):
    """With repetition, presence and frequency penalties every lossless method's greedy output
    equals a plain penalized decoding loop: each verification row is penalized for the draft
    tokens before it."""
    eng = tiny_engine
    model = eng.verifier.runner.model
    accepted = 0
    for text in PROMPTS[:4]:
        ids = eng.encode(text * 2)
        ref = penalized_greedy(model, ids, 40, PENALTIES)
        assert ref != eng.generate(GenerationRequest(ids, 40, method="vanilla")).result()["token_ids"], text
        for method in ("vanilla", "sd", "suffix"):
            out = eng.generate(GenerationRequest(ids, 40, sampling=PENALTIES, method=method)).result()
            got = out["token_ids"]
            assert got == ref[: len(got)] and (len(got) == 40 or got[-1] == eng.eos_id), (text, method)
            accepted += out["stats"]["accepted_tokens"] if method != "vanilla" else 0
    assert accepted > 0  # drafts were verified under penalties, not only plain steps


def plain_greedy(model, ids: list[int], n: int, eos: int, pick) -> list[int]:
    """A plain loop: the target's full forward, then ``pick(logits, output)`` chooses the token."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            x = model.forward_train(torch.tensor([ids + out]))[0, -1].float()
        token = pick(x, out)
        if token == eos:
            break
        out.append(token)
    return out


def biased_greedy(model, ids: list[int], n: int, sp: Sampling, eos: int) -> list[int]:
    """The bias added, argmax over the allowed tokens."""
    bias = dict(sp.logit_bias)
    return plain_greedy(
        model,
        ids,
        n,
        eos,
        lambda x, out: max(sp.allowed_token_ids or range(x.shape[0]), key=lambda t: float(x[t]) + bias.get(t, 0.0)),
    )


@pytest.mark.parametrize("engine", ["tiny_engine", "tiny_eagle_engine"])
def test_logit_bias_and_allowed_tokens_stay_lossless(request, engine):
    """logit_bias and allowed_token_ids shape every verification row (and the drafters' own
    logits): each lossless method equals a plain biased loop, and only allowed tokens appear."""
    eng = request.getfixturevalue(engine)
    model = eng.verifier.runner.model
    methods = [m for m in ("vanilla", "sd", "suffix", "eagle3") if m in eng.methods()]
    ids = eng.encode(PROMPTS[0] * 2)
    plain = eng.generate(GenerationRequest(ids, 30, method="vanilla")).result()["token_ids"]
    allowed = tuple(sorted(set(plain[::2]) | set(range(200, 400)) | {eng.eos_id}))
    for sp in (
        Sampling(logit_bias=tuple((t, -5.0) for t in plain[:6]) + ((77, 4.0),)),
        Sampling(allowed_token_ids=allowed, logit_bias=((plain[0], -100.0),)),
    ):
        ref = biased_greedy(model, ids, 30, sp, eng.eos_id)
        assert ref != plain
        for method in methods:
            got = eng.generate(GenerationRequest(ids, 30, sampling=sp, method=method)).result()["token_ids"]
            assert got == ref, (method, sp)
            assert not sp.allowed_token_ids or set(got) <= set(sp.allowed_token_ids)


def banned_greedy(model, ids: list[int], n: int, words, eos: int) -> list[int]:
    """Argmax after banning each bad word's last token where the output ends with the rest."""

    def pick(x, out):
        for w in words:
            if len(w) == 1 or len(out) >= len(w) - 1 and tuple(out[len(out) - len(w) + 1 :]) == w[:-1]:
                x[w[-1]] = float("-inf")
        return int(x.argmax())

    return plain_greedy(model, ids, n, eos, pick)


@pytest.mark.parametrize("engine", ["tiny_engine", "tiny_eagle_engine"])
def test_bad_words_stay_lossless(request, engine):
    """bad_words mask each verification row by the output and the draft tokens before it: every
    lossless method equals a plain loop with the same bans, and no banned sequence appears."""
    eng = request.getfixturevalue(engine)
    model = eng.verifier.runner.model
    methods = [m for m in ("vanilla", "sd", "suffix", "eagle3", "hybrid") if m in eng.methods()]
    ids = eng.encode(PROMPTS[0] * 2)
    plain = eng.generate(GenerationRequest(ids, 30, method="vanilla")).result()["token_ids"]
    words = ((plain[3],), (plain[8], plain[9]), tuple(plain[12:15]))  # one, two and three tokens long
    ref = banned_greedy(model, ids, 30, words, eng.eos_id)
    assert ref != plain
    for method in methods:
        got = eng.generate(GenerationRequest(ids, 30, sampling=Sampling(bad_words=words), method=method)).result()
        assert got["token_ids"] == ref, method
        assert not any(
            tuple(got["token_ids"][i : i + len(w)]) == w for w in words for i in range(len(got["token_ids"]))
        )


def test_the_draft_lm_does_not_draft_a_bad_words_last_token(tiny_engine):
    """The draft LM bans, in its own logits, what the target will ban: a one-token word never
    starts its draft, and a two-token word's second token never follows its first."""
    drafter = tiny_engine.verifier.drafters["draft-lm"]
    ids = tiny_engine.encode(PROMPTS[0])

    def draft(words) -> list[int]:
        drafter.start("bw", ids, Sampling(bad_words=words), None, 16)
        try:
            return drafter.propose("bw", 4).token_ids
        finally:
            drafter.stop("bw")

    free = draft(())
    assert len(free) >= 2
    assert draft(((free[0],),))[0] != free[0]
    two = draft(((free[0], free[1]),))
    assert two[0] == free[0] and two[1:2] != free[1:2]


def test_router_drafts_end_before_a_bad_words_last_token():
    """A suffix-cache draft is cut where its next token would complete a bad word, counting
    the output's last tokens as the word's start."""
    from types import SimpleNamespace

    from services.router.engine import Generation

    def cut(output, draft, words):
        gen = SimpleNamespace(req=SimpleNamespace(sampling=Sampling(bad_words=words)), output_ids=output)
        return Generation._without_bad_words(gen, draft)

    assert cut([1, 2], [3, 4, 5], ()) == [3, 4, 5]
    assert cut([1, 2], [3, 4, 5], ((4,),)) == [3]
    assert cut([1, 2], [3, 4, 5], ((2, 3),)) == []  # the word starts in the output
    assert cut([1, 2], [3, 4, 5], ((1, 2, 3, 9), (3, 4, 5))) == [3, 4]
    assert cut([], [7, 8, 9], ((6, 7),)) == [7, 8, 9]


def test_a_reopened_session_counts_its_generated_tokens_as_output(tiny_engine):
    """Failover re-opens a session with prompt + output so far as its prompt; ``generated``
    tells the verifier which part is output, so presence and frequency penalties carry on."""
    from services.common.types import CycleRequest, SessionSpec

    eng = tiny_engine
    sp = Sampling(presence_penalty=2.0, frequency_penalty=2.0)

    def resume(ids: list[int], done: list[int], generated: int) -> list[int]:
        s = eng.verifier.open(SessionSpec(ids + done, 15, sampling=sp, generated=generated))
        out: list[int] = []
        try:
            while len(out) < 15 and eng.eos_id not in out:
                out += s.cycle(CycleRequest()).committed
        finally:
            s.close()
        return out

    differs = 0
    for text in PROMPTS:
        ids = eng.encode(text)
        whole = eng.generate(GenerationRequest(ids, 30, sampling=sp, method="vanilla")).result()["token_ids"]
        if len(whole) < 30:
            continue
        assert resume(ids, whole[:15], 15) == whole[15:], text
        differs += resume(ids, whole[:15], 0) != whole[15:]  # counted as prompt: not penalized
    assert differs > 0


def test_seeded_sampling_is_vanillas_own_whatever_the_drafter(tiny_eagle_engine):
    """A seeded request's drafts (with q or without: draft LM, EAGLE-3 chains and trees, the
    suffix cache, the hybrid's pick among them) are verified by drawing the target's own token
    at each node and following the child that carries it: one draw per emitted token, in
    order, as vanilla sampling draws. So with a seed every method emits exactly vanilla's
    tokens (top-p, top-k and min-p included), while drafts were still accepted; the hybrid's
    per-cycle choice, which follows the suffix cache and measured costs, changes nothing."""
    eng = tiny_eagle_engine
    methods = [
        m
        for m in ("suffix", "suffix-tree", "eagle3", "eagle3-tree", "ngram", "hybrid", "hybrid-csd")
        if m in eng.methods()
    ]
    assert {"eagle3", "hybrid"} <= set(methods)
    accepted = 0
    for i, text in enumerate(PROMPTS[:6]):
        sp = Sampling(
            temperature=0.8, top_p=0.95, top_k=40 if i % 2 else 0, min_p=0.02 if i % 3 == 0 else 0.0, seed=100 + i
        )
        ids = eng.encode(text * 2)
        van = eng.generate(GenerationRequest(ids, 40, sp, method="vanilla")).result()["token_ids"]
        for method in methods:
            out = eng.generate(GenerationRequest(ids, 40, sp, method=method)).result()
            assert out["token_ids"] == van, (method, text)
            accepted += out["stats"]["accepted_tokens"]
    assert accepted > 0


def test_tree_cycles_report_the_accepted_branchs_logprobs(bundled_engine):
    """A tree cycle reads each committed token's logprobs from the row of the node it came
    from, not from the row at its depth: eagle3-tree's and hybrid-tree's logprobs are
    vanilla's, over cycles that accepted off the main chain too."""
    eng = bundled_engine
    for p in load("humaneval", 3):
        ids = eng.encode(p.text)
        van = eng.generate(GenerationRequest(ids, 40, method="vanilla", logprobs=3)).result()
        for method in ("eagle3-tree", "hybrid-tree"):
            tree = eng.generate(GenerationRequest(ids, 40, method=method, logprobs=3)).result()
            assert tree["token_ids"] == van["token_ids"] and tree["stats"]["accepted_tokens"] > 0, method
            for a, b in zip(tree["logprobs"], van["logprobs"]):
                assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-4, method
                assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
