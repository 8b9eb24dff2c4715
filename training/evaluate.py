"""Evaluate a bundled model and write its model card (README.md in the model directory).

Gates reported: held-out loss (nats/token over held-out stdlib modules) and the loop rate:
the share of 128-token greedy continuations of held-out prompts that end in a repeated
n-gram cycle (``ends_in_loop``), with its standard error. The prompts go round-robin over the
40 held-out files, five windows each by default; the first round alone (each file's head:
imports, docstrings, ``__all__`` lists) loops far more often and is reported apart.

    python -m training.evaluate --model models/target [--prompts 200]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.workloads import edit, stdlib_heldout
from services.common.llama import Llama
from services.common.sampling import make_rng
from services.common.types import Draft, Sampling
from services.verifier.policies import exact_greedy
from services.verifier.runner import TargetRunner
from training.corpus import HELD_OUT
from training.pretrain import SEQ_LEN, default_work_dir, encode_corpus

LOOP_MAX_PERIOD = 32
LOOP_MIN_SPAN = 16


def ends_in_loop(tokens: list[int]) -> bool:
    """True when the tail is a cycle: for some period p ≤ 32, the last max(3p, 16) tokens repeat with period p."""
    for p in range(1, LOOP_MAX_PERIOD + 1):
        span = max(3 * p, LOOP_MIN_SPAN)
        if span > len(tokens):
            break
        tail = tokens[-span:]
        if all(tail[i] == tail[i - p] for i in range(p, span)):
            return True
    return False


def seq_rep(tokens: list[int], n: int = 4) -> float:
    """Share of a sequence's n-grams that repeat an earlier one (Welleck et al.'s seq-rep-n):
    near-loops that vary a token each cycle escape ``ends_in_loop`` but not this."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def text_seq_rep(held: np.ndarray, windows: int = 40, n_tokens: int = 128) -> float:
    """seq-rep-4 of held-out source itself: ``windows`` spaced 128-token windows (the reference)."""
    step = (len(held) - n_tokens) // windows
    return float(np.mean([seq_rep(held[i * step : i * step + n_tokens].tolist()) for i in range(windows)]))


@torch.inference_mode()
def greedy(model: Llama, prompt: list[int], n: int, eos: int) -> list[int]:
    """Greedy continuation of up to ``n`` tokens, stopping at EOS or the end of the context."""
    prompt = prompt[-(model.s.max_positions - 1) :]
    n = min(n, model.s.max_positions - len(prompt))
    runner = TargetRunner(model)
    st = runner.open(prompt, len(prompt) + n + 1)
    out: list[int] = []
    while len(out) < n:
        logits, _ = runner.verify(st, [])
        v = exact_greedy(Draft.empty(), logits, Sampling(), make_rng(0))
        runner.commit(st, v)
        if v.tokens[0] == eos:
            break
        out.append(v.tokens[0])
    return out


