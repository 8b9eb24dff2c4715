"""`training.distill` end to end on tiny models: the soft cross-entropy to the target falls and
the distilled draft's drafts are accepted far more often; a finished run is not repeated, but a
changed target is distilled toward again."""

import json
import subprocess
import sys

from bench.workloads import Prompt
from services.common.config import EngineConfig
from services.drafter.replay import save_traces
from services.router.engine import Engine, GenerationRequest
from tests.conftest import make_tiny
from training.evaluate import distill_row
from training.traces import record_traces


def acceptance(target, draft, prompts) -> float:
    eng = Engine(EngineConfig(target=target, draft=draft, eagle3=None, draft_confidence=0.0, max_new_tokens_limit=200))
    acc = drafted = 0
    for p in prompts:
        r = eng.generate(GenerationRequest(eng.encode(p.text), 40, method="sd")).result()
        acc, drafted = acc + r["stats"]["accepted_tokens"], drafted + r["stats"]["draft_tokens"]
    return acc / drafted


def test_distill_draft_on_target_traces(tiny_dirs, tmp_path):
    target = tiny_dirs[0]
    draft = make_tiny(tmp_path / "draft", seed=5, layers=1)  # unrelated to the target
    (draft / "training_state.json").write_text(json.dumps({"preset": "draft", "step": 1}))
    eng = Engine(EngineConfig(target=target, draft=None, eagle3=None, max_new_tokens_limit=200))
    prompts = [
        Prompt(f"p{i}", t)
        for i, t in enumerate(["def f(x):\n", "import os\n", "class A:\n", "for i in range(3):\n", "x = [", "return"])
    ]
    save_traces(tmp_path / "t.jsonl", record_traces(eng, prompts, 48, progress=False))
    before = acceptance(target, draft, prompts)
    cmd = [
        sys.executable,
        "-m",
        "training.distill",
        "--draft",
        str(draft),
        "--target",
        str(target),
        "--traces",
        str(tmp_path / "t.jsonl"),
        "--out",
        str(draft),
        "--work-dir",
        str(tmp_path / "work"),
        "--epochs",
        "40",
        "--batch-tokens",
        "256",
        "--log-every",
        "1",
        "--lr",
        "3e-3",
        "--threads",
        "1",
    ]
    log = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    losses = [float(line.split("soft-CE ")[1].split()[0]) for line in log.splitlines() if "soft-CE" in line]
    assert len(losses) > 10 and losses[-1] < 0.7 * losses[0], losses
    state = json.loads((draft / "training_state.json").read_text())
    assert state["preset"] == "draft" and state["distill"]["final"]
    assert "40 epochs" in distill_row(state) and "in progress" not in distill_row(state)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "already distilled" in again
    after = acceptance(target, draft, prompts)
    assert after > max(0.2, 2 * before), (before, after)
    retuned = make_tiny(tmp_path / "target2", seed=3)  # new target weights, same shape
    cmd2 = list(cmd)
    cmd2[cmd2.index("--target") + 1], cmd2[cmd2.index("--epochs") + 1] = str(retuned), "1"
    log2 = subprocess.run(cmd2, capture_output=True, text=True, timeout=300, check=True).stdout
    assert "distilled toward other target weights" in log2 and "resumed" not in log2
    state2 = json.loads((draft / "training_state.json").read_text())
    assert state2["distill"]["final"] and state2["distill"]["target"] != state["distill"]["target"]
