"""Acceptance policies: pure functions (draft, target logits, sampling, rng) → Verdict.

Definitions (as in vLLM's rejection sampler):
- accepted tokens: the longest draft prefix the policy keeps;
- recovered (correction) token: emitted by the target at the first rejected position;
- bonus token: sampled from the target's last distribution when every draft token passed.
Every cycle therefore emits ``accepted + 1`` tokens.

``logits`` is [k+1, V]: row i is the target's prediction for the position of draft token
i (row k predicts the bonus token).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.sampling import Draws, greedy_ids, probs_from_logits, sample
from services.common.token_tree import walk
from services.common.types import Draft, Sampling, Verdict

Rng = torch.Generator | Draws  # a request's draws (a bare generator: unseeded, in order)


class AcceptancePolicy(Protocol):
    def __call__(self, draft: Draft, logits: torch.Tensor, sp: Sampling, rng: Rng) -> Verdict: ...


@dataclass
class GreedyRows:
    """What a greedy policy reads of a draft's target rows: each row's argmax (``target``), and
    for a calibrated gate, at each draft row i, logit(d_i) − logit(t_i) (``gaps``) and whether
    d_i ranks within the gate's top-k (``within``). A step reads them for all its sessions at
    once (``read_greedy``); None where the step did not, and the gate reads ``logits`` then."""

    target: list[int]
    logits: torch.Tensor | None = None
    gaps: list[float] | None = None
    within: list[bool] | None = None

    @classmethod
    def of(cls, logits: torch.Tensor) -> "GreedyRows":
        return cls(greedy_ids(logits), logits)

    def gap(self, i: int, d: int, t: int) -> float:
        """logit(d) − logit(t) at row i."""
        if self.gaps is not None:
            return self.gaps[i]
        vals = self._row(i)
        return float(vals[d] - vals[t])

    def ranks_within(self, i: int, d: int, k: int) -> bool:
        """Fewer than k tokens rank strictly above d at row i."""
        if self.within is not None:
            return self.within[i]
        vals = self._row(i)
        return int((vals > vals[d]).sum()) < k

    def _row(self, i: int):
        assert self.logits is not None, "reads without gaps or ranks keep their rows"
        row = self.logits[i]
        return row.float().numpy() if row.device.type == "cpu" else row  # scalar reads: numpy's are ~1 µs


def read_greedy(
    logits: torch.Tensor | None,
    spans: Sequence[tuple[int, int]],
    drafts: Sequence[list[int]],
    top_k: Sequence[int],
    taken: tuple[list[int], list[float], list[bool]] | None = None,
) -> list[GreedyRows]:
    """Every greedy session's reads of one step's logits [N, V] in one pass (as vLLM's rejection
    sampler takes a batch): session i's rows are ``spans[i]`` (start, k + 1), its draft
    ``drafts[i]``; ``top_k[i]`` > 0 asks for a calibrated gate's reads on its draft rows. One
    argmax over the step and one transfer to the host, not a row read per session. On a GPU
    the gate's reads of every gated row come with it: the top-k test is d's logit ≥ the k-th
    largest (fewer than k tokens rank strictly above d). From fp32 rows on the CPU, where a
    row's reads cost no transfer and its top-k test a pass over the vocabulary, the gate reads
    the few rows it reaches itself (``logits`` kept). ``taken``: the step's argmaxes, gaps and
    top-k tests already read where its logits were (a vocabulary-split step's), in this order."""
    gaps: list[float] | None
    within: list[bool] | None
    if taken is not None:
        targets, gaps, within = taken
    elif logits is None:
        raise ValueError("read_greedy: a step's logits or its reads")
    elif logits.device.type == "cpu" and logits.dtype == torch.float32:
        targets = logits.numpy().argmax(-1).tolist()  # numpy's argmax: several times faster than torch's here
        gaps = within = None
    else:
        gated = [(s + j, d[j], k) for (s, _), d, k in zip(spans, drafts, top_k) if k > 0 for j in range(len(d))]
        targets, gaps, within = _read_on_device(logits, gated)
    out, g = [], 0
    for (start, n), draft, k in zip(spans, drafts, top_k):
        m = len(draft) if k > 0 else 0
        reads = GreedyRows(targets[start : start + n])
        if m and gaps is not None and within is not None:
            reads.gaps, reads.within = gaps[g : g + m], within[g : g + m]
        elif m and logits is not None:
            reads.logits = logits[start : start + n]
        out.append(reads)
        g += m
    return out


def _read_on_device(
    logits: torch.Tensor, gated: list[tuple[int, int, int]]
) -> tuple[list[int], list[float], list[bool]]:
    """``read_greedy``'s reads where the logits are (a GPU, or low precision): every row's
    argmax, and the gated rows' gaps and top-k tests, in one transfer."""
    ids = logits.argmax(-1)
    parts = [ids.double()]
    if gated:
        dev = logits.device
        r = torch.tensor([g[0] for g in gated], device=dev)
        d = torch.tensor([g[1] for g in gated], device=dev)
        k = torch.tensor([g[2] for g in gated], device=dev)
        at_d = logits[r, d].float()
        top = logits[r].topk(max(g[2] for g in gated), dim=-1).values
        kth = top.gather(1, (k - 1)[:, None])[:, 0].float()
        parts += [(at_d - logits[r, ids[r]].float()).double(), (at_d >= kth).double()]
    host = torch.cat(parts).tolist()
    n, m = len(ids), len(gated)
    targets = [int(x) for x in host[:n]]
    return targets, host[n : n + m], [bool(x) for x in host[n + m :]]


def exact_greedy(draft: Draft, logits: torch.Tensor, sp: Sampling, rng: Rng) -> Verdict:
    """Accept while d_i == argmax p_i; then emit argmax at the first mismatch (or the bonus).
    A tree draft: follow the child carrying each argmax (``token_tree.walk``)."""
    return exact_rows(draft, GreedyRows.of(logits))


def exact_rows(draft: Draft, rows: GreedyRows) -> Verdict:
    """``exact_greedy`` on a step's reads."""
    target = rows.target
    d = draft.token_ids
    if draft.is_tree:
        return _greedy_walk(draft, target)
    m = 0
    while m < len(d) and d[m] == target[m]:
        m += 1
    first = (d[m], target[m]) if m < len(d) else None
    return Verdict(accepted=m, tokens=d[:m] + [target[m]], first_rejection=first)


def _greedy_walk(draft: Draft, target: list[int]) -> Verdict:
    """Row 0 of ``target`` follows the committed tokens, row j + 1 follows draft node j."""
    return _walked(draft, *walk(draft.token_ids, draft.parents, lambda node: target[node + 1]))


def _walked(draft: Draft, path: list[int], t: int) -> Verdict:
    """The verdict of a walk that accepted ``path`` and emitted ``t``; where the walk stopped
    at a node with children, the first child against ``t`` is the true rejection."""
    last = path[-1] if path else -1
    first_child = next((i for i, p in enumerate(draft.parents) if p == last), None)
    first = (draft.token_ids[first_child], t) if first_child is not None else None
    return Verdict(
        accepted=len(path),
        tokens=[draft.token_ids[i] for i in path] + [t],
        first_rejection=first,
        path=tuple(path) if draft.is_tree else None,
    )


def _sampled_walk(draft: Draft, logits: torch.Tensor, sp: Sampling, rng: Rng) -> Verdict:
    """A deterministic draft (a chain or a tree, no q) under sampling: at each node, sample
    the target's own token from its row (row 0 after the committed tokens, row j + 1 after
    node j) and follow the child that carries it; the first token no child carries is
    emitted and ends the cycle. For a chain this is rejection sampling with q one-hot
    (accept d with probability p(d), else sample p with d removed), drawn differently:
    every emitted token is the target's sample, taken in order, one draw each, so a seeded
    request emits exactly the tokens vanilla sampling would."""
    draws, drawn = Draws.of(rng), itertools.count()  # the i-th draw emits the cycle's i-th token

    def target_token(node: int) -> int:
        return sample(probs_from_logits(logits[node + 1], sp), draws.at(next(drawn)))

    return _walked(draft, *walk(draft.token_ids, draft.parents, target_token))


def rejection_sampling(draft: Draft, logits: torch.Tensor, sp: Sampling, rng: Rng) -> Verdict:
    """Lossless speculative sampling.

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a
    token from norm(max(p_i − q_i, 0)); if all pass, a bonus token from p_k. A draft with
    no probabilities (q one-hot on its tokens: the suffix cache, draft trees) is verified
    by ``_sampled_walk``, which is the same in distribution. So is a seeded request's draft,
    whatever its q: the walk's tokens are vanilla's own draws, so a seed gives the same tokens
    whichever drafter proposed (the hybrid's choice follows the cache and measured costs),
    at the price of accepting d with p(d) rather than min(1, p(d) / q(d)).
    """
    if draft.probs is None or sp.seed is not None:
        return _sampled_walk(draft, logits, sp, rng)
    rng = Draws.of(rng).stream
    p = probs_from_logits(logits, sp)
    k = len(draft)
    d = torch.tensor(draft.token_ids, dtype=torch.long)
    pos = torch.arange(k)
    q_d = draft.probs[pos, d] if draft.probs is not None else torch.ones(k)
    u = torch.rand(k, generator=rng)
    rejected = (u * q_d >= p[pos, d]).nonzero()  # u < p/q accepts; written without division
    m = int(rejected[0]) if len(rejected) else k
    if m == k:
        return Verdict(accepted=k, tokens=draft.token_ids + [sample(p[k], rng)])
    if draft.probs is not None:
        residual = (p[m] - draft.probs[m]).clamp_min(0)
    else:
        residual = p[m].clone()
        residual[d[m]] = 0.0
    t = sample(residual / residual.sum() if residual.sum() > 0 else p[m], rng)
    return Verdict(accepted=m, tokens=draft.token_ids[:m] + [t], first_rejection=(int(d[m]), t))


class CalibratedGreedy:
    """Calibrated Speculative Decoding's verification (greedy requests only).

    Walk the draft: d_i == argmax p_i is accepted; a mismatch is *rescued* when the gate
    passes (``GateConfig``), which emits the draft token and keeps verifying — the target's
    later logits were computed on the draft prefix, so they stay valid. The same holds for
    ``confirm``: whether the target, given d_i, takes d_{i+1}.. as they are is read from the
    rows already computed. The first mismatch that is not rescued is the true rejection:
    emit the target's token there and report the pair for the memory. Sampled requests fall
    back to lossless rejection sampling.
    """

    def __init__(self, gate, memory=None):
        self.gate = gate
        self.memory = memory if gate.use_memory else None
        self.log_tau = math.log(gate.tau)

    def __call__(self, draft: Draft, logits: torch.Tensor, sp: Sampling, rng: Rng) -> Verdict:
        if not sp.greedy:
            return rejection_sampling(draft, logits, sp, rng)
        return self.rows(draft, GreedyRows.of(logits))

    def rows(self, draft: Draft, rows: GreedyRows) -> Verdict:
        """The greedy walk on a step's reads (``read_greedy``)."""
        target = rows.target
        d = draft.token_ids
        m = 0
        rescued: list[tuple[int, int]] = []
        while m < len(d):
            if d[m] != target[m]:
                if not (self._confirmed(d, target, m) and self._rescue(d[m], target[m], rows, m)):
                    break
                rescued.append((d[m], target[m]))
            m += 1
        first = (d[m], target[m]) if m < len(d) else None
        return Verdict(accepted=m, tokens=d[:m] + [target[m]], rescued_pairs=tuple(rescued), first_rejection=first)

    def _confirmed(self, d: list[int], target: list[int], m: int) -> bool:
        """The target, given d_m, takes the next ``confirm`` draft tokens exactly."""
        c = self.gate.confirm
        return m + c < len(d) and d[m + 1 : m + 1 + c] == target[m + 1 : m + 1 + c]

    def _rescue(self, d: int, t: int, rows: GreedyRows, m: int) -> bool:
        if self.memory is not None and self.memory.lookup(d, t) < self.gate.min_count:
            return False
        if rows.gap(m, d, t) < self.log_tau:  # ≤ 0: t is the argmax
            return False
        return rows.ranks_within(m, d, self.gate.top_k)


def lossless(draft: Draft, logits: torch.Tensor, sp: Sampling, rng: Rng) -> Verdict:
    """Exact match when greedy, rejection sampling otherwise: output distribution = target's."""
    policy = exact_greedy if sp.greedy else rejection_sampling
    return policy(draft, logits, sp, rng)


def rows_policy(policy: AcceptancePolicy) -> Callable[[Draft, GreedyRows], Verdict] | None:
    """A greedy request's policy as a walk on a step's reads (``read_greedy``); None for one
    that reads whole rows (rejection sampling)."""
    if isinstance(policy, CalibratedGreedy):
        return policy.rows
    return exact_rows if policy in (exact_greedy, lossless) else None


POLICIES: dict[str, Callable[..., Verdict]] = {
    "exact": exact_greedy,
    "rejection": rejection_sampling,
    "lossless": lossless,
}
