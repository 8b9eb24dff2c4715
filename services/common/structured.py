"""Structured output (vLLM's guided decoding): a JSON schema, a regular expression, a choice
of strings or a JSON object becomes a token-level automaton over the target's vocabulary,
and every verification row is masked to the tokens it allows after the draft prefix before it.

Rule: a row's distribution is the target's restricted to the tokens that keep the output a
prefix of some match (the end-of-sequence token only where the output is a whole match).
Greedy, rejection sampling and the calibrated gate all read the masked rows, so a draft
token the grammar forbids is simply rejected, and every lossless method still equals
``vanilla`` under the same constraint. The automaton is outlines-core's ``Index`` (a regex
DFA walked over each token's bytes); JSON schemas become regexes first.
"""

from __future__ import annotations

import functools
import json
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from services.common.grammar_worker import CompileTimeout, IndexWorker, RegexTooLong
from services.common.refusals import Overloaded

MAX_SPEC_CHARS = 32768  # a schema, regex or all choices together
MAX_CHOICES = 256
MAX_REGEX_CHARS = 65536  # the regex a schema expands to
MASKS_CACHED = 256  # token masks kept per compiled pattern (a mask is one bool per vocabulary entry)


class GrammarError(ValueError):
    """A structured-output spec that cannot be compiled; the message says what to fix."""


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: ``json_schema`` (a JSON Schema document), ``regex``, ``choice``,
    ``json_object`` (a JSON object whose values are scalars, or arrays and objects of scalars:
    ``JSON_OBJECT``)."""

    json_schema: str = ""
    regex: str = ""
    choice: tuple[str, ...] = ()
    json_object: bool = False

    def check(self) -> None:
        """What can be told without compiling (a request is refused for it before admission):
        exactly one kind, the size cap, the choices' bounds, a schema that parses as JSON."""
        kinds = [k for k in ("json_schema", "regex", "choice", "json_object") if getattr(self, k)]
        if len(kinds) != 1:
            raise GrammarError(
                f"structured_output: set exactly one of json_schema, regex, choice, json_object (got {kinds or 'none'})"
            )
        size = len(self.json_schema) + len(self.regex) + sum(len(c) for c in self.choice)
        if size > MAX_SPEC_CHARS:
            raise GrammarError(f"structured_output: at most {MAX_SPEC_CHARS} characters, got {size}")
        if self.choice and (len(self.choice) > MAX_CHOICES or not all(self.choice)):
            raise GrammarError(f"structured_output.choice: 1 to {MAX_CHOICES} non-empty strings")
        if self.json_schema:
            try:
                json.loads(self.json_schema)
            except ValueError as e:
                raise GrammarError(f"structured_output.json_schema: not a usable JSON schema: {e}") from None

    def pattern(self, expand: Callable[[str], str] | None = None) -> str:
        """The regular expression the output must match as a whole. ``expand``: how a JSON schema
        becomes its regex (a server's ``GrammarCompiler.schema_regex``, in its capped worker;
        else ``schema_regex``, in this process, for trusted schemas)."""
        self.check()
        if self.json_object:
            return JSON_OBJECT
        if self.choice:
            return "(" + "|".join(escape(c) for c in self.choice) + ")"
        if self.regex:
            return self.regex
        return (expand or schema_regex)(self.json_schema)


def _json_object(depth: int) -> str:
    """A JSON object whose values nest at most ``depth`` levels of arrays and objects. Its
    whitespace is a space or a newline with up to 8 spaces of indent, never a run: an
    unbounded run would let a model pad forever, and JSON's arbitrary nesting has no regex."""
    ws = r"(\n {0,8}| )?"
    string = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"'
    value = rf"({string}|-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null)"
    for level in range(depth + 1):
        items = rf"\[{ws}({value}({ws},{ws}{value})*)?{ws}\]"
        members = rf"\{{{ws}({string}{ws}:{ws}{value}({ws},{ws}{string}{ws}:{ws}{value})*)?{ws}\}}"
        if level == depth:
            return members
        value = rf"({value}|{items}|{members})"
    raise ValueError(f"depth must be >= 0, got {depth}")


JSON_OBJECT = _json_object(1)  # bundled vocabulary: depth 1 compiles in 0.3 s, depth 2 in 13 s (bench.grammar_compile)

_META = re.compile(r"([\\.+*?()|\[\]{}^$#&\-~])")


def escape(text: str) -> str:
    """``text`` as a literal in the automaton's regex syntax (Rust ``regex``)."""
    return _META.sub(r"\\\1", text)


@functools.lru_cache(maxsize=64)
def schema_regex(schema: str) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    try:
        json.loads(schema)
        pattern = build_regex_from_schema(schema)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"structured_output.json_schema: not a usable JSON schema: {e}") from None
    if len(pattern) > MAX_REGEX_CHARS:
        raise GrammarError(
            f"structured_output.json_schema: too complex (its regex has {len(pattern)} characters, "
            f"at most {MAX_REGEX_CHARS}); bound nesting or drop open-ended objects"
        )
    return pattern


