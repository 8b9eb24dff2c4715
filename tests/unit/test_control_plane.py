"""The control-plane benchmark's stand-in verdict: what a greedy target keeps of a draft."""

from bench.control_plane import agreed


def test_a_chain_keeps_its_prefix_that_agrees_with_the_output():
    assert agreed((5, 6, 7), (), [5, 6, 9, 1]) == 2
    assert agreed((4,), (), [5]) == 0
    assert agreed((5, 6, 7), (), [5, 6]) == 2  # the output ends first
    assert agreed((), (), [1, 2]) == 0


def test_a_tree_keeps_its_deepest_agreeing_path():
    # root -> 0:5 -> 1:6 -> 3:7 ; root -> 2:9 ; 0:5 -> 4:8
    draft, parents = (5, 6, 9, 7, 8), (-1, 0, -1, 1, 0)
    assert agreed(draft, parents, [5, 6, 7, 0]) == 3
    assert agreed(draft, parents, [5, 8, 0]) == 2
    assert agreed(draft, parents, [9, 9]) == 1
    assert agreed(draft, parents, [1]) == 0
