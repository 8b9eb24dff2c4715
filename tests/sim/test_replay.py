"""The replay simulator reproduces a real `suffix` run: identical τ, cycles and acceptance."""

import json
import subprocess
import sys

from bench.workloads import Prompt
from services.common.config import EngineConfig
from services.drafter.replay import load_traces, replay, save_traces
from services.drafter.suffix import SuffixDrafter
from services.router.engine import Engine, GenerationRequest
from training.traces import record_traces

PROMPTS = [
    Prompt(f"p{i}", t)
    for i, t in enumerate(
        [
            "def area(r):\n    return 3.14 * r * r\n\ndef area(r):\n",
            "import os\nimport sys\nimport os\n",
            "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [",
            "class A:\n    pass\n\nclass B:\n    pass\n\nclass",
        ]
    )
] * 2  # the second round drafts from the global tree


def fresh_engine(tiny_dirs) -> Engine:
    return Engine(EngineConfig(target=tiny_dirs[0], draft=None, max_new_tokens_limit=200))


def real_run(eng: Engine, traces, method: str) -> dict:
    """The engine's own run of ``method`` over the traces' prompts (40 tokens each): the same
    tokens as the traces, and its speculation counters summed."""
    real = {"cycles": 0, "generated_tokens": 0, "draft_tokens": 0, "accepted_tokens": 0}
    for p, tr in zip(PROMPTS, traces):
        out = eng.generate(GenerationRequest(eng.encode(p.text), 40, method=method)).result()
        assert out["token_ids"] == tr.output_ids
        for k in real:
            real[k] += out["stats"][k]
    return real


def test_replay_equals_real_suffix_run(tiny_dirs, tmp_path):
    traces = record_traces(fresh_engine(tiny_dirs), PROMPTS, 40, progress=False)
    path = tmp_path / "t.jsonl"
    save_traces(path, traces)
    assert load_traces(path) == traces

    eng = fresh_engine(tiny_dirs)
    real = real_run(eng, traces, "suffix")
    sim = replay(SuffixDrafter(eng.cfg.suffix), traces, eng.max_draft["suffix"]).report()
    assert {k: sim[k] for k in real} == real
    assert sim["tau"] == round(real["generated_tokens"] / real["cycles"], 4)
    assert real["accepted_tokens"] > 0


def test_tree_replay_equals_real_suffix_tree_run(tiny_dirs):
    """Speculation trees: the replay's greedy walk over each tree against the trace is the
    verifier's over the target's logits, cycle for cycle; the trees do branch here."""
    from dataclasses import replace

    traces = record_traces(fresh_engine(tiny_dirs), PROMPTS, 40, progress=False)
    eng = fresh_engine(tiny_dirs)
    real = real_run(eng, traces, "suffix-tree")
    tree = SuffixDrafter(replace(eng.cfg.suffix, tree=True))
    sim = replay(tree, traces, eng.max_draft["suffix-tree"]).report()
    assert {k: sim[k] for k in real} == real
    chain = replay(SuffixDrafter(eng.cfg.suffix), traces, eng.max_draft["suffix"]).report()
    assert sim["draft_tokens"] != chain["draft_tokens"]  # some drafts were trees


def test_replay_cli_reports_metrics(tiny_dirs, tmp_path):
    traces = record_traces(fresh_engine(tiny_dirs), PROMPTS[:4], 24, progress=False)
    save_traces(tmp_path / "t.jsonl", traces)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "replay",
            "--drafter",
            "suffix",
            "--traces",
            str(tmp_path / "t.jsonl"),
            "--suffix-max-draft",
            "5",
            "--out",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["tau"] >= 1.0 and rep["cycles"] > 0 and "acceptance_per_position" in rep
    assert sum(rep["draft_length_histogram"].values()) == rep["cycles"]
    assert rep["max_draft"] == 5 and max(int(n) for n in rep["draft_length_histogram"]) <= 5
    assert out.stdout


def test_concurrent_trace_recording_equals_sequential(tiny_dirs):
    """Traces recorded with requests in flight together (batched verification, a global
    suffix tree filled in another order) are the same target tokens, in prompt order."""
    one = record_traces(fresh_engine(tiny_dirs), PROMPTS, 32, progress=False, method="suffix")
    many = record_traces(fresh_engine(tiny_dirs), PROMPTS, 32, progress=False, method="suffix", concurrency=4)
    assert many == one
