"""`training.draft_from_target` on the tiny target: a draft cut from its first layers, trained,
stored without the target's embedding, served beside the target losslessly."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from bench.workloads import Prompt
from services.common.config import EngineConfig
from services.common.llama import Llama
from services.drafter.replay import save_traces
from services.router.engine import Engine, GenerationRequest
from training.traces import record_traces


def test_a_draft_cut_from_the_target_trains_shares_its_embedding_and_serves_losslessly(tiny_dirs, tmp_path):
    target = tiny_dirs[0]
    eng = Engine(EngineConfig(target=target, draft=None, eagle3=None, predictor=None, max_new_tokens_limit=200))
    prompts = [Prompt(f"p{i}", t) for i, t in enumerate(["def f(x):\n", "import os\n", "class A:\n", "x = ["])]
    save_traces(tmp_path / "t.jsonl", record_traces(eng, prompts, 48, progress=False))
    out = tmp_path / "draft"
    cmd = [
        sys.executable,
        "-m",
        "training.draft_from_target",
        "--target",
        str(target),
        "--layers",
        "1",
        "--traces",
        str(tmp_path / "t.jsonl"),
        "--out",
        str(out),
        "--work-dir",
        str(tmp_path / "work"),
        "--epochs",
        "20",
        "--batch-tokens",
        "256",
        "--log-every",
        "1",
        "--lr",
        "3e-3",
    ]
    log = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    losses = [float(line.split("soft-CE ")[1].split()[0]) for line in log.splitlines() if "soft-CE" in line]
    assert len(losses) > 10 and losses[-1] < 0.9 * losses[0], losses  # (an EMA: it lags)
    state = json.loads((out / "training_state.json").read_text())
    assert state["from_target"]["layers"] == 1 and state["distill"]["final"]
    stored = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith("model.embed_tokens") for k in stored)  # the target's, not stored
    assert {k.split(".")[2] for k in stored if k.startswith("model.layers.")} == {"0"}  # of the target's 2

    tgt = Llama.from_pretrained(target)
    with pytest.raises(ValueError, match="shares its target's embedding"):
        Llama.from_pretrained(out)  # alone it cannot run: the error says to load it beside its target
    draft = Llama.from_pretrained(out, target_embed=tgt.embed_tokens.weight)
    assert torch.equal(draft.embed_tokens.weight, tgt.embed_tokens.weight)
    assert not torch.equal(draft.layers[0].mlp.down_proj.weight, tgt.layers[0].mlp.down_proj.weight)  # trained

    served = Engine(EngineConfig(target=target, draft=out, eagle3=None, predictor=None, max_new_tokens_limit=200))
    for p in prompts:
        ids = served.encode(p.text)
        sd = served.generate(GenerationRequest(ids, 40, method="sd")).result()
        assert sd["token_ids"] == served.generate(GenerationRequest(ids, 40, method="vanilla")).result()["token_ids"]
        assert sd["stats"]["draft_tokens"] > 0

    from bench.harness import HFPeers

    peers = HFPeers(target, out, served.eos_id)  # transformers' assisted decoding with the same draft
    assert torch.equal(peers.draft.model.embed_tokens.weight, peers.target.model.embed_tokens.weight)
    ids = served.encode(prompts[0].text)
    assert peers.run("hf-assisted", ids, 24).ids == peers.run("hf-vanilla", ids, 24).ids

    from training.cards import chain_acceptance, draft_card

    # its card: acceptance per position on the target's own continuations, falling with position,
    # and all of them for the target itself as the draft (it agrees with itself everywhere)
    ev = draft_card(out, target, [tmp_path / "t.jsonl"], vocab=0, regenerate="test")
    accept = ev["acceptance_per_position"]
    assert ev["positions_measured"] > 100 and 0 < accept[-1] <= accept[0] <= 1
    assert 0 < ev["share"] < 1 and "step cost" in (out / "README.md").read_text()
    assert chain_acceptance(tgt, tgt, [tmp_path / "t.jsonl"], None)["acceptance_per_position"] == [1.0] * 4


def test_a_draft_trains_on_cached_labels_over_its_reduced_head_and_exports_the_whole_one(tiny_dirs, tmp_path):
    """--cache: the target's top-k labels read back (training/target_cache.py) instead of its
    forward; --loss-vocab: the draft scores only the traces' most frequent ids, as its FR-Spec head
    will; the export keeps the target's whole (tied) head, and the draft serves losslessly."""
    target = tiny_dirs[0]
    eng = Engine(EngineConfig(target=target, draft=None, eagle3=None, predictor=None, max_new_tokens_limit=200))
    prompts = [Prompt(f"p{i}", t) for i, t in enumerate(["def g(y):\n", "from x import y\n", "for i in"])]
    save_traces(tmp_path / "t.jsonl", record_traces(eng, prompts, 48, progress=False))
    run = lambda *a: subprocess.run([sys.executable, "-m", *a], capture_output=True, text=True, timeout=600, check=True)  # noqa: E731
    run("training.target_cache", "--target", str(target), "--traces", str(tmp_path / "t.jsonl"), "--out",
        str(tmp_path / "cache"), "--top-k", "8", "--threads", "1")  # fmt: skip
    out = tmp_path / "draft"
    log = run("training.draft_from_target", "--target", str(target), "--layers", "1", "--traces",
              str(tmp_path / "t.jsonl"), "--cache", str(tmp_path / "cache"), "--loss-vocab", "512", "--out",
              str(out), "--work-dir", str(tmp_path / "work"), "--epochs", "20", "--batch-tokens", "256",
              "--log-every", "1", "--lr", "3e-3", "--corpus-tokens", "512").stdout  # fmt: skip
    losses = [float(line.split("soft-CE ")[1].split()[0]) for line in log.splitlines() if "soft-CE" in line]
    assert len(losses) > 10 and losses[-1] < 0.9 * losses[0], losses
    state = json.loads((out / "training_state.json").read_text())["distill"]
    assert state["final"] and state["loss_vocab"] == 512 and state["cached_labels"]
    # the data is the cache's: its corpus tokens are recorded, not --corpus-tokens (unused with --cache)
    assert state["corpus_tokens"] == json.loads((tmp_path / "cache/meta.json").read_text())["corpus_tokens"] == 0
    stored = load_file(str(out / "model.safetensors"))
    assert not any("lm_head" in k or "embed_tokens" in k for k in stored)  # the target's, handed over
    tgt = Llama.from_pretrained(target)
    draft = Llama.from_pretrained(out, target_embed=tgt.embed_tokens.weight)
    assert draft.lm_head.weight.shape[0] == tgt.s.vocab  # the whole head came back
    served = Engine(EngineConfig(target=target, draft=out, eagle3=None, predictor=None, max_new_tokens_limit=200))
    for p in prompts:
        ids = served.encode(p.text)
        sd = served.generate(GenerationRequest(ids, 40, method="sd")).result()
        assert sd["token_ids"] == served.generate(GenerationRequest(ids, 40, method="vanilla")).result()["token_ids"]
