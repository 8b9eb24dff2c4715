"""Output quality next to speed: agreement with vanilla, Python parse rate, rescued-token kinds."""

from __future__ import annotations

import ast
import keyword
import re
from collections import Counter

KINDS = ("whitespace", "punctuation", "identifier", "literal", "other")
_NUMBER = re.compile(r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")


def token_agreement(a: list[int], b: list[int]) -> float:
    """Share of positions (over the longer output) where both outputs hold the same token."""
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / n if n else 1.0


def parses(prompt: str, completion: str) -> bool:
    """Does prompt + completion parse as Python? Completions cut mid-statement are trimmed
    back to their last complete line first, so only real syntax errors count."""
    text = prompt + completion
    lines = text.split("\n")
    for cut in range(len(lines), max(0, len(lines) - 8), -1):
        try:
            ast.parse("\n".join(lines[:cut]))
            return True
        except SyntaxError:
            continue
        except ValueError:  # null bytes and the like
            return False
    return False


def token_kind(text: str) -> str:
    s = text.strip()
    if not s:
        return "whitespace"
    if all(not c.isalnum() and c != "_" for c in s):
        return "punctuation"
    if _NUMBER.match(s) or s[0] in "\"'" or s.startswith(('f"', "b'", 'b"', "f'", "r'", 'r"')):
        return "literal"
    if s.isidentifier() or keyword.iskeyword(s):
        return "identifier"
    return "other"


def rescued_breakdown(tokenizer, pairs: list[tuple[int, int]], examples: int = 3) -> dict:
    """Kinds of rescued (draft, target) pairs, with the most frequent examples of each kind."""
    kinds: Counter = Counter()
    by_kind: dict[str, Counter] = {k: Counter() for k in KINDS}
    for d, t in pairs:
        kind = token_kind(tokenizer.decode([d]))
        kinds[kind] += 1
        by_kind[kind][(tokenizer.decode([d]), tokenizer.decode([t]))] += 1
    total = sum(kinds.values())
    return {
        "total": total,
        "share": {k: round(kinds[k] / total, 3) if total else 0.0 for k in KINDS},
        "examples": {
            k: [{"draft": d, "target": t, "count": n} for (d, t), n in by_kind[k].most_common(examples)]
            for k in KINDS
            if by_kind[k]
        },
    }
