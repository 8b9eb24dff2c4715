"""Train the EAGLE-3 head with training-time test (TTT) on the target's own generations.

Data: traces (`python -m training trace`) of the target's greedy regenerations of *training* prompts
(stdlib-train, edit-train); each sequence = prompt + the target's output.
Per batch the target runs once (no grad) to give the fused features f (residual streams
entering the aux layers) and its next-token distributions p. The head is unrolled for
``ttt_steps`` steps; at step j, index i stands for the chain started at position i, now at
position i+j:
    hidden   = fc(f_i) at j = 0, else the head's own step j−1 output at i   (TTT)
    token    = x_{i+1+j} (teacher forced), RoPE position i+j
    keys     = step-0 keys of positions ≤ i  +  the chain's own keys of steps 1..j at i
    loss_j   = Σ_i soft-CE(head_j(i), p_{i+1+j}) over valid i,  weighted 0.8^j
The attention pattern is exactly what chain drafting sees at inference.

    python -m training.eagle3 --traces T1.jsonl,T2.jsonl --out models/eagle3 [--ttt-steps 4]
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
from services.drafter.eagle3 import Eagle3Head, eagle3_config
from services.drafter.vocab import coverage, frequency_ranking, top_vocabulary
from training.precision import autocast, use_bf16
from training.pretrain import load_checkpoint, weights_digest
from training.sequences import batches, build_sequences, corpus_windows, evenly, index_batches, pad
from training.target_cache import TargetCache, sparse_probs

STEP_WEIGHT = 0.8


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """Distinct low / mid / high layers (EAGLE-3 uses 2, N/2, N−3 on deep targets)."""
    if n_layers >= 8:
        return 1, n_layers // 2, n_layers - 1
    return 0, max(1, n_layers // 2), n_layers - 1


def ttt_unroll(head: Eagle3Head, feats: torch.Tensor, ids: torch.Tensor, steps: int):
    """Yield (j, logits_j [B, L, V_draft]) for the TTT steps; feats [B, L, 3H_t], ids [B, L]."""
    L = feats.shape[1]
    s = head.s
    scale = 1.0 / math.sqrt(s.head_dim)
    rep = s.heads // s.kv_heads
    idx = torch.arange(L, device=ids.device)
    causal = idx[None, :] <= idx[:, None]  # [L(query), L(key)]
    h = head.fc(feats)
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    for j in range(steps):
        tok = torch.roll(ids, -(1 + j), dims=1)  # x_{i+1+j}; the wrapped tail is masked
        cos, sin = head.rope((idx + j).clamp_max(head.rope_cos.shape[0] - 1), h.dtype)
        q, k, v = head.midlayer.qkv(head.midlayer.input_layernorm(head.embed_tokens(tok)), h, cos, sin)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if j == 0:
            k0, v0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        main = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
        if diag_k:
            diag = torch.stack([(q * dk).sum(-1) * scale for dk in diag_k], -1)  # [B, nh, L, j]
            w = torch.softmax(torch.cat([main, diag], -1), -1)
            attn = w[..., :L] @ v0 + (w[..., L:, None] * torch.stack(diag_v, -2)).sum(-2)
        else:
            attn = torch.softmax(main, -1) @ v0
        out = head.midlayer.finish(attn, h)
        yield j, head.lm_head(head.norm(out))
        h = out


def ttt_loss(
    head: Eagle3Head,
    feats: torch.Tensor,
    probs: torch.Tensor,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    steps: int,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Σ_j 0.8^j · mean over valid i of soft-CE(head_j(i), p_{i+1+j}); probs [B, L, V_draft].
    ``keep`` [B, L] marks the positions whose label counts (a reduced draft vocabulary drops
    those whose target token it cannot draft)."""
    idx = torch.arange(ids.shape[1], device=ids.device)
    total = feats.new_zeros(())
    per_step = []
    for j, logits in ttt_unroll(head, feats, ids, steps):
        logp = torch.log_softmax(logits.float(), -1)
        target = torch.roll(probs, -(1 + j), dims=1)
        valid = (idx[None, :] + 1 + j) < lengths[:, None]
        if keep is not None:
            valid = valid & torch.roll(keep, -(1 + j), dims=1)
        loss_j = (-(target * logp).sum(-1) * valid).sum() / valid.sum().clamp_min(1)
        total = total + (STEP_WEIGHT**j) * loss_j
        per_step.append(float(loss_j.detach()))
    return total, per_step


