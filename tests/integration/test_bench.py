"""bench.harness on the tiny models: interleaved rows, lossless exact match, cycle profile."""

import os

import pytest

from bench.harness import benchmark, markdown
from bench.workloads import Prompt


def test_benchmark_rows_and_cycle_profile(tiny_engine):
    prompts = [Prompt("a", "def add(a, b):\n"), Prompt("b", "import os\n\nclass Config:\n")]
    rows = {r["method"]: r for r in benchmark(tiny_engine, prompts, ["vanilla", "sd"], 24, 1, None)}
    van, sd = rows["vanilla"], rows["sd"]
    assert van["speedup_vs_vanilla"] == 1.0 and van["tau"] == 1.0 and van["cycles_per_1k"] == 1000.0
    assert sd["exact_match_vs_vanilla"] == 1.0 and sd["tau"] > 1.0 and 0 < sd["acceptance_rate"] <= 1
    assert van["verify_ms_per_cycle"] > 0 and sd["draft_ms_per_cycle"] > van["draft_ms_per_cycle"]
    assert set(van["cycles_by_source"]) == {"none"} and sd["cycles_by_source"]["draft-lm"] > 0
    cycles = sd["cycles_per_1k"] * sd["mean_new_tokens"] * len(prompts) / 1000
    assert abs(sum(sd["cycles_by_source"].values()) - cycles) <= 1.5
    per_token = 1e3 / sd["tokens_per_s"]
    assert sd["other_ms_per_cycle"] >= 0 and sd["verify_ms_per_cycle"] < per_token * sd["tau"] * 1.5
    table = markdown(
        {"workload": "t", "limit": 2, "max_new_tokens": 24, "command": "c", "machine": "m", "rows": list(rows.values())}
    )
    assert "draft_ms_per_cycle" in table and table.count("\n| ") >= 3


def test_hf_peers_are_reported_against_both_baselines(tiny_engine, tiny_dirs):
    """Each row carries its speedup over our `vanilla` and over transformers' own `hf-vanilla`,
    measured in the same run, so no peer's ratio rests on our engine's GEMM packing alone."""
    from bench.harness import HFPeers

    peers = HFPeers(*tiny_dirs, tiny_engine.eos_id)
    prompts = [Prompt("a", "def add(a, b):\n"), Prompt("b", "import os\n\nclass Config:\n")]
    rows = {r["method"]: r for r in benchmark(tiny_engine, prompts, ["vanilla", "hf-vanilla", "hf-pld"], 16, 1, peers)}
    assert rows["hf-vanilla"]["speedup_vs_hf_vanilla"] == 1.0 and rows["vanilla"]["speedup_vs_vanilla"] == 1.0
    for r in rows.values():
        assert r["speedup_vs_hf_vanilla"] > 0 and r["speedup_vs_vanilla"] > 0
    # the two baselines' ratios are each other's inverse, prompt by prompt (medians of two prompts)
    assert rows["vanilla"]["speedup_vs_hf_vanilla"] == pytest.approx(
        1 / rows["hf-vanilla"]["speedup_vs_vanilla"], rel=0.35
    )


def test_benchmark_never_drafts_from_another_methods_output_of_the_same_prompt(tiny_engine):
    """Each prompt's lossless runs insert one output into the global suffix cache, after all
    methods ran on it; the warm-up inserts none."""
    prompts = [Prompt("a", "def add(a, b):\n"), Prompt("b", "import os\n\nclass Config:\n")]
    cache = tiny_engine.suffix_cache
    before = list(cache.outputs)
    benchmark(tiny_engine, prompts, ["vanilla", "suffix", "hybrid-rule"], 24, 2, None)
    new = list(cache.outputs)[len(before) :]
    assert len(new) == 2 and new[0] != new[1]


