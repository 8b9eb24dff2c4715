"""OpenAI batch files (vLLM's run-batch): every line answered in order, as the HTTP API answers
the same body; bad lines get their own error line and the file goes on."""

import json
import subprocess
import sys

from services.router.batch_file import run_batch
from services.router.engine import GenerationRequest

PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n", "class A:\n    pass\n\nclass", "x = [1, 2"]


def line(cid: str, body: dict, url: str = "/v1/completions", method: str = "POST") -> str:
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": body})


def vanilla_text(engine, prompt: str, n: int) -> str:
    return engine.generate(
        GenerationRequest(engine.encode(prompt, add_special_tokens=True), n, method="vanilla", ignore_eos=True)
    ).result()["text"]


def test_every_line_is_answered_in_order_as_the_http_api_would(tiny_engine):
    lines = [
        line(
            f"r{i}",
            {"model": "target", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "method": m},
        )
        for i, (p, m) in enumerate(zip(PROMPTS, ["vanilla", "sd", "suffix", "sd"]))
    ]
    lines.insert(
        2, line("many", {"prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1})
    )
    outs = list(run_batch(tiny_engine, lines, "target", concurrency=3, max_sessions=2))
    assert [o["custom_id"] for o in outs] == ["r0", "r1", "many", "r2", "r3"]
    for o in outs:
        assert o["error"] is None and o["response"]["status_code"] == 200 and o["id"] == o["response"]["request_id"]
    singles = [o for o in outs if o["custom_id"] != "many"]
    for p, o in zip(PROMPTS, singles):
        (choice,) = o["response"]["body"]["choices"]
        assert choice["text"] == vanilla_text(tiny_engine, p, 12) and choice["finish_reason"] == "length"
    many = outs[2]["response"]["body"]
    assert [c["text"] for c in many["choices"]] == [vanilla_text(tiny_engine, p, 6) for p in PROMPTS[:2]]
    assert all(len(c["logprobs"]["tokens"]) == 6 for c in many["choices"]) and many["usage"]["completion_tokens"] == 12


def test_bad_lines_get_their_own_error_and_the_file_goes_on(tiny_engine):
    lines = [
        "{not json",
        json.dumps(["a"]),
        line("get", {}, method="GET"),
        line("url", {}, url="/v1/embeddings"),
        line("typo", {"prompt": "x", "max_tokens": 4, "temprature": 0}),
        line("range", {"prompt": "x", "max_tokens": 4, "top_p": 2}),
        line("stream", {"prompt": "x", "max_tokens": 4, "stream": True}),
        line("model", {"prompt": "x", "max_tokens": 4, "model": "other"}),
        json.dumps({"custom_id": "body", "method": "POST", "url": "/v1/completions", "body": "x"}),
        line("n", {"prompt": ["x", "y"], "max_tokens": 4, "n": 3}),
        line("ok", {"prompt": "x", "max_tokens": 4, "temperature": 0}),
    ]
    outs = list(run_batch(tiny_engine, lines, "target", concurrency=4, max_sessions=4))
    assert len(outs) == len(lines)
    assert outs[0]["custom_id"] is None and outs[0]["error"].startswith("line: not valid JSON")
    assert outs[1]["custom_id"] is None and outs[1]["error"].startswith("custom_id: every line needs")
    expect = [
        ("get", 400, "method: only POST"),
        ("url", 400, "url: one of /v1/completions"),
        ("typo", 400, "temprature: unknown field"),
        ("range", 400, "top_p"),
        ("stream", 400, "stream: a batch file's answers are whole"),
        ("model", 404, "model"),
        ("body", 400, "body: must be a JSON object"),
        ("n", 400, "n: at most 4 completions in all"),
        ("ok", 200, None),
    ]
    for o, (cid, code, message) in zip(outs[2:], expect):
        assert (o["custom_id"], o["response"]["status_code"]) == (cid, code), o
        assert o["error"] is None if message is None else o["error"].startswith(message), o
    for o in outs:
        if o["error"]:
            assert o["response"]["body"]["error"]["message"] == o["error"]


def test_run_batch_cli_reads_and_writes_jsonl_files(tiny_dirs, tiny_engine, tmp_path):
    target, draft = tiny_dirs
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        "\n".join(
            [
                line("a", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}),
                "",
                line("b", {"prompt": "x", "max_tokens": 0}),
            ]
        )
        + "\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "run-batch",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--eagle3",
            "none",
            "-i",
            str(src),
            "-o",
            str(dst),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-800:]
    assert "[run-batch] 2/2 requests (1 failed)" in out.stderr
    a, b = [json.loads(x) for x in dst.read_text().splitlines()]
    assert a["custom_id"] == "a" and a["response"]["body"]["choices"][0]["text"] == vanilla_text(
        tiny_engine, PROMPTS[0], 8
    )
    assert b["custom_id"] == "b" and b["response"]["status_code"] == 400 and b["error"].startswith("max_tokens")