@torch.inference_mode()
def heldout_loss(model: Llama, held: np.ndarray, windows: int = 64) -> float:
    step = max(1, (len(held) - SEQ_LEN - 1) // windows)
    losses = []
    for i in range(windows):
        x = torch.from_numpy(held[i * step : i * step + SEQ_LEN].astype(np.int64))[None]
        logits = model.forward_train(x)[0, :-1]
        losses.append(float(torch.nn.functional.cross_entropy(logits, x[0, 1:])))
    return float(np.mean(losses))


def evaluate(model_dir: Path, n_prompts: int, n_edit: int) -> dict:
    from transformers import AutoTokenizer

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = Llama.from_pretrained(model_dir)
    _, held = encode_corpus(model_dir, default_work_dir("corpus"))
    loss = heldout_loss(model, held)
    loop_flags, reps, samples = [], [], []
    prompts = stdlib_heldout(n_prompts)
    for i, p in enumerate(prompts):
        ids = tok(p.text, add_special_tokens=False)["input_ids"]
        out = greedy(model, ids, 128, tok.eos_token_id)
        loop_flags.append(float(ends_in_loop(out)))
        reps.append(seq_rep(out))
        if i < 3:
            samples.append({"prompt_tail": p.text[-300:], "continuation": tok.decode(out)})
        print(f"[eval] loop check {i + 1}/{len(prompts)} ({time.time() - t0:.0f}s)", flush=True)
    exact = 0
    edits = edit(n_edit)
    for i, p in enumerate(edits):
        ids = tok(p.text, add_special_tokens=False)["input_ids"]
        ref = tok(p.reference, add_special_tokens=False)["input_ids"]
        out = greedy(model, ids, len(ref) + 4, tok.eos_token_id)
        exact += tok.decode(out).startswith(p.reference)
        print(f"[eval] edit {i + 1}/{len(edits)} ({time.time() - t0:.0f}s)", flush=True)
    rate, heads = np.mean(loop_flags), len({p.id.rsplit(":", 1)[0] for p in prompts})
    return {
        "heldout_loss": round(loss, 4),
        "loop_rate": round(float(rate), 3),
        "loop_prompts": len(prompts),
        "loop_rate_stderr": round(float((rate * (1 - rate) / len(prompts)) ** 0.5), 3),
        "loop_rate_file_heads": round(float(np.mean(loop_flags[:heads])), 3),
        "file_heads": heads,
        "seq_rep_4": round(float(np.mean(reps)), 3),
        "text_seq_rep_4": round(text_seq_rep(held), 3),
        "edit_exact_rate": round(exact / max(1, len(edits)), 3),
        "edit_prompts": len(edits),
        "samples": samples,
        "eval_seconds": round(time.time() - t0, 1),
    }


def distill_row(state: dict) -> str:
    """Card row for a draft distilled toward the target (`training/distill.py`), else nothing."""
    d = state.get("distill")
    if not d:
        return ""
    return (
        f"| distillation | then {d['step']}/{d['total_steps']} steps ({d['epochs']} epochs, {d['train_minutes']} min)"
        f" toward the target's distribution on its generations of {d['sequences']} training prompts"
        f"{'' if d['final'] else ' — **in progress**'} |\n"
    )


def unlikelihood_row(state: dict) -> str:
    """Card row for a target fine-tuned against loops (`training/unlikelihood.py`), else nothing."""
    u = state.get("unlikelihood")
    if not u:
        return ""
    rounds = [*u.get("previous", []), u]
    first, last = rounds[0]["history"][0], u["history"][-1]
    steps = " + ".join(f"{r['step']}/{r['total_steps']} (LR {r['lr']:g})" for r in rounds)
    minutes = round(sum(r["train_minutes"] for r in rounds), 1)
    return (
        f"| unlikelihood fine-tuning | then {steps} steps ({minutes} min): MLE on "
        f"{u['mle_batch']} windows + sequence-level unlikelihood (α = {u['alpha']}) on {u['ul_batch']} greedy "
        f"{u['continuation']}-token continuations of training prompts per step; loop rate on {u['monitor_prompts']} monitored "
        f"training prompts {first['monitor_loop_rate']:.1%} → {last['monitor_loop_rate']:.1%}"
        f"{'' if u['final'] else ' — **in progress**'} |\n"
    )


def loop_row(ev: dict) -> str:
    row = (
        f"**{ev['loop_rate']:.1%}** of {ev['loop_prompts']} 128-token greedy continuations end in an n-gram cycle "
        f"(the target's gate: ≤ 25 %)"
    )
    if "loop_rate_stderr" not in ev:
        return row
    return (
        row + f", standard error {ev['loop_rate_stderr']:.1%}; the {ev['file_heads']} windows at file heads "
        f"(the first of each file's windows) alone: {ev['loop_rate_file_heads']:.1%}"
    )


def write_card(model_dir: Path, ev: dict) -> None:
    state = json.loads((model_dir / "training_state.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    n = "\n"
    card = f"""# specmesh bundled model: `{model_dir.name}`

Llama-architecture causal LM in Hugging Face format (config.json + fp16 safetensors), trained
from scratch by `training/pretrain.py` (preset `{state["preset"]}`) — no hub download.

| | |
|---|---|
| layers × hidden | {cfg["num_hidden_layers"]} × {cfg["hidden_size"]} (MLP {cfg["intermediate_size"]}, {cfg["num_attention_heads"]} heads) |
| vocabulary | {cfg["vocab_size"]} byte-level BPE (`models/tokenizer`) |
| context | {cfg["max_position_embeddings"]} tokens, trained on {state["seq_len"]}-token windows |
| training data | Python {__import__("sys").version.split()[0]} stdlib sources + edit documents, held-out modules excluded |
| tokens seen | {state["tokens_seen"]:,} of {state["tokens"]:,} planned (step {state["step"]}/{state["total_steps"]}){"" if state["final"] else " — **training still in progress**"} |
| training time | {state["train_minutes"]} min on {"a GPU" if state.get("device") == "cuda" else str(state["threads"]) + " CPU thread(s)"} |
{distill_row(state)}{unlikelihood_row(state)}| held-out loss | **{ev["heldout_loss"]}** nats/token |
| loop rate | {loop_row(ev)} |
| seq-rep-4 | {ev["seq_rep_4"]:.1%} of the continuations' 4-grams repeat an earlier one (held-out source text itself: {ev["text_seq_rep_4"]:.1%}) |
| edit exact rate | {ev["edit_exact_rate"]:.1%} of {ev["edit_prompts"]} held-out edit prompts rewritten exactly |

Held-out modules (never trained on): {", ".join(HELD_OUT)} (and their `test/test_*` files).

Regenerate: `make models` (deterministic, seeded). Evaluate: `python -m training.evaluate --model models/{model_dir.name}`.

## Samples (greedy, held-out prompts)
{n.join(f"{n}```python{n}{s['prompt_tail']}⟪{s['continuation']}⟫{n}```" for s in ev["samples"])}
"""
    (model_dir / "README.md").write_text(card)
    (model_dir / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=200, help="held-out windows (40 files, round-robin)")
    ap.add_argument("--edit-prompts", type=int, default=12)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ev = evaluate(args.model, args.prompts, args.edit_prompts)
    write_card(args.model, ev)
    print(json.dumps({k: v for k, v in ev.items() if k != "samples"}))


if __name__ == "__main__":
    main()