def test_eagle3_sweep_swaps_heads_and_chain_length(tiny_dirs, tiny_eagle3, tmp_path):
    """bench.eagle3_sweep: one `sd` reference row, then one lossless `eagle3` row per (head, k,
    confidence) whose chains never pass k; a confidence no token reaches stops chains at one;
    other methods that use the head get rows of their own."""
    from bench.eagle3_sweep import markdown as sweep_md
    from bench.eagle3_sweep import plot, sweep
    from bench.harness import save
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    eng = Engine(
        EngineConfig(
            target=tiny_dirs[0],
            draft=tiny_dirs[1],
            eagle3=tiny_eagle3,
            draft_confidence=0.0,
            eagle3_confidence=0.0,
            predictor=None,
            ocm_snapshot=None,
        )
    )
    prompts = [Prompt("a", "def add(a, b):\n"), Prompt("b", "x = [1, 2, 3]\ny = [1, 2, 3]\n")]
    rows = sweep(eng, prompts, 20, [tiny_eagle3], [1, 3], [0.0, 1.01])
    assert [(r["method"], r["k"], r.get("confidence")) for r in rows] == [
        ("sd", 4, None),
        ("eagle3", 1, 0.0),
        ("eagle3", 1, 1.01),
        ("eagle3", 3, 0.0),
        ("eagle3", 3, 1.01),
    ]
    assert all(r["exact_match_vs_vanilla"] == 1.0 for r in rows)
    assert len(rows[1]["acceptance_per_position"]) <= 1 and len(rows[3]["acceptance_per_position"]) <= 3
    assert len(rows[4]["acceptance_per_position"]) <= 1
    mixed = sweep(eng, prompts, 20, [tiny_eagle3], [2], None, ("eagle3", "hybrid-rule"))
    assert [(r["method"], r["k"]) for r in mixed] == [("sd", 4), ("eagle3", 2), ("hybrid-rule", 2)]
    assert all(r["exact_match_vs_vanilla"] == 1.0 for r in mixed)
    assert len(eng.suffix_cache.outputs) == len(prompts)  # the last setting's outputs only
    rows += mixed[1:]
    result = {"workload": "t", "limit": 2, "max_new_tokens": 20, "command": "c", "rows": rows}
    assert "| eagle3 |" in sweep_md(result)
    save(tmp_path / "sweep.json", result, sweep_md, plot)
    assert (tmp_path / "sweep.png").stat().st_size > 0 and (tmp_path / "sweep.md").read_text() == sweep_md(result)


def test_draft_vocab_bench_rows(tiny_dirs, tmp_path):
    """bench.draft_vocab: one row per size, interleaved; every size lossless, so outputs agree."""
    import shutil

    from bench.draft_vocab import markdown as vocab_md
    from bench.draft_vocab import measure
    from services.common.config import EngineConfig
    from services.drafter.vocab import RANKING_FILE, frequency_ranking, save_ranking
    from services.router.engine import Engine

    target, draft = tiny_dirs
    d = tmp_path / "draft"
    shutil.copytree(draft, d)
    save_ranking(d / RANKING_FILE, frequency_ranking([list(range(2000))], 8192), "test")
    engines = {
        n: Engine(
            EngineConfig(
                target=target,
                draft=d,
                draft_vocab=n,
                eagle3=None,
                predictor=None,
                ocm_snapshot=None,
                max_new_tokens_limit=200,
            )
        )
        for n in (0, 4096)
    }
    first = engines[0]
    prompts = [first.encode("def add(a, b):\n"), first.encode("import os\n")]
    rows = measure(engines, prompts, 16)
    assert [r["draft_vocab"] for r in rows] == ["all", 4096]
    assert all(r["same_output_as_first"] == 1.0 and r["tau"] >= 1.0 for r in rows)
    assert "| all |" in vocab_md({"workload": "t", "limit": 2, "max_new_tokens": 16, "command": "c", "rows": rows})


def test_repeats_keep_the_median_run_whole(tiny_engine):
    """With repeats, each prompt's row is the repeat with the median wall, its stats with it:
    the time outside drafting and verifying is never negative."""
    prompts = [Prompt("a", "def add(a, b):\n"), Prompt("b", "import os\n\nclass Config:\n")]
    rows = {r["method"]: r for r in benchmark(tiny_engine, prompts, ["vanilla", "sd"], 16, 3, None)}
    assert all(r["other_ms_per_cycle"] >= 0 for r in rows.values())
    assert rows["sd"]["exact_match_vs_vanilla"] == 1.0


