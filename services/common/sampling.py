"""Logits → sampling distribution, shared by the target and the drafters.

The same transform (temperature, then min-p, top-k, top-p, in vLLM's order) is applied to the
target's p and the drafter's q, so rejection sampling compares like with like.
"""

from __future__ import annotations

import hashlib
import math

import torch

from services.common.types import Sampling, TokenLogprob


def probs_from_logits(logits: torch.Tensor, sp: Sampling) -> torch.Tensor:
    """[..., V] logits → [..., V] float32 probabilities under ``sp`` (temperature > 0)."""
    x = logits.float() / sp.temperature
    if sp.min_p > 0.0:  # keep p ≥ min_p · max p, i.e. logits ≥ max logit + log min_p
        x = x.masked_fill(x < x.amax(-1, keepdim=True) + math.log(sp.min_p), float("-inf"))
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always keeps the first token).
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= sp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def apply_penalties(
    logits: torch.Tensor,
    tokens: list[int],
    output_from: int,
    draft: list[int],
    sp: Sampling,
    columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Sampling``' penalties on verification rows [k+1, V]. Row i predicts the token after
    ``tokens`` (the prompt, then the output from ``output_from`` on) plus draft[:i], so it
    counts those draft tokens too: every row is penalized as a plain decoding step there would be.
    ``columns``: the token ids of the logits' columns when they cover a draft vocabulary."""
    (rows, width), dev = logits.shape, logits.device
    cols = slice(0, width) if columns is None else columns
    vocab = max(width if columns is None else int(columns.max()) + 1, max(tokens + draft, default=0) + 1)
    counts = torch.zeros(rows, vocab, device=dev)
    counts[:] = torch.bincount(torch.tensor(tokens[output_from:], dtype=torch.long, device=dev), minlength=vocab)
    for i, d in enumerate(draft[: rows - 1], 1):
        counts[i:, d] += 1
    seen = None
    if sp.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, torch.tensor(tokens[:output_from], dtype=torch.long, device=dev)] = True
    counts = counts[:, cols]
    x = logits.float()
    if seen is not None:
        x = torch.where(seen[:, cols], torch.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty), x)
    return (x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).float()).to(logits.dtype)


def apply_bias(logits: torch.Tensor, sp: Sampling, columns: torch.Tensor | None = None) -> torch.Tensor:
    """``Sampling``' logit_bias (added to the listed tokens' logits) and allowed_token_ids
    (every other token at −inf) on every row of ``logits`` [..., V]. ``columns``: the token ids
    of the logits' columns when they cover a draft vocabulary."""
    width, dev = logits.shape[-1], logits.device
    ids = [i for i, _ in sp.logit_bias] + list(sp.allowed_token_ids)
    vocab = max(width if columns is None else int(columns.max()) + 1, max(ids, default=0) + 1)
    cols = slice(0, width) if columns is None else columns
    x = logits.float()
    if sp.logit_bias:
        bias = torch.zeros(vocab, device=dev)
        bias[torch.tensor([i for i, _ in sp.logit_bias], device=dev)] = torch.tensor(
            [b for _, b in sp.logit_bias], device=dev
        )
        x = x + bias[cols]
    if sp.allowed_token_ids:
        allowed = torch.zeros(vocab, dtype=torch.bool, device=dev)
        allowed[torch.tensor(sp.allowed_token_ids, device=dev)] = True
        x = x.masked_fill(~allowed[cols], float("-inf"))
    return x.to(logits.dtype)


def banned_tokens(context: list[int], bad_words: tuple[tuple[int, ...], ...]) -> list[int]:
    """The tokens that would complete a bad word right after ``context`` (the output so far):
    each word's last token where the context ends with the word's other tokens (a one-token
    word: always)."""
    out = []
    for w in bad_words:
        k = len(w) - 1
        if k == 0 or (len(context) >= k and tuple(context[len(context) - k :]) == w[:-1]):
            out.append(w[-1])
    return out


def ban_bad_words(
    logits: torch.Tensor, output: list[int], draft: list[int], bad_words: tuple[tuple[int, ...], ...]
) -> torch.Tensor:
    """Row r of ``logits`` follows ``output`` + ``draft[:r]``: a bad word's last token gets −inf
    in every row whose context ends with the word's other tokens."""
    longest = max(len(w) for w in bad_words)
    rows, cols = [], []
    for r in range(logits.shape[0]):
        tail = (output + draft[:r])[-(longest - 1) :] if longest > 1 else []
        for t in banned_tokens(tail, bad_words):
            rows.append(r)
            cols.append(t)
    if not rows:
        return logits
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits


