"""A verifier replica's sessions: what it admits (every field of an open and of a cycle checked
against the loaded target and drafters) and the slots it holds. Refusals are plain values
(``services/common/refusals.py``); the gRPC edge maps them to status codes."""

from __future__ import annotations

import threading
import uuid

from services.common.metrics import REQUESTS_REJECTED
from services.common.prefix_cache import MAX_CACHE_SALT
from services.common.refusals import Invalid, Overloaded, Unavailable
from services.common.sampling import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGPROBS, sampling_error
from services.common.structured import MAX_REGEX_CHARS, GrammarError
from services.common.token_tree import check_tree
from services.common.types import CycleRequest, Sampling, SessionSpec
from services.verifier.core import VerifierCore, VerifierSession


class Replica:
    """At most ``max_sessions`` sessions at once on ``core``; ``drain`` refuses new ones."""

    def __init__(self, core: VerifierCore, max_sessions: int = 16, replica: str | None = None):
        self.core = core
        self.replica = replica or uuid.uuid4().hex[:8]
        self.max_sessions = max_sessions
        self._slots = threading.BoundedSemaphore(max_sessions)
        self._lock = threading.Lock()
        self.active: set[str] = set()
        self.draining = False
        core.declare_capacity(max_sessions)

    def _check_open(self, s: SessionSpec) -> None:
        if not s.prompt_ids:
            raise Invalid("open.prompt_ids: must not be empty")
        if any(t >= self.core.vocab_size for t in s.prompt_ids):
            raise Invalid(f"open.prompt_ids: ids must be < {self.core.vocab_size}")
        if (
            not 0 < s.max_new_tokens
            or len(s.prompt_ids) + s.max_new_tokens + s.max_draft + 1 > self.core.context_len + 64
        ):
            raise Invalid(f"open.max_new_tokens: prompt + max_new_tokens must fit {self.core.context_len} tokens")
        if s.policy not in self.core.policies:
            raise Invalid(f"open.policy: unknown policy {s.policy!r}; known: {sorted(self.core.policies)}")
        if s.model_drafter and s.model_drafter not in self.core.drafters:
            raise Invalid(f"open.model_drafter: {s.model_drafter!r} is not loaded on this replica")
        if s.min_tokens > s.max_new_tokens:
            raise Invalid("open.min_tokens: must not exceed max_new_tokens")
        if len(s.cache_salt) > MAX_CACHE_SALT:
            raise Invalid(f"open.cache_salt: at most {MAX_CACHE_SALT} characters")
        if s.logprobs is not None and not 0 <= s.logprobs <= MAX_LOGPROBS:
            raise Invalid(f"open.logprobs: at most {MAX_LOGPROBS} alternatives")
        if s.prompt_logprobs is not None and not 0 <= s.prompt_logprobs <= MAX_LOGPROBS:
            raise Invalid(f"open.prompt_logprobs: at most {MAX_LOGPROBS} alternatives")
        self._check_sampling(s.sampling)
        if s.generated > len(s.prompt_ids):
            raise Invalid("open.generated: must not exceed the prompt's length")
        if s.grammar is not None:
            self._check_grammar(s)

    def _check_sampling(self, sp: Sampling) -> None:
        if (err := sampling_error(sp)) is not None:
            raise Invalid(f"open.sampling.{err}")
        vocab = self.core.vocab_size
        if any(not 0 <= t < vocab for t, _ in sp.logit_bias):
            raise Invalid(f"open.sampling.logit_bias: ids must be < {vocab}")
        if any(not 0 <= t < vocab for t in sp.allowed_token_ids):
            raise Invalid(f"open.sampling.allowed_token_ids: ids must be < {vocab}")
        if len(sp.bad_words) > 2 * MAX_BAD_WORDS or any(
            not 0 < len(w) <= MAX_BAD_WORD_TOKENS or max(w) >= vocab for w in sp.bad_words
        ):
            raise Invalid(
                f"open.sampling.bad_words: at most {2 * MAX_BAD_WORDS} sequences of 1 to "
                f"{MAX_BAD_WORD_TOKENS} ids < {vocab}"
            )

    def _check_grammar(self, s: SessionSpec) -> None:
        assert s.grammar is not None
        if s.ignore_eos or s.min_tokens:
            raise Invalid("open.grammar: cannot be combined with ignore_eos or min_tokens")
        if len(s.grammar) > MAX_REGEX_CHARS:
            raise Invalid(f"open.grammar: at most {MAX_REGEX_CHARS} characters")
        try:
            grammar = self.core.grammars.compile(s.grammar)
        except GrammarError as e:
            raise Invalid(f"open.grammar: {e}") from None
        if grammar.walk(grammar.initial, s.prompt_ids[len(s.prompt_ids) - s.generated :]) is None:
            raise Invalid("open.generated: the output so far does not follow open.grammar")

    def check_cycle(self, c: CycleRequest, spec: SessionSpec) -> None:
        if c.draft_with and c.draft_with != spec.model_drafter:
            raise Invalid(f"cycle.draft_with: session opened with model_drafter {spec.model_drafter!r}")
        if len(c.draft_ids) > max(spec.max_draft, 0) or c.budget > max(spec.max_draft, 0):
            raise Invalid(f"cycle: drafts are limited to max_draft={spec.max_draft} tokens")
        if any(t >= self.core.vocab_size for t in c.draft_ids):
            raise Invalid(f"cycle.draft_ids: ids must be < {self.core.vocab_size}")
        if c.draft_parents:
            if len(c.draft_parents) != len(c.draft_ids):
                raise Invalid(
                    f"cycle.draft_parents: {len(c.draft_parents)} given for {len(c.draft_ids)} draft_ids; "
                    "give one per draft token, or none for a chain"
                )
            try:
                check_tree(c.draft_parents)
            except ValueError as e:
                raise Invalid(f"cycle.draft_parents: {e}") from None

    def admit(self, spec: SessionSpec) -> VerifierSession:
        """Check an open and take a session slot: Invalid, Overloaded at the limit, Unavailable while draining."""
        self._check_open(spec)
        if self.draining:
            raise Unavailable(f"verifier {self.replica} is shutting down")
        if not self._slots.acquire(blocking=False):
            REQUESTS_REJECTED.labels("RESOURCE_EXHAUSTED").inc()
            raise Overloaded(f"verifier {self.replica} is at its limit of {self.max_sessions} sessions")
        try:
            session = self.core.open(spec)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self.active.add(session.session_id)
        return session

    def release(self, session: VerifierSession) -> None:
        session.close()
        with self._lock:
            self.active.discard(session.session_id)
        self._slots.release()

    def drain(self) -> None:
        """Shutdown: refuse new sessions; those open finish."""
        self.draining = True
