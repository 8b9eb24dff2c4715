def test_summary_table_has_a_cell_per_method_and_workload():
    from bench.summary import summary

    a = {
        "workload": "edit",
        "limit": 2,
        "max_new_tokens": 8,
        "rows": [
            {"method": "vanilla", "speedup_vs_vanilla": 1.0, "tau": 1.0},
            {"method": "suffix", "speedup_vs_vanilla": 3.5, "tau": 6.25},
        ],
    }
    b = {
        "workload": "humaneval",
        "limit": 2,
        "max_new_tokens": 8,
        "rows": [
            {"method": "vanilla", "speedup_vs_vanilla": 1.0, "tau": 1.0, "speedup_vs_hf_vanilla": 1.6},
            {"method": "hf-pld", "speedup_vs_vanilla": 1.2, "tau": None, "speedup_vs_hf_vanilla": 1.9},
        ],
    }
    lines = summary([a, b]).splitlines()
    assert lines[0] == "| method | edit (2 prompts, 8 tokens) | humaneval (2 prompts, 8 tokens) |"
    assert "| `suffix` | 3.50× (τ 6.25) | — |" in lines and "| `hf-pld` | — | 1.20× (1.90× hf-vanilla) |" in lines
    assert "| `vanilla` | 1.00× (τ 1.00) | 1.00× (τ 1.00, 1.60× hf-vanilla) |" in lines  # both baselines


def test_serving_overhead_is_each_distributed_variant_minus_embedded_per_method(tmp_path):
    from bench.serving import overhead_vs_embedded, write

    def row(topology, method, overhead, sdb=0):
        return {
            "topology": topology,
            "method": method,
            "spec_disable_batch": sdb,
            "median_ms_per_cycle": 3.0,
            "median_overhead_ms_per_cycle": overhead,
            "tokens_per_s": {"1": 100.0, "8": 250.0},
            "scaling_vs_first": {"1": 1.0, "8": 2.5},
        }

    rows = [
        row("embedded", "sd", 0.4),
        row("distributed", "sd", 0.9),
        row("distributed-stream", "sd", 1.5),
        row("embedded", "vanilla", 0.3),
        row("distributed", "vanilla", 0.8),
        row("distributed", "sd", 9.0, sdb=1),
    ]
    got = overhead_vs_embedded(rows)["overhead_vs_embedded_ms_per_cycle"]
    assert got == {"distributed": {"sd": 0.5, "vanilla": 0.5}, "distributed-stream": {"sd": 1.1}}
    result = {
        "workload": "w",
        "max_new_tokens": 8,
        "replicas": 1,
        "command": "c",
        "rows": rows,
        "overhead_vs_embedded_ms_per_cycle": got,
    }
    write(result, tmp_path / "s.json")
    md = (tmp_path / "s.md").read_text()
    assert "distributed-stream − embedded, ms per cycle outside model work: sd +1.1" in md
    assert (tmp_path / "s.png").stat().st_size > 0


def test_csd_quality_pools_prompts_and_splits_by_first_divergence(tmp_path):
    """Pooled NLL and τ ratios, intervals that shrink to the point when every prompt agrees,
    and the early / later split by where an output first leaves vanilla's."""
    from bench.csd_quality import compare, first_divergence, interval, markdown, plot

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1 and first_divergence([1, 2], [1, 2, 3]) == 2
    assert interval(lambda idx: 0.25, 5) == [0.25, 0.25]

    def run(ids, nll, cycles, rescued=0):
        return {"ids": ids, "nll": nll, "n": len(ids), "cycles": cycles, "gen": len(ids), "rescued": rescued}

    vanilla = [run([1, 2, 3, 4], 4.0, 4), run([5, 6, 7, 8], 8.0, 4)]
    sd = [run([1, 2, 3, 4], 4.0, 2), run([5, 6, 7, 8], 8.0, 2)]
    csd = [run([1, 9, 3, 4], 6.0, 2, rescued=1), run([5, 6, 7, 0], 12.0, 1, rescued=1)]
    got = compare(csd, vanilla, sd, ["a", "b"], ["a", "b"], ["x = 1\n", "y = (\n"])
    assert got["nll_vs_vanilla"] == 0.5  # (18 / 8) / (12 / 8) − 1
    assert got["tau_vs_sd"] == 1.3333  # (8 / 3) / (8 / 4)
    assert got["early_divergence"] == {"prompts": 1, "nll_vs_vanilla": 0.5}
    assert got["late_divergence"] == {"prompts": 1, "nll_vs_vanilla": 0.5}
    assert got["exact_match_vs_vanilla"] == 0.0 and got["rescues_per_1k"] == 250.0
    lo, hi = got["tau_vs_sd_ci95"]
    assert lo <= got["tau_vs_sd"] <= hi and lo < hi  # the two prompts disagree: a real interval
    assert got["parse_rate"] == got["parse_rate_vanilla"] == 0.5  # "y = (" never closes
    result = {
        "workload": "w",
        "limit": 2,
        "max_new_tokens": 4,
        "command": "c",
        "sd_tau": 2.0,
        "vanilla_nll": 1.5,
        "rows": [{"method": "csd", "gate": "0.5:2:3", **got}],
    }
    assert "| csd | 0.5:2:3 | +50.0 % [" in markdown(result)
    plot(result, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 0


def test_the_machine_line_carries_the_speed_probe():
    import re

    from bench.harness import machine, speed_probe

    gemm, op = speed_probe(reps=20)
    assert 0 < gemm < 1000 and 0 < op < 1e6
    assert re.search(r"probe: GEMM \d+\.\d{3} ms, op \d+\.\d µs$", machine())
