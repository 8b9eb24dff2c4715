"""Pre-train a Llama-architecture causal LM of the bundled zoo on the stdlib corpus.

Resumable: a full checkpoint (weights, optimizer, step) is written every
``--ckpt-minutes`` to ``--work-dir`` and on SIGTERM/SIGINT; rerunning the same command
continues from it. Each checkpoint also exports the fp16 Hugging Face model to ``--out``.

    python -m training.pretrain --preset target --out models/target
    python -m training.pretrain --preset draft  --out models/draft
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from services.common.llama import Llama
from training.corpus import EOS, source_document, source_files, training_texts
from training.precision import autocast, use_bf16


@dataclass(frozen=True)
class Preset:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    tokens: int  # total training tokens (sets the LR schedule)
    batch: int  # sequences per step
    lr: float


# The published zoo's recipes: about six passes over the 10.5 M-token corpus, trained on a lent
# GPU (scripts/gpu_pretrain.sh, about 1 M tok/s). On a CPU (~1 k tok/s) pass --tokens/--batch
# for a shorter run, or --warm-start to continue published weights.
PRESETS = {
    "target": Preset(layers=8, hidden=256, intermediate=768, heads=4, tokens=60_000_000, batch=64, lr=1.5e-3),
    "draft": Preset(layers=1, hidden=256, intermediate=768, heads=4, tokens=60_000_000, batch=64, lr=2e-3),
    # The next pair (issue 39), on the package corpus (--packages; about 50 M tokens): the smallest
    # target whose step a 1-layer draft's fixed cost stays within 10 % of on the CPU, in a size that
    # still lets the repository travel to the GPU machine (bench/results/pair_cost.md).
    "target-next": Preset(layers=14, hidden=320, intermediate=960, heads=5, tokens=150_000_000, batch=64, lr=1e-3),
    "draft-next": Preset(layers=1, hidden=128, intermediate=384, heads=2, tokens=150_000_000, batch=64, lr=2e-3),
}
SEQ_LEN = 1024


def default_work_dir(name: str) -> Path:
    base = Path(os.environ.get("SPECMESH_TRAIN_DIR", Path.home() / ".cache" / "specmesh" / "train"))
    return base / name


def weights_digest(model_dir: Path) -> str:
    """Fingerprint of a model directory's weights (keys checkpoints and \"distilled toward\")."""
    h = hashlib.sha1()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def load_checkpoint(ckpt: Path, fingerprint: str, key, tag: str, device="cpu") -> dict | None:
    """The checkpoint at ``ckpt`` if ``key(checkpoint)`` equals ``fingerprint`` (the weights it
    was made from or for), else None, saying so: a stale checkpoint is never resumed."""
    if not ckpt.exists():
        return None
    st = torch.load(ckpt, weights_only=False, map_location=device)
    if key(st) == fingerprint:
        return st
    print(f"[{tag}] {ckpt} was made for other target weights; starting afresh", flush=True)
    return None


def encode_corpus(tokenizer_dir: Path, work: Path, packages: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token streams (train, heldout) as uint16, cached in ``work``. With ``packages`` (a
    directory of ``python -m training.packages`` splits), the train packages join the standard
    library's training split, both read from there (the machine that made them: a GPU machine's
    Python may be another version); the held-out stream stays the standard library's (the gate's)."""
    from transformers import AutoTokenizer

    tag = "" if packages is None else "-packages"
    train_f, held_f = work / f"train{tag}.u16", work / f"heldout{tag}.u16"
    if train_f.exists() and held_f.exists():
        return np.fromfile(train_f, np.uint16), np.fromfile(held_f, np.uint16)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    eos = tok.convert_tokens_to_ids(EOS)

    def stream(texts: list[str]) -> np.ndarray:
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        return np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.uint16)

    t0 = time.time()
    if packages is None:
        texts = training_texts()
        held_texts = [source_document(p) for p in source_files("heldout")]
    else:
        from training.packages import read_documents

        texts = read_documents(packages / "stdlib-train.txt.xz", EOS)
        texts += read_documents(packages / "packages-train.txt.xz", EOS)
        random.Random(0).shuffle(texts)
        held_texts = read_documents(packages / "stdlib-heldout.txt.xz", EOS)
    train = stream(texts)
    held = stream(held_texts)
    work.mkdir(parents=True, exist_ok=True)
    train.tofile(train_f)
    held.tofile(held_f)
    print(f"[corpus] train={len(train):,} heldout={len(held):,} tokens ({time.time() - t0:.0f}s)", flush=True)
    return train, held


def build_model(p: Preset, vocab: int, eos: int) -> Llama:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.heads,
        max_position_embeddings=SEQ_LEN,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Llama(cfg)
    for m in model.modules():  # HF Llama initialisation: N(0, 0.02)
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)
    return model


def lm_loss(model: Llama, x: torch.Tensor) -> torch.Tensor:
    logits = model.forward_train(x)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    """Linear warm-up, then cosine decay to 10 % of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def budgeted_total(total: int, step: int, seconds_per_step: float, seconds_left: float) -> int:
    """Steps that fit a wall-clock budget: the schedule is shortened, never lengthened."""
    return max(step + 1, min(total, step + int(seconds_left / max(seconds_per_step, 1e-9))))


