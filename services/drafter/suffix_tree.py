"""Depth-capped suffix trie with occurrence counts, for SuffixDecoding (arXiv 2411.04975).

Every substring of length ≤ ``max_depth`` of the inserted sequences is a path from the root;
``count`` is its number of occurrences. Speculation from a matched context suffix follows
the most frequent child while the running probability ``count(child) / count(node)`` stays
≥ ``min_token_prob``; a draft's ``score`` is the sum of its token probabilities.

Representation (ours, shaped for Python speed and memory):
- *Lazy leaves.* A node seen once has no children: its continuation is read from the one
  occurrence it references (``seq[end:]``). When a second occurrence arrives, the first
  one's next token is materialized as a child (one level per step), so counts match a full
  trie exactly while unique text costs one node per token instead of ``max_depth``.
- *Active suffixes.* A sequence being extended keeps the nodes of its suffixes that are
  repeated (count ≥ 2); a token append touches only those, and they double as the
  sequence's matches in its own tree.
- Each node caches its most frequent child (``best``) so a speculation step is O(1). Equal
  counts go to the child counted most recently (as ArcticInference orders siblings), then to
  the first inserted.

This module is the reference; ``_suffix_tree.cpp`` is its compiled twin (same nodes, counts,
drafts and tie-breaks; a property test holds them equal). ``new_tree`` picks the compiled one
when the package was built with it. No torch, gRPC, Redis or Ray.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from services.common.config import SpecParams

try:
    from services.drafter._suffix_tree import Matches as CompiledMatches
    from services.drafter._suffix_tree import SuffixTree as CompiledSuffixTree
    from services.drafter._suffix_tree import grow_live, step_batch
except ImportError:  # built without a C++ compiler: the reference serves
    CompiledSuffixTree = CompiledMatches = grow_live = step_batch = None


# (token_ids, probs, parents, score, match_len): what both trees' speculate returns
Draft = tuple[list[int], list[float], list[int], float, int]


class Node:
    __slots__ = ("count", "stamp", "children", "depth", "seq", "end", "best", "token")

    def __init__(self, token: int, depth: int, seq: list[int], end: int):
        self.token = token
        self.count = 1
        self.stamp = 0  # the tree's clock at the last count increment: recency breaks ties
        self.children: dict[int, Node] | None = None
        self.depth = depth
        self.seq = seq  # one occurrence: this node's string is seq[end-depth:end]
        self.end = end
        self.best: Node | None = None


@dataclass
class Candidate:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    parents: list[int] = field(default_factory=list)  # a tree's (token_tree); empty: a chain

    def as_tuple(self) -> Draft:
        return self.token_ids, self.probs, self.parents, self.score, self.match_len

    @classmethod
    def of(cls, draft: Draft) -> Candidate:
        ids, probs, parents, score, match_len = draft
        return cls(list(ids), list(probs), score, match_len, list(parents))


@dataclass(frozen=True)
class Match:
    """A context suffix matched in a tree: ``node``'s string plus ``extra`` implicit tokens."""

    node: Node
    extra: int = 0

    @property
    def length(self) -> int:
        return self.node.depth + self.extra


class Matches:
    """A context's matches in a tree, longest first, with the context's last max_depth tokens."""

    __slots__ = ("items", "tail")

    def __init__(self) -> None:
        self.items: list[Match] = []
        self.tail: list[int] = []

    def __len__(self) -> int:
        return len(self.items)


