"""Suffix tree against brute force: exact substring counts and greedy-path speculation."""

import random
import threading
import time
from collections import Counter

import pytest

from services.common.config import SpecParams, SuffixConfig
from services.drafter.suffix import GlobalSuffixCache, SuffixDrafter
from services.drafter.suffix_tree import Candidate, CompiledSuffixTree, SuffixTree

# Every test here runs on the reference and on the compiled tree (built by `pip install`).
TREES = [pytest.param(SuffixTree, id="python"), pytest.param(CompiledSuffixTree, id="compiled")]
LIMITS = (16, 1.0, 0.0, 0.1)  # SpecParams' defaults, one by one


def limits(p: SpecParams) -> tuple:
    return p.max_spec_tokens, p.max_spec_factor, p.max_spec_offset, p.min_token_prob


def test_the_compiled_tree_was_built():
    assert CompiledSuffixTree is not None, "pip install should build services/drafter/_suffix_tree.cpp (g++, pybind11)"


def substring_counts(seqs, depth):
    c = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                c[tuple(s[i:j])] += 1
    return c


@pytest.mark.parametrize("Tree", TREES)
@pytest.mark.parametrize("vocab,depth,seed", [(2, 8, 0), (3, 6, 1), (5, 64, 2), (20, 16, 3)])
def test_counts_equal_brute_force(Tree, vocab, depth, seed):
    rng = random.Random(seed)
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(4)]
    tree = Tree(depth)
    for s in seqs:
        tree.add(s)
    ref = substring_counts(seqs, depth)
    for sub, n in ref.items():
        assert tree.count(list(sub)) == n, sub
    assert tree.count([vocab + 1]) == 0
    assert tree.total == sum(len(s) for s in seqs)


def _children(ref, pattern, vocab):
    return {t: ref[tuple(pattern) + (t,)] for t in range(vocab) if ref[tuple(pattern) + (t,)]}


@pytest.mark.parametrize("Tree", TREES)
@pytest.mark.parametrize("seed", range(6))
def test_local_speculation_follows_most_frequent_children(Tree, seed):
    rng = random.Random(seed)
    vocab, depth = 4, 12
    seq = [rng.randrange(vocab) for _ in range(120)]
    tree = Tree(depth)
    own = tree.new_seq()
    tree.extend(own, seq)
    p = SpecParams(max_spec_tokens=10, min_token_prob=0.2)
    cand = Candidate.of(tree.speculate(own, 10, *limits(p), False))
    ref = substring_counts([seq], depth)
    assert cand.token_ids, "a 120-token sequence over 4 symbols always repeats its suffix"
    pattern = seq[-cand.match_len :]
    assert cand.match_len <= depth and len(cand.token_ids) <= min(10, cand.match_len)
    prob = 1.0
    for tok, pr in zip(cand.token_ids, cand.probs):
        if len(pattern) < depth:
            kids = _children(ref, pattern, vocab)
            assert kids[tok] == max(kids.values())
            prob *= kids[tok] / ref[tuple(pattern)]
        assert pr == pytest.approx(prob) and pr >= 0.2
        pattern = pattern + [tok]
    assert cand.score == pytest.approx(sum(cand.probs))


@pytest.mark.parametrize("Tree", TREES)
def test_repeated_block_is_drafted_from_the_prompt(Tree):
    block = list(range(100, 160))
    tree = Tree(64)
    seq = tree.new_seq()
    tree.extend(seq, [1, 2] + block + [7, 8] + block[:10])
    cand = Candidate.of(tree.speculate(seq, 32, *limits(SpecParams(max_spec_tokens=32)), False))
    assert cand.token_ids == block[10:20]  # draft length ≤ match_len (10)
    # The context's own occurrence counts too (node count 2, child count 1): p = 0.5 per token.
    assert cand.match_len == 10 and cand.probs == [0.5] * 10 and cand.score == 5.0


@pytest.mark.parametrize("compiled", [False, True])
def test_drafter_global_cache_makes_second_request_hit(compiled):
    cache = GlobalSuffixCache(max_depth=64, max_cached_requests=10, compiled=compiled)
    d = SuffixDrafter(SuffixConfig(compiled=compiled), cache)
    answer = list(range(500, 540))
    d.start("a", [1, 2, 3])
    d.observe("a", answer)
    assert d.stop("a") == answer
    d.start("b", [9, 9, 9])
    d.observe("b", answer[:5])
    draft = d.propose("b", 16)
    assert draft.token_ids == answer[5:10] and draft.features["tree"] == "global"
    assert draft.source == "suffix" and draft.match_len == 5


@pytest.mark.parametrize("compiled", [False, True])
def test_global_cache_fifo_eviction(compiled):
    cache = GlobalSuffixCache(max_depth=8, max_cached_requests=4, compiled=compiled)
    for i in range(12):
        cache.insert([1000 + i, 2000 + i, 3000 + i])
    assert len(cache) == 4
    assert cache.tree.count([1011, 2011]) == 1
    assert cache.tree.count([1000]) == 0  # evicted outputs leave the tree
    live = sum(1 for i in range(12) if cache.tree.count([1000 + i]))
    assert 4 <= live <= 5  # rebuild slack: at most a quarter of capacity extra


def _rebuilt(cache: GlobalSuffixCache, version: int) -> None:
    deadline = time.monotonic() + 10
    while cache.version == version or cache._building is not None:
        assert time.monotonic() < deadline, "the background rebuild never replaced the tree"
        time.sleep(0.01)


