"""Incremental detokenization: each new token costs a decode of a few tokens, not the whole output."""
from __future__ import annotations


class Detokenizer:
    """Streams text for byte-level BPE ids, holding back incomplete UTF-8 sequences.

    Rule (as in vLLM): decode the window ``ids[prefix:]`` and emit what it adds over
    ``ids[prefix:read]``; advance the window only when the new text is complete (does
    not end in U+FFFD). With ``skip_special_tokens`` (vLLM's default) the tokenizer's special
    tokens add no text; other added tokens read as written.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        old = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        new = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(new) > len(old) and not new.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return new[len(old):]
        return ""
