"""The frozen target's side of training, computed once and read back every epoch.

Distilling a draft LM and training an EAGLE-3 head both spend most of an epoch in the target's
forward pass (its soft labels; the head's features too), which is the same every epoch. This
pass runs it once over the training sequences and keeps, per token:
- the target's ``top_k`` next-token log-probabilities over its whole vocabulary (ids int32,
  log-probabilities float16): the soft label, renormalised over the top-k (and over a reduced
  draft vocabulary by whoever reads it);
- with ``aux_layers``, the residual streams entering those layers (bfloat16): the EAGLE-3 features.

The arrays are memory-mapped files in ``--out`` written sequence batch by sequence batch; a
stopped run resumes where it stopped, and a cache made for other target weights, sequences or
settings is refused, not read. ``TargetCache`` reads batches back as padded tensors.

    python -m training.target_cache --target build/models/smollm2 \\
        --traces build/traces/smollm2-stdlib-train.jsonl --aux-layers 1,15,29 --out ~/.cache/specmesh/smollm2-labels
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from services.common.llama import Llama
from training.precision import autocast, use_bf16
from training.pretrain import weights_digest
from training.sequences import build_sequences, corpus_windows, pad

TOP_K = 32


def sequences_digest(seqs: list[list[int]]) -> str:
    h = hashlib.sha1()
    for s in seqs:
        h.update(np.asarray(s, dtype=np.int32).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


class TargetCache:
    """A cache directory's arrays: ``ids`` [N] int32 (every sequence back to back), ``offsets``
    [S+1], ``topk_ids`` [N, K] int32, ``topk_logp`` [N, K] float16 and, when made with
    aux layers, ``feats`` [N, F] bfloat16 (stored as uint16)."""

    def __init__(self, root: Path, meta: dict, mode: str = "r") -> None:
        self.root, self.meta = Path(root), meta
        n, k, f = meta["tokens"], meta["top_k"], meta["feature_dim"]
        self.offsets = np.load(self.root / "offsets.npy")
        self.ids = np.load(self.root / "ids.npy", mmap_mode="r")
        self.topk_ids = np.lib.format.open_memmap(self.root / "topk_ids.npy", mode, np.int32, (n, k))
        self.topk_logp = np.lib.format.open_memmap(self.root / "topk_logp.npy", mode, np.float16, (n, k))
        self.feats = np.lib.format.open_memmap(self.root / "feats.npy", mode, np.uint16, (n, f)) if f else None

    @classmethod
    def open(cls, root: Path, expect: dict | None = None) -> TargetCache:
        """The finished cache at ``root``; ``expect``'s keys must match its meta (a cache for other
        weights, sequences or layers is an error naming what differs)."""
        meta = json.loads((Path(root) / "meta.json").read_text())
        for key, want in (expect or {}).items():
            if meta.get(key) != want:
                raise SystemExit(f"--cache {root}: made with {key}={meta.get(key)!r}, this run needs {want!r}")
        if meta["done"] < meta["sequences"]:
            raise SystemExit(f"--cache {root}: {meta['done']} of {meta['sequences']} sequences cached; finish it first")
        return cls(root, meta)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sequence(self, i: int) -> list[int]:
        return self.ids[self.offsets[i] : self.offsets[i + 1]].astype(np.int64).tolist()

    def batch(self, index: list[int]) -> dict[str, torch.Tensor]:
        """Padded tensors for sequences ``index``: ids [B, L], lengths [B], topk_ids / topk_logp
        [B, L, K] (padding: id 0, log-probability −inf), and feats [B, L, F] (bfloat16) if cached."""
        ids, lengths = pad([self.sequence(i) for i in index], pad_id=0)
        b, width, k = len(index), ids.shape[1], self.meta["top_k"]
        tk_ids = torch.zeros(b, width, k, dtype=torch.int64)
        tk_logp = torch.full((b, width, k), float("-inf"))
        feats = (
            torch.zeros(b, width, self.meta["feature_dim"], dtype=torch.bfloat16) if self.feats is not None else None
        )
        for r, i in enumerate(index):
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            tk_ids[r, : hi - lo] = torch.from_numpy(np.asarray(self.topk_ids[lo:hi], dtype=np.int64))
            tk_logp[r, : hi - lo] = torch.from_numpy(np.asarray(self.topk_logp[lo:hi], dtype=np.float32))
            if feats is not None:
                raw = torch.from_numpy(np.asarray(self.feats[lo:hi]).astype(np.int16))
                feats[r, : hi - lo] = raw.view(torch.bfloat16)
        out = {"ids": ids, "lengths": lengths, "topk_ids": tk_ids, "topk_logp": tk_logp}
        return out | ({"feats": feats} if feats is not None else {})


def sparse_probs(topk_ids: torch.Tensor, topk_logp: torch.Tensor, vocab_map: torch.Tensor, size: int) -> torch.Tensor:
    """The cached top-k as a distribution over ``size`` ids, renormalised: ``vocab_map`` [V]
    takes a target id to its id in that vocabulary (−1: not in it, its mass dropped). Rows whose
    top-k holds none of the vocabulary come out all zero."""
    mapped = vocab_map[topk_ids]
    w = torch.exp(topk_logp.float()) * (mapped >= 0)
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-12)
    out = torch.zeros(*topk_ids.shape[:-1], size)
    return out.scatter_add_(-1, mapped.clamp_min(0), w)


def build(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = Llama.from_pretrained(args.target).requires_grad_(False)
    aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else ()
    seqs = build_sequences([Path(x) for x in args.traces.split(",")], target.s.max_positions)
    seqs += corpus_windows(args.corpus_tokens, tokenizer=args.target)
    meta = {
        "target": weights_digest(args.target),
        "sequences_digest": sequences_digest(seqs),
        "aux_layers": list(aux),
        "top_k": args.top_k,
        "feature_dim": len(aux) * target.s.hidden,
        "sequences": len(seqs),
        "tokens": sum(map(len, seqs)),
        "traces": args.traces,
        "corpus_tokens": args.corpus_tokens,
        "done": 0,
    }
    meta_path = out / "meta.json"
    old = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if old and {k: v for k, v in old.items() if k != "done"} == {k: v for k, v in meta.items() if k != "done"}:
        meta["done"] = old["done"]
    else:
        np.save(out / "offsets.npy", np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64))
        np.save(out / "ids.npy", np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]))
        TargetCache(out, meta, mode="w+")  # creates the label and feature files
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    cache = TargetCache(out, meta, mode="r+")
    fill(args, target, aux, seqs, cache, meta, meta_path)


def fill(args, target: Llama, aux: tuple[int, ...], seqs, cache: TargetCache, meta: dict, meta_path: Path) -> None:
    """Run the target over the sequences not yet cached, shortest first, a batch at a time, recording
    how many are done (the order is fixed by the sequences, so a resumed run goes on from there)."""
    order = sorted(range(len(seqs)), key=lambda s: len(seqs[s]))  # shortest first: batches pad little
    t0, i, total, tokens_done = time.time(), meta["done"], meta["sequences"], 0
    while i < total:
        j = i + 1
        while j < total and (j - i + 1) * len(seqs[order[j]]) <= args.batch_tokens:
            j += 1
        rows = order[i:j]
        ids, lengths = pad([seqs[s] for s in rows], pad_id=0)
        with torch.no_grad(), autocast(torch.device("cpu"), use_bf16(args.bf16, torch.device("cpu"))):
            logits, hidden = target.forward_train(ids, capture=aux) if aux else (target.forward_train(ids), [])
            logp, top = torch.log_softmax(logits.float(), -1).topk(args.top_k, -1)
            feats = torch.cat(hidden, -1).to(torch.bfloat16) if aux else None
        for r, s in enumerate(rows):
            lo, n = int(cache.offsets[s]), int(lengths[r])
            cache.topk_ids[lo : lo + n] = top[r, :n].numpy().astype(np.int32)
            cache.topk_logp[lo : lo + n] = logp[r, :n].numpy().astype(np.float16)
            if feats is not None:
                cache.feats[lo : lo + n] = feats[r, :n].view(torch.int16).numpy().view(np.uint16)
        tokens_done += int(lengths.sum())
        i = j
        for arr in (cache.topk_ids, cache.topk_logp, cache.feats):
            if arr is not None:
                arr.flush()
        meta["done"] = i
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        rate = tokens_done / (time.time() - t0)
        left = sum(len(seqs[s]) for s in order[i:])
        print(f"[target-cache] {i}/{total} sequences, {rate:,.0f} tok/s, eta {left / rate / 60:.0f} min", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--traces", required=True, help="comma-separated trace files (training prompts only)")
    ap.add_argument("--corpus-tokens", type=int, default=0, help="add this many corpus tokens (512-token windows)")
    ap.add_argument("--aux-layers", default="", help="comma-separated layers whose entering residual stream to keep")
    ap.add_argument("--top-k", type=int, default=TOP_K)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="bf16 autocast: auto = where bf16 matmuls are native (a CPU with AMX or AVX-512 BF16); "
        "elsewhere it is emulated, many times slower than fp32",
    )
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    build(ap.parse_args())


if __name__ == "__main__":
    main()