def test_a_background_rebuild_serves_the_old_tree_until_the_new_one_holds_every_output(monkeypatch):
    """An eviction's rebuild builds on a thread of its own: meanwhile the old tree serves and
    takes the outputs that finish; the new tree, once in place, has them too."""
    gate = threading.Event()
    build = GlobalSuffixCache._build
    monkeypatch.setattr(GlobalSuffixCache, "_build", lambda self, *a: (gate.wait(10), build(self, *a)))
    cache = GlobalSuffixCache(max_depth=8, max_cached_requests=4, background=True)
    outs = [[1000 + i, 2000 + i, 3000 + i] for i in range(7)]
    for out in outs[:5]:  # the fifth evicts the first: a rebuild starts
        cache.insert(out)
    assert cache._building == []
    for out in outs[5:]:  # finished while it builds
        cache.insert(out)
    assert all(cache.tree.count(out) == 1 for out in outs)  # the old tree, evicted output included
    version = cache.version
    gate.set()
    _rebuilt(cache, version)
    assert cache.tree.count(outs[0]) == 0
    assert all(cache.tree.count(out) == 1 for out in outs[1:])  # (two evicted since: the quarter's slack)
    assert list(cache.outputs) == [tuple(out) for out in outs[3:]]
    assert cache._evicted == 2  # they count toward the next rebuild


def test_a_clear_during_a_background_rebuild_stands(monkeypatch):
    gate = threading.Event()
    build = GlobalSuffixCache._build
    monkeypatch.setattr(GlobalSuffixCache, "_build", lambda self, *a: (gate.wait(10), build(self, *a)))
    cache = GlobalSuffixCache(max_depth=8, max_cached_requests=4, background=True)
    for i in range(5):
        cache.insert([1000 + i, 2000 + i])
    cache.clear()
    gate.set()
    time.sleep(0.2)
    assert cache.tree.total == 0 and len(cache) == 0 and cache._building is None


def test_deferred_inserts_land_once_after_the_block_and_never_inside_it():
    cache = GlobalSuffixCache(max_depth=64, max_cached_requests=10)
    d = SuffixDrafter(SuffixConfig(), cache)
    answer = list(range(500, 540))
    with cache.deferred():
        for req in ("first-method", "second-method"):
            d.start(req, [1, 2, 3])
            d.observe(req, answer[:5])
            assert d.propose(req, 16).features["tree"] == "local"  # the other run's output is not visible
            d.observe(req, answer[5:])
            d.stop(req)
        assert len(cache) == 0
    assert list(cache.outputs) == [tuple(answer)]  # one distinct output, inserted once
    with cache.deferred(keep=False):
        d.start("warm-up", [4])
        d.observe("warm-up", [7, 8, 9])
        d.stop("warm-up")
    assert len(cache) == 1
    cache.clear()
    assert len(cache) == 0 and not cache.tree.match(answer[:5])


@pytest.mark.parametrize("Tree", TREES)
def test_a_followed_match_survives_its_leaf_being_materialized(Tree):
    tree = Tree(8)
    tree.add([1, 2, 3, 4, 5])
    m = tree.match([1, 2, 3])  # past the lazy leaf "1": its one occurrence's continuation
    assert tree.match_lengths(m) == [3, 2, 1]
    tree.add([1, 2, 9])  # a second "1 2": "1" and "1 2" get explicit children
    tree.advance(m, [4])
    assert tree.match_lengths(m) == [4, 3, 2, 1]  # "1 2 3 4" is still matched, through the new nodes
    assert Candidate.of(tree.speculate_matches(m, 4, *LIMITS, False)).token_ids == [5]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_live_output_is_drafted_from_before_it_finishes(compiled):
    cfg = SuffixConfig(compiled=compiled)
    cache = GlobalSuffixCache(64, 10, compiled)
    d = SuffixDrafter(cfg, cache)
    answer = list(range(500, 540))
    d.start("writer", [1, 2, 3])
    d.observe("writer", answer)
    d.start("reader", [9, 9, 9])
    d.observe("reader", answer[:5])
    draft = d.propose("reader", 16)
    assert draft.token_ids == answer[5:10] and draft.features["tree"] == "global"
    assert len(cache) == 0  # not finished: in the tree, not yet among the cached outputs
    d.stop("writer")
    assert (
        list(cache.outputs) == [tuple(answer)] and cache.tree.count(answer[:3]) == 2
    )  # the writer's once, the live reader's
    off = SuffixDrafter(SuffixConfig(compiled=compiled, live_outputs=False), GlobalSuffixCache(64, 10, compiled))
    off.start("writer", [1, 2, 3])
    off.observe("writer", answer)
    off.start("reader", [9, 9, 9])
    off.observe("reader", answer[:5])
    assert off.propose("reader", 16).features["tree"] == "local"


def test_a_live_output_leaves_the_tree_inside_a_deferred_block_and_survives_rebuilds():
    cache = GlobalSuffixCache(64, 4)
    d = SuffixDrafter(SuffixConfig(), cache)
    answer = list(range(500, 540))
    with cache.deferred():
        d.start("first-method", [1, 2, 3])
        d.observe("first-method", answer)
        d.stop("first-method")
        assert cache.tree.count(answer[:3]) == 0  # the next method on this prompt cannot draft from it
    assert cache.tree.count(answer[:3]) == 1 and len(cache) == 1
    d.start("long", [7])
    d.observe("long", [900, 901, 902])
    for i in range(6):  # evictions rebuild the tree under the live output
        cache.insert([1000 + i, 2000 + i])
    d.observe("long", [903])
    d.propose_batch([])  # the next step takes the observed tokens into the trees ...
    d.after_step()  # ... the global one once the step is sent
    assert cache.tree.count([900, 901, 902, 903]) == 1
