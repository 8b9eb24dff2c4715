"""Training sequences shared by every trainer: the target's traces and corpus windows as token
lists, their shuffled length-bounded batches, and padding."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import torch

from services.drafter.replay import load_traces

BUNDLED_TOKENIZER = Path("models/tokenizer")


def build_sequences(trace_files: list[Path], max_len: int) -> list[list[int]]:
    seqs = []
    for f in trace_files:
        for t in load_traces(f):
            seq = (t.prompt_ids + t.continuation)[:max_len]
            if len(seq) > 8:
                seqs.append(seq)
    return seqs


def evenly(seqs: list, fraction: float) -> list:
    """An evenly spaced ``fraction`` of ``seqs`` (every source file keeps its share)."""
    return [s for i, s in enumerate(seqs) if int((i + 1) * fraction) > int(i * fraction)]


def corpus_windows(
    n_tokens: int,
    width: int = 512,
    corpus_dir: Path | None = None,
    offset: float = 0.0,
    packages: Path | None = None,
    tokenizer: Path = BUNDLED_TOKENIZER,
) -> list[list[int]]:
    """``n_tokens`` of the pretraining stream as evenly spaced ``width``-token windows (more
    data for the head: the target still supplies features and soft labels). The stream is
    encoded with ``tokenizer`` (the target's) and cached in ``corpus_dir`` (default:
    pre-training's for the bundled tokenizer, one per tokenizer otherwise), encoded there if
    missing, with the package corpus when ``packages`` is given (``pretrain.encode_corpus``);
    ``offset`` shifts every window by that fraction of the spacing."""
    if n_tokens <= 0:
        return []
    from training.pretrain import encode_corpus

    stream, _ = encode_corpus(tokenizer, corpus_dir or corpus_cache(tokenizer), packages)
    n = max(1, n_tokens // width)
    starts = [int((i + offset % 1.0) * (len(stream) - width) / n) for i in range(n)]
    return [stream[s : s + width].astype("int64").tolist() for s in starts]


def corpus_cache(tokenizer: Path) -> Path:
    """Where the corpus encoded with ``tokenizer`` is cached: pre-training's directory for the
    bundled tokenizer, else one named by the tokenizer file's digest (another vocabulary's ids
    must never be read as ours)."""
    from training.pretrain import default_work_dir

    mine = (tokenizer / "tokenizer.json").read_bytes()
    if mine == (BUNDLED_TOKENIZER / "tokenizer.json").read_bytes():
        return default_work_dir("corpus")
    return default_work_dir(f"corpus-{hashlib.sha1(mine).hexdigest()[:12]}")


def batches(seqs: list[list[int]], tokens_per_batch: int, seed: int):
    for index in index_batches([len(s) for s in seqs], tokens_per_batch, seed):
        yield [seqs[i] for i in index]


def index_batches(lengths: list[int], tokens_per_batch: int, seed: int):
    """Sequence indices in a ``seed``-shuffled order, cut into batches whose padded size stays
    within ``tokens_per_batch`` (a longer sequence alone makes a batch)."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    batch, width = [], 0
    for i in order:
        w = max(width, lengths[i])
        if batch and w * (len(batch) + 1) > tokens_per_batch:
            yield batch
            batch, w = [], lengths[i]
        batch.append(i)
        width = w
    if batch:
        yield batch


def pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    for r, s in enumerate(batch):
        ids[r, : len(s)] = torch.tensor(s)
    return ids, torch.tensor([len(s) for s in batch])
