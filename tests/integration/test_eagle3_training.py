"""`training.eagle3` end to end on the tiny target: loss falls, the head loads and drafts."""

import json
import shutil
import subprocess
import sys

import torch

from bench.workloads import Prompt
from services.common.config import EngineConfig
from services.drafter.replay import save_traces
from services.router.engine import Engine, GenerationRequest
from tests.conftest import make_tiny
from training.precision import bf16_native
from training.traces import record_traces


def acceptance(target, head_dir, prompts) -> float:
    eng = Engine(EngineConfig(target=target, draft=None, eagle3=head_dir, max_new_tokens_limit=200))
    acc = drafted = 0
    for p in prompts:
        ids = eng.encode(p.text)
        r = eng.generate(GenerationRequest(ids, 40, method="eagle3")).result()
        assert r["token_ids"] == eng.generate(GenerationRequest(ids, 40, method="vanilla")).result()["token_ids"]
        acc += r["stats"]["accepted_tokens"]
        drafted += r["stats"]["draft_tokens"]
    return acc / drafted


def first_loss(log: str) -> float:
    return next(float(line.split("loss/step ")[1].split()[0]) for line in log.splitlines() if "loss/step" in line)


def d2t(head_dir):
    from safetensors.torch import load_file

    return load_file(str(head_dir / "model.safetensors"))["d2t"]


def test_train_eagle3_head_on_traces(tiny_dirs, tiny_eagle3, tmp_path):
    target = tiny_dirs[0]
    eng = Engine(EngineConfig(target=target, draft=None, eagle3=None, max_new_tokens_limit=200))
    prompts = [
        Prompt(f"p{i}", t)
        for i, t in enumerate(["def f(x):\n", "import os\n", "class A:\n", "for i in range(3):\n", "x = [", "return"])
    ]
    save_traces(tmp_path / "t.jsonl", record_traces(eng, prompts, 48, progress=False))
    out = tmp_path / "head"
    cmd = [
        sys.executable,
        "-m",
        "training.eagle3",
        "--target",
        str(target),
        "--traces",
        str(tmp_path / "t.jsonl"),
        "--out",
        str(out),
        "--work-dir",
        str(tmp_path / "work"),
        "--epochs",
        "30",
        "--batch-tokens",
        "256",
        "--ttt-steps",
        "3",
        "--log-every",
        "1",
        "--lr",
        "3e-3",
    ]
    log = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    losses = [float(line.split("loss/step ")[1].split()[0]) for line in log.splitlines() if "loss/step" in line]
    assert len(losses) > 10 and losses[-1] < 0.7 * losses[0], losses
    state = json.loads((out / "training_state.json").read_text())
    assert state["final"] and state["ttt_steps"] == 3
    assert state["bf16"] is bf16_native(torch.device("cpu"))  # autocast where bf16 matmuls are native
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "resumed" in again  # a finished run resumes from its checkpoint instead of restarting
    shutil.copytree(tmp_path / "work", tmp_path / "work2")  # that checkpoint, found by a run for new target weights
    other = list(cmd)
    for flag, value in (
        ("--target", make_tiny(tmp_path / "target2", seed=3)),
        ("--epochs", 1),
        ("--work-dir", tmp_path / "work2"),
        ("--out", tmp_path / "head2"),
    ):
        other[other.index(flag) + 1] = str(value)
    fresh = subprocess.run(other, capture_output=True, text=True, timeout=300, check=True).stdout
    assert "other target weights; starting afresh" in fresh and "resumed" not in fresh
    assert json.loads((tmp_path / "head2" / "training_state.json").read_text())["target"] != state["target"]
    small = list(other)  # a draft vocabulary of the 300 most frequent tokens
    for flag, value in (("--target", target), ("--work-dir", tmp_path / "work3"), ("--out", tmp_path / "head3")):
        small[small.index(flag) + 1] = str(value)
    log3 = subprocess.run(
        small + ["--draft-vocab", "300"], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    assert "draft vocabulary 300 (" in log3
    state3 = json.loads((tmp_path / "head3" / "training_state.json").read_text())
    assert state3["draft_vocab"] == 300 and 0.5 < state3["draft_vocab_coverage"] <= 1.0
    assert json.loads((tmp_path / "head3" / "config.json").read_text())["draft_vocab_size"] == 300
    assert acceptance(target, tmp_path / "head3", prompts) >= 0.0  # loads, drafts, equals vanilla
    warm = list(small)  # --init: head3 trained on, keeping its vocabulary
    for flag, value in (("--work-dir", tmp_path / "work4"), ("--out", tmp_path / "head4")):
        warm[warm.index(flag) + 1] = str(value)
    log4 = subprocess.run(
        warm + ["--draft-vocab", "300", "--init", str(tmp_path / "head3")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert first_loss(log4) < first_loss(log3), (first_loss(log4), first_loss(log3))
    assert json.loads((tmp_path / "head4" / "training_state.json").read_text())["init"]["step"] == state3["step"]
    assert d2t(tmp_path / "head4").equal(d2t(tmp_path / "head3"))
    refused = subprocess.run(
        warm + ["--draft-vocab", "200", "--init", str(tmp_path / "head3")], capture_output=True, text=True, timeout=300
    )
    assert refused.returncode != 0 and "draft vocabulary 300" in refused.stderr
    stage2 = list(small)  # stage 1's work dir holds its finished checkpoint: a continuation must not resume it
    stage2[stage2.index("--out") + 1] = str(tmp_path / "head5")
    log5 = subprocess.run(
        stage2 + ["--draft-vocab", "300", "--init", str(tmp_path / "head3")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "starting afresh" in log5 and "resumed" not in log5 and "loss/step" in log5
    trained, untrained = acceptance(target, out, prompts), acceptance(target, tiny_eagle3, prompts)
    assert trained > max(0.05, 2 * untrained), (trained, untrained)  # it learned the target's continuations