def token_bytes(tokenizer) -> dict[bytes, list[int]]:
    """The bytes each ordinary token stands for: byte-level BPE (GPT-2, Llama 3, Qwen2) maps
    its printable alphabet back to bytes; SentencePiece maps ▁ to a space and <0xNN> to the byte."""
    special = set(tokenizer.all_special_ids)
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = _byte_level_decoder() if "ByteLevel" in repr(decoder) else {}
    out: dict[bytes, list[int]] = {}
    for s, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if byte_level and all(c in byte_level for c in s):
            b = bytes(byte_level[c] for c in s)
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", s):
            b = bytes([int(s[3:5], 16)])
        else:
            b = s.replace("\u2581", " ").encode()
        out.setdefault(b, []).append(i)
    return out


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable map, inverted: printable bytes map to themselves, the other
    bytes to code points from 256 upward, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


class TokenGrammar:
    """A compiled pattern: automaton states, and per state the tokens allowed (as a mask)."""

    def __init__(self, index, vocab_size: int, eos_id: int):
        self.index, self.vocab_size, self.eos_id = index, vocab_size, eos_id
        self.initial = index.get_initial_state()
        self._masks: OrderedDict[tuple[int, torch.device | None], torch.Tensor] = OrderedDict()

    def next(self, state: int | None, token: int) -> int | None:
        """The state after ``token``; None where the grammar forbids it (or the match ended)."""
        if state is None or token == self.eos_id:
            return None
        return self.index.get_next_state(state, token)

    def walk(self, state: int | None, tokens) -> int | None:
        for t in tokens:
            state = self.next(state, t)
        return state

    def allowed(self, state: int, device: torch.device | None = None) -> torch.Tensor:
        """[V] bool: the tokens that keep the output a prefix of a match (EOS where it is
        whole). The last ``MASKS_CACHED`` are kept per state and device, so a mask is built
        and copied to the device once while its state is in use."""
        key = (state, device)
        mask = self._masks.get(key)
        if mask is None:
            if device is None:
                mask = torch.zeros(self.vocab_size, dtype=torch.bool)
                mask[torch.tensor(self.index.get_allowed_tokens(state), dtype=torch.long)] = True
            else:
                mask = self.allowed(state).to(device)
            self._masks[key] = mask
            if len(self._masks) > MASKS_CACHED:
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(key)
        return mask

    def mask_columns(
        self, logits: torch.Tensor, state: int, columns: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """A drafter's logits over ``columns`` (target ids; None: the whole
        vocabulary) with what the grammar forbids at −inf; None where it allows none of them."""
        allowed = self.allowed(state, logits.device)
        if columns is not None:
            allowed = allowed[columns]
        if not bool(allowed.any()):
            return None
        return logits.masked_fill(~allowed, float("-inf"))

    def mask_rows(self, logits: torch.Tensor, state: int | None, draft: list[int]) -> torch.Tensor:
        """Row r of ``logits`` follows the output plus ``draft[:r]``: every token the grammar
        forbids there gets −inf. Rows after a forbidden draft token are left as they are: the
        token is rejected (its probability is 0), so no policy reads them."""
        logits = logits.clone()
        for r in range(min(len(draft) + 1, logits.shape[0])):
            if state is None:
                break
            logits[r].masked_fill_(~self.allowed(state, logits.device), float("-inf"))
            if r < len(draft):
                state = self.next(state, draft[r])
        return logits


def _regex_detail(pattern: str) -> str:
    """Python's account of a syntax error in ``pattern`` (it says where), if it finds one."""
    try:
        re.compile(pattern)
    except re.error as e:
        return str(e)
    return ""


class GrammarCompiler:
    """Compiles patterns over one tokenizer's vocabulary in worker processes with a time limit
    (``IndexWorker``: some short patterns take longer to compile than any request should wait,
    ``bench.grammar_compile``). ``workers`` processes compile at once; a request waits at most
    ``wait_s`` for one (then it is refused as overload, not queued without end); requests for a
    pattern already compiling wait for that compile rather than start their own; the most recent
    patterns stay cached (their requests usually repeat them)."""

    def __init__(
        self, tokenizer, vocab_size: int, cached: int = 32, timeout_s: float = 10.0, workers: int = 2, wait_s=30.0
    ):
        from outlines_core import Vocabulary

        self.eos_id, self.vocab_size = tokenizer.eos_token_id, vocab_size
        vocabulary = Vocabulary(self.eos_id, token_bytes(tokenizer))
        self.workers = [IndexWorker(vocabulary, timeout_s) for _ in range(workers)]
        self._idle: queue.SimpleQueue[IndexWorker] = queue.SimpleQueue()
        for w in self.workers:
            self._idle.put(w)
        self.wait_s = wait_s
        self._cache: OrderedDict[str, TokenGrammar] = OrderedDict()
        self._schemas: OrderedDict[str, str] = OrderedDict()  # schema -> its regex
        self._flights: dict[tuple[str, str], Future] = {}  # (kind, text) being built -> its result
        self._cached, self._lock = cached, threading.Lock()

    def cached(self, pattern: str) -> bool:
        with self._lock:
            return pattern in self._cache

    def close(self) -> None:
        for w in self.workers:
            w.close()

    def _build(self, kind: str, text: str, build: Callable[[IndexWorker], Any], store: OrderedDict):
        """``build(worker)`` once for ``text`` however many ask at once (the others wait for
        its result or its error), on a free worker; the result kept in ``store``."""
        with self._lock:
            if text in store:
                store.move_to_end(text)
                return store[text], True
            waiting = self._flights.get((kind, text))
            if waiting is None:
                flight: Future = Future()
                self._flights[(kind, text)] = flight
        if waiting is not None:
            return waiting.result(), True
        try:
            try:
                worker = self._idle.get(timeout=self.wait_s)
            except queue.Empty:
                raise Overloaded(
                    f"structured_output: every grammar compile worker stayed busy for {self.wait_s:g} s; retry later"
                ) from None
            try:
                value = build(worker)
            finally:
                self._idle.put(worker)
            with self._lock:
                store[text] = value
                while len(store) > self._cached:
                    store.popitem(last=False)
            flight.set_result(value)
            return value, False
        except BaseException as e:
            flight.set_exception(e)
            raise
        finally:
            with self._lock:
                self._flights.pop((kind, text), None)

    def schema_regex(self, schema: str) -> str:
        """``schema``'s regex, expanded in a compile worker (a schema of a few kilobytes whose
        ``$ref``s fan out can expand to gigabytes: past the worker's time or memory, or past
        ``MAX_REGEX_CHARS``, it is refused as too complex); recent ones cached."""
        try:
            json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"structured_output.json_schema: not a usable JSON schema: {e}") from None
        return self._build("schema", schema, lambda w: self._expand(w, schema), self._schemas)[0]

    @staticmethod
    def _expand(worker: IndexWorker, schema: str) -> str:
        try:
            return worker.schema_regex(schema, MAX_REGEX_CHARS)
        except CompileTimeout as e:
            raise GrammarError(f"structured_output.json_schema: too complex: {e}; bound its nesting") from None
        except RegexTooLong as e:
            raise GrammarError(
                f"structured_output.json_schema: too complex ({e}); bound nesting or drop open-ended objects"
            ) from None
        except ValueError as e:
            raise GrammarError(f"structured_output.json_schema: not a usable JSON schema: {e}") from None

    def compile(self, pattern: str) -> TokenGrammar:
        from services.common.metrics import GRAMMAR_COMPILES

        grammar, shared = self._build("pattern", pattern, lambda w: self._compile(w, pattern), self._cache)
        if shared:
            GRAMMAR_COMPILES.labels("cached").inc()
        return grammar

    def _compile(self, worker: IndexWorker, pattern: str) -> TokenGrammar:
        from services.common.metrics import GRAMMAR_COMPILE_SECONDS, GRAMMAR_COMPILES

        t0 = time.perf_counter()
        try:
            grammar = TokenGrammar(worker.compile(pattern), self.vocab_size, self.eos_id)
        except CompileTimeout as e:
            GRAMMAR_COMPILES.labels("too_complex").inc()
            raise GrammarError(
                f"structured_output: too complex: {e}; use fewer or smaller bounded repetitions "
                "(x{0,100}), e.g. an unbounded x* or a shorter maxLength"
            ) from None
        except ValueError as e:
            GRAMMAR_COMPILES.labels("invalid").inc()
            raise GrammarError(
                f"structured_output: the pattern cannot be compiled: {_regex_detail(pattern) or e}"
            ) from None
        GRAMMAR_COMPILES.labels("compiled").inc()
        GRAMMAR_COMPILE_SECONDS.observe(time.perf_counter() - t0)
        return grammar


@dataclass
class GrammarCursor:
    """A session's place in its grammar: the automaton state after its output so far. The
    verifier session advances it as tokens commit; the drafters beside the target read it."""

    automaton: TokenGrammar
    state: int

    @classmethod
    def after(cls, automaton: TokenGrammar, output: list[int]) -> "GrammarCursor":
        cursor = cls(automaton, automaton.initial)
        cursor.advance(output)
        return cursor

    def advance(self, tokens: list[int]) -> None:
        """Walk committed tokens (a final end-of-sequence token ends the output: nothing to walk)."""
        if tokens and tokens[-1] == self.automaton.eos_id:
            tokens = tokens[:-1]
        state = self.automaton.walk(self.state, tokens)
        if state is None:
            raise GrammarError("structured_output: the output does not follow the grammar")
        self.state = state
