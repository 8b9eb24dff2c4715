"""Distil the draft LM toward the target on the target's own generations (DistillSpec-style).

Acceptance in speculative decoding depends on how often the draft agrees with the target,
not on how well the draft models text. A small draft pretrained on the corpus agrees with
the target far less than its loss gap suggests. Fine-tuning it on what the target
actually generates closes that gap where it matters.

Data: traces (`python -m training trace`) of the target's greedy generations of *training* prompts.
Each sequence is prompt + output. Per batch the frozen target gives p at every position.
The draft minimises the forward KL to it (soft cross-entropy Σ −p·log q) over all real
positions. The pretrain fields of the draft's `training_state.json` are kept; a `distill`
section is added.

    python -m training.distill --draft models/draft --traces T1.jsonl,T2.jsonl --out build/models/draft
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from pathlib import Path

import torch

from services.common.llama import Llama
from training.pretrain import export, load_checkpoint, weights_digest
from training.sequences import batches, build_sequences, index_batches, pad


def soft_ce(
    draft_logits: torch.Tensor, p: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over real positions (and those ``keep`` [B, L] marks) of −Σ p·log q; logits [B, L, V],
    p [B, L, V], lengths [B]."""
    valid = torch.arange(draft_logits.shape[1], device=p.device)[None, :] < lengths[:, None]
    if keep is not None:
        valid = valid & keep
    per_pos = -(p * torch.log_softmax(draft_logits.float(), -1)).sum(-1)
    return per_pos[valid].mean()


def live_labels(target: Llama, seqs: list[list[int]]):
    """Batches' soft labels from the target's forward: index → (ids, lengths, p, None)."""
    device = next(target.parameters()).device

    @torch.no_grad()
    def labels(index: list[int]):
        ids, lengths = (t.to(device) for t in pad([seqs[i] for i in index], pad_id=0))
        return ids, lengths, torch.softmax(target.forward_train(ids).float(), -1), None

    return labels


def lr_at(step: int, total: int, peak: float) -> float:
    """Short linear warm-up (the optimizer starts fresh), then cosine to 10 % of ``peak``."""
    warmup = min(30, max(1, total // 10))
    return peak * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / max(1, total))))


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    state = json.loads((args.draft / "training_state.json").read_text())
    toward = weights_digest(args.target)
    done = state.get("distill", {})
    if done.get("final") and done.get("target") == toward:
        print(f"[distill] {args.draft} is already distilled toward {args.target} ({done['step']} steps); nothing to do")
        return
    if done.get("final"):  # distilled toward other target weights: start a new distillation from it
        print(
            f"[distill] {args.draft} was distilled toward other target weights; distilling toward {args.target}",
            flush=True,
        )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = Llama.from_pretrained(args.target, device=device).requires_grad_(False)
    draft = Llama.from_pretrained(args.draft, device=device, target_embed=target.embed_tokens.weight).train()
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    seqs = build_sequences([Path(x) for x in args.traces.split(",")], target.s.max_positions)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt.pt"
    prog = {"epoch": 0, "done": 0, "step": 0, "elapsed": 0.0, "target": toward}
    st = load_checkpoint(ckpt, toward, lambda c: c["progress"].get("target"), "distill", device)
    if st:
        draft.load_state_dict(st["draft"])
        opt.load_state_dict(st["opt"])
        prog = st["progress"]
        print(f"[distill] resumed at epoch {prog['epoch']} step {prog['step']}", flush=True)
    total = sum(1 for e in range(args.epochs) for _ in batches(seqs, args.batch_tokens, e))  # packing varies by epoch
    print(f"[distill] {len(seqs)} sequences, {sum(map(len, seqs)):,} tokens, {total} steps", flush=True)

    def save() -> None:
        torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "progress": prog}, ckpt.with_suffix(".tmp"))
        os.replace(ckpt.with_suffix(".tmp"), ckpt)
        export(draft, args.draft, args.out, {**state, "distill": distill_record(args, seqs, prog, total, toward)})

    stop = stop_on_signal()
    run_epochs(args, live_labels(target, seqs), draft, opt, seqs, prog, total, save, stop)
    save()
    print(f"[distill] saved {args.out} (step {prog['step']}/{total})", flush=True)


def distill_record(args, seqs, prog: dict, total: int, toward: str) -> dict:
    """The ``distill`` section of a draft's training_state.json."""
    return {
        "traces": args.traces,
        "sequences": len(seqs),
        "epochs": args.epochs,
        "step": prog["step"],
        "total_steps": total,
        "lr": args.lr,
        "train_minutes": round(prog["elapsed"] / 60, 1),
        "final": prog["step"] >= total,
        "target": toward,
    }


def stop_on_signal() -> dict:
    """{"now": True} once SIGTERM or SIGINT arrives: the run saves and stops at its next step."""
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *a: stop.update(now=True))
    return stop


def run_epochs(args, labels, draft, opt, seqs, prog, total, save, stop) -> None:
    """``args.epochs`` epochs of soft cross-entropy toward ``labels(index)`` (the batch's ids,
    lengths, label distributions and the positions they count at), resumable at any step."""
    t_last, t_seg, ema = time.time(), time.time(), None
    while prog["epoch"] < args.epochs and not stop["now"]:
        for i, index in enumerate(index_batches([len(s) for s in seqs], args.batch_tokens, seed=prog["epoch"])):
            if i < prog["done"]:
                continue
            ids, lengths, p, keep = labels(index)
            for g in opt.param_groups:
                g["lr"] = lr_at(prog["step"], total, args.lr)
            loss = soft_ce(draft.forward_train(ids), p, lengths, keep)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            now = time.time()
            prog.update(step=prog["step"] + 1, done=i + 1, elapsed=prog["elapsed"] + now - t_seg)
            t_seg, ema = now, loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
            if prog["step"] % args.log_every == 0:
                eta = (total - prog["step"]) * prog["elapsed"] / prog["step"]
                print(
                    f"[distill] epoch {prog['epoch']} step {prog['step']}/{total} soft-CE {ema:.3f} "
                    f"{prog['step'] * args.batch_tokens / prog['elapsed']:,.0f} tok/s eta {eta / 60:.0f} min",
                    flush=True,
                )
            if now - t_last > args.ckpt_minutes * 60:
                save()
                t_last = t_seg = time.time()
            if stop["now"]:
                return
        prog.update(epoch=prog["epoch"] + 1, done=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, default=Path("models/draft"), help="pretrained draft to start from")
    ap.add_argument("--target", type=Path, default=Path("models/target"))
    ap.add_argument("--traces", required=True, help="comma-separated trace files (training prompts only)")
    ap.add_argument("--out", type=Path, default=Path("build/models/draft"))
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache/specmesh/train/distill"))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--log-every", type=int, default=5)
    train(ap.parse_args())


if __name__ == "__main__":
    main()
