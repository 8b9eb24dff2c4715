"""Draft vocabularies (services/drafter/vocab.py): the frequency ranking, and the draft LM
restricted to it (FR-Spec) — drafts inside it, q zero outside, sd still lossless."""

import shutil

import pytest
import torch

from services.common.config import EngineConfig
from services.common.types import Sampling
from services.drafter.vocab import RANKING_FILE, coverage, frequency_ranking, load_ranking, save_ranking, top_vocabulary
from services.router.engine import Engine, GenerationRequest


def test_ranking_is_by_next_token_frequency_then_id(tmp_path):
    seqs = [[9, 5, 5, 5, 7, 7, 3], [5, 4, 4, 3], [6]]  # labels: 5×3; 3, 4, 7 ×2; a 1-token sequence has none
    r = frequency_ranking(seqs, 10)
    assert r[:4].tolist() == [5, 3, 4, 7] and sorted(r.tolist()) == list(range(10))
    assert r[4:].tolist() == [0, 1, 2, 6, 8, 9]  # unseen ids by id
    assert top_vocabulary(r, 3).tolist() == [3, 4, 5]
    save_ranking(tmp_path / "r.json", r, "test")
    assert torch.equal(load_ranking(tmp_path / "r.json"), r)


@pytest.fixture(scope="module")
def restricted(tiny_dirs, tmp_path_factory):
    """The tiny draft with a ranking that puts 600 mid-range ids first; an engine serving its 600."""
    target, draft = tiny_dirs
    d = tmp_path_factory.mktemp("draft") / "draft"
    shutil.copytree(draft, d)
    seqs = [list(range(1000 + 7 * i, 1000 + 7 * i + 50)) for i in range(30)]
    save_ranking(d / RANKING_FILE, frequency_ranking(seqs, 8192), "test")
    eng = Engine(
        EngineConfig(
            target=target,
            draft=d,
            num_speculative_tokens=4,
            draft_confidence=0.0,
            draft_vocab=600,
            max_new_tokens_limit=200,
            eagle3=None,
            predictor=None,
            ocm_snapshot=None,
        )
    )
    return eng, set(top_vocabulary(load_ranking(d / RANKING_FILE), 600).tolist())


def test_restricted_draft_lm_stays_lossless(restricted, tiny_engine):
    eng, _ = restricted
    for text in ["def add(a, b):\n", "import os\nimport sys\n", "x = [1, 2"]:
        ids = eng.encode(text)
        want = tiny_engine.generate(GenerationRequest(ids, 40, method="vanilla")).result()["token_ids"]
        got = eng.generate(GenerationRequest(ids, 40, method="sd")).result()
        assert got["token_ids"] == want and got["stats"]["draft_tokens"] > 0


def test_restricted_drafts_and_q_stay_inside_the_vocabulary(restricted):
    eng, allowed = restricted
    drafter = eng.verifier.drafters["draft-lm"]
    prompt = eng.encode("def f(x):\n")
    drafter.start("g", prompt, Sampling(), None)
    assert set(drafter.propose("g", 4).token_ids) <= allowed
    drafter.start("s", prompt, Sampling(1.0, 1.0, 0, 3), torch.Generator().manual_seed(0))
    d = drafter.propose("s", 4)
    outside = torch.ones(8192, dtype=torch.bool)
    outside[list(allowed)] = False
    assert d.token_ids and set(d.token_ids) <= allowed
    assert float(d.probs[:, outside].sum()) == 0.0 and torch.allclose(d.probs.sum(-1), torch.ones(len(d.token_ids)))
    out = eng.generate(GenerationRequest(prompt, 20, Sampling(0.8, 0.9, 0, 5), method="sd", ignore_eos=True)).result()
    assert len(out["token_ids"]) == 20


def test_draft_vocab_without_a_ranking_is_refused(tiny_dirs):
    target, draft = tiny_dirs
    with pytest.raises(ValueError, match=RANKING_FILE):
        Engine(
            EngineConfig(target=target, draft=draft, draft_vocab=600, eagle3=None, predictor=None, ocm_snapshot=None)
        )


def test_auto_draft_vocab_follows_the_shipped_ranking(tiny_dirs, restricted):
    """-1 (the default): 4,096 tokens where the draft ships a ranking, the whole vocabulary
    where it does not (a user's own draft); 0: always the whole vocabulary."""
    from services.verifier.core import draft_vocabulary

    target, draft = tiny_dirs
    shipped = restricted[0].cfg.draft
    assert draft_vocabulary(EngineConfig(target=target, draft=draft, draft_vocab=-1)) is None
    auto = draft_vocabulary(EngineConfig(target=target, draft=shipped, draft_vocab=-1))
    assert len(auto) == 4096 and set(restricted[1]) <= set(auto.tolist())
    assert draft_vocabulary(EngineConfig(target=target, draft=shipped, draft_vocab=0)) is None
    assert draft_vocabulary(EngineConfig(target=target, draft=shipped, draft_vocab=8192)) is None


def test_training_vocab_writes_the_ranking_beside_the_drafter(tmp_path, monkeypatch, capsys):
    """training.vocab: ranks the traces' next tokens, reports coverage, writes token_ranking.json."""
    import sys

    from services.drafter.replay import Trace, save_traces
    from training import vocab

    traces = [Trace("a", [1, 2], [7, 7, 7, 3, 7, 7, 3, 5], 16), Trace("b", [4], [7, 3, 9, 7, 3, 7, 7, 3], 16)]
    save_traces(tmp_path / "t.jsonl", traces)
    assert coverage([[1, 7, 7, 3]], torch.tensor([7]), 16) == 2 / 3
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "vocab",
            "--traces",
            str(tmp_path / "t.jsonl"),
            "--out",
            str(tmp_path),
            "--vocab",
            "16",
            "--heldout",
            str(tmp_path / "t.jsonl"),
        ],
    )
    vocab.main()
    ranking = load_ranking(tmp_path / RANKING_FILE)
    assert ranking[:5].tolist() == [7, 3, 2, 5, 9] and sorted(ranking.tolist()) == list(range(16))
    assert "100.0% of training tokens, 100.0% held-out" in capsys.readouterr().out
