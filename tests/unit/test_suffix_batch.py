"""The suffix drafter's batched step (one compiled call per global cache for a step's sessions,
without the GIL) against its per-request calls: the same drafts, bit for bit, on random
interleavings of starts (in the shared pool or a tenant's scope), observations, steps that ask
some of the sessions, finishes, and a peer's outputs arriving (which re-match, and with a small
cache rebuild, the global tree)."""

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
    cfg = SuffixConfig(max_depth=depth, tree=tree, live_outputs=live, spec=SpecParams(min_token_prob=min_prob))
    fast, ref = drafter(cfg, True), drafter(cfg, False)
    running: list[str] = []
    for n, o in enumerate(ops):
        if o[0] == "start":
            running.append(f"r{n}")
            for d in (fast, ref):
                d.start(f"r{n}", o[1], scope=o[2])
        elif o[0] == "observe" and running:
            req = running[o[1] % len(running)]
            for d in (fast, ref):
                d.observe(req, list(o[2]))
        elif o[0] == "step" and running:
            asks = list({running[i % len(running)]: b for i, b in o[1]}.items())
            for a, b in zip(fast.propose_batch(asks), ref.propose_batch(asks)):
                same(a, b)
        elif o[0] == "stop" and running:
            req = running.pop(o[1] % len(running))
            assert fast.stop(req) == ref.stop(req)
        elif o[0] == "peer" and o[1]:
            for d in (fast, ref):
                d.global_cache.insert(list(o[1]))


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