def batch_at(stream: np.ndarray, step: int, batch: int, seed: int) -> torch.Tensor:
    """Random ``SEQ_LEN``-token windows; a pure function of step so resumes are exact."""
    rng = np.random.default_rng(seed * 1_000_003 + step)
    starts = rng.integers(0, len(stream) - SEQ_LEN - 1, size=batch)
    return torch.from_numpy(np.stack([stream[s : s + SEQ_LEN] for s in starts]).astype(np.int64))


@torch.no_grad()
def heldout_loss(model, held: np.ndarray, windows: int = 24) -> float:
    model.eval()
    step = max(1, (len(held) - SEQ_LEN - 1) // windows)
    losses = []
    for i in range(windows):
        x = torch.from_numpy(held[i * step : i * step + SEQ_LEN].astype(np.int64))[None]
        losses.append(lm_loss(model, x.to(next(model.parameters()).device)).item())
    model.train()
    return float(np.mean(losses))


def export(model, tokenizer_dir: Path, out: Path, state: dict) -> None:
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, dtype=torch.float16)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out)
    (out / "training_state.json").write_text(json.dumps(state, indent=2) + "\n")


class _Stop:
    requested = False

    @classmethod
    def install(cls) -> None:
        def handler(signum, frame):
            cls.requested = True

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def train(args: argparse.Namespace) -> None:
    p = PRESETS[args.preset]
    if args.tokens or args.batch:
        p = Preset(**{**asdict(p), "tokens": args.tokens or p.tokens, "batch": args.batch or p.batch})
    torch.set_num_threads(args.threads)
    work = args.work_dir or default_work_dir(args.preset)
    work.mkdir(parents=True, exist_ok=True)
    train_ids, held_ids = encode_corpus(args.tokenizer, default_work_dir("corpus"), args.packages)
    eos = int(train_ids[-1])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bf16 = use_bf16(args.bf16, device)
    model = build_model(p, vocab=8192, eos=eos).to(device)
    if args.compile:  # inductor fuses the elementwise work (norms, RoPE, SiLU·mul): ~13 % faster here
        model.forward_train = torch.compile(model.forward_train)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step, elapsed, budget_steps = 0, 0.0, None
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False, map_location=device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed = st["step"], st["elapsed"]
        budget_steps = st.get("budget_steps")
        print(f"[{args.preset}] resumed at step {step} ({elapsed / 60:.1f} min trained)", flush=True)
    elif args.warm_start and (args.warm_start / "training_state.json").exists():
        # A new machine has no checkpoint: continue from published weights (fp16) and their
        # step; the optimizer restarts (a short re-warm-up of its moments).
        state = json.loads((args.warm_start / "training_state.json").read_text())
        done = state.get("final") or int(state["step"]) >= p.tokens // (p.batch * SEQ_LEN)
        if done or "distill" in state:
            print(f"[{args.preset}] {args.warm_start} has finished pretraining (step {state['step']}); nothing to do")
            return
        published = Llama.from_pretrained(args.warm_start)
        model.load_state_dict(published.state_dict())
        step, elapsed = int(state["step"]), 60.0 * float(state["train_minutes"])
        print(f"[{args.preset}] warm start from {args.warm_start} at step {step}", flush=True)
    total_steps = budget_steps or p.tokens // (p.batch * SEQ_LEN)
    nparams = sum(x.numel() for x in model.parameters())
    print(
        f"[{args.preset}] params={nparams / 1e6:.2f}M steps={total_steps} "
        f"tokens={p.tokens / 1e6:.0f}M train_stream={len(train_ids) / 1e6:.1f}M",
        flush=True,
    )
    _Stop.install()
    model.train()

    def save(final: bool = False) -> None:
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "elapsed": elapsed,
                "budget_steps": budget_steps,
            },
            ckpt.with_suffix(".tmp"),
        )
        os.replace(ckpt.with_suffix(".tmp"), ckpt)
        state = {
            "preset": args.preset,
            **asdict(p),
            "tokens": total_steps * p.batch * SEQ_LEN,
            "seq_len": SEQ_LEN,
            "step": step,
            "device": device.type,
            "total_steps": total_steps,
            "tokens_seen": step * p.batch * SEQ_LEN,
            "train_minutes": round(elapsed / 60, 1),
            "final": final,
            "heldout_loss": round(heldout_loss(model, held_ids), 4),
            "threads": args.threads,
            "bf16": bf16,
        }
        export(model, args.tokenizer, args.out, state)
        print(f"[{args.preset}] checkpoint step={step} heldout_loss={state['heldout_loss']}", flush=True)

    last_ckpt, t_seg, loss_ema = time.time(), time.time(), None
    t_start, step_start = time.time(), step
    t_mark = t_start  # reset at step_start + 20: steps 20-40 time the rate
    while step < total_steps and not _Stop.requested:
        if args.max_minutes and step == step_start + 40:
            # A wall-clock budget (a lent GPU) fixes the schedule's length once, from the rate
            # of steps 20-40 (past compilation), before warm-up ends; a resume keeps it.
            if budget_steps is None:
                per_step = (time.time() - t_mark) / 20
                left = args.max_minutes * 60 - (time.time() - t_start) - 30
                total_steps = budget_steps = budgeted_total(total_steps, step, per_step, left)
                print(
                    f"[{args.preset}] time budget: {total_steps} steps "
                    f"({total_steps * p.batch * SEQ_LEN / 1e6:.0f}M tokens)",
                    flush=True,
                )
        if step == step_start + 20:
            t_mark = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_steps, p.lr)
        x = batch_at(train_ids, step, p.batch, seed=1).to(device)
        with autocast(device, bf16):
            loss = lm_loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        now = time.time()
        elapsed += now - t_seg
        t_seg = now
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        if step % args.log_every == 0 or step == total_steps:
            rate = step * p.batch * SEQ_LEN / max(elapsed, 1e-9)
            eta = (total_steps - step) * p.batch * SEQ_LEN / max(rate, 1e-9)
            print(
                f"[{args.preset}] step {step}/{total_steps} loss {loss_ema:.3f} "
                f"lr {lr_at(step, total_steps, p.lr):.2e} {rate:,.0f} tok/s eta {eta / 60:.0f} min",
                flush=True,
            )
        if now - last_ckpt > args.ckpt_minutes * 60:
            save()
            last_ckpt = t_seg = time.time()
    save(final=step >= total_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=Path("models/tokenizer"))
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=0, help="override the preset's token budget")
    ap.add_argument("--batch", type=int, default=0, help="override the preset's sequences per step (GPU: 64)")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument(
        "--packages",
        type=Path,
        default=None,
        help="train on the package corpus too: a directory of `python -m training.packages` splits",
    )
    ap.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="bf16 autocast: auto = where bf16 matmuls are native (CUDA; a CPU with AMX or AVX-512 BF16)",
    )
    ap.add_argument(
        "--warm-start",
        type=Path,
        default=None,
        help="without a checkpoint, continue from this published model directory and its step",
    )
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="fit the schedule to this wall-clock budget, measured at step 40 (a lent GPU)",
    )
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch.compile the training forward (default on)",
    )
    train(ap.parse_args())


if __name__ == "__main__":
    main()
