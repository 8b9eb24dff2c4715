"""Sequence-level unlikelihood fine-tuning of the target against greedy loops (Welleck et al., 2019).

MLE training leaves a small LM's greedy continuations stuck in n-gram cycles (the loop-rate
gate of ``training/evaluate.py``). Sequence-level unlikelihood penalises the model's own
repetitions directly. Each step makes two updates:

* MLE on random ``SEQ_LEN`` windows of the training stream, which keeps the language model;
* unlikelihood on the model's greedy continuations of *training* prompts. A continuation
  token y_t that continues a cycle gets loss −log(1 − p(y_t | y_<t)), scaled by ``alpha``
  and averaged over all continuation tokens. y_t continues a cycle when the tokens ending at
  t repeat with some period p ≤ 32 for at least max(2p, 8) tokens.

The pretrain fields of ``training_state.json`` are kept and an ``unlikelihood`` section is
added. ``--round N`` runs round N on a model that has finished round N − 1 (its own steps, LR
and a fresh optimizer; earlier rounds move to ``unlikelihood.previous`` and each round draws
windows and prompts the earlier ones did not); a finished round is skipped. Resumable: a checkpoint is written every
``--ckpt-minutes`` and on SIGTERM/SIGINT; it records the weights it started from and is
ignored when those differ.

    python -m training.unlikelihood --model models/target --out build/models/target
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch

from services.common.llama import Llama
from training.pretrain import (
    batch_at,
    default_work_dir,
    encode_corpus,
    export,
    heldout_loss,
    lm_loss,
    load_checkpoint,
    weights_digest,
)

MAX_PERIOD = 32
MIN_SPAN = 8


def cycle_mask(tokens: list[int]) -> list[bool]:
    """mask[t]: the tokens ending at t repeat with some period p ≤ 32 for ≥ max(2p, 8) tokens."""
    n = len(tokens)
    mask = [False] * n
    for p in range(1, MAX_PERIOD + 1):
        run, need = 0, max(2 * p, MIN_SPAN) - p  # a p-periodic span of length L has L − p matches
        for t in range(p, n):
            run = run + 1 if tokens[t] == tokens[t - p] else 0
            if run >= need:
                mask[t] = True
    return mask


@torch.no_grad()
def greedy_batch(model: Llama, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuations [B, n] of equal-length prompts [B, L] through the static KV cache."""
    b, plen = prompts.shape
    cache = model.new_cache(batch=b, capacity=plen + n)
    logits, _ = model(prompts, 0, cache)
    out = [logits[:, -1].argmax(-1)]
    for i in range(1, n):
        logits, _ = model(out[-1][:, None], plen + i - 1, cache)
        out.append(logits[:, -1].argmax(-1))
    return torch.stack(out, 1)


