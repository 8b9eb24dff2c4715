"""Structured output and speculation: each method's speedup over `vanilla` under the same
constraint (a JSON schema, a regular expression), greedy.

The verifier masks every verification row to what the grammar allows after the draft prefix
before it, and the model drafters (draft LM, EAGLE-3) mask their own chains the same way, so
they draft only what the grammar allows. For each prompt, every (setting, method) cell runs
once per repeat in rotated order, in one process; speedup is the median over prompts of
wall(`vanilla`, same setting) / wall(method). Every lossless method must equal `vanilla` token
for token under the same constraint ("identical"); "valid" is the share of outputs that end
(EOS) as a whole match (JSON: parses and is an instance of the schema).

    python -m bench.structured --workload humaneval --limit 20 --out bench/results/structured_humaneval.json
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.harness import run_settings, setting_bars, settings_main, table_markdown
from bench.workloads import load
from services.common.structured import StructuredOutput

TYPES = ["int", "float", "str", "bool", "list", "dict", "tuple", "None"]
SCHEMA = {
    "type": "object",
    "required": ["name", "arguments", "returns", "summary"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "arguments": {
            "type": "array",
            "maxItems": 5,
            "items": {
                "type": "object",
                "required": ["name", "type"],
                "properties": {"name": {"type": "string", "maxLength": 24}, "type": {"enum": TYPES}},
            },
        },
        "returns": {"enum": TYPES},
        "summary": {"type": "string", "maxLength": 100},
    },
}
BODY = r"(    [^\n]*\n){1,16}"  # a function body: up to 16 indented lines
JSON_CUE = "\n\n# The function above, described as JSON:\n"


@dataclass(frozen=True)
class Setting:
    cue: str  # appended to the prompt
    structured: StructuredOutput | None

    def valid(self, text: str) -> bool:
        if self.structured is None:
            return True
        if self.structured.regex:
            return re.fullmatch(self.structured.regex, text) is not None
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        return (
            set(obj) == set(SCHEMA["required"])
            and obj["returns"] in TYPES
            and all(a["type"] in TYPES for a in obj["arguments"])
        )


SETTINGS = {
    "json cue, free": Setting(JSON_CUE, None),
    "json schema": Setting(JSON_CUE, StructuredOutput(json_schema=json.dumps(SCHEMA))),
    "body regex": Setting("", StructuredOutput(regex=BODY)),
}


def run(engine, args) -> dict:
    texts = [p.text for p in load(args.workload, args.limit)]
    return run_settings(
        engine,
        args.methods.split(","),
        {s: [engine.encode_fit(t + st.cue, args.max_new_tokens) for t in texts] for s, st in SETTINGS.items()},
        {s: {"structured": st.structured} for s, st in SETTINGS.items()},
        args.max_new_tokens,
        args.repeats,
        "structured",
    )


def rows(engine, runs: dict, methods: list[str]) -> list[dict]:
    out = []
    for s, setting in SETTINGS.items():
        van = runs[(s, "vanilla")]
        for m in methods:
            rs = runs[(s, m)]
            cycles = sum(r.stats["cycles"] for r in rs)
            ended = [r for r in rs if r.finish == "eos"]
            out.append(
                {
                    "setting": s,
                    "method": m,
                    "tokens_per_s": round(sum(len(r.ids) for r in rs) / sum(r.wall for r in rs), 1),
                    "speedup_vs_vanilla": round(statistics.median(v.wall / r.wall for v, r in zip(van, rs)), 3),
                    "tau": round(sum(r.stats["generated_tokens"] for r in rs) / cycles, 3),
                    "acceptance_rate": round(
                        sum(r.stats["accepted_tokens"] for r in rs) / max(1, sum(r.stats["draft_tokens"] for r in rs)),
                        3,
                    ),
                    "identical_to_vanilla": round(sum(r.ids == v.ids for v, r in zip(van, rs)) / len(rs), 3),
                    "ended": round(len(ended) / len(rs), 3),
                    "valid_of_ended": round(
                        sum(setting.valid(engine.tokenizer.decode(r.ids)) for r in ended) / max(1, len(ended)), 3
                    ),
                }
            )
    return out


def markdown(result: dict) -> str:
    a = result["args"]
    cols = [
        "constraint",
        "method",
        "tok/s",
        "speedup vs vanilla (same constraint)",
        "τ",
        "acceptance",
        "identical to vanilla",
        "ended (EOS)",
        "valid of ended",
    ]
    table = [
        [
            r["setting"],
            r["method"],
            r["tokens_per_s"],
            r["speedup_vs_vanilla"],
            r["tau"],
            r["acceptance_rate"],
            f"{100 * r['identical_to_vanilla']:.0f} %",
            f"{100 * r['ended']:.0f} %",
            f"{100 * r['valid_of_ended']:.0f} %",
        ]
        for r in result["rows"]
    ]
    title = (
        f"### Structured output — `{a['workload']}`, {a['limit']} prompts, {a['max_new_tokens']} new tokens, "
        f"greedy, {a['repeats']} repeat(s) (medians over prompts)"
    )
    notes = (
        f"Machine: {result['machine']}",
        "Constraints: `json schema` is the schema in `bench/structured.py` (the function's name, arguments with "
        "types, return type, summary) after the cue `# The function above, described as JSON:`; `json cue, free` "
        "is the same prompt unconstrained; `body regex` is `" + BODY.replace("\n", "\\n") + "` after the plain "
        "prompt.",
    )
    return table_markdown(title, cols, table, result["command"], notes)


def plot(result: dict, path: Path) -> None:
    setting_bars(result, SETTINGS, "speedup vs vanilla (same constraint)", path)


def main(argv: list[str] | None = None) -> dict:
    return settings_main(
        "bench.structured",
        __doc__,
        argv,
        {
            s: {"cue": st.cue, "pattern": st.structured.pattern() if st.structured else None}
            for s, st in SETTINGS.items()
        },
        run,
        rows,
        markdown,
        plot,
    )


if __name__ == "__main__":
    main()
