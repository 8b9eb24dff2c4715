"""The suffix drafter's batched step (one compiled call per global cache for a step's sessions,
without the GIL) against its per-request calls: the same drafts, bit for bit, on random
interleavings of starts (in the shared pool or a tenant's scope), observations, steps that ask
some of the sessions, finishes, and a peer's outputs arriving (which re-match, and with a small
cache rebuild, the global tree). Lagged (the global tree's writes after the step is sent), the
trees and matches it leaves once caught up are the unlagged step's."""

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import SpecParams, SuffixConfig
from services.drafter.suffix import GlobalSuffixCache, SuffixDrafter

tokens = st.lists(st.integers(0, 5), max_size=12)
op = st.one_of(
    st.tuples(st.just("start"), st.lists(st.integers(0, 5), max_size=20), st.sampled_from([None, None, "a", "b"])),
    st.tuples(st.just("observe"), st.integers(0, 5), tokens),
    st.tuples(st.just("step"), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12)), max_size=6)),
    st.tuples(st.just("stop"), st.integers(0, 5)),
    st.tuples(st.just("peer"), tokens),
)


def drafter(cfg: SuffixConfig, batched: bool) -> SuffixDrafter:
    d = SuffixDrafter(cfg, GlobalSuffixCache(cfg.max_depth, 3, compiled=True))
    assert d.batched  # built with the compiled tree
    d.batched = batched
    return d


def same(a, b) -> None:
    assert (a.token_ids, a.parents, a.token_probs, a.score, a.match_len) == (
        b.token_ids,
        b.parents,
        b.token_probs,
        b.score,
        b.match_len,
    )
    assert a.features == b.features


@settings(max_examples=250, deadline=None)
@given(
    depth=st.integers(2, 10),
    tree=st.booleans(),
    live=st.booleans(),
    min_prob=st.sampled_from([0.0, 0.1, 0.4]),
    ops=st.lists(op, max_size=40),
)
def test_a_batched_step_drafts_as_the_per_request_calls(depth, tree, live, min_prob, ops):
    cfg = SuffixConfig(
        max_depth=depth, tree=tree, live_outputs=live, lag_live=False, spec=SpecParams(min_token_prob=min_prob)
    )
    fast, ref = drafter(cfg, True), drafter(cfg, False)

    def step(asks):
        for a, b in zip(fast.propose_batch(asks), ref.propose_batch(asks)):
            same(a, b)

    play(ops, fast, ref, step)


def play(ops, a: SuffixDrafter, b: SuffixDrafter, step) -> list[str]:
    """Both drafters through ``ops`` (``step(asks)`` for a step); the requests left running."""
    running: list[str] = []
    for n, o in enumerate(ops):
        if o[0] == "start":
            running.append(f"r{n}")
            for d in (a, b):
                d.start(f"r{n}", o[1], scope=o[2])
        elif o[0] == "observe" and running:
            for d in (a, b):
                d.observe(running[o[1] % len(running)], list(o[2]))
        elif o[0] == "step" and running:
            step(list({running[i % len(running)]: budget for i, budget in o[1]}.items()))
        elif o[0] == "stop" and running:
            req = running.pop(o[1] % len(running))
            assert a.stop(req) == b.stop(req)
        elif o[0] == "peer" and o[1]:
            for d in (a, b):
                d.global_cache.insert(list(o[1]))
    return running


def state(d: SuffixDrafter) -> tuple:
    """What later drafts read: the global trees (the shared one and the scopes') by size and by
    each sequence's draft, and every request's matches in its global tree."""
    caches = [d.global_cache, *d.scoped.values()]
    trees = [(c.tree.num_nodes, c.tree.total, c.version) for c in caches]
    matches = {
        r: (st.gversion, list(st.gtree.match_lengths(st.gmatches)) if st.gversion >= 0 else None)
        for r, st in d.states.items()
    }
    lives = {r: (list(st.live.tokens), st.live.seq_id) if st.live else None for r, st in d.states.items()}
    return trees, matches, lives


@settings(max_examples=250, deadline=None)
@given(depth=st.integers(2, 10), tree=st.booleans(), ops=st.lists(op, max_size=40))
def test_a_lagged_step_leaves_the_unlagged_ones_trees_once_caught_up(depth, tree, ops):
    """Lagged, a step's drafts come before its live outputs enter the global tree; once the step
    is sent (``after_step``) the trees, live outputs and matches are the unlagged step's, so
    every later step starts from the same state."""
    lagged = drafter(SuffixConfig(max_depth=depth, tree=tree), True)
    plain = drafter(SuffixConfig(max_depth=depth, tree=tree, lag_live=False), True)

    def step(asks):
        lagged.propose_batch(asks)
        plain.propose_batch(asks)
        assert lagged._lagged or not asks
        lagged.after_step()
        assert state(lagged) == state(plain)

    for req in play(ops, lagged, plain, step):
        lagged.speculate(req, 8)  # (catches up first)
        plain.speculate(req, 8)
    assert state(lagged) == state(plain)


def test_a_lagged_draft_misses_only_its_steps_own_tokens_in_the_global_tree():
    """A peer's tokens of the same step reach another session's draft a step later."""
    cfg = SuffixConfig(max_depth=16)
    d = SuffixDrafter(cfg, GlobalSuffixCache(16, 50))
    d.start("a", [9, 9, 9])
    d.start("b", [8, 8, 8])
    d.observe("a", [1, 2, 3, 4, 5, 6])  # a writes what b is about to need
    d.observe("b", [1, 2])
    first = d.propose_batch([("a", 4), ("b", 4)])[1]
    assert first.token_ids != [3, 4, 5, 6]  # a's tokens are not in the shared tree yet
    d.after_step()
    assert d.global_cache.tree.count([1, 2, 3, 4, 5, 6]) == 1
    d.observe("b", [3])
    assert d.propose_batch([("b", 3)])[0].token_ids == [4, 5, 6]


def test_a_batched_step_runs_beside_a_writer_of_the_global_tree():
    """The step runs without the GIL while another thread inserts peers' outputs into the
    shared tree: the tree's own lock keeps them apart, and every draft still comes."""
    cfg = SuffixConfig(max_depth=16)
    d = SuffixDrafter(cfg, GlobalSuffixCache(16, 50))
    text = [i % 7 for i in range(400)]
    for i in range(32):
        d.start(f"r{i}", text[i : i + 60])
    stop = threading.Event()

    def feed() -> None:
        k = 0
        while not stop.is_set():
            d.global_cache.insert(text[k % 50 : k % 50 + 40])
            k += 1

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        for step in range(200):
            drafts = d.propose_batch([(f"r{i}", 8) for i in range(32)])
            assert len(drafts) == 32 and all(x.token_ids for x in drafts)
            for i in range(32):
                d.observe(f"r{i}", drafts[i].token_ids[:2] or [step % 7])
    finally:
        stop.set()
        writer.join()
