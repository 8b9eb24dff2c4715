"""Incremental detokenization: each new token costs a decode of a few tokens, not the whole output."""
from __future__ import annotations


class Detokenizer:
    """Streams text for byte-level BPE ids, holding back incomplete UTF-8 sequences.

    Rule (as in vLLM): decode the window ``ids[prefix:]`` and emit what it adds over
    ``ids[prefix:read]``; advance the window only when the new text is complete (does
    not end in U+FFFD).
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        old = self.tok.decode(self.ids[self.prefix:self.read])
        new = self.tok.decode(self.ids[self.prefix:])
        if len(new) > len(old) and not new.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return new[len(old):]
        return ""