def test_step_profile_times_attention_only_when_batched(tiny_dirs, tmp_path):
    """bench.step_profile: one session takes the plain path (attention not timed apart); two
    sessions spend part of their ragged draft and target forwards in per-session attention,
    timed apart."""
    from bench.harness import save
    from bench.step_profile import markdown, plot, profile, summary
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    eng = Engine(EngineConfig(target=tiny_dirs[0], draft=tiny_dirs[1], eagle3=None, predictor=None, ocm_snapshot=None))
    prompts = [eng.encode("def add(a, b):\n"), eng.encode("import os\n")]
    one, two = summary(1, profile(eng.verifier, prompts[:1], 1, 3)), summary(2, profile(eng.verifier, prompts, 2, 3))
    assert one["verify_attention_ms"] == one["draft_attention_ms"] == 0.0
    assert 0 < two["verify_attention_ms"] <= two["verify_ms"] and 0 < two["draft_attention_ms"] <= two["draft_ms"]
    assert one["draft_ms"] > 0 and two["finish_ms"] > 0
    result = {"workload": "t", "cycles": 3, "command": "c", "rows": [one, two]}
    save(tmp_path / "p.json", result, markdown, plot)
    assert "| 2 |" in (tmp_path / "p.md").read_text() and (tmp_path / "p.png").stat().st_size > 0


def test_prefill_bench_runs_every_chunk_setting_on_the_same_outputs(tiny_dirs, tmp_path):
    """bench.prefill: each chunk setting runs the same scenario (streams decoding, long prompts
    arriving); outputs are checked against single requests, and a nonzero chunk really chunks."""
    import argparse

    from bench.harness import save
    from bench.prefill import markdown, plot, run
    from services.common.config import EngineConfig
    from services.common.metrics import PREFILL_CHUNKS
    from services.router.engine import Engine

    eng = Engine(
        EngineConfig(
            target=tiny_dirs[0],
            draft=tiny_dirs[1],
            eagle3=None,
            predictor=None,
            ocm_snapshot=None,
            max_new_tokens_limit=200,
        )
    )
    args = argparse.Namespace(
        method="sd",
        chunks="0,8",
        streams=2,
        stream_tokens=40,
        arrivals=2,
        arrival_tokens=4,
        prompt_chars=600,
        gap_ms=10.0,
        repeats=1,
    )
    before = PREFILL_CHUNKS._value.get()
    rows = run(eng, args)
    assert [r["prefill_chunk"] for r in rows] == [0, 8] and all(r["identical_outputs"] for r in rows)
    assert PREFILL_CHUNKS._value.get() > before
    assert all(r["gap_p99_ms"] <= r["gap_max_ms"] and r["arrival_ttft_ms"] > 0 for r in rows)
    result = {"args": vars(args), "arrival_prompt_tokens": 100, "machine": "m", "command": "c", "rows": rows}
    save(tmp_path / "p.json", result, markdown, plot)
    assert "| whole prompt |" in (tmp_path / "p.md").read_text() and (tmp_path / "p.png").stat().st_size > 0


def test_op_profile_counts_operators_per_cycle(tiny_dirs):
    from bench.op_profile import markdown, profile_method
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    eng = Engine(EngineConfig(target=tiny_dirs[0], draft=tiny_dirs[1], eagle3=None, predictor=None, ocm_snapshot=None))
    row = profile_method(eng, "sd", [eng.encode("def add(a, b):\n")], 12, 5)
    assert row["cycles"] > 0 and len(row["top_cpu"]) == 5 and row["top_device"] == []
    assert any(r["op"].startswith("aten::") and r["calls_per_cycle"] > 0 for r in row["top_cpu"])
    text = markdown(
        {
            "workload": "w",
            "prompts": 1,
            "max_new_tokens": 12,
            "device": "cpu",
            "dtype": "float32",
            "threads": 1,
            "command": "c",
            "methods": [row],
        }
    )
    assert "**sd**" in text and "self CPU" in text


