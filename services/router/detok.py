"""Incremental detokenization through the tokenizers library's own ``DecodeStream``: each new
token costs a decode of a few tokens, not the whole output; incomplete UTF-8 sequences are held
back until a later token completes them. With ``skip_special_tokens`` (vLLM's default) the
tokenizer's special tokens add no text; other added tokens read as written."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._backend = tokenizer.backend_tokenizer  # a fast (Rust) tokenizer: transformers' own
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token: int) -> str:
        """The text ``token`` completes ("" while a character is still incomplete)."""
        return self._stream.step(self._backend, token) or ""
