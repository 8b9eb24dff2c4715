"""Token trees: the pure helpers, the tree forward against each branch's own forward, and
the K/V of an accepted branch after commit."""

import pytest
import torch

from services.common.llama import Llama, ancestor_mask
from services.common.token_tree import accepted_by, check_tree, depths, main_chain, walk
from services.common.types import Draft, Sampling
from services.verifier.policies import exact_greedy
from services.verifier.runner import TargetRunner

#        -1
#      /    \
#     0(a)   1(b)
#    / \       \
#  2(c) 3(d)   4(e)
#   |
#  5(f)
TREE = [-1, -1, 0, 0, 1, 2]


def test_tree_helpers():
    assert depths(TREE) == [1, 1, 2, 2, 2, 3]
    assert main_chain(TREE) == [0, 2, 5]
    m = ancestor_mask(TREE)
    assert m[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert m[4].nonzero().flatten().tolist() == [1, 4]
    toks = [10, 11, 12, 13, 14, 15]
    assert accepted_by(toks, TREE, [10, 13, 99]) == [0, 3]
    assert accepted_by(toks, TREE, [11, 14, 1]) == [1, 4]
    assert accepted_by(toks, TREE, [10, 12, 15]) == [0, 2, 5]
    assert accepted_by(toks, TREE, [7]) == []
    assert walk(toks, TREE, lambda node: {-1: 11, 1: 14, 4: 3}[node]) == ([1, 4], 3)
    check_tree(TREE)
    for bad in ([0], [-1, 1], [-2]):
        with pytest.raises(ValueError, match="parent"):
            check_tree(bad)


def test_draft_chain_and_greedy_walk():
    d = Draft([10, 11, 12, 13, 14, 15], TREE, token_probs=[0.5, 0.4, 0.3, 0.2, 0.1, 0.05])
    c = d.chain()
    assert d.is_tree and not c.is_tree and c.token_ids == [10, 12, 15] and c.token_probs == [0.5, 0.3, 0.05]
    logits = torch.zeros(7, 32)
    for row, tok in {0: 11, 2: 14, 5: 30}.items():  # row j + 1 follows node j
        logits[row, tok] = 1.0
    v = exact_greedy(d, logits, Sampling(), torch.Generator())
    assert v.path == (1, 4) and v.tokens == [11, 14, 30] and v.accepted == 2 and v.first_rejection is None
    logits[0] = 0
    logits[0, 10] = 1
    logits[1, 20] = 1  # after node 0 the target wants 20: children 12, 13 both miss
    v = exact_greedy(d, logits, Sampling(), torch.Generator())
    assert v.path == (0,) and v.tokens == [10, 20] and v.first_rejection == (12, 20)


def fresh(model: Llama, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_train(torch.tensor([tokens]))[0, -1]


@pytest.mark.parametrize("batched", [False, True])
def test_tree_forward_equals_each_branch_and_commit_keeps_the_accepted_one(tiny_dirs, batched):
    model = Llama.from_pretrained(tiny_dirs[0])
    runner = TargetRunner(model)
    prompt = [5, 17, 300, 42, 9]
    toks = [11, 12, 13, 14, 15, 16]
    st = runner.open(prompt, capacity=64)
    other = runner.open([7, 8, 9], capacity=64)
    items = [(st, toks)] + ([(other, [1, 2])] if batched else [])
    rows, _ = runner.step(items, [], [TREE] + ([None] if batched else []))
    logits = rows.host(0)
    assert torch.allclose(logits[0], fresh(model, prompt), atol=1e-4)
    for node in range(len(TREE)):  # row node + 1: the branch from the root to that node
        branch, cur = [], node
        while cur >= 0:
            branch.insert(0, toks[cur])
            cur = TREE[cur]
        assert torch.allclose(logits[node + 1], fresh(model, prompt + branch), atol=1e-4), node
    if batched:
        assert torch.allclose(rows.host(1)[2], fresh(model, [7, 8, 9, 1, 2]), atol=1e-4)
    # accept branch 1 → 4 (tokens 12, 15), then the target's 99: the K/V of 12 and 15 move to
    # the positions after the prompt, and the next verification sees exactly that context
    target = torch.zeros(7, model.s.vocab)
    target[0, 12], target[2, 15], target[5, 99] = 1, 1, 1
    v = exact_greedy(Draft(toks, TREE), target, Sampling(), torch.Generator())
    assert v.path == (1, 4) and v.tokens == [12, 15, 99]
    runner.commit(st, v)
    assert st.tokens == prompt + [12, 15, 99] and st.cache_len == len(prompt) + 2
    after, _ = runner.verify(st, [3, 4])
    assert torch.allclose(after[0], fresh(model, st.tokens), atol=1e-4)
    assert torch.allclose(after[2], fresh(model, st.tokens + [3, 4]), atol=1e-4)


def test_graft_adds_a_chain_under_the_root_sharing_what_the_tree_holds():
    from services.common.token_tree import graft

    toks = [10, 11, 12, 13, 14, 15]
    # 10 → 12 is in the tree; 99, 98 are new under node 2; the main chain stays first
    assert graft(toks, TREE, [10, 12, 99, 98], 16) == (toks + [99, 98], TREE + [2, 6])
    assert graft(toks, TREE, [7, 8], 16) == (toks + [7, 8], TREE + [-1, 6])  # a new root child
    assert graft(toks, TREE, [10, 12, 15], 16) == (toks, TREE)  # all there already
    assert graft(toks, TREE, [7, 8, 9], 7) == (toks + [7], TREE + [-1])  # cut at the limit
    assert graft([], [], [4, 5], 16) == ([4, 5], [-1, 0])
    assert main_chain(graft(toks, TREE, [7, 8], 16)[1]) == main_chain(TREE)