def test_prefix_cache_bench_rows_off_cold_on(tmp_path):
    """bench.prefix_cache: per method the settings off, cold (emptied before each request) and
    on; only "on" reuses the shared examples, and every output equals the cache-off one."""
    import argparse

    from bench.harness import save
    from bench.prefix_cache import markdown, plot, run
    from services.common.config import EngineConfig
    from services.router.engine import Engine
    from tests.conftest import make_tiny

    target = make_tiny(tmp_path / "long-target", seed=0, max_pos=1024)
    eng = Engine(
        EngineConfig(
            target=target, draft=None, eagle3=None, predictor=None, ocm_snapshot=None, max_new_tokens_limit=200
        )
    )
    args = argparse.Namespace(methods="vanilla", limit=3, shots=1, max_new_tokens=4, repeats=1)
    rows = run(eng, args)
    assert [r["prefix_cache"] for r in rows] == ["off", "cold", "on"]
    assert all(r["identical_outputs"] for r in rows)
    assert rows[0]["cached_share"] == rows[1]["cached_share"] == 0 < rows[2]["cached_share"]
    assert rows[2]["ttft_ratio"] == round(rows[2]["ttft_ms"] / rows[0]["ttft_ms"], 3)
    result = {"args": vars(args), "prompt_tokens": 280, "machine": "m", "command": "c", "rows": rows}
    save(tmp_path / "p.json", result, markdown, plot)
    assert "| vanilla | cold |" in (tmp_path / "p.md").read_text() and (tmp_path / "p.png").stat().st_size > 0


def test_train_precision_times_both_precisions_of_both_training_steps(tmp_path, monkeypatch):
    """bench.train_precision on the bundled weights (random tokens stand in for the corpus):
    a row per training step with both rates, their ratio and the first losses, and its files."""
    import torch

    import bench.train_precision as tp

    monkeypatch.setattr(tp, "corpus_batch", lambda rows, width, offset: torch.randint(0, 8192, (rows, width)))
    result = tp.main(
        ["--rounds", "2", "--steps", "1", "--draft-rows", "1", "--eagle3-rows", "1", "--out", str(tmp_path / "t.json")]
    )
    assert [r["job"] for r in result["rows"]] == ["draft LM", "EAGLE-3 head"]
    for r in result["rows"]:
        assert len(r["rates"]["fp32"]) == len(r["rates"]["bf16"]) == 2
        # the ratio of the unrounded medians: the rounded rates may give another last digit
        assert r["speedup"] == pytest.approx(r["bf16_tokens_per_s"] / r["fp32_tokens_per_s"], abs=2e-3)
        assert abs(r["first_loss_bf16"] - r["first_loss_fp32"]) < 0.1  # autocast, not another model
    assert "| draft LM | 1024 |" in (tmp_path / "t.md").read_text() and (tmp_path / "t.png").stat().st_size > 0


def test_heads_runs_every_method_under_each_head_beside_vanilla(tiny_dirs, tiny_eagle3, tmp_path):
    """bench.heads: an engine per head, each cell lossless; two copies of one head draft alike
    (same cycles), so what differs between heads in a real run is the head."""
    import shutil

    from bench.harness import save
    from bench.heads import markdown, plot, rows, run
    from bench.workloads import Prompt
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    copy = tmp_path / "head-copy"
    shutil.copytree(tiny_eagle3, copy)
    engines = {
        str(h): Engine(
            EngineConfig(
                target=tiny_dirs[0], draft=None, eagle3=h, predictor=None, ocm_snapshot=None, max_new_tokens_limit=200
            )
        )
        for h in (tiny_eagle3, copy)
    }
    prompts = [Prompt(f"p{i}", t) for i, t in enumerate(["def f(x):\n", "class A:\n    def g(self):\n"])]
    methods = ["eagle3", "hybrid-rule"]
    runs = run(engines, prompts, methods, 24)
    result = {
        "workload": "w",
        "limit": 2,
        "max_new_tokens": 24,
        "heads": list(engines),
        "methods": methods,
        "machine": "m",
        "command": "c",
        "rows": rows(next(iter(engines.values())), prompts, runs, 24),
    }
    got = {(r["method"], r["head"]): r for r in result["rows"]}
    assert set(got) == {("vanilla", None)} | {(m, h) for h in engines for m in methods}
    assert all(r["exact_match_vs_vanilla"] == 1.0 for r in result["rows"])
    a, b = (got[("eagle3", h)] for h in engines)
    assert a["cycles_per_1k"] == b["cycles_per_1k"] and a["cycles_by_source"] == b["cycles_by_source"]
    save(tmp_path / "h.json", result, markdown, plot)
    assert "| eagle3 | `" in (tmp_path / "h.md").read_text() and (tmp_path / "h.png").stat().st_size > 0


