

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
