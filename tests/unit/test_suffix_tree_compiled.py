"""The compiled suffix tree against the Python reference on random traces (hypothesis): the same
counts, node numbers, matches and drafts, bit for bit, paths and trees, local and foreign."""

from hypothesis import given, settings
from hypothesis import strategies as st

from services.drafter.suffix_tree import CompiledSuffixTree, SuffixTree

# A trace: sequences extended in interleaved chunks, some finished ones added whole, and foreign
# contexts matched then advanced; small vocabularies so suffixes repeat and trees branch.
tokens = st.lists(st.integers(0, 5), max_size=40)
limits = st.tuples(
    st.integers(1, 24),
    st.sampled_from([0.5, 1.0, 2.0]),
    st.sampled_from([0.0, 1.0, 3.0]),
    st.sampled_from([0.0, 0.05, 0.1, 0.3, 0.6]),
)
op = st.one_of(
    st.tuples(st.just("extend"), st.integers(0, 2), tokens),
    st.tuples(st.just("add"), tokens),
    st.tuples(st.just("foreign"), tokens, tokens),
    st.tuples(st.just("speculate"), st.integers(0, 2), st.integers(1, 24), limits, st.booleans()),
    st.tuples(st.just("follow"), tokens),  # a context matched once, then advanced as the tree grows
)


def same_draft(a, b):
    assert list(a[0]) == list(b[0]), "token ids"
    assert list(a[1]) == list(b[1]), "probabilities"
    assert list(a[2]) == list(b[2]), "parents"
    assert a[3] == b[3] and a[4] == b[4], "score, match_len"


@settings(max_examples=300, deadline=None)
@given(depth=st.integers(1, 12), ops=st.lists(op, max_size=25))
def test_compiled_tree_equals_the_reference(depth, ops):
    ref, fast = SuffixTree(depth), CompiledSuffixTree(depth)
    seqs = [(ref.new_seq(), fast.new_seq()) for _ in range(3)]
    followed, fr, ff = [], ref.match([]), fast.match([])
    for o in ops:
        if o[0] == "extend":
            r, f = seqs[o[1]]
            ref.extend(r, o[2])
            fast.extend(f, o[2])
        elif o[0] == "add":
            assert ref.add(o[1]) == fast.add(o[1])
        elif o[0] == "foreign":
            mr, mf = ref.match(o[1]), fast.match(o[1])
            ref.advance(mr, o[2])
            fast.advance(mf, o[2])
            assert ref.match_lengths(mr) == fast.match_lengths(mf)
            for tree in (False, True):
                same_draft(
                    ref.speculate_matches(mr, 16, 16, 1.0, 0.0, 0.1, tree),
                    fast.speculate_matches(mf, 16, 16, 1.0, 0.0, 0.1, tree),
                )
        elif o[0] == "follow":
            ref.advance(fr, o[1])
            fast.advance(ff, o[1])
            followed += o[1]
            lengths = ref.match_lengths(fr)
            assert lengths == fast.match_lengths(ff)
            # every match is a suffix of the context that the tree holds, however it grew meanwhile
            assert all(n and ref.count(followed[-n:]) >= 1 for n in lengths)
            same_draft(
                ref.speculate_matches(fr, 16, 16, 1.0, 0.0, 0.1, True),
                fast.speculate_matches(ff, 16, 16, 1.0, 0.0, 0.1, True),
            )
        else:
            _, i, budget, lim, tree = o
            same_draft(ref.speculate(seqs[i][0], budget, *lim, tree), fast.speculate(seqs[i][1], budget, *lim, tree))
        assert (ref.num_nodes, ref.total) == (fast.num_nodes, fast.total)
    for o in ops:  # every inserted substring's count
        for seq in [x for x in o[1:] if isinstance(x, list)]:
            for i in range(len(seq)):
                sub = seq[i : i + depth]
                assert ref.count(sub) == fast.count(sub)


def test_a_tree_past_its_storage_chunks_equals_the_reference():
    """Past 16,384 nodes (one chunk of the compiled tree's storage) several times over, with
    matches held across the growth: the same nodes, counts and drafts as the reference."""
    import random

    rng = random.Random(7)
    ref, fast = SuffixTree(16), CompiledSuffixTree(16)
    mr, mf = ref.match([1, 2]), fast.match([1, 2])
    for _ in range(120):
        seq = [rng.randrange(3) for _ in range(500)]
        assert ref.add(seq) == fast.add(seq)
        ref.advance(mr, seq[:3])
        fast.advance(mf, seq[:3])
        assert (ref.num_nodes, ref.total) == (fast.num_nodes, fast.total)
        assert ref.match_lengths(mr) == fast.match_lengths(mf)
    assert fast.num_nodes > 5 * 16384
    for start in range(0, 400, 37):
        ctx = seq[start : start + 10]
        assert ref.count(ctx) == fast.count(ctx)
        same_draft(
            ref.speculate_matches(ref.match(ctx), 16, 16, 1.0, 0.0, 0.0, True),
            fast.speculate_matches(fast.match(ctx), 16, 16, 1.0, 0.0, 0.0, True),
        )