def test_hybrid_cycles_books_each_measured_cycle_of_a_hybrid_by_its_choice(tiny_engine, tmp_path):
    """bench.hybrid_cycles: every proposed cycle of the measured runs is booked once, under the
    choice the hybrid made, except each request's first (it holds the prefill); the warm-up's
    cycles are not booked."""
    from bench.harness import save
    from bench.hybrid_cycles import markdown, measure, plot

    prompts = [Prompt("a", "def add(a, b):\n"), Prompt("b", "import os\n\nclass Config:\n")]
    result = {
        "workload": "w",
        "machine": "m",
        "command": "c",
        **measure(tiny_engine, prompts, ["vanilla", "hybrid-rule"], 24),
    }
    row = next(r for r in result["rows"] if r["method"] == "hybrid-rule")
    booked = result["hybrids"]["hybrid-rule"]["cycles"]
    assert booked and {r["choice"] for r in booked} <= {"cache", "model", "plain"}
    total = sum(row["cycles_by_source"].values())
    # not booked: each request's first cycle, and a last cycle with no draft budget left
    assert total - 2 * len(prompts) <= sum(r["cycles"] for r in booked) <= total - len(prompts)
    for r in booked:
        assert r["tokens_per_s"] == pytest.approx(1e3 * r["tokens_per_cycle"] / r["ms_per_cycle"], rel=0.01)
    save(tmp_path / "c.json", result, markdown, plot)
    assert "#### `hybrid-rule`: cycles by choice" in (tmp_path / "c.md").read_text()
    assert (tmp_path / "c.png").stat().st_size > 0


def test_control_plane_stand_in_answers_as_the_target_did(tiny_engine):
    """The control-plane benchmark's verifier stand-in commits what the real target committed
    (greedy for the lossless methods, csd's own output for csd) and replays the real draft LM's
    acceptance, so a method's cycles through it equal its real run's."""
    from bench import control_plane as cp
    from services.router.engine import Engine, GenerationRequest

    texts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "import os\n\n\ndef list_files(path):\n"]
    traces = cp.record_with(tiny_engine, texts)
    core = cp.StandInCore(
        traces, tiny_engine.context_len, tiny_engine.verifier.vocab_size, tiny_engine.verifier.max_draft
    )
    engine = Engine(tiny_engine.cfg, verifier=core)
    for t in traces:
        for method in ("vanilla", "suffix", "sd", "csd"):
            expected = t["csd"] if method == "csd" else t["greedy"]
            gen = engine.generate(GenerationRequest(list(t["prompt"]), len(expected), method=method))
            out = [tok for step in gen for tok in step.token_ids] + (
                [tiny_engine.eos_id] * (gen.finish_reason == "eos")
            )
            assert out == expected, method
            if method in ("sd", "csd"):
                assert gen.stats.cycles == len(t["accepted"][method]), method
    engine.close()


def test_control_plane_steady_load_keeps_every_session_open(tiny_engine):
    """The control-plane benchmark's steady load: each session runs requests back to back, so
    the measured steps hold every session (no tail of a few), and the tokens counted are those
    that came within the measured span, on prompts run once each; the clients stream on one event
    loop (the public servers' way) or from a thread each."""
    from bench import control_plane as cp
    from services.router.engine import Engine

    texts = [f"def f{i}(a, b):\n    return a * {i} + b\n\ndef g{i}(x):\n" for i in range(12)]
    traces = cp.record_with(tiny_engine, texts)
    core = cp.StandInCore(
        traces, tiny_engine.context_len, tiny_engine.verifier.vocab_size, tiny_engine.verifier.max_draft
    )
    place = cp.Embedded.__new__(cp.Embedded)
    place.core = core
    engine = Engine(tiny_engine.cfg, verifier=core)
    row = cp.measure(engine, place, traces, 3, "suffix", "embedded", cp.Load("steady", 0.2, 1.0))
    burst = cp.measure(engine, place, traces[:3], 3, "suffix", "embedded", cp.Load("burst"))
    threads = cp.measure(engine, place, traces, 3, "suffix", "embedded", cp.Load("steady", 0.2, 1.0, "threads"))
    engine.close()
    assert row["errors"] == burst["errors"] == threads["errors"] == 0
    assert threads["sessions_per_step"] > 2.5 and threads["tokens"] > 0  # a thread per stream, the same load
    assert row["requests"] >= 3 and row["repeated_requests"] < row["requests"]  # begun after the first ones
    assert row["sessions_per_step"] > 2.5
    assert 0 < row["tokens"] < sum(len(t["greedy"]) for t in traces) and row["tau"] > 1
    ends = sum(len(t["greedy"]) - (t["greedy"][-1] == tiny_engine.eos_id) for t in traces[:3])
    assert burst["requests"] == 3 and burst["tokens"] == ends  # every token of the three, once


