"""bench.harness on the tiny models: interleaved rows, lossless exact match, cycle profile."""
from bench.harness import benchmark, markdown
from bench.workloads import Prompt


def test_benchmark_rows_and_cycle_profile(tiny_engine):
    prompts = [Prompt("a", "def add(a, b):\n"), Prompt("b", "import os\n\nclass Config:\n")]
    rows = {r["method"]: r for r in benchmark(tiny_engine, prompts, ["vanilla", "sd"], 24, 1, None)}
    van, sd = rows["vanilla"], rows["sd"]
    assert van["speedup_vs_vanilla"] == 1.0 and van["tau"] == 1.0 and van["cycles_per_1k"] == 1000.0
    assert sd["exact_match_vs_vanilla"] == 1.0 and sd["tau"] > 1.0 and 0 < sd["acceptance_rate"] <= 1
    assert van["verify_ms_per_cycle"] > 0 and sd["draft_ms_per_cycle"] > van["draft_ms_per_cycle"]
    per_token = 1e3 / sd["tokens_per_s"]
    assert sd["other_ms_per_cycle"] >= 0 and sd["verify_ms_per_cycle"] < per_token * sd["tau"] * 1.5
    table = markdown({"workload": "t", "limit": 2, "max_new_tokens": 24, "command": "c", "machine": "m",
                      "rows": list(rows.values())})
    assert "draft_ms_per_cycle" in table and table.count("\n| ") >= 3


def test_benchmark_never_drafts_from_another_methods_output_of_the_same_prompt(tiny_engine):
    """Each prompt's lossless runs insert one output into the global suffix cache, after all
    methods ran on it; the warm-up inserts none."""
    prompts = [Prompt("a", "def add(a, b):\n"), Prompt("b", "import os\n\nclass Config:\n")]
    cache = tiny_engine.suffix_cache
    before = list(cache.outputs)
    benchmark(tiny_engine, prompts, ["vanilla", "suffix", "hybrid-rule"], 24, 2, None)
    new = list(cache.outputs)[len(before):]
    assert len(new) == 2 and new[0] != new[1]