@torch.no_grad()
def heldout_agreement(head: Eagle3Head, target: Llama, seqs: list[list[int]], steps: int) -> list[float]:
    """Per chain position j: how often head_j's argmax equals the target's greedy token
    (teacher-forced, as in TTT); a greedy chain's acceptance cannot beat the running product."""
    return chain_agreement(head, target, seqs, steps)[0]


@torch.no_grad()
def chain_agreement(
    head: Eagle3Head, target: Llama, seqs: list[list[int]], steps: int
) -> tuple[list[float], list[float]]:
    """(agreement per position, chain acceptance per position). A greedy chain keeps position
    j only when positions 1..j all agree, and then the teacher-forced inputs are exactly the
    drafted ones: chain acceptance is greedy acceptance, and its sum the mean accepted length."""
    hits, chain, counts = [0.0] * steps, [0.0] * steps, [0] * steps
    for batch in batches(seqs, 4096, seed=0):
        ids, lengths = pad(batch, pad_id=0)
        logits, hidden = target.forward_train(ids, capture=head.aux_layers)
        greedy = logits.argmax(-1)
        idx = torch.arange(ids.shape[1])
        alive = torch.ones_like(ids, dtype=torch.bool)
        for j, lg in ttt_unroll(head, torch.cat(hidden, -1), ids, steps):
            valid = (idx[None, :] + 1 + j) < lengths[:, None]
            same = head.to_target_ids(lg.argmax(-1)) == torch.roll(greedy, -(1 + j), dims=1)
            alive &= same
            hits[j] += float((same & valid).sum())
            chain[j] += float((alive & valid).sum())
            counts[j] += int(valid.sum())
    rate = lambda xs: [round(x / max(c, 1), 4) for x, c in zip(xs, counts)]  # noqa: E731
    return rate(hits), rate(chain)


@torch.no_grad()
def lm_agreement(draft: Llama, target: Llama, seqs: list[list[int]]) -> float:
    """How often a draft LM's argmax equals the target's (teacher-forced): the same measure
    as ``heldout_agreement`` at chain position 1, for the `sd` drafter."""
    hits = count = 0
    for batch in batches(seqs, 4096, seed=0):
        ids, lengths = pad(batch, pad_id=0)
        valid = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        same = draft.forward_train(ids).argmax(-1) == target.forward_train(ids).argmax(-1)
        hits += int((same & valid).sum())
        count += int(valid.sum())
    return round(hits / max(count, 1), 4)