def test_suffix_micro_replays_every_tree_on_the_same_traces(tmp_path, monkeypatch):
    """bench.suffix_micro: each kind of tree replays the same traces in interleaved rounds; the
    compiled tree drafts exactly as the reference (same τ); Arctic is left out, and says so,
    when it cannot be built."""
    import random

    from bench import arctic, suffix_micro
    from services.drafter.replay import Trace

    rng = random.Random(0)
    phrases = [[rng.randrange(50) for _ in range(12)] for _ in range(6)]
    text = lambda n: [t for _ in range(n) for t in rng.choice(phrases)]  # noqa: E731
    traces = [Trace(f"t{i}", text(8), text(6), 72) for i in range(6)]
    monkeypatch.setattr(arctic, "CACHE", tmp_path / "arctic")
    monkeypatch.setattr(arctic.shutil, "which", lambda _: None)
    assert arctic.load() is None  # no CMake here: no Arctic rows
    rows = suffix_micro.measure(suffix_micro.drafters(None, False), traces, text(10), 2)
    assert set(rows) == {"python", "compiled-finished", "compiled"}
    assert rows["python"]["tau"] == rows["compiled-finished"]["tau"] > 1.0
    assert all(r["us_per_speculate_call"] > 0 and r["index_2000_tokens_ms"] > 0 for r in rows.values())
    for r in rows.values():
        r |= {"speculate_plus_update_share_of_cycle": 0.01, "index_share_of_prefill": 0.01}
    result = {
        "command": "c",
        "traces": "t",
        "rounds": 2,
        "tree": False,
        "kinds": {},
        "arctic": "left out",
        "replay": rows,
    }
    suffix_micro.plot(result, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0 and suffix_micro.markdown(result).count("\n| ") == 4


@pytest.mark.slow
def test_control_plane_stand_in_serves_as_a_ray_replica(tiny_engine):
    """The Ray topology of the control-plane benchmark: the stand-in runs inside the real
    VerifierDeployment as a Serve replica, the router reaches it through deployment handles,
    and a method's output through it is the target's; the control plane's CPU counts Ray's
    own processes."""
    from bench import control_plane as cp
    from services.router.engine import Engine, GenerationRequest

    traces = cp.record_with(tiny_engine, ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"])
    core = cp.StandInCore(
        traces, tiny_engine.context_len, tiny_engine.verifier.vocab_size, tiny_engine.verifier.max_draft
    )
    place = cp.RayServe(len(traces), core=core)
    try:
        assert cp.descendants_cpu_s(os.getpid()) > 0  # Ray's GCS, raylet and the replica are ours
        engine = Engine(tiny_engine.cfg, verifier=place.verifier())
        cpu0 = place.snapshot()[1]
        for method in ("suffix", "sd"):
            t = traces[0]
            gen = engine.generate(GenerationRequest(list(t["prompt"]), len(t["greedy"]), method=method))
            out = [tok for step in gen for tok in step.token_ids] + [tiny_engine.eos_id] * (gen.finish_reason == "eos")
            assert out == t["greedy"], method
        assert place.counters()["cycles"] > 0 and place.snapshot()[1] > cpu0
        engine.close()
    finally:
        place.close()


def test_pair_cost_times_every_target_against_every_draft(tmp_path, monkeypatch):
    """bench.pair_cost: one row per target shape, one share per draft shape, from timed steps."""
    import json
    import sys

    from bench import pair_cost

    out = tmp_path / "pc.json"
    argv = ["pair_cost", "--targets", "2x64,3x128", "--drafts", "1x64", "--rounds", "1", "--steps", "2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--context", "8", "--draft-vocab", "512", "--out", str(out)])
    assert pair_cost.main() == 0
    r = json.loads(out.read_text())
    assert r["targets"] == ["2x64", "3x128"] and r["drafts"] == ["draft 1x64"]
    assert all(m["step_ms"] > 0 for m in r["models"].values())
    assert r["models"]["3x128"]["params_m"] > r["models"]["2x64"]["params_m"]
    assert "| 3x128 |" in out.with_suffix(".md").read_text() and out.with_suffix(".png").exists()


def test_bf16_lossless_bench_finds_the_invariant_mode_lossless(tmp_path, monkeypatch):
    """bench.bf16_lossless on the bundled models, briefly: the invariant bfloat16 mode leaves no
    method off vanilla's tokens, and every mode reports every method's speed."""
    import json
    import sys

    from bench import bf16_lossless

    out = tmp_path / "b.json"
    argv = [
        "bf16_lossless",
        "--modes",
        "bfloat16-invariant,float32,float32-device-drafts",
        "--prompts",
        "1",
        "--max-new-tokens",
        "24",
    ]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    assert bf16_lossless.main() == 0
    r = json.loads(out.read_text())
    assert all(row["differing"] == 0 for row in r["modes"]["bfloat16-invariant"].values())
    assert all(len(row["tok_s"]) == 2 for mode in r["modes"].values() for row in mode.values())
    assert all(row["differing"] == 0 for row in r["modes"]["float32-device-drafts"].values())
    md = out.with_suffix(".md").read_text()
    assert "| bfloat16-invariant |" in md and "float32-device-drafts against float32: " in md
    # the engine's flags: without a draft LM, sd is left out
    argv = ["bf16_lossless", "--modes", "float32", "--prompts", "1", "--max-new-tokens", "8", "--draft", ""]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    assert bf16_lossless.main() == 0
    r = json.loads(out.read_text())
    assert "sd" not in r["modes"]["float32"] and "suffix" in r["modes"]["float32"]
    assert all(row["differing"] == 0 for row in r["modes"]["float32"].values())
    md = out.with_suffix(".md").read_text()
    assert "| sd |" not in md and "| suffix |" in md


def test_compile_bench_finds_the_compiled_forward_greedy_equal_to_eager(tmp_path, monkeypatch):
    """bench.compile, briefly: torch.compile's forward (inductor, dynamic shapes) decodes the
    same greedy tokens as the eager one on the bundled target, and every variant is timed."""
    import json
    import sys

    from bench import compile as compile_bench

    out = tmp_path / "c.json"
    argv = ["compile", "--variants", "eager,compile", "--rounds", "1", "--steps", "2", "--tokens", "16"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    assert compile_bench.main() == 0
    r = json.loads(out.read_text())["variants"]
    assert r["compile"]["differing"] == 0
    assert all(v["decode_median_ms"] > 0 and v["verify_median_ms"] > 0 for v in r.values())
    assert "| compile |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):  # CUDA graphs need CUDA
        monkeypatch.setattr(sys, "argv", ["compile", "--variants", "reduce-overhead", "--out", str(out)])
        compile_bench.main()


def test_heads_main_takes_the_engines_flags_for_every_head(tiny_dirs, tiny_eagle3, tmp_path):
    """bench.heads from its command line: the target and the rest from the engine's flags, only
    the head differs between the engines (what a real target's heads are compared with)."""
    import shutil

    from bench.heads import main

    copy = tmp_path / "head-copy"
    shutil.copytree(tiny_eagle3, copy)
    out = tmp_path / "heads.json"
    result = main(
        ["--target", str(tiny_dirs[0]), "--draft", "", "--predictor", "", "--threads", "1"]
        + ["--heads", f"{tiny_eagle3},{copy}", "--methods", "eagle3", "--limit", "2", "--max-new-tokens", "12"]
        + ["--out", str(out)]
    )
    assert result["target"] == str(tiny_dirs[0]) and result["heads"] == [str(tiny_eagle3), str(copy)]
    assert {(r["method"], r["head"]) for r in result["rows"]} == {("vanilla", None)} | {
        ("eagle3", h) for h in result["heads"]
    }
    assert all(r["exact_match_vs_vanilla"] == 1.0 for r in result["rows"]) and out.with_suffix(".md").exists()