def ban_columns(logits: torch.Tensor, tokens: list[int], columns: torch.Tensor | None) -> torch.Tensor:
    """One row's logits with ``tokens`` (target ids) at −inf; ``columns``: the target ids of the
    logits' columns when they cover a draft vocabulary (a token outside it needs nothing)."""
    if not tokens:
        return logits
    if columns is None:
        return logits.index_fill(-1, torch.tensor(tokens, device=logits.device), float("-inf"))
    return logits.masked_fill(torch.isin(columns, torch.tensor(tokens, device=columns.device)), float("-inf"))


def sample(probs: torch.Tensor, rng: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=rng).item())


def make_rng(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


class Draws:
    """A request's random draws. Seeded, the token at output position ``i`` is drawn from a
    generator seeded by (seed, i) alone: the same seed gives the same tokens whichever cycle,
    drafter or replica draws them (a session re-opened after a failover resumes at its position).
    Unseeded, and for draws that are not one output token each (a drafter's, rejection
    sampling's), ``stream``: one generator drawn from in order."""

    def __init__(self, seed: int | None, stream: torch.Generator | None = None):
        self.seed = seed
        self.stream = stream if stream is not None else make_rng(seed)
        self.position = 0  # the output position of this cycle's first token

    def at(self, offset: int) -> torch.Generator:
        """The generator for the token ``offset`` places after this cycle's first."""
        if self.seed is None:
            return self.stream
        key = hashlib.blake2b(f"{self.seed}:{self.position + offset}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)

    @staticmethod
    def of(rng: "torch.Generator | Draws") -> "Draws":
        """``rng`` as Draws (a bare generator: unseeded, drawn in order)."""
        return rng if isinstance(rng, Draws) else Draws(None, rng)


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """argmax of each row (the first maximum, as torch's). On CPU through numpy: torch's
    argmax costs ~50 µs on [5, 8192] here, numpy's ~2 µs, and it runs every cycle."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


MAX_LOGPROBS = 20  # alternatives a request may ask for per token
MAX_LOGIT_BIAS = 300  # tokens a request may bias (OpenAI's limit)
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 64, 32  # bad words per request (two token sequences each), tokens per word


def sampling_error(sp: Sampling) -> str | None:
    """What is out of range in ``sp``, starting with the field's name; None when all is valid.
    (Token ids are checked where the vocabulary is known.)"""
    if not 0 <= sp.temperature < float("inf"):  # nan fails too; inf would turn masked logits into nan
        return f"temperature: must be a finite number >= 0, got {sp.temperature}"
    if not 0 < sp.top_p <= 1:
        return f"top_p: must be in (0, 1], got {sp.top_p}"
    if sp.top_k < 0:
        return f"top_k: must be >= 0 (0 disables it), got {sp.top_k}"
    if not 0 <= sp.min_p <= 1:
        return f"min_p: must be in [0, 1] (0 disables it), got {sp.min_p}"
    if not 0 < sp.repetition_penalty < float("inf"):
        return f"repetition_penalty: must be > 0 (1 disables it), got {sp.repetition_penalty}"
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(sp, name) <= 2:
            return f"{name}: must be in [-2, 2] (0 disables it), got {getattr(sp, name)}"
    if len(sp.logit_bias) > MAX_LOGIT_BIAS or not all(-100 <= b <= 100 for _, b in sp.logit_bias):
        return f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, each bias in [-100, 100]"
    return None


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> tuple[TokenLogprob, ...]:
    """Token j of ``tokens`` was chosen at row j of ``logits`` [≥ len(tokens), V]: its
    log-probability under the raw logits, and the ``top`` most likely tokens there."""
    if not tokens:
        return ()
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if top <= 0:
        return tuple(TokenLogprob(t, c) for t, c in zip(tokens, chosen))
    vals, ids = lp.topk(top, dim=-1)
    return tuple(
        TokenLogprob(t, c, tuple(zip(i, v))) for t, c, i, v in zip(tokens, chosen, ids.tolist(), vals.tolist())
    )
