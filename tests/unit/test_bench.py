

def test_summary_table_has_a_cell_per_method_and_workload():
    from bench.summary import summary

    a = {"workload": "edit", "limit": 2, "max_new_tokens": 8,
         "rows": [{"method": "vanilla", "speedup_vs_vanilla": 1.0, "tau": 1.0},
                  {"method": "suffix", "speedup_vs_vanilla": 3.5, "tau": 6.25}]}
    b = {"workload": "humaneval", "limit": 2, "max_new_tokens": 8,
         "rows": [{"method": "vanilla", "speedup_vs_vanilla": 1.0, "tau": 1.0},
                  {"method": "hf-pld", "speedup_vs_vanilla": 1.2, "tau": None}]}
    lines = summary([a, b]).splitlines()
    assert lines[0] == "| method | edit (2 prompts, 8 tokens) | humaneval (2 prompts, 8 tokens) |"
    assert "| `suffix` | 3.50× (τ 6.25) | — |" in lines and "| `hf-pld` | — | 1.20× |" in lines


def test_serving_overhead_is_each_distributed_variant_minus_embedded_per_method(tmp_path):
    from bench.serving import overhead_vs_embedded, write

    def row(topology, method, overhead, sdb=0):
        return {"topology": topology, "method": method, "spec_disable_batch": sdb, "median_ms_per_cycle": 3.0,
                "median_overhead_ms_per_cycle": overhead, "tokens_per_s": {"1": 100.0, "8": 250.0},
                "scaling_vs_first": {"1": 1.0, "8": 2.5}}

    rows = [row("embedded", "sd", 0.4), row("distributed", "sd", 0.9), row("distributed-stream", "sd", 1.5),
            row("embedded", "vanilla", 0.3), row("distributed", "vanilla", 0.8), row("distributed", "sd", 9.0, sdb=1)]
    got = overhead_vs_embedded(rows)["overhead_vs_embedded_ms_per_cycle"]
    assert got == {"distributed": {"sd": 0.5, "vanilla": 0.5}, "distributed-stream": {"sd": 1.1}}
    result = {"workload": "w", "max_new_tokens": 8, "replicas": 1, "command": "c", "rows": rows,
              "overhead_vs_embedded_ms_per_cycle": got}
    write(result, tmp_path / "s.json")
    md = (tmp_path / "s.md").read_text()
    assert "distributed-stream − embedded, ms per cycle outside model work: sd +1.1" in md
    assert (tmp_path / "s.png").stat().st_size > 0