class SuffixTree:
    """The reference tree. Sequences are named by the ids ``new_seq`` hands out; the tree keeps
    each one (its lazy leaves read from it) and, while it is extended, its repeated suffixes.
    ``services/drafter/_suffix_tree.cpp`` is the compiled twin with the same methods."""

    def __init__(self, max_depth: int = 64):
        self.max_depth = max_depth
        self.root = Node(-1, 0, [], 0)
        self.root.count = 0
        self.root.children = {}
        self.num_nodes = 0
        self.clock = 0
        self.seqs: list[list[int]] = []
        self.actives: list[list[Node]] = []

    @property
    def total(self) -> int:
        """Tokens inserted (the root's count)."""
        return self.root.count

    def new_seq(self) -> int:
        self.seqs.append([])
        self.actives.append([])
        return len(self.seqs) - 1

    def extend(self, seq_id: int, tokens) -> None:
        seq, actives = self.seqs[seq_id], self.actives[seq_id]
        for t in tokens:
            actives = self.append(seq, actives, t)
        self.actives[seq_id] = actives

    def add(self, tokens) -> int:
        """A finished sequence: inserted whole, never extended."""
        seq_id = self.new_seq()
        self.extend(seq_id, tokens)
        self.actives[seq_id] = []
        return seq_id

    # -- insertion ----------------------------------------------------------------------
    def append(self, seq: list[int], actives: list[Node], token: int) -> list[Node]:
        """Append ``token`` to ``seq`` (mutated) and return the new active suffix nodes.

        ``actives`` are the nodes of seq's repeated suffixes before the append, longest first.
        """
        seq.append(token)
        end = len(seq)
        self.root.count += 1
        new: list[Node] = []
        for node in (*actives, self.root):
            if node.depth >= self.max_depth:
                continue
            children = cast(dict[int, Node], node.children)  # actives and the root are explicit
            child = children.get(token)
            if child is None:
                child = Node(token, node.depth + 1, seq, end)
                children[token] = child
                self.num_nodes += 1
                if node.best is None:
                    node.best = child
                continue  # seen once: its future is implicit in seq
            if child.count == 1:
                self._materialize(child)
            child.count += 1
            self.clock += 1
            child.stamp = self.clock
            child.seq, child.end = seq, end
            if child.count >= cast(Node, node.best).count:  # ties: the most recently counted
                node.best = child
            new.append(child)
        return new

    def _materialize(self, node: Node) -> None:
        """Give a once-seen node an explicit child for its single occurrence's next token."""
        node.children = {}
        if node.end < len(node.seq) and node.depth < self.max_depth:
            tok = node.seq[node.end]
            child = Node(tok, node.depth + 1, node.seq, node.end + 1)
            node.children[tok] = child
            node.best = child
            self.num_nodes += 1

    # -- matching a foreign context (e.g. a request against the global tree) --------------
    def advance_one(self, matches: list[Match], token: int, tail: Sequence[int] = ()) -> list[Match]:
        """Matches of the context extended by ``token``, longest first (capped at max_depth).

        ``tail``: the context before ``token`` (its last max_depth tokens). A match that ran past
        a lazy leaf which has since been materialized (the tree grew) walks down the explicit
        children its implicit tokens now name."""
        out: list[Match] = []
        for m in (*matches, Match(self.root)):
            node: Node | None = m.node
            extra = m.extra
            while extra and node is not None and node.children is not None:
                node, extra = node.children.get(tail[len(tail) - extra]), extra - 1
            if node is None:  # cannot happen: a materialized leaf keeps its path
                continue
            if node.depth + extra >= self.max_depth:
                continue
            if node.children is None:  # implicit continuation
                i = node.end + extra
                if i < len(node.seq) and node.seq[i] == token:
                    out.append(Match(node, extra + 1))
            else:
                child = node.children.get(token)
                if child is not None:
                    out.append(Match(child))
        return out

    def match(self, context) -> Matches:
        m = Matches()
        self.advance(m, list(context)[-self.max_depth :])
        return m

    def advance(self, matches: Matches, tokens) -> None:
        """Extend the matched context by ``tokens`` (``matches`` is updated in place)."""
        for t in tokens:
            matches.items = self.advance_one(matches.items, t, matches.tail)
            matches.tail.append(t)
            if len(matches.tail) > self.max_depth:
                del matches.tail[0]

    @staticmethod
    def match_lengths(matches: Matches) -> list[int]:
        return [m.length for m in matches.items]

    def count(self, tokens: list[int]) -> int:
        """Occurrences of ``tokens`` (length ≤ max_depth) in the inserted sequences."""
        m = Match(self.root)
        for t in tokens:
            nxt = self.advance_one([m], t)
            if not nxt or nxt[0].length != m.length + 1:
                return 0
            m = nxt[0]
        return self.root.count if not tokens else m.node.count

    # -- speculation ------------------------------------------------------------------------
    def speculate(
        self, seq_id: int, budget: int, max_tokens: int, factor: float, offset: float, min_prob: float, tree: bool
    ) -> Draft:
        """The best draft from sequence ``seq_id``'s repeated suffixes (its matches in its own
        tree), under SpecParams' limits given one by one."""
        p = SpecParams(max_tokens, factor, offset, min_prob)
        return self._best(self.actives[seq_id], budget, p, tree).as_tuple()

    def speculate_matches(
        self,
        matches: Matches,
        budget: int,
        max_tokens: int,
        factor: float,
        offset: float,
        min_prob: float,
        tree: bool,
    ) -> Draft:
        p = SpecParams(max_tokens, factor, offset, min_prob)
        return self._best(matches.items, budget, p, tree).as_tuple()

    def _best(self, matches, budget: int, p: SpecParams, tree: bool) -> Candidate:
        """Best-scoring draft over all matched suffix lengths (longest first): a path, or with
        ``tree`` a speculation tree (``_speculate_tree``) of as many tokens.

        ``matches``: Match objects or nodes (a node = a match of its full depth).
        """
        grow = self._speculate_tree if tree else self._speculate_path
        best = Candidate()
        for m in matches:
            node, extra = (m.node, m.extra) if isinstance(m, Match) else (m, 0)
            match_len = node.depth + extra
            limit = min(budget, p.max_spec_tokens, int(match_len * p.max_spec_factor + p.max_spec_offset + 1e-6))
            if limit <= best.score:  # every token adds ≤ 1 to the score: cannot win
                continue
            cand = grow(node, extra, limit, p.min_token_prob)
            if cand.score > best.score:
                cand.match_len = match_len
                best = cand
        return best

    def _speculate_path(self, node: Node, extra: int, limit: int, min_prob: float) -> Candidate:
        c = Candidate()
        ids, probs = c.token_ids, c.probs
        prob = 1.0
        while len(ids) < limit:
            if node.children is None:  # single occurrence: copy its continuation, probability unchanged
                i = node.end + extra
                room = min(limit - len(ids), len(node.seq) - i, self.max_depth - node.depth - extra)
                if room <= 0:
                    break
                ids.extend(node.seq[i : i + room])
                probs.extend([prob] * room)
                break
            child = node.best
            if child is None:
                break
            prob *= child.count / node.count
            if prob < min_prob:
                break
            ids.append(child.token)
            probs.append(prob)
            node, extra = child, 0
        c.score = sum(probs)
        return c

    def _speculate_tree(self, node: Node, extra: int, limit: int, min_prob: float) -> Candidate:
        """SuffixDecoding's speculation tree: grow best-first by running probability, taking
        up to ``limit`` tokens whose probability stays ≥ ``min_prob``. The score (expected
        accepted tokens under the tree's counts) is the sum of the tokens' probabilities; a
        path of the same length scores no more. Siblings are taken most probable first, so
        first children form the most probable path."""
        c = Candidate()
        order = 0  # ties pop in push order
        heap: list = []

        def push(parent: int, n: Node, x: int, prob: float) -> None:
            nonlocal order
            for tok, child, cx, q in self._next_tokens(n, x, prob, min_prob):
                heapq.heappush(heap, (-q, order, parent, tok, child, cx))
                order += 1

        push(-1, node, extra, 1.0)
        while heap and len(c.token_ids) < limit:
            q, _, parent, tok, child, cx = heapq.heappop(heap)
            c.token_ids.append(tok)
            c.probs.append(-q)
            c.parents.append(parent)
            push(len(c.token_ids) - 1, child, cx, -q)
        c.score = sum(c.probs)
        return c

    def _next_tokens(self, node: Node, extra: int, prob: float, min_prob: float):
        """(token, node, extra, running probability) of each continuation of a match worth
        drafting, most frequent first."""
        if node.children is None:  # single occurrence: its next token, probability unchanged
            i = node.end + extra
            if i < len(node.seq) and node.depth + extra < self.max_depth:
                yield node.seq[i], node, extra + 1, prob
            return
        if node.best is None or prob * node.best.count < min_prob * node.count:
            return  # not even the most frequent child is worth it (the common case: no scan)
        need = min_prob * node.count / prob
        kids = [ch for ch in list(node.children.values()) if ch.count >= need]  # (a snapshot: writers may add)
        for child in sorted(kids, key=lambda ch: (-ch.count, -ch.stamp)):
            yield child.token, child, 0, prob * child.count / node.count


def new_tree(max_depth: int, compiled: bool = True):
    """A compiled tree when built (and ``compiled``), else the reference."""
    if compiled and CompiledSuffixTree is not None:
        return CompiledSuffixTree(max_depth)
    return SuffixTree(max_depth)
