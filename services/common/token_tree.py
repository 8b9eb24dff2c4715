"""Token trees: a draft of several candidate continuations verified in one forward pass
(SpecInfer's tree attention, SuffixDecoding's speculation trees).

A tree is ``parents``: node i's parent index, -1 for a child of the last committed token,
and always < i (topological order). A chain is [-1, 0, 1, ...]. Among siblings the
lowest index is the drafter's first choice, so following first children from the root
gives the tree's *main chain*, the draft a chain-only verification would take.

Verification walks the tree: from the root, the target's token at the current node (its
argmax, or under sampling its own sample) selects the child carrying it, if any; the
walk's nodes are the accepted path, and the target's token where it stops is emitted.
Every token emitted is the one plain decoding would emit there, so greedy output equals
plain greedy decoding and sampled output follows the target's distribution.

Pure: no gRPC, Redis or Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def is_chain(parents: Sequence[int]) -> bool:
    """Every node's parent is the node before it (compared in C: a cycle's hot path)."""
    return list(parents) == list(range(-1, len(parents) - 1))


def check_tree(parents: Sequence[int]) -> None:
    """ValueError unless every parent is -1 or an earlier node."""
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(
                f"parents[{i}] = {p}: a node's parent must be -1 (the last committed token) "
                f"or an earlier node (0..{i - 1})"
            )


def children(parents: Sequence[int]) -> dict[int, list[int]]:
    """{node (-1: root): its children in index order}."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def main_chain(parents: Sequence[int]) -> list[int]:
    """Node indices of the first-child path from the root."""
    kids = children(parents)
    path: list[int] = []
    cur = -1
    while kids.get(cur):
        cur = kids[cur][0]
        path.append(cur)
    return path


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 1 for a child of the root."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def graft(
    token_ids: Sequence[int], parents: Sequence[int], branch: Sequence[int], limit: int
) -> tuple[list[int], list[int]]:
    """The tree with the chain ``branch`` added under the root: it follows the tree while the
    tree holds its tokens, and what is left becomes new nodes after the tree's (so the main
    chain is unchanged), at most ``limit`` nodes in all."""
    toks, pars = list(token_ids), list(parents)
    kids = children(pars)
    cur = -1
    for i, t in enumerate(branch):
        nxt = next((c for c in kids.get(cur, ()) if toks[c] == t), None)
        if nxt is None:
            room = max(0, limit - len(toks))
            for t2 in branch[i : i + room]:
                toks.append(t2)
                pars.append(cur)
                cur = len(toks) - 1
            break
        cur = nxt
    return toks, pars


def walk(token_ids: Sequence[int], parents: Sequence[int], next_token: Callable[[int], int]) -> tuple[list[int], int]:
    """The accepted path and the token emitted after it. ``next_token(node)`` is the target's
    choice after ``node`` (-1: after the last committed token)."""
    kids = children(parents)
    path: list[int] = []
    cur = -1
    while True:
        t = next_token(cur)
        nxt = next((c for c in kids.get(cur, ()) if token_ids[c] == t), None)
        if nxt is None:
            return path, t
        path.append(nxt)
        cur = nxt


def accepted_by(token_ids: Sequence[int], parents: Sequence[int], truth: Sequence[int]) -> list[int]:
    """The path a greedy verification accepts when the target's output is ``truth``
    (trace replay)."""
    dep = depths(parents)

    def next_token(node: int) -> int:
        d = 0 if node < 0 else dep[node]
        return truth[d] if d < len(truth) else -1

    return walk(token_ids, parents, next_token)[0]