def draft_vocabulary(seqs: list[list[int]], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` target ids most frequent as next tokens in ``seqs`` (EAGLE-3 counts the
    training data's tokens), ascending; never-seen ids fill up by id."""
    return top_vocabulary(frequency_ranking(seqs, vocab), size)


def set_draft_vocabulary(head: Eagle3Head, ids: torch.Tensor, target_lm_head: torch.Tensor) -> None:
    """Draft id d ↦ target id ids[d]: d2t = ids − d, t2d marks ids; LM head rows from the target's."""
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(len(ids)))
        head.t2d.zero_()
        head.t2d[ids] = True
        head.lm_head.weight.copy_(target_lm_head[ids])
    head.remaps_vocab = len(ids) != head.s.vocab


def new_head(
    target: Llama, aux: tuple[int, ...], seqs: list[list[int]], draft_vocab: int, device
) -> tuple[Eagle3Head, torch.Tensor]:
    """A fresh head: the target's embeddings (frozen), its LM head rows for the draft
    vocabulary (chosen from ``seqs``), small random weights elsewhere; and the vocabulary's target ids."""
    vocab = target.s.vocab
    torch.manual_seed(0)
    head = Eagle3Head(eagle3_config(target.hf_config, aux, draft_vocab=draft_vocab)).to(device)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.embed_tokens.weight)
        for m in (head.fc, *[x for x in head.midlayer.modules() if isinstance(x, torch.nn.Linear)]):
            torch.nn.init.normal_(m.weight, std=0.02)
    vocab_ids = (draft_vocabulary(seqs, draft_vocab, vocab) if draft_vocab < vocab else torch.arange(vocab)).to(device)
    set_draft_vocabulary(head, vocab_ids, target.lm_head.weight)
    return head, vocab_ids


def warm_head(
    path: Path, target: Llama, aux: tuple[int, ...], draft_vocab: int, device
) -> tuple[Eagle3Head, torch.Tensor]:
    """A published head to train on: same target, feature layers and draft-vocabulary size,
    and it keeps its own vocabulary (d2t) so its LM head rows stay meaningful."""
    head = Eagle3Head.from_pretrained(path, target_embed=target.embed_tokens.weight, device=device, target=target.s)
    layers = tuple(head.cfg.eagle_config["eagle_aux_hidden_state_layer_ids"])
    if layers != tuple(aux) or head.draft_vocab != draft_vocab:
        raise SystemExit(
            f"--init {path}: head has feature layers {layers} and draft vocabulary {head.draft_vocab}; "
            f"this run asks for {tuple(aux)} and {draft_vocab}"
        )
    head.train()
    vocab_ids = head.d2t + torch.arange(head.draft_vocab, device=head.d2t.device)
    return head, vocab_ids


@torch.no_grad()
def target_side(target: Llama, cache: TargetCache | None, seqs, index: list[int], head: Eagle3Head, vocab_ids, device):
    """(ids, lengths, features, labels over the draft vocabulary, keep) for sequences ``index``:
    from the target's forward, or read back from ``cache``. Labels are renormalised over the
    draft vocabulary (as EAGLE-3's); with a reduced one, ``keep`` marks positions whose target
    token it holds (None otherwise)."""
    reduced = len(vocab_ids) < target.s.vocab
    if cache is None:
        ids, lengths = (t.to(device) for t in pad([seqs[i] for i in index], pad_id=0))
        logits, hidden = target.forward_train(ids, capture=head.aux_layers)
        keep = head.t2d[logits.argmax(-1)] if reduced else None
        probs = torch.softmax((logits[..., vocab_ids] if reduced else logits).float(), -1)
        return ids, lengths, torch.cat(hidden, -1), probs, keep
    b = {k: v.to(device) for k, v in cache.batch(index).items()}
    to_draft = torch.full((target.s.vocab,), -1, dtype=torch.long, device=device)
    to_draft[vocab_ids] = torch.arange(len(vocab_ids), device=device)
    probs = sparse_probs(b["topk_ids"], b["topk_logp"], to_draft, len(vocab_ids))
    keep = head.t2d[b["topk_ids"][..., 0]] if reduced else None
    return b["ids"], b["lengths"], b["feats"].float(), probs, keep


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = Llama.from_pretrained(args.target, device=device)
    bf16 = use_bf16(args.bf16, device)
    for p in target.parameters():
        p.requires_grad_(False)
    aux = tuple(args.aux_layers) if args.aux_layers else default_aux_layers(target.s.layers)
    cache = (
        TargetCache.open(args.cache, {"target": weights_digest(args.target), "aux_layers": list(aux)})
        if args.cache
        else None
    )
    if cache is not None:  # the sequences the cache was made of (its traces and corpus windows)
        seqs = [cache.sequence(i) for i in range(cache.meta["sequences"])]
        args.traces, args.corpus_tokens = cache.meta["traces"], cache.meta["corpus_tokens"]  # (its record)
    else:
        seqs = build_sequences([Path(x) for x in args.traces.split(",")], target.s.max_positions)
        corpus = corpus_windows(
            args.corpus_tokens,
            corpus_dir=args.corpus_dir,
            offset=args.corpus_offset,
            packages=args.packages,
            tokenizer=args.target,
        )
        seqs = evenly(seqs, args.trace_fraction) + corpus
    n_tokens = sum(len(s) for s in seqs)
    vocab = target.s.vocab
    draft_vocab = args.draft_vocab if 0 < args.draft_vocab < vocab else vocab
    if args.init:
        if Path(args.init).resolve() == Path(args.out).resolve():
            raise SystemExit(
                f"--init {args.init}: write the continued head elsewhere (--out), the start must stay as it is"
            )
        head, vocab_ids = warm_head(args.init, target, aux, draft_vocab, device)
    else:
        head, vocab_ids = new_head(target, aux, seqs, draft_vocab, device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt.pt"
    epoch, done_in_epoch, step, elapsed = 0, 0, 0, 0.0
    toward = weights_digest(args.target)  # a checkpoint of a head for other target weights is not resumed,
    start = weights_digest(args.init) if args.init else ""  # nor one of another draft vocabulary size or --init
    st = load_checkpoint(
        ckpt,
        f"{toward}:{draft_vocab}:{start}",
        lambda c: f"{c.get('target')}:{c.get('draft_vocab', vocab)}:{c.get('init', '')}",
        "eagle3",
        device,
    )
    if st:
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        epoch, done_in_epoch, step, elapsed = st["epoch"], st["done"], st["step"], st["elapsed"]
        print(f"[eagle3] resumed at epoch {epoch} step {step}", flush=True)
    total_steps = sum(
        1 for e in range(args.epochs) for _ in index_batches([len(s) for s in seqs], args.batch_tokens, e)
    )  # packing varies by epoch
    covered = coverage(seqs, vocab_ids.cpu(), vocab)
    print(
        f"[eagle3] aux layers {aux}, {len(seqs)} sequences, {n_tokens:,} tokens, {total_steps} steps, "
        f"TTT steps {args.ttt_steps}, draft vocabulary {draft_vocab} ({covered:.1%} of training tokens), "
        f"bf16 autocast {'on' if bf16 else 'off'}",
        flush=True,
    )
    init_state = (
        json.loads((args.init / "training_state.json").read_text())
        if args.init and (args.init / "training_state.json").exists()
        else None
    )
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *a: stop.update(now=True))

    def save():
        torch.save(
            {
                "head": head.state_dict(),
                "opt": opt.state_dict(),
                "epoch": epoch,
                "done": done_in_epoch,
                "step": step,
                "elapsed": elapsed,
                "target": toward,
                "draft_vocab": draft_vocab,
                "init": start,
            },
            ckpt.with_suffix(".tmp"),
        )
        os.replace(ckpt.with_suffix(".tmp"), ckpt)
        head.save_pretrained(args.out)
        (Path(args.out) / "training_state.json").write_text(
            json.dumps(
                {
                    "traces": args.traces,
                    "sequences": len(seqs),
                    "tokens": n_tokens,
                    "epochs": args.epochs,
                    "step": step,
                    "total_steps": total_steps,
                    "ttt_steps": args.ttt_steps,
                    "aux_layers": list(aux),
                    "train_minutes": round(elapsed / 60, 1),
                    "final": step >= total_steps,
                    "lr": args.lr,
                    "trace_fraction": args.trace_fraction,
                    "corpus_tokens": args.corpus_tokens,
                    "corpus_offset": args.corpus_offset,
                    "target": toward,
                    "bf16": bf16,
                    "draft_vocab": draft_vocab,
                    "draft_vocab_coverage": round(covered, 4),
                    "labels": f"top-{cache.meta['top_k']} cached (training/target_cache.py)" if cache else "full",
                    "init": init_state,
                },
                indent=2,
            )
            + "\n"
        )

    t_last, t_seg, ema, seen, t_run = time.time(), time.time(), None, 0, time.time()
    while epoch < args.epochs and not stop["now"]:
        for i, index in enumerate(index_batches([len(s) for s in seqs], args.batch_tokens, epoch)):
            if i < done_in_epoch:
                continue
            with autocast(device, bf16):
                ids, lengths, feats, probs, keep = target_side(target, cache, seqs, index, head, vocab_ids, device)
                loss, per_step = ttt_loss(head, feats, probs, ids, lengths, args.ttt_steps, keep)
            warmup = min(50, max(1, total_steps // 10))
            lr = (
                args.lr
                * min(1.0, (step + 1) / warmup)
                * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total_steps)))
            )
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            seen += int(lengths.sum())
            done_in_epoch = i + 1
            now = time.time()
            elapsed += now - t_seg
            t_seg = now
            ema = per_step if ema is None else [0.9 * a + 0.1 * b for a, b in zip(ema, per_step)]
            if step % args.log_every == 0:
                eta = (total_steps - step) * elapsed / step
                print(
                    f"[eagle3] epoch {epoch} step {step}/{total_steps} loss/step "
                    f"{' '.join(f'{x:.2f}' for x in ema)} lr {lr:.1e} {seen / (now - t_run):,.0f} tok/s "
                    f"eta {eta / 60:.0f} min",
                    flush=True,
                )
            if now - t_last > args.ckpt_minutes * 60:
                save()
                t_last = t_seg = time.time()
            if stop["now"]:
                break
        else:
            epoch, done_in_epoch = epoch + 1, 0
    save()
    print(f"[eagle3] saved {args.out} (step {step}/{total_steps})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("models/target"))
    ap.add_argument("--traces", required=True, help="comma-separated trace files (training prompts only)")
    ap.add_argument("--out", type=Path, default=Path("models/eagle3"))
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache/specmesh/train/eagle3"))
    ap.add_argument("--aux-layers", type=int, nargs=3, default=None)
    ap.add_argument(
        "--ttt-steps",
        type=int,
        default=4,
        help="unrolled training-time-test steps (1 = no TTT); serve the head with --eagle3-k at most this",
    )
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="bf16 autocast: auto = where bf16 matmuls are native (CUDA; a CPU with AMX or AVX-512 BF16)",
    )
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--trace-fraction", type=float, default=1.0, help="train on this share of the traces (ablation)")
    ap.add_argument(
        "--corpus-tokens",
        type=int,
        default=0,
        help="add this many pretraining-corpus tokens (512-token windows) to the traces",
    )
    ap.add_argument(
        "--corpus-dir",
        type=Path,
        default=None,
        help="where the encoded pre-training stream is cached (a GPU run carries it: build/corpus)",
    )
    ap.add_argument(
        "--packages",
        type=Path,
        default=None,
        help="the corpus windows come from the package corpus's stream (pretrain --packages)",
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="LM head over the N most frequent training tokens (EAGLE-3's draft vocabulary, d2t/t2d); "
        "0 = the whole target vocabulary",
    )
    ap.add_argument(
        "--init",
        type=Path,
        default=None,
        help="continue training this published head (same target, feature layers, vocabulary size) "
        "instead of a fresh one: more data at the cost of only the new tokens",
    )
    ap.add_argument(
        "--corpus-offset",
        type=float,
        default=0.0,
        help="shift the corpus windows by this fraction of their spacing (0.5 = between a "
        "previous run's windows of the same count)",
    )
    ap.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="read the target's features and top-k labels from this cache (python -m training.target_cache, "
        "made with the same target and --aux-layers) instead of running the target every epoch",
    )
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--log-every", type=int, default=10)
    train(ap.parse_args())


if __name__ == "__main__":
    main()
