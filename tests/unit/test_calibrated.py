"""Calibrated verification (CSD): gate rules, rescue semantics, first-rejection reporting."""

import math

import torch

from services.common.config import GateConfig
from services.common.types import Draft, Sampling
from services.memory.correction_memory import LocalCorrectionMemory
from services.verifier.policies import CalibratedGreedy

GREEDY = Sampling()


def logits_rows(rows):
    return torch.tensor(rows, dtype=torch.float32)


# vocab 6; row i is the target's logits at draft position i
ROWS = logits_rows(
    [
        [5.0, 4.5, 0.0, 0.0, 0.0, 0.0],  # argmax 0; token 1 close (ratio e^-0.5 ≈ 0.61)
        [0.0, 0.0, 6.0, 0.0, 0.0, 1.0],  # argmax 2; token 5 far (ratio e^-5)
        [0.0, 0.0, 0.0, 3.0, 0.0, 0.0],  # argmax 3
        [0.0, 0.0, 0.0, 0.0, 2.0, 0.0],  # bonus row
    ]
)


def memory_with(pairs, n=5):
    m = LocalCorrectionMemory()
    m.record([p for p in pairs for _ in range(n)])
    return m


def test_rescue_emits_draft_token_and_keeps_verifying():
    pol = CalibratedGreedy(GateConfig(min_count=3, top_k=2, tau=0.5), memory_with([(1, 0)]))
    v = pol(Draft([1, 2, 3]), ROWS, GREEDY, torch.Generator())
    assert v.accepted == 3 and v.rescued == 1 and v.tokens == [1, 2, 3, 4] and v.first_rejection is None


def test_first_true_rejection_is_reported_after_a_rescue():
    pol = CalibratedGreedy(GateConfig(min_count=3, top_k=2, tau=0.5, confirm=0), memory_with([(1, 0)]))
    v = pol(Draft([1, 5, 3]), ROWS, GREEDY, torch.Generator())
    assert v.accepted == 1 and v.rescued == 1 and v.tokens == [1, 2] and v.first_rejection == (5, 2)


def test_gate_conditions_each_block_a_rescue():
    draft = Draft([1, 2, 3])
    # pair not frequent enough in the memory
    assert (
        CalibratedGreedy(GateConfig(min_count=10, top_k=2, tau=0.5), memory_with([(1, 0)]))(
            draft, ROWS, GREEDY, torch.Generator()
        ).accepted
        == 0
    )
    # ratio below tau: p(1)/p(0) = e^-0.5 ≈ 0.61 < 0.7
    assert (
        CalibratedGreedy(GateConfig(min_count=1, top_k=2, tau=0.7), memory_with([(1, 0)]))(
            draft, ROWS, GREEDY, torch.Generator()
        ).accepted
        == 0
    )
    # outside top-k (top_k=1 keeps the argmax only)
    assert (
        CalibratedGreedy(GateConfig(min_count=1, top_k=1, tau=0.5), memory_with([(1, 0)]))(
            draft, ROWS, GREEDY, torch.Generator()
        ).accepted
        == 0
    )


def test_scg_ablation_ignores_memory():
    pol = CalibratedGreedy(GateConfig(min_count=100, top_k=2, tau=0.5, use_memory=False), LocalCorrectionMemory())
    assert pol(Draft([1, 2, 3]), ROWS, GREEDY, torch.Generator()).rescued == 1


def test_sampling_stays_lossless_rejection_sampling():
    pol = CalibratedGreedy(GateConfig(min_count=0, top_k=6, tau=1e-9, use_memory=False))
    sp = Sampling(temperature=1.0)
    rows = logits_rows([[20.0, 0, 0, 0, 0, 0], [0, 0, 20.0, 0, 0, 0]])
    v = pol(Draft([3]), rows, sp, torch.Generator().manual_seed(0))
    assert v.rescued == 0 and v.tokens == [0]  # p(3) ≈ 0: rejected, never rescued
    assert math.isclose(pol.log_tau, math.log(1e-9))


def test_confirm_rescues_only_where_the_target_then_takes_the_draft():
    """confirm = c: d_i is rescued only when the target, given it, takes the next c draft
    tokens exactly (read from rows already computed); too near the draft's end, never."""
    gate = lambda c: GateConfig(min_count=3, top_k=2, tau=0.5, confirm=c)  # noqa: E731
    mem = memory_with([(1, 0)])
    v = CalibratedGreedy(gate(1), mem)(Draft([1, 2, 3]), ROWS, GREEDY, torch.Generator())
    assert v.accepted == 3 and v.rescued == 1 and v.tokens == [1, 2, 3, 4]
    v = CalibratedGreedy(gate(1), mem)(Draft([1, 5, 3]), ROWS, GREEDY, torch.Generator())
    assert v.accepted == 0 and v.rescued == 0 and v.tokens == [0] and v.first_rejection == (1, 0)
    assert CalibratedGreedy(gate(2), mem)(Draft([1, 2, 3]), ROWS, GREEDY, torch.Generator()).rescued == 1
    assert CalibratedGreedy(gate(3), mem)(Draft([1, 2, 3]), ROWS, GREEDY, torch.Generator()).accepted == 0
    assert CalibratedGreedy(gate(0), mem)(Draft([1, 5, 3]), ROWS, GREEDY, torch.Generator()).rescued == 1
