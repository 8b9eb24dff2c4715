"""Before/after: TTFT of a lone request when the target's LM head runs on every fed position
(before: a prompt's logits were computed and dropped) against only the positions a
verification reads, the draft's and the bonus one (after, `tails` in `Llama.forward_ragged`).
The "before" runner path is re-created inline; each prompt runs both, in alternating order,
and their outputs must be identical.

    python -m bench.prompt_logits_ab > bench/results/prompt_logits_ttft.md
"""

import argparse
import statistics as S

import torch

from bench.workloads import load
from services.cli import add_engine_args, engine_config
from services.router.engine import Engine, GenerationRequest
from services.verifier.runner import TargetRunner

ap = argparse.ArgumentParser()
add_engine_args(ap)
eng = Engine(engine_config(ap.parse_args(["--threads", "1"])))
after = TargetRunner.verify_batch


@torch.inference_mode()
def before(self, items):
    pending = [st.pending for st, _ in items]
    logits, hidden = self.model.forward_ragged(
        [p + d for p, (_, d) in zip(pending, items)],
        [st.cache_len for st, _ in items],
        [st.cache for st, _ in items],
        self.capture_layers,
    )
    return [(lg[len(p) - 1 :].float().cpu(), [h[None] for h in hs]) for p, lg, hs in zip(pending, logits, hidden)]


prompts = load("stdlib-heldout", 20)
encoded = [eng.encode_fit(p.text, 8) for p in prompts]
lines = [
    "### Prompt logits: TTFT before/after — stdlib-heldout, 20 prompts, lone requests, 1 thread",
    "",
    "| method | prompt tokens (median) | TTFT before, ms | TTFT after, ms | after / before (median per prompt) |",
    "|---|---|---|---|---|",
]
for method in ("vanilla", "sd", "hybrid"):
    ttft = {"before": [], "after": []}
    for i, ids in enumerate(encoded):
        order = [("before", before), ("after", after)][:: 1 if i % 2 else -1]
        outs = {}
        for name, verify in order:
            TargetRunner.verify_batch = verify
            eng.verifier.clear_prefix_cache()  # every run prefills cold
            r = eng.generate(GenerationRequest(ids, 8, method=method)).result()
            ttft[name].append(r["stats"]["ttft_s"])
            outs[name] = r["token_ids"]
        assert outs["before"] == outs["after"], "outputs differ"
    ratio = S.median(a / b for b, a in zip(ttft["before"], ttft["after"]))
    lines.append(
        f"| {method} | {S.median(map(len, encoded))} | {1e3 * S.median(ttft['before']):.1f} "
        f"| {1e3 * S.median(ttft['after']):.1f} | {ratio:.3f} |"
    )
print(
    "\n".join(
        lines
        + [
            "",
            "Outputs identical before and after on every prompt.",
            "",
            "Command: `python -m bench.prompt_logits_ab`",
            "",
        ]
    )
)
