"""A draft LM cut from its target: the target's first ``--layers`` decoder layers, its final norm
and its input embedding, then distilled toward the target (soft cross-entropy to the target's
next-token distributions, as `training.distill`) on the target's own generations plus corpus
text encoded with its tokenizer.

Only the layers and the norm train. The embedding, and with tied embeddings the LM head, stay
the target's: the draft shares them at serving time (``shares_target_embedding``; the engine
hands it the target's), so they are not stored and the draft directory holds a few layers.
Serve it with a reduced LM head (FR-Spec: ``python -m training.vocab`` ranks the vocabulary
beside it) to keep its step a small share of the target's.

    python -m training.draft_from_target --target build/models/smollm2 --layers 2 \\
        --traces build/traces/smollm2-stdlib-train.jsonl --corpus-tokens 500000 --out build/models/smollm2-draft
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from services.common.llama import Llama
from services.drafter.vocab import frequency_ranking, top_vocabulary
from training.distill import distill_record, live_labels, run_epochs, stop_on_signal
from training.pretrain import export, load_checkpoint, weights_digest
from training.sequences import batches, build_sequences, corpus_windows
from training.target_cache import TargetCache, sparse_probs


def cut(target_dir: Path, layers: int, work: Path) -> Llama:
    """The target's first ``layers`` layers, final norm and (shared) embedding as a draft LM."""
    target = Llama.from_pretrained(target_dir)
    if not 1 <= layers < target.s.layers:
        raise SystemExit(f"--layers: between 1 and {target.s.layers - 1} of the target's {target.s.layers}")
    cfg = target.hf_config.__class__.from_dict(target.hf_config.to_dict())
    cfg.num_hidden_layers = layers
    cfg.shares_target_embedding = True
    draft = Llama(cfg)
    keep = {
        k: v for k, v in target.state_dict().items() if not k.startswith("layers.") or int(k.split(".")[1]) < layers
    }
    missing = [k for k in draft.load_state_dict(keep, strict=False).missing_keys if "rope" not in k]
    assert not missing, f"a cut target lacks {missing[:3]}"
    draft.save_pretrained(work / "cut", dtype=torch.float32)
    return Llama.from_pretrained(work / "cut", target_embed=target.embed_tokens.weight)


def trainable(draft: Llama) -> list[torch.nn.Parameter]:
    """The layers and the final norm; the shared embedding (and a tied LM head) stay frozen."""
    draft.embed_tokens.weight.requires_grad_(False)
    if not draft.s.tie_embeddings:
        draft.lm_head.weight.requires_grad_(False)
    return [p for p in draft.parameters() if p.requires_grad]


def cached_labels(cache: TargetCache, draft: Llama, traces: list[list[int]], size: int):
    """Batches' soft labels read from ``cache``; with ``size``, the draft scores only the ``size``
    ids most frequent as next tokens in ``traces`` (its FR-Spec head at serving), the labels are
    renormalised over them and positions whose top-k holds none of them do not count. Returns
    the labels function and the head it trains with (the full one put back before export)."""
    vocab = draft.s.vocab
    to_draft = torch.arange(vocab)
    head = draft.lm_head
    if 0 < size < vocab:
        ids = top_vocabulary(frequency_ranking(traces, vocab), size)
        to_draft = torch.full((vocab,), -1, dtype=torch.long)
        to_draft[ids] = torch.arange(size)
        head = torch.nn.Linear(draft.s.hidden, size, bias=False)
        head.weight = torch.nn.Parameter(draft.lm_head.weight.detach()[ids].clone(), requires_grad=False)

    def labels(index: list[int]):
        b = cache.batch(index)
        p = sparse_probs(b["topk_ids"], b["topk_logp"], to_draft, len(head.weight))
        return b["ids"], b["lengths"], p, p.sum(-1) > 0

    return labels, head


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    target = Llama.from_pretrained(args.target).requires_grad_(False)
    draft = cut(args.target, args.layers, work).train()
    opt = torch.optim.AdamW(trainable(draft), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    traces = build_sequences([Path(x) for x in args.traces.split(",")], target.s.max_positions)
    full_head = draft.lm_head
    if args.cache:  # the sequences the cache holds (its traces and corpus windows), its labels
        cache = TargetCache.open(args.cache, {"target": weights_digest(args.target)})
        seqs = [cache.sequence(i) for i in range(cache.meta["sequences"])]
        labels, draft.lm_head = cached_labels(cache, draft, traces, args.loss_vocab)
        args.corpus_tokens = cache.meta["corpus_tokens"]  # (its record, as training.eagle3 keeps it)
    else:
        seqs = traces + corpus_windows(args.corpus_tokens, tokenizer=args.target)
        labels = live_labels(target, seqs)
    toward = f"{weights_digest(args.target)}:{args.layers}:{args.corpus_tokens}:{args.loss_vocab}"
    ckpt = work / "ckpt.pt"
    prog = {"epoch": 0, "done": 0, "step": 0, "elapsed": 0.0, "target": toward}
    st = load_checkpoint(ckpt, toward, lambda c: c["progress"].get("target"), "draft", "cpu")
    if st:
        draft.load_state_dict({**st["draft"], "embed_tokens.weight": target.embed_tokens.weight}, strict=False)
        opt.load_state_dict(st["opt"])
        prog = st["progress"]
        print(f"[draft] resumed at epoch {prog['epoch']} step {prog['step']}", flush=True)
    total = sum(1 for e in range(args.epochs) for _ in batches(seqs, args.batch_tokens, e))
    print(
        f"[draft] the target's first {args.layers} of {target.s.layers} layers; {len(seqs)} sequences, "
        f"{sum(map(len, seqs)):,} tokens, {total} steps",
        flush=True,
    )

    def save() -> None:
        training_head, draft.lm_head = draft.lm_head, full_head  # exported with the target's (tied) head
        own = {k: v for k, v in draft.state_dict().items() if not k.startswith(("embed_tokens", "lm_head"))}
        torch.save({"draft": own, "opt": opt.state_dict(), "progress": prog}, ckpt.with_suffix(".tmp"))
        os.replace(ckpt.with_suffix(".tmp"), ckpt)
        state = {
            "from_target": {"target": str(args.target), "layers": args.layers, "of": target.s.layers},
            "distill": {
                **distill_record(args, seqs, prog, total, toward),
                "corpus_tokens": args.corpus_tokens,
                "loss_vocab": args.loss_vocab,
                "cached_labels": bool(args.cache),
            },
        }
        export(draft, args.target, args.out, state)
        draft.lm_head = training_head

    stop = stop_on_signal()
    run_epochs(args, labels, draft, opt, seqs, prog, total, save, stop)
    save()
    print(f"[draft] saved {args.out} (step {prog['step']}/{total})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=2, help="the target's first layers the draft keeps")
    ap.add_argument("--traces", required=True, help="comma-separated trace files (training prompts only)")
    ap.add_argument("--corpus-tokens", type=int, default=0, help="add this many corpus tokens (512-token windows)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache/specmesh/train/draft-from-target"))
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="the target's top-k labels from this cache (python -m training.target_cache, same target; its "
        "sequences replace --traces/--corpus-tokens as the data) instead of its forward every epoch",
    )
    ap.add_argument(
        "--loss-vocab",
        type=int,
        default=0,
        help="with --cache: score and learn only the N ids most frequent in the traces (the FR-Spec head "
        "it serves with); 0 = the whole vocabulary",
    )
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--log-every", type=int, default=5)
    train(ap.parse_args())


if __name__ == "__main__":
    main()
