"""Acceptance policies: exact greedy cases and the losslessness of rejection sampling."""

import pytest
import torch

from services.common.sampling import probs_from_logits
from services.common.types import Draft, Sampling
from services.verifier.policies import exact_greedy, lossless, rejection_sampling

GREEDY = Sampling()


def onehot_logits(targets, vocab=10):
    x = torch.full((len(targets), vocab), -5.0)
    x[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return x


@pytest.mark.parametrize(
    "draft,target,accepted,tokens",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 2, 3], [1, 5, 3, 4], 1, [1, 5]),  # correction at the first mismatch
        ([7, 2, 3], [1, 2, 3, 4], 0, [1]),  # nothing accepted
        ([], [6], 0, [6]),  # no draft: one plain step
    ],
)
def test_exact_greedy(draft, target, accepted, tokens):
    v = exact_greedy(Draft(draft), onehot_logits(target), GREEDY, torch.Generator())
    assert (v.accepted, v.tokens) == (accepted, tokens)
    assert v.first_rejection == (None if accepted == len(draft) else (draft[accepted], target[accepted]))


def _chi2_pvalue_ok(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    """Pearson chi-square statistic divided by its degrees of freedom (≈1 when distributions match)."""
    keep = probs > 0
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert counts[~keep].sum() == 0, "sampled a token of zero target probability"
    return stat / max(1, int(keep.sum()) - 1)


@pytest.mark.parametrize("draft_has_probs", [True, False])
def test_rejection_sampling_reproduces_target_distribution(draft_has_probs):
    """First emitted token ~ p whatever q is (Leviathan et al., Thm 1)."""
    torch.manual_seed(0)
    vocab, n = 6, 30000
    sp = Sampling(temperature=1.0)
    logits_p = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -9.0], [0.0] * 6])
    p = probs_from_logits(logits_p[0], sp)
    q = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.05, 0.05])
    rng = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=rng)) if draft_has_probs else 3
        draft = Draft([d], probs=q[None] if draft_has_probs else None)
        v = rejection_sampling(draft, logits_p, sp, rng)
        counts[v.tokens[0]] += 1
    ratio = _chi2_pvalue_ok(counts, p, n)
    assert ratio < 3.0, (counts / n, p)


def test_rejection_sampling_bonus_when_all_accepted():
    sp = Sampling(temperature=1.0)
    logits = onehot_logits([2, 4, 1]) * 10  # target is (near) certain
    v = rejection_sampling(Draft([2, 4]), logits, sp, torch.Generator().manual_seed(0))
    assert v.accepted == 2 and v.tokens == [2, 4, 1]


def test_lossless_dispatches_on_temperature():
    logits = onehot_logits([3, 3])
    assert lossless(Draft([3]), logits, GREEDY, torch.Generator()).tokens == [3, 3]
    v = lossless(Draft([0]), logits * 10, Sampling(temperature=0.5), torch.Generator().manual_seed(0))
    assert v.accepted == 0 and v.tokens == [3]
    assert v.first_rejection == (0, 3)


def test_greedy_ids_equal_torch_argmax_including_ties():
    from services.verifier.policies import greedy_ids

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 8192, generator=g)
    logits[2, 10] = logits[2, 4000] = logits[2].max() + 1  # a tie: the first maximum wins
    assert greedy_ids(logits) == logits.argmax(-1).tolist() and greedy_ids(logits)[2] == 10
    assert greedy_ids(logits[3:]) == logits[3:].argmax(-1).tolist()  # a view, as verify returns