def ul_loss(model: Llama, prompts: torch.Tensor, cont: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over continuation tokens of mask·(−log(1 − p(y_t))); mask [B, n] (float)."""
    seq = torch.cat([prompts, cont], 1)
    plen = prompts.shape[1]
    logits = model.forward_train(seq)[:, plen - 1 : -1].float()
    p = torch.softmax(logits, -1).gather(-1, cont[..., None])[..., 0]
    return (-torch.log1p(-p.clamp(max=1 - 1e-5)) * mask).mean()


def loop_masks(cont: torch.Tensor, eos: int) -> torch.Tensor:
    """Float mask of cycle-continuing tokens, nothing at or after a row's first EOS."""
    rows = []
    for r in cont.tolist():
        m = cycle_mask(r)
        if eos in r:
            k = r.index(eos)
            m = m[:k] + [False] * (len(r) - k)
        rows.append(m)
    return torch.tensor(rows, dtype=torch.float32)


class PromptPool:
    """Training-split prompts (the stdlib workload's format), tokenised; the last ``n_monitor``
    are never trained on and measure the loop rate as training goes."""

    def __init__(self, model_dir: Path, size: int, n_monitor: int, max_len: int):
        from transformers import AutoTokenizer

        from bench.workloads import stdlib_heldout

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        texts = [p.text for p in stdlib_heldout(size + n_monitor, split="train")]
        ids = [tok(t, add_special_tokens=False)["input_ids"][-max_len:] for t in texts]
        self.train, self.monitor = ids[:-n_monitor], ids[-n_monitor:]

    def batch(self, step: int, b: int) -> torch.Tensor:
        rng = np.random.default_rng(7_000_003 + step)  # step counts on across rounds (global_step)
        return stack_left_truncated([self.train[i] for i in rng.choice(len(self.train), b, replace=False)])


def stack_left_truncated(rows: list[list[int]]) -> torch.Tensor:
    """[B, L] with L the shortest row: longer prompts lose their oldest tokens."""
    n = min(map(len, rows))
    return torch.tensor([r[-n:] for r in rows], dtype=torch.long)


def monitor(model: Llama, pool: PromptPool, held_ids: np.ndarray, step: int) -> dict:
    row = {
        "step": step,
        "monitor_loop_rate": monitor_loop_rate(model, pool),
        "heldout_loss": round(heldout_loss(model, held_ids), 4),
    }
    print(
        f"[unlikelihood] step {step} monitor loop rate {row['monitor_loop_rate']:.1%} "
        f"held-out loss {row['heldout_loss']}",
        flush=True,
    )
    return row


def monitor_loop_rate(model: Llama, pool: PromptPool, n: int = 128) -> float:
    from training.evaluate import ends_in_loop

    loops = 0
    for i in range(0, len(pool.monitor), 8):  # similar lengths: batches of 8 keep truncation small
        cont = greedy_batch(model, stack_left_truncated(pool.monitor[i : i + 8]), n)
        loops += sum(ends_in_loop(r) for r in cont.tolist())
    return loops / len(pool.monitor)


def lr_at(step: int, total: int, peak: float, warmup: int = 20) -> float:
    """Linear warm-up (the optimizer's moments start empty), constant to 2/3 of the run, then
    cosine decay to 10 % of peak (the loop rate oscillates step to step at a constant rate)."""
    hold = 2 * total // 3
    if step < hold:
        return peak * min(1.0, (step + 1) / warmup)
    frac = (step - hold) / max(1, total - hold)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def ul_step(model, opt, args, pool, train_ids, step: int, eos: int) -> tuple[float, float, float]:
    """One MLE update and one unlikelihood update; returns (mle loss, ul loss, share of loop tokens)."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, args.steps, args.lr)
    step += args.step_offset  # a later round draws windows and prompts the earlier ones did not
    x = batch_at(train_ids, step, args.mle_batch, seed=11)
    mle = lm_loss(model, x)
    opt.zero_grad(set_to_none=True)
    mle.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    prompts = pool.batch(step, args.ul_batch)
    cont = greedy_batch(model, prompts, args.continuation)  # no dropout: train mode decodes as eval
    mask = loop_masks(cont, eos)
    ul = args.alpha * ul_loss(model, prompts, cont, mask)
    opt.zero_grad(set_to_none=True)
    ul.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return mle.item(), ul.item(), float(mask.mean())


def round_state(state: dict, model_dir: Path, round_no: int) -> tuple[dict, list[dict], str]:
    """(pretrain state, finished earlier rounds, digest of the weights round ``round_no`` starts from).

    A model exported mid-round carries its round's start digest, so that round resumes. Raises
    ``AlreadyTuned`` when round ``round_no`` is finished and ValueError when an earlier one is not."""
    base = {k: v for k, v in state.items() if k != "unlikelihood"}
    cur = state.get("unlikelihood")
    if not cur:
        done, earlier = 0, []
    elif cur["final"]:
        earlier = [*cur.get("previous", []), {k: v for k, v in cur.items() if k != "previous"}]
        done = len(earlier)
    else:
        done, earlier = len(cur.get("previous", [])), cur.get("previous", [])
        if done + 1 == round_no:
            return base, earlier, cur.get("source") or weights_digest(model_dir)
    if done >= round_no:
        raise AlreadyTuned
    if done + 1 < round_no:
        raise ValueError(f"{model_dir} has {done} finished unlikelihood round(s); run round {done + 1} first")
    return base, earlier, weights_digest(model_dir)


class AlreadyTuned(Exception):
    pass


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    state = json.loads((args.model / "training_state.json").read_text())
    try:
        base, earlier, source = round_state(state, args.model, args.round)
    except AlreadyTuned:
        print(f"[unlikelihood] {args.model} has finished round {args.round}; nothing to do")
        return
    args.step_offset = sum(r["step"] for r in earlier)
    model = Llama.from_pretrained(args.model).train()
    eos = int(model.hf_config.eos_token_id)
    train_ids, held_ids = encode_corpus(args.model, default_work_dir("corpus"))
    pool = PromptPool(args.model, args.prompts, args.monitor, args.max_prompt)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    work = args.work_dir / f"round{args.round}"
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt.pt"
    prog = {"step": 0, "elapsed": 0.0, "history": [], "source": source}
    st = load_checkpoint(ckpt, source, lambda c: c["progress"].get("source"), "unlikelihood")
    if st:
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        prog = st["progress"]
        print(f"[unlikelihood] resumed at step {prog['step']}", flush=True)
    else:
        prog["history"].append(monitor(model, pool, held_ids, 0))

    def save() -> None:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "progress": prog}, ckpt.with_suffix(".tmp"))
        os.replace(ckpt.with_suffix(".tmp"), ckpt)
        ul = {
            "step": prog["step"],
            "total_steps": args.steps,
            "lr": args.lr,
            "alpha": args.alpha,
            "ul_batch": args.ul_batch,
            "monitor_prompts": args.monitor,
            "mle_batch": args.mle_batch,
            "continuation": args.continuation,
            "train_minutes": round(prog["elapsed"] / 60, 1),
            "history": prog["history"],
            "heldout_loss": round(heldout_loss(model, held_ids), 4),
            "final": prog["step"] >= args.steps,
            "source": source,
        }
        if earlier:
            ul["previous"] = earlier
        export(model, args.model, args.out, {**base, "unlikelihood": ul})

    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *a: stop.update(now=True))
    run(args, model, opt, pool, (train_ids, held_ids), eos, prog, save, stop)
    save()
    print(f"[unlikelihood] saved {args.out} (step {prog['step']}/{args.steps})", flush=True)


def run(args, model, opt, pool, streams, eos, prog, save, stop) -> None:
    train_ids, held_ids = streams
    t_last, t_seg, ema = time.time(), time.time(), None
    while prog["step"] < args.steps and not stop["now"]:
        mle, ul, loop_share = ul_step(model, opt, args, pool, train_ids, prog["step"], eos)
        now = time.time()
        prog.update(step=prog["step"] + 1, elapsed=prog["elapsed"] + now - t_seg)
        t_seg = now
        ema = (
            (mle, ul, loop_share)
            if ema is None
            else tuple(0.9 * e + 0.1 * v for e, v in zip(ema, (mle, ul, loop_share)))
        )
        step = prog["step"]
        if step % args.log_every == 0:
            eta = (args.steps - step) * prog["elapsed"] / step
            print(
                f"[unlikelihood] step {step}/{args.steps} mle {ema[0]:.3f} ul {ema[1]:.4f} "
                f"loop tokens {ema[2]:.1%} {prog['elapsed'] / step:.1f} s/step eta {eta / 60:.0f} min",
                flush=True,
            )
        if step % args.monitor_every == 0 or step == args.steps:
            prog["history"].append(monitor(model, pool, held_ids, step))
            t_seg = time.time()
        if now - t_last > args.ckpt_minutes * 60:
            save()
            t_last = t_seg = time.time()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/target"), help="pretrained target to start from")
    ap.add_argument("--out", type=Path, default=Path("build/models/target"))
    ap.add_argument("--work-dir", type=Path, default=default_work_dir("unlikelihood"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--alpha", type=float, default=1.0, help="weight of the unlikelihood loss")
    ap.add_argument("--ul-batch", type=int, default=16, help="greedy continuations per step")
    ap.add_argument("--mle-batch", type=int, default=8, help="SEQ_LEN windows per MLE update")
    ap.add_argument("--continuation", type=int, default=128, help="tokens per greedy continuation")
    ap.add_argument("--prompts", type=int, default=960, help="training prompts in the pool")
    ap.add_argument("--monitor", type=int, default=40, help="training prompts kept aside to monitor the loop rate")
    ap.add_argument("--max-prompt", type=int, default=384, help="prompt tokens kept (the most recent)")
    ap.add_argument("--monitor-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument(
        "--round", type=int, default=1, help="which fine-tuning round this run is; a finished one is skipped"
    )
    train(ap.parse_args())


if __name__ == "__main__":
    main()
