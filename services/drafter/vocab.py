"""Draft vocabularies: a drafter's LM head restricted to the target's most frequent tokens.

EAGLE-3 trains its head over such a vocabulary (``d2t``/``t2d``); FR-Spec (frequency-ranked
speculative sampling) restricts an existing draft LM's head the same way at inference. A
decoding step then reads a fraction of the LM head's rows. Verification stays lossless: a
greedy draft is the argmax over the vocabulary, a sampled one comes from q renormalised over
it (zero elsewhere), and rejection sampling uses that same q.

The ranking (every token id, most frequent next token first; ties by id) is computed from
token sequences of the target's generations and shipped with the drafter as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

RANKING_FILE = "token_ranking.json"


def frequency_ranking(seqs: list[list[int]], vocab: int) -> torch.Tensor:
    """All ``vocab`` ids by how often each is a next token in ``seqs`` (the first token of a
    sequence is no label), most frequent first, ties by id."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for seq in seqs:
        if len(seq) > 1:
            counts += torch.bincount(torch.tensor(seq[1:], dtype=torch.long), minlength=vocab)
    return torch.argsort(-counts * vocab + torch.arange(vocab))


def top_vocabulary(ranking: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` best-ranked ids, ascending (draft id d ↦ target id ids[d])."""
    return torch.sort(ranking[:size]).values


def coverage(seqs: list[list[int]], ids: torch.Tensor, vocab: int) -> float:
    """Share of ``seqs``' next tokens inside ``ids``."""
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[ids] = True
    hit = sum(int(inside[torch.tensor(s[1:], dtype=torch.long)].sum()) for s in seqs if len(s) > 1)
    return hit / max(1, sum(len(s) - 1 for s in seqs))


def save_ranking(path: Path, ranking: torch.Tensor, source: str) -> None:
    path.write_text(json.dumps({"source": source, "ranking": ranking.tolist()}) + "\n")


def load_ranking(path: Path) -> torch.Tensor:
    return torch.tensor(json.loads(Path(path).read_text())["ranking"], dtype=torch.long)
