"""``python -m training trace`` appends each trace as it finishes and resumes where it stopped."""

import json

from training.traces import main


def test_a_rerun_of_trace_keeps_the_traces_written_and_adds_only_the_missing_ones(tiny_dirs, tmp_path):
    target, _ = tiny_dirs
    out = tmp_path / "traces.jsonl"
    common = ["trace", "--target", str(target), "--draft", "", "--eagle3", "", "--predictor", ""]
    common += ["--workload", "stdlib-train", "--max-new-tokens", "8", "--concurrency", "2", "--out", str(out)]
    main([*common, "--limit", "2"])
    first = out.read_text().splitlines()
    assert len(first) == 2
    main([*common, "--limit", "3"])
    lines = out.read_text().splitlines()
    assert lines[:2] == first and len(lines) == 3  # the two kept as written, one more traced
    assert len({json.loads(line)["id"] for line in lines}) == 3
