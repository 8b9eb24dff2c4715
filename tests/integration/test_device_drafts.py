"""Device drafts (``EngineConfig.device_drafts``): a draft-LM or EAGLE-3 chain of greedy,
unconstrained requests keeps its tokens on the device and is read once per draft, and an EAGLE
draft tree is grown on the device and read once. Their drafts must be the host loop's, token for
token, with and without a confidence cut, for rows of
different budgets in one batch, and across cycles (the caches' rollback). (The hybrid is left
out of the engine-level comparison: its suffix cache learns the first run's outputs, so a second
run drafts differently whatever the chains do; its host reads are counted in test_host_syncs.)"""

import pytest
import torch

from services.common.llama import Llama
from services.common.types import Sampling
from services.drafter.draft_lm import DraftLMDrafter
from services.drafter.vocab import frequency_ranking, top_vocabulary
from services.router.engine import GenerationRequest

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "import os\n\nfor name in os.listdir('.'):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]


def drafts_of(drafter: DraftLMDrafter, prompts: list[list[int]], budgets: list[int], cycles: int) -> list:
    """Every cycle's drafts for the prompts in one batch; each cycle commits the first half of
    its draft plus a token of its own (a partial acceptance: the cache rolls back)."""
    sp = Sampling(temperature=0.0)
    for i, ids in enumerate(prompts):
        drafter.start(str(i), ids, sp, None)
    seen = []
    for c in range(cycles):
        drafts = drafter.propose_batch([(str(i), b) for i, b in enumerate(budgets)])
        seen.append([(d.token_ids, drafter.states[str(i)].cache_len) for i, d in enumerate(drafts)])
        for i, d in enumerate(drafts):
            drafter.observe(str(i), d.token_ids[: len(d.token_ids) // 2] + [100 + 7 * c + i])
    return seen


@pytest.mark.parametrize("confidence", [0.0, 0.3])
@pytest.mark.parametrize("restricted", [False, True])
def test_device_drafts_draft_the_host_loops_tokens(tiny_engine, tiny_dirs, confidence, restricted):
    model = Llama.from_pretrained(tiny_dirs[1])
    prompts = [tiny_engine.encode(p) for p in PROMPTS]
    vocab = top_vocabulary(frequency_ranking(prompts, 8192), 1024) if restricted else None
    budgets = [4, 2, 6]
    host = drafts_of(DraftLMDrafter(model, confidence, vocab), prompts, budgets, 4)
    device = drafts_of(DraftLMDrafter(model, confidence, vocab, device_drafts=True), prompts, budgets, 4)
    assert device == host
    cut = [len(toks) < b for cycle in host for (toks, _), b in zip(cycle, budgets)]
    # without a cut every chain is drafted whole; with one, some end early (else the test could not tell)
    assert any(cut) if confidence else not any(cut)


def cycle_drafts(engine, method: str, monkeypatch) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's greedy output and every draft its cycles verified."""
    seen: list[list[int]] = []
    verifier = engine.verifier
    drafter = verifier.drafters["eagle3" if method == "eagle3" else "draft-lm"]
    propose = drafter.propose_batch

    def recorded(asks):
        drafts = propose(asks)
        seen.extend(d.token_ids for d in drafts)
        return drafts

    monkeypatch.setattr(drafter, "propose_batch", recorded)
    outs = []
    for p in PROMPTS:
        req = GenerationRequest(engine.encode(p), 40, method=method, ignore_eos=True)
        outs.append(engine.generate(req).result()["token_ids"])
    monkeypatch.undo()
    return outs, seen


@pytest.mark.parametrize("method", ["sd", "scg", "eagle3"])
def test_device_drafts_serve_the_same_drafts_and_tokens(tiny_engine, bundled_engine, method, monkeypatch):
    engine = tiny_engine if method in ("sd", "scg") else bundled_engine
    name = "draft-lm" if method in ("sd", "scg") else "eagle3"
    drafter = engine.verifier.drafters[name]
    host = cycle_drafts(engine, method, monkeypatch)
    monkeypatch.setattr(drafter, "device_drafts", True)
    device = cycle_drafts(engine, method, monkeypatch)
    assert device == host
    assert any(host[1]), "no draft was verified: nothing compared"
    if method != "scg":  # lossless (scg relaxes acceptance; csd too, and its memory learns between runs)
        vanilla = [
            engine.generate(GenerationRequest(engine.encode(p), 40, method="vanilla", ignore_eos=True)).result()[
                "token_ids"
            ]
            for p in PROMPTS
        ]
        assert device[0] == vanilla


def test_device_trees_draft_the_host_loops_trees(bundled_engine, monkeypatch):
    """EAGLE draft trees grown on the device and read once (``_grow_on_device``) are the host
    loop's trees: the same nodes, parents and scores, cycle by cycle, and the same tokens."""
    drafter = bundled_engine.verifier.drafters["eagle3-tree"]
    trees: dict[bool, list] = {False: [], True: []}
    tokens: dict[bool, list] = {False: [], True: []}
    for on in (False, True):
        monkeypatch.setattr(drafter, "device_drafts", on)
        name = "_grow_on_device" if on else "_grow"
        grow = getattr(drafter, name)
        monkeypatch.setattr(
            drafter, name, lambda rows, grow=grow, on=on: trees[on].extend(grow(rows)) or trees[on][-len(rows) :]
        )
        for p in PROMPTS:
            req = GenerationRequest(bundled_engine.encode(p), 40, method="eagle3-tree", ignore_eos=True)
            tokens[on].append(bundled_engine.generate(req).result()["token_ids"])
        monkeypatch.undo()
    assert len(trees[True]) > len(PROMPTS), "no tree was drafted"
    assert [(d.token_ids, d.parents, d.token_probs) for d in trees[True]] == [
        (d.token_ids, d.parents, d.token_probs) for d in trees[False]
    ]
    assert tokens[True] == tokens[False]
    # Three completions of one prompt grow their trees in lockstep, several in one call (which
    # calls group which is the batcher's timing, so only their tokens are compared).
    widths: list[int] = []
    grow = drafter._grow_on_device
    monkeypatch.setattr(drafter, "device_drafts", True)
    monkeypatch.setattr(drafter, "_grow_on_device", lambda rows: widths.append(len(rows)) or grow(rows))
    req = GenerationRequest(bundled_engine.encode(PROMPTS[0]), 24, method="eagle3-tree", ignore_eos=True, n=3)
    completions = bundled_engine.generate_all(req)
    for _ in completions:
        pass
    assert max(widths) > 1, "no call grew several requests' trees"
    assert all(g.result()["token_ids"] == tokens[False][0][:24] for g in completions.gens)


def test_sampled_device_chains_draw_from_the_q_they_return(tiny_engine, tiny_dirs):
    """A sampled request's device chain draws each token from its q on the device and returns
    those q rows (rejection sampling needs them): top-k 1 draws the argmax with a one-hot q,
    and at a temperature every token has mass in its row, each row a distribution."""
    model = Llama.from_pretrained(tiny_dirs[1])
    prompt = tiny_engine.encode(PROMPTS[0])
    greedy = DraftLMDrafter(model, 0.0)
    greedy.start("g", prompt, Sampling(temperature=0.0), None)
    want = greedy.propose("g", 5).token_ids
    for sp, check_argmax in (
        (Sampling(temperature=1.0, top_k=1), True),
        (Sampling(temperature=0.9), False),
    ):
        drafter = DraftLMDrafter(model, 0.0, device_drafts=True)
        drafter.start("s", prompt, sp, torch.Generator().manual_seed(3))
        d = drafter.propose_batch([("s", 5)])[0]
        assert d.probs is not None and d.probs.shape == (5, 8192)
        assert torch.allclose(d.probs.sum(-1), torch.ones(5), atol=1e-4)
        assert all(d.probs[i, t] > 0 for i, t in enumerate(d.token_ids))
        if check_argmax:
            assert d.token_ids == want and all(d.probs[i, t] == 1 for i, t in enumerate(d.token_ids))


@pytest.mark.parametrize("method", ["sd", "eagle3"])
def test_seeded_sampling_with_device_drafts_gives_vanillas_tokens(tiny_engine, bundled_engine, method, monkeypatch):
    """A seeded request's tokens are vanilla's own draws whatever its drafts drew on the device,
    and its drafts were drawn there (each cycle's q rows came back with them)."""
    engine = tiny_engine if method == "sd" else bundled_engine
    drafter = engine.verifier.drafters["draft-lm" if method == "sd" else "eagle3"]
    monkeypatch.setattr(drafter, "device_drafts", True)
    chains = drafter._device_chains
    drawn: list[int] = []
    monkeypatch.setattr(drafter, "_device_chains", lambda rows, *a: drawn.append(len(rows)) or chains(rows, *a))
    sp = Sampling(temperature=0.8, top_p=0.95, seed=11)
    for p in PROMPTS:
        ids = engine.encode(p)
        out = engine.generate(GenerationRequest(ids, 32, sampling=sp, method=method, ignore_eos=True)).result()
        van = engine.generate(GenerationRequest(ids, 32, sampling=sp, method="vanilla", ignore_eos=True)).result()
        assert out["token_ids"] == van["token_ids"]
    assert drawn, "no chain was drafted on the device"
