"""A step's greedy verdicts from one batched read of its logits (``policies.read_greedy``) equal
each session's verdict from its own rows: exact chains and trees, and CSD's gate, whose gaps
and top-k ranks are read for the whole step at once off the fp32-on-CPU path."""

import random

import pytest
import torch

from services.common.config import GateConfig
from services.common.types import Draft, Sampling
from services.memory.correction_memory import LocalCorrectionMemory
from services.verifier.policies import CalibratedGreedy, exact_greedy, read_greedy, rows_policy

V = 12


def step(seed: int, sessions: int = 9) -> tuple[torch.Tensor, list[tuple[int, int]], list[Draft]]:
    """A step's joined logits [N, V] with unread rows between sessions (a prompt's logprob rows),
    each session's span and a draft that agrees with its argmaxes for a while, then strays to a
    near or far token (so gates pass and fail)."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    logits = torch.randn(sessions * 8, V, generator=g) * 3
    logits[:, 7] = logits[:, 6]  # ties in every row: the first maximum must win everywhere
    spans, drafts, at = [], [], 0
    for _ in range(sessions):
        at += rnd.randint(0, 2)
        k = rnd.randint(0, 5)
        rows = logits[at : at + k + 1]
        best = rows.argmax(-1).tolist()
        second = rows.topk(2).indices[:, 1].tolist()
        d = [best[j] if rnd.random() < 0.6 else rnd.choice([second[j], rnd.randrange(V)]) for j in range(k)]
        spans.append((at, k + 1))
        drafts.append(Draft(d))
        at += k + 1
    return logits[:at], spans, drafts


def memory_of_every_pair() -> LocalCorrectionMemory:
    m = LocalCorrectionMemory()
    m.record([(a, b) for a in range(V) for b in range(V) for _ in range(4)])
    return m


GATES = [
    GateConfig(min_count=3, top_k=2, tau=0.3, confirm=0),
    GateConfig(min_count=3, top_k=3, tau=0.05, confirm=1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_batched_reads_give_each_sessions_own_verdict(seed, dtype):
    """fp32 takes numpy's path (gates read the rows they reach); bf16 the device path (gaps and
    ranks of every gated row in one transfer): both must give the per-session verdicts."""
    logits, spans, drafts = step(seed)
    logits = logits.to(dtype)
    memory = memory_of_every_pair()
    policies = [exact_greedy, *(CalibratedGreedy(g, memory) for g in GATES)]
    for pol in policies:
        top_k = [pol.gate.top_k if isinstance(pol, CalibratedGreedy) else 0] * len(spans)
        reads = read_greedy(logits, spans, [d.token_ids for d in drafts], top_k)
        walk = rows_policy(pol)
        assert walk is not None
        for (start, n), d, r in zip(spans, drafts, reads):
            own = pol(d, logits[start : start + n].float(), Sampling(), torch.Generator())
            assert walk(d, r) == own


def test_gated_reads_on_the_device_path_are_exact():
    """Gaps in fp32 from the rows' own values; ``within`` is "fewer than k rank strictly above d"."""
    logits, spans, drafts = step(11)
    low = logits.to(torch.bfloat16)
    reads = read_greedy(low, spans, [d.token_ids for d in drafts], [2] * len(spans))
    for (start, _), d, r in zip(spans, drafts, reads):
        rows = low[start : start + len(d)].float()
        if not d.token_ids:
            assert r.gaps is None
            continue
        assert r.gaps is not None and r.within is not None
        for j, tok in enumerate(d.token_ids):
            row = rows[j]
            assert r.gaps[j] == float(row[tok] - row[r.target[j]])
            assert r.within[j] == (int((row > row[tok]).sum()) < 2)


def test_tree_drafts_walk_the_read_argmaxes():
    logits, _, _ = step(3, sessions=1)
    rows = logits[:4]
    best = rows.argmax(-1).tolist()
    # root children: best[0] and a stray; node 0's child: best[1]
    tree = Draft([best[0], (best[0] + 1) % V, best[1]], [-1, -1, 0])
    (r,) = read_greedy(logits, [(0, 4)], [tree.token_ids], [0])
    assert exact_greedy(tree, rows, Sampling(), torch.Generator()) == rows_policy(exact_greedy)(tree, r)  # type: ignore[misc]


def test_sampling_policies_read_whole_rows():
    from services.verifier.policies import rejection_sampling

    assert rows_policy(rejection_sampling) is None


def test_a_steps_reads_off_the_host_path_take_one_transfer():
    """On a GPU every host read stalls the device: the whole step's reads come back in one."""
    import collections

    from tests.integration.test_host_syncs import counted_syncs

    logits, spans, drafts = step(5)
    low = logits.to(torch.bfloat16)
    counts: collections.Counter = collections.Counter()
    with counted_syncs(counts):
        read_greedy(low, spans, [d.token_ids for d in drafts], [2] * len(spans))
    assert sum(counts.values()) == 1, counts
