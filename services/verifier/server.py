"""Verifier replica over gRPC (`specmesh.v1.Verifier`), and the router's client for it.

Protobuf lives only here: ``*_to_pb`` / ``*_from_pb`` convert at the edge; the servicer
drives a ``VerifierCore`` and the client (``RemoteVerifier``) offers the same interface as
``VerifierCore`` to the router.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import uuid
from typing import Any

import grpc

from services.common.grpc_server import build_grpc_server, channel
from services.common.metrics import ACTIVE_SESSIONS, REQUESTS_REJECTED
from services.common.prefix_cache import MAX_CACHE_SALT
from services.common.sampling import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGPROBS, sampling_error
from services.common.structured import MAX_REGEX_CHARS, GrammarError
from services.common.token_tree import check_tree
from services.common.types import SamplingParams, TokenLogprob
from services.router.affinity import PrefixAffinity, choose
from services.verifier.core import CycleRequest, CycleResult, SessionCancelled, SessionSpec, VerifierCore
from specmesh.v1 import verifier_pb2 as pb
from specmesh.v1 import verifier_pb2_grpc as pb_grpc

log = logging.getLogger("specmesh.verifier")
# Fault injection for failure tests only: slow every cycle down (milliseconds).
FAULT_CYCLE_DELAY_S = float(os.environ.get("SPECMESH_FAULT_CYCLE_DELAY_MS", "0")) / 1000
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name


# -- conversions ------------------------------------------------------------------------------
def spec_to_pb(s: SessionSpec) -> pb.Open:
    sp = s.sampling
    return pb.Open(session_id=s.session_id, prompt_ids=s.prompt_ids, max_new_tokens=s.max_new_tokens,
                   sampling=pb.Sampling(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed,
                                        repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
                                        frequency_penalty=sp.frequency_penalty, logit_bias=dict(sp.logit_bias),
                                        allowed_token_ids=sp.allowed_token_ids,
                                        bad_words=[pb.TokenIds(ids=w) for w in sp.bad_words], min_p=sp.min_p),
                   policy=s.policy, model_drafter=s.model_drafter or "", on_demand=s.on_demand, max_draft=s.max_draft,
                   logprobs=s.logprobs, cache_salt=s.cache_salt, ignore_eos=s.ignore_eos, min_tokens=s.min_tokens,
                   generated=s.generated, prompt_logprobs=s.prompt_logprobs, grammar=s.grammar or "")


def spec_from_pb(o: pb.Open) -> SessionSpec:
    sp = o.sampling
    return SessionSpec(prompt_ids=list(o.prompt_ids), max_new_tokens=o.max_new_tokens,
                       sampling=SamplingParams(sp.temperature, sp.top_p or 1.0, sp.top_k,
                                               sp.seed if sp.HasField("seed") else None,
                                               sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
                                               sp.presence_penalty, sp.frequency_penalty,
                                               tuple(sorted(sp.logit_bias.items())), tuple(sp.allowed_token_ids),
                                               tuple(tuple(w.ids) for w in sp.bad_words), sp.min_p),
                       policy=o.policy or "lossless", model_drafter=o.model_drafter or None,
                       on_demand=o.on_demand, max_draft=o.max_draft, session_id=o.session_id,
                       logprobs=o.logprobs if o.HasField("logprobs") else None, cache_salt=o.cache_salt,
                       ignore_eos=o.ignore_eos, min_tokens=o.min_tokens, generated=o.generated,
                       prompt_logprobs=o.prompt_logprobs if o.HasField("prompt_logprobs") else None,
                       grammar=o.grammar or None)


def cycle_to_pb(c: CycleRequest) -> pb.Cycle:
    return pb.Cycle(draft_ids=c.draft_ids, draft_source=c.draft_source, draft_with=c.draft_with or "",
                    budget=c.budget, draft_parents=c.draft_parents)


def cycle_from_pb(c: pb.Cycle) -> CycleRequest:
    return CycleRequest(draft_ids=tuple(c.draft_ids), draft_source=c.draft_source or "none",
                        draft_with=c.draft_with or None, budget=c.budget, draft_parents=tuple(c.draft_parents))


def result_to_pb(r: CycleResult) -> pb.CycleResult:
    return pb.CycleResult(committed=r.committed, drafted=r.drafted, accepted=r.accepted, source=r.source,
                          rescued=[pb.RescuedPair(draft=d, target=t) for d, t in r.rescued_pairs],
                          rejected=r.rejected, draft_s=r.draft_s, verify_s=r.verify_s, batch_size=r.batch_size,
                          cached_tokens=r.cached_tokens, logprobs=[x.logprob for x in r.logprobs],
                          top_ids=[i for x in r.logprobs for i, _ in x.top],
                          top_logprobs=[v for x in r.logprobs for _, v in x.top],
                          prompt_ids=[x.token_id for x in r.prompt_logprobs],
                          prompt_logprobs=[x.logprob for x in r.prompt_logprobs],
                          prompt_top_ids=[i for x in r.prompt_logprobs for i, _ in x.top],
                          prompt_top_logprobs=[v for x in r.prompt_logprobs for _, v in x.top])


def result_from_pb(r: pb.CycleResult) -> CycleResult:
    return CycleResult(committed=list(r.committed), drafted=r.drafted, accepted=r.accepted, source=r.source,
                       rescued_pairs=tuple((p.draft, p.target) for p in r.rescued), rejected=r.rejected,
                       draft_s=r.draft_s, verify_s=r.verify_s, batch_size=max(1, r.batch_size),
                       cached_tokens=r.cached_tokens,
                       logprobs=logprobs_from_pb(r.committed, r.logprobs, r.top_ids, r.top_logprobs),
                       prompt_logprobs=logprobs_from_pb(r.prompt_ids, r.prompt_logprobs, r.prompt_top_ids,
                                                        r.prompt_top_logprobs))


def logprobs_from_pb(tokens, lps, top_ids, top_lps) -> tuple[TokenLogprob, ...]:
    """Per token: its log-probability and an equal share of the flattened alternatives."""
    n = len(lps)
    k = len(top_ids) // n if n else 0
    return tuple(TokenLogprob(t, lp, tuple(zip(top_ids[j * k:(j + 1) * k], top_lps[j * k:(j + 1) * k])))
                 for j, (t, lp) in enumerate(zip(tokens, lps)))


# -- server ------------------------------------------------------------------------------------
class BadRequest(ValueError):
    pass


class Exhausted(RuntimeError):
    pass


class Draining(RuntimeError):
    pass


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, core: VerifierCore, max_sessions: int = 16, replica: str | None = None):
        self.core = core
        self.replica = replica or uuid.uuid4().hex[:8]
        self.max_sessions = max_sessions
        self._slots = threading.BoundedSemaphore(max_sessions)
        self._lock = threading.Lock()
        self.active: set[str] = set()
        self.links: set[LinkServer] = set()
        self.draining = False

    def drain(self) -> None:
        """Shutdown: refuse new sessions; each link ends once its sessions are done."""
        self.draining = True
        for link in list(self.links):
            link.end_if_drained()

    def Info(self, request, context):
        return pb.InfoResponse(context_len=self.core.context_len, vocab_size=self.core.vocab_size,
                               max_draft=self.core.max_draft, active_sessions=len(self.active),
                               max_sessions=self.max_sessions, replica=self.replica)

    def ResetPrefixCache(self, request, context):
        self.core.clear_prefix_cache()
        return pb.ResetPrefixCacheResponse(replica=self.replica)

    def _check_open(self, s: SessionSpec) -> None:
        if not s.prompt_ids:
            raise BadRequest("open.prompt_ids: must not be empty")
        if any(t >= self.core.vocab_size for t in s.prompt_ids):
            raise BadRequest(f"open.prompt_ids: ids must be < {self.core.vocab_size}")
        if not 0 < s.max_new_tokens or len(s.prompt_ids) + s.max_new_tokens + s.max_draft + 1 > self.core.context_len + 64:
            raise BadRequest(f"open.max_new_tokens: prompt + max_new_tokens must fit {self.core.context_len} tokens")
        if s.policy not in self.core.policies:
            raise BadRequest(f"open.policy: unknown policy {s.policy!r}; known: {sorted(self.core.policies)}")
        if s.model_drafter and s.model_drafter not in self.core.drafters:
            raise BadRequest(f"open.model_drafter: {s.model_drafter!r} is not loaded on this replica")
        if s.min_tokens > s.max_new_tokens:
            raise BadRequest("open.min_tokens: must not exceed max_new_tokens")
        if len(s.cache_salt) > MAX_CACHE_SALT:
            raise BadRequest(f"open.cache_salt: at most {MAX_CACHE_SALT} characters")
        if s.logprobs is not None and not 0 <= s.logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"open.logprobs: at most {MAX_LOGPROBS} alternatives")
        if s.prompt_logprobs is not None and not 0 <= s.prompt_logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"open.prompt_logprobs: at most {MAX_LOGPROBS} alternatives")
        self._check_sampling(s.sampling)
        if s.generated > len(s.prompt_ids):
            raise BadRequest("open.generated: must not exceed the prompt's length")
        if s.grammar is not None:
            self._check_grammar(s)

    def _check_sampling(self, sp: SamplingParams) -> None:
        if (err := sampling_error(sp)) is not None:
            raise BadRequest(f"open.sampling.{err}")
        vocab = self.core.vocab_size
        if any(not 0 <= t < vocab for t, _ in sp.logit_bias):
            raise BadRequest(f"open.sampling.logit_bias: ids must be < {vocab}")
        if any(not 0 <= t < vocab for t in sp.allowed_token_ids):
            raise BadRequest(f"open.sampling.allowed_token_ids: ids must be < {vocab}")
        if len(sp.bad_words) > 2 * MAX_BAD_WORDS or any(not 0 < len(w) <= MAX_BAD_WORD_TOKENS or max(w) >= vocab
                                                         for w in sp.bad_words):
            raise BadRequest(f"open.sampling.bad_words: at most {2 * MAX_BAD_WORDS} sequences of 1 to "
                             f"{MAX_BAD_WORD_TOKENS} ids < {vocab}")

    def _check_grammar(self, s: SessionSpec) -> None:
        if s.ignore_eos or s.min_tokens:
            raise BadRequest("open.grammar: cannot be combined with ignore_eos or min_tokens")
        if len(s.grammar) > MAX_REGEX_CHARS:
            raise BadRequest(f"open.grammar: at most {MAX_REGEX_CHARS} characters")
        try:
            grammar = self.core.grammars.compile(s.grammar)
        except GrammarError as e:
            raise BadRequest(f"open.grammar: {e}") from None
        if grammar.walk(grammar.initial, s.prompt_ids[len(s.prompt_ids) - s.generated:]) is None:
            raise BadRequest("open.generated: the output so far does not follow open.grammar")

    def check_cycle(self, c: CycleRequest, spec: SessionSpec) -> None:
        if c.draft_with and c.draft_with != spec.model_drafter:
            raise BadRequest(f"cycle.draft_with: session opened with model_drafter {spec.model_drafter!r}")
        if len(c.draft_ids) > max(spec.max_draft, 0) or c.budget > max(spec.max_draft, 0):
            raise BadRequest(f"cycle: drafts are limited to max_draft={spec.max_draft} tokens")
        if any(t >= self.core.vocab_size for t in c.draft_ids):
            raise BadRequest(f"cycle.draft_ids: ids must be < {self.core.vocab_size}")
        if c.draft_parents:
            if len(c.draft_parents) != len(c.draft_ids):
                raise BadRequest(f"cycle.draft_parents: {len(c.draft_parents)} given for {len(c.draft_ids)} draft_ids; "
                                 "give one per draft token, or none for a chain")
            try:
                check_tree(c.draft_parents)
            except ValueError as e:
                raise BadRequest(f"cycle.draft_parents: {e}") from None

    def admit(self, spec: SessionSpec):
        """Check an open and take a session slot: BadRequest, or Exhausted at the limit."""
        self._check_open(spec)
        if self.draining:
            raise Draining(f"verifier {self.replica} is shutting down")
        if not self._slots.acquire(blocking=False):
            REQUESTS_REJECTED.labels("RESOURCE_EXHAUSTED").inc()
            raise Exhausted(f"verifier {self.replica} is at its limit of {self.max_sessions} sessions")
        try:
            session = self.core.open(spec)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self.active.add(session.session_id)
            ACTIVE_SESSIONS.set(len(self.active))
        return session

    def release(self, session) -> None:
        session.close()
        with self._lock:
            self.active.discard(session.session_id)
            ACTIVE_SESSIONS.set(len(self.active))
        self._slots.release()

    def Session(self, request_iterator, context):
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        if first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session: the first message must be `open`")
        spec = spec_from_pb(first.open)
        try:
            session = self.admit(spec)
        except BadRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exhausted as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Draining as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        context.add_callback(session.cancel)   # the router went away: a cycle in flight stops at the next step
        try:
            yield pb.SessionResponse(opened=pb.Opened(session_id=session.session_id, replica=self.replica))
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "cycle":
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session: expected `cycle` after `open`")
                req = cycle_from_pb(msg.cycle)
                try:
                    self.check_cycle(req, spec)
                except BadRequest as e:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                if FAULT_CYCLE_DELAY_S:
                    time.sleep(FAULT_CYCLE_DELAY_S)
                yield pb.SessionResponse(result=result_to_pb(session.cycle(req)))
        except SessionCancelled:   # the router's stream ended mid-cycle: no one to answer
            log.info("session %s: cancelled mid-cycle", session.session_id)
        finally:
            self.release(session)

    def Link(self, request_iterator, context):
        link = LinkServer(self, request_iterator, context)
        context.add_callback(link.end)           # a cancelled or broken link unblocks the writer
        self.links.add(link)
        try:
            while (replies := link.next_replies()) is not None:
                yield pb.LinkResponse(replies=replies)
        finally:
            link.end()
            self.links.discard(link)


_READ = object()   # in the reply queue: the reader thread hands reading back to the writer


class LinkServer:
    """The verifier's end of one multiplexed link. Each message's opens and closes are handled
    and its cycles posted to the replica's batcher together; finished cycles queue up as
    replies, and the writer (the RPC's own thread) sends all queued replies in one message.
    When the link ends (half-close, cancel, drain) a session busy with a cycle is answered and
    closed once that cycle is done.

    Who reads: while nothing is in flight, the writer reads the next message itself; when
    the step it then leads answers every cycle, it sends the replies with no hand-off between
    threads (a lone session's cycle crosses no thread of ours, as on a per-session stream).
    While something is in flight (cycles behind a step on another thread, an open compiling
    its grammar), the reader thread reads, so replies go out as they come and the link's
    other sessions keep cycling; it hands reading back after a message that leaves nothing
    in flight."""

    def __init__(self, servicer: VerifierServicer, requests=None, context=None):
        self.servicer = servicer
        self.sessions: dict[str, Any] = {}
        self.busy: set[str] = set()
        self.opening: set[str] = set()   # sessions opening on a thread of their own (``_open``)
        self.closing: set[str] = set()
        self.ended = self._stopped = False
        self._lock = threading.Lock()
        self._turn = threading.Condition(self._lock)   # the reader thread waits here for its turn
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._posts: list = []    # cycles of the message being read, posted together after it
        self._requests, self._context = requests, context
        self._reader = "writer"   # who reads the next message: "writer" or "thread"
        self._writer_reading = False
        self._thread: threading.Thread | None = None

    def _in_flight(self) -> bool:
        return bool(self.busy or self.opening)

    def _take(self, msg) -> None:
        """Handle one message: its items in order, then its cycles posted together (the
        reading thread leads their step when none is running and it would not wait)."""
        if FAULT_CYCLE_DELAY_S:
            time.sleep(FAULT_CYCLE_DELAY_S)
        for item in msg.items:
            self._handle(item)
        posts, self._posts = self._posts, []
        if posts:
            self.servicer.core.batcher.post_all(posts, lead=True)

    def _next_message(self):
        """The link's next message; None once its requests have ended."""
        try:
            return next(self._requests)
        except StopIteration:
            return None
        except Exception as e:  # the link broke (cancelled, reset): its sessions end with it
            log.debug("link ended: %s", e)
            return None

    def _read_while_in_flight(self) -> None:
        """The reader thread: reads while it has the turn, until the link ends."""
        try:
            while True:
                with self._lock:
                    while self._reader != "thread" and not self.ended:
                        self._turn.wait()
                    if self.ended:
                        return
                msg = self._next_message()
                if msg is None:
                    return
                self._take(msg)
                with self._lock:
                    back = not self._in_flight()
                    if back:
                        self._reader = "writer"
                if back:
                    self._out.put(_READ)   # the writer may be waiting for a reply that is not coming
        finally:
            self.end()

    def _give_turn_to_thread(self) -> None:
        """Called with the lock held."""
        self._reader = "thread"
        if self._thread is None:
            self._thread = threading.Thread(target=self._read_while_in_flight, name="verifier-link", daemon=True)
            self._thread.start()
        self._turn.notify()

    def next_replies(self) -> list | None:
        """Every reply ready now (while nothing is in flight, the next message is read and
        handled first; else the first reply is waited for); None once the link has ended."""
        while True:
            replies = self._queued(block=False)
            if replies or replies is None:
                return replies
            with self._lock:
                read = self._reader == "writer" and not self.ended and not self._in_flight()
                self._writer_reading = read
                if not read and self._reader == "writer" and not self.ended:
                    self._give_turn_to_thread()
            if read:
                msg = self._next_message()
                with self._lock:
                    self._writer_reading = False
                if msg is None:
                    self.end()
                else:
                    self._take(msg)
                continue
            replies = self._queued(block=True)
            if replies or replies is None:
                return replies

    def _queued(self, block: bool) -> list | None:
        """The replies queued now (``block``: waiting for the first item); None at the link's
        end. An empty list when the reader thread has handed reading back."""
        replies = []
        while True:
            try:
                r = self._out.get(block=block and not replies)
            except queue.Empty:
                return replies
            if r is None:
                self._out.put(None)   # every later call sees the end too
                return replies or None
            if r is _READ:
                block = False   # the writer reads next: take what is queued, wait for nothing
            else:
                replies.append(r)

    def _handle(self, item: pb.LinkItem) -> None:
        sid, kind = item.session_id, item.WhichOneof("kind")
        if kind == "open":
            self._guarded(sid, kind, self._open, sid, spec_from_pb(item.open))
        elif kind == "cycle":
            self._guarded(sid, kind, self._cycle, sid, cycle_from_pb(item.cycle))
        elif kind == "close":
            self._guarded(sid, kind, self._close, sid)
        else:
            self._fail(sid, grpc.StatusCode.INVALID_ARGUMENT, "link item: set one of open, cycle, close")

    def _guarded(self, sid: str, kind: str, handle, *args) -> None:
        """One item's failure is its session's own (a status for it); the link carries on."""
        try:
            handle(*args)
        except BadRequest as e:
            self._fail(sid, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exhausted as e:
            self._fail(sid, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Draining as e:
            self._fail(sid, grpc.StatusCode.UNAVAILABLE, str(e))
        except Exception as e:
            log.exception("link item for session %s failed", sid)
            self._fail(sid, grpc.StatusCode.INTERNAL, f"{kind} failed: {e}")

    def _open(self, sid: str, spec: SessionSpec) -> None:
        """Open a session. One whose grammar this replica has not compiled yet opens on a
        thread of its own (a compile may take seconds), so the link's other sessions keep
        cycling; the router sends its cycles only once it is opened."""
        if not sid:
            raise BadRequest("link item: session_id must not be empty")
        with self._lock:
            if sid in self.sessions or sid in self.opening:
                raise BadRequest(f"link item: session {sid!r} is already open on this link")
            later = bool(spec.grammar) and not self.servicer.core.grammars.cached(spec.grammar)
            if later:
                self.opening.add(sid)
        if later:
            threading.Thread(target=self._guarded, args=(sid, "open", self._admit, sid, spec), daemon=True,
                             name=f"open-{sid}").start()
        else:
            self._admit(sid, spec)

    def _admit(self, sid: str, spec: SessionSpec) -> None:
        try:
            session = self.servicer.admit(spec)
        finally:
            with self._lock:
                self.opening.discard(sid)
        with self._lock:
            gone = self.ended or sid in self.closing   # closed (or the link ended) while it opened
            if not gone:
                self.sessions[sid] = session
        if gone:
            self.servicer.release(session)
            with self._lock:
                self.closing.discard(sid)
            self.end_if_drained()
            return
        self._out.put(pb.LinkReply(session_id=sid, opened=pb.Opened(session_id=session.session_id,
                                                                   replica=self.servicer.replica)))

    def _cycle(self, sid: str, req: CycleRequest) -> None:
        with self._lock:
            session = self.sessions.get(sid)
            if session is None:
                raise BadRequest(f"link item: session {sid!r} is not open on this link")
            if sid in self.busy:
                raise BadRequest(f"link item: session {sid!r} already has a cycle in flight")
            self.servicer.check_cycle(req, session.spec)
            self.busy.add(sid)
        self._posts.append((session, req, lambda item: self._done(sid, item)))

    def _done(self, sid: str, item) -> None:
        """The session is free before its reply is queued: the router sends its next cycle as
        soon as the reply arrives, and the reader must not find it still busy."""
        if item.error is None:
            reply = pb.LinkReply(session_id=sid, result=result_to_pb(item.result))
        elif isinstance(item.error, SessionCancelled):
            log.info("session %s: %s", sid, item.error)
            reply = pb.LinkReply(session_id=sid, error=pb.SessionError(
                code=grpc.StatusCode.CANCELLED.value[0], message=str(item.error)))
        else:
            log.error("session %s failed: %s", sid, item.error)
            reply = pb.LinkReply(session_id=sid, error=pb.SessionError(
                code=grpc.StatusCode.INTERNAL.value[0], message=f"cycle failed: {item.error}"))
        with self._lock:
            self.busy.discard(sid)
            release = self.ended or item.error is not None or sid in self.closing
        self._out.put(reply)
        if release:
            self._close(sid)
        self._stop_when_idle()

    def _fail(self, sid: str, code: grpc.StatusCode, message: str) -> None:
        self._out.put(pb.LinkReply(session_id=sid, error=pb.SessionError(code=code.value[0], message=message)))
        self._close(sid)

    def _close(self, sid: str) -> None:
        with self._lock:
            if sid in self.opening:
                self.closing.add(sid)   # released by _admit once it has opened
                return
            if sid in self.busy:
                self.closing.add(sid)   # closed by _done once its cycle is through,
                self.sessions[sid].cancel()   # which stops at the next step
                return
            self.closing.discard(sid)
            session = self.sessions.pop(sid, None)
        if session is not None:
            self.servicer.release(session)
        self.end_if_drained()

    def end_if_drained(self) -> None:
        if self.servicer.draining and not self.sessions:
            self.end()

    def end(self) -> None:
        """No more requests: idle sessions close now, busy ones once their cycle is answered;
        then the reply stream ends."""
        with self._lock:
            if self.ended:
                return
            self.ended = True
            idle = [sid for sid in self.sessions if sid not in self.busy]
            self._turn.notify_all()
            blocked = self._writer_reading   # waiting for a message that may never come (a drain)
        for sid in idle:
            self._close(sid)
        self._stop_when_idle()
        if blocked and self._context is not None:
            self._context.cancel()

    def _stop_when_idle(self) -> None:
        with self._lock:
            stop = self.ended and not self.busy and not self._stopped
            self._stopped |= stop
        if stop:
            self._out.put(None)


def build_verifier_server(core: VerifierCore, host: str, port: int, max_sessions: int = 16, workers: int = 32,
                          max_message_bytes: int = 4 * 1024 * 1024):
    servicer = VerifierServicer(core, max_sessions)
    server, bound = build_grpc_server(lambda s: pb_grpc.add_VerifierServicer_to_server(servicer, s), [SERVICE_NAME],
                                      host, port, workers, max_message_bytes)
    return server, servicer, bound


# -- client ------------------------------------------------------------------------------------
class NoReplica(RuntimeError):
    """Every verifier replica failed; the router answers UNAVAILABLE."""


_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.CANCELLED}


class SessionStream:
    """Transport: one bidirectional ``Session`` stream per session."""

    def __init__(self, stub: pb_grpc.VerifierStub, spec: SessionSpec, timeout: float | None):
        self._q: queue.Queue = queue.Queue()
        self._q.put(pb.SessionRequest(open=spec_to_pb(spec)))
        self._call = stub.Session(iter(self._q.get, None), timeout=timeout)
        self.replica = next(self._call).opened.replica

    def cycle(self, req: CycleRequest, timeout: float | None) -> CycleResult:
        self._q.put(pb.SessionRequest(cycle=cycle_to_pb(req)))
        try:
            return result_from_pb(next(self._call).result)
        except StopIteration:
            raise LinkError(grpc.StatusCode.UNAVAILABLE, "session stream ended") from None

    def close(self) -> None:
        self._q.put(None)
        self._call.cancel()


class RemoteSession:
    """A verifier session on some replica; on replica failure it re-opens elsewhere with the
    prompt plus every token committed so far, and retries the cycle (nothing lost or repeated)."""

    def __init__(self, pool: "RemoteVerifier", spec: SessionSpec):
        self.pool, self.spec = pool, spec
        self.tokens = list(spec.prompt_ids)
        self.cancelled = False
        self._t0 = time.monotonic()
        self._connect(exclude=set())

    def _connect(self, exclude: set[str]) -> None:
        """Open the session (prompt + committed so far) on a live replica: the least loaded, or
        one nearly as loaded that holds the prompt's start in its prefix cache."""
        spec = self.spec.resumed(self.tokens[len(self.spec.prompt_ids):])
        while True:
            addr = self.pool.pick(exclude, self.tokens, self.spec.cache_salt)
            try:
                self._t = self.pool.transport(addr, spec, self._timeout())
            except grpc.RpcError as e:
                if e.code() not in _RETRYABLE:
                    raise
                log.warning("verifier %s unavailable at open (%s)", addr, e.code().name)
                exclude.add(addr)
                continue
            self.addr, self.replica = addr, self._t.replica
            self.pool.load[addr] += 1
            self.pool.affinity.placed(self.tokens, addr, self.spec.cache_salt)
            return

    def _timeout(self) -> float | None:
        """The client's deadline, carried to the verifier (re-opens get what is left)."""
        if self.spec.deadline_s is None:
            return self.pool.timeout_s
        return max(0.001, self.spec.deadline_s - (time.monotonic() - self._t0))

    def cycle(self, req: CycleRequest) -> CycleResult:
        tried: set[str] = set()
        while True:
            try:
                res = self._t.cycle(req, self._timeout())
                break
            except grpc.RpcError as e:
                if self.cancelled:
                    raise SessionCancelled(f"session {self.spec.session_id} was cancelled") from e
                if e.code() not in _RETRYABLE or self._timeout() == 0.001:
                    raise
                log.warning("verifier %s failed (%s); re-opening the session elsewhere", self.addr, e.code().name)
                self.pool.affinity.forget(self.addr)
                self._release()
                tried.add(self.addr)
                self._connect(exclude=tried)  # same context, so the same request is valid there
        self.tokens.extend(res.committed)
        return res

    def cancel(self) -> None:
        """The client went away (any thread): the cycle in flight ends now with
        ``SessionCancelled`` (no failover), and the verifier stops it at its next step: closing
        the transport ends the stream, or sends the Link's close and wakes the waiting cycle."""
        self.cancelled = True
        self._t.close()

    def _release(self) -> None:
        self._t.close()
        self.pool.load[self.addr] -= 1

    def close(self) -> None:
        self._release()


class RemoteVerifier:
    """Router-side view of verifier replicas: least-loaded placement with prefix affinity,
    session affinity."""

    def __init__(self, addresses: list[str], timeout_s: float | None = None, max_message_bytes: int = 4 << 20,
                 link: bool = True, affinity_slack: int | None = 2):
        """``link``: all sessions on a replica share one multiplexed ``Link`` stream (one
        message per step each way); else each session has its own ``Session`` stream.
        ``affinity_slack``: a new session may go to a replica with up to this many sessions
        more than the least loaded when that replica holds the longest start of its prompt
        (``services/router/affinity.py``); 0 = only among the least loaded; None = off."""
        if not addresses:
            raise ValueError("at least one verifier address is required")
        self.channels = {a: channel(a, max_message_bytes) for a in addresses}
        self._stubs = {a: pb_grpc.VerifierStub(ch) for a, ch in self.channels.items()}
        self.load = {a: 0 for a in addresses}
        self.affinity, self.affinity_slack = PrefixAffinity(), affinity_slack
        self.timeout_s = timeout_s
        self.link = link
        self._links: dict[str, ReplicaLink] = {}
        self._links_lock = threading.Lock()
        info = self._info()
        self.context_len, self.vocab_size = info.context_len, info.vocab_size
        self.max_draft = dict(info.max_draft)

    def _info(self) -> pb.InfoResponse:
        last = None
        for addr, stub in self._stubs.items():
            try:
                return stub.Info(pb.InfoRequest(), timeout=30, wait_for_ready=True)
            except grpc.RpcError as e:
                last = e
        raise RuntimeError(f"no verifier replica answered: {last}")

    def stub(self, addr: str) -> pb_grpc.VerifierStub:
        return self._stubs[addr]

    def pick(self, exclude: set[str], tokens: list[int] = (), salt: str = "") -> str:
        live = [a for a in self.load if a not in exclude]
        if not live:
            raise NoReplica(f"no live verifier replica among {sorted(self.load)}")
        if self.affinity_slack is None:
            return min(live, key=lambda a: self.load[a])
        return choose(live, self.load, self.affinity.holders(list(tokens), salt), self.affinity_slack)

    def open(self, spec: SessionSpec) -> RemoteSession:
        return RemoteSession(self, spec)

    def clear_prefix_cache(self) -> None:
        """Every replica forgets its cached prompt blocks, and placement forgets where they were
        (the affinity map would send sessions after blocks no longer there). A replica that
        does not answer fails the call, naming it; the others are cleared all the same."""
        failed = []
        for addr, stub in self._stubs.items():
            try:
                stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=30)
            except grpc.RpcError as e:
                failed.append(f"{addr} ({e.code().name})")
            self.affinity.forget(addr)
        if failed:
            raise NoReplica(f"prefix cache: not reset on {', '.join(failed)}")

    def transport(self, addr: str, spec: SessionSpec, timeout: float | None):
        """Open ``spec`` on ``addr``: over the replica's link (made anew if it broke), or its own stream."""
        if not self.link:
            return SessionStream(self._stubs[addr], spec, timeout)
        with self._links_lock:
            link = self._links.get(addr)
            if link is None or link.broken is not None:
                link = self._links[addr] = ReplicaLink(self._stubs[addr], addr)
        return link.open(spec, timeout)

    def close(self) -> None:
        with self._links_lock:
            for link in self._links.values():
                link.shut()
        for ch in self.channels.values():
            ch.close()

    # the router's engine asks these of any verifier
    policies: dict = {}
    memory = None


class LinkError(grpc.RpcError):
    """A session's failure reported over a link (or the link's own), shaped like a gRPC error."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {c.value[0]: c for c in grpc.StatusCode}
_BROKEN = object()
_CLOSED = object()   # put in a session's inbox when the router closes it: a waiting cycle ends


class ReplicaLink:
    """The router's end of one multiplexed ``Link`` to a replica. Sessions queue items; the
    request generator sends all queued items as one message; a reader thread hands each
    reply to its session. A broken link fails every session on it with UNAVAILABLE (they
    re-open elsewhere)."""

    def __init__(self, stub: pb_grpc.VerifierStub, addr: str):
        self.addr = addr
        self.broken: grpc.RpcError | None = None
        self._cond = threading.Condition()
        self._items: list[pb.LinkItem] = []
        self._shut = False
        self._inbox: dict[str, queue.SimpleQueue] = {}
        self._ids = itertools.count()
        self._call = stub.Link(self._requests())
        threading.Thread(target=self._read, name=f"link-{addr}", daemon=True).start()

    def _requests(self):
        while True:
            with self._cond:
                while not self._items and not self._shut:
                    self._cond.wait()
                items, self._items = self._items, []
            if items:
                yield pb.LinkRequest(items=items)
            elif self._shut:
                return

    def _send(self, item: pb.LinkItem) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def _read(self) -> None:
        err: grpc.RpcError = LinkError(grpc.StatusCode.UNAVAILABLE, f"link to {self.addr} ended")
        try:
            for msg in self._call:
                for r in msg.replies:
                    box = self._inbox.get(r.session_id)
                    if box is not None:
                        box.put(r)
        except grpc.RpcError as e:
            err = LinkError(e.code() if e.code() in _RETRYABLE else grpc.StatusCode.UNAVAILABLE,
                            f"link to {self.addr}: {e.details()}")
        self.broken = err
        for box in list(self._inbox.values()):
            box.put(_BROKEN)

    def _await(self, sid: str, timeout: float | None) -> pb.LinkReply:
        try:
            r = self._inbox[sid].get(timeout=timeout)
        except queue.Empty:
            self.release(sid)
            raise LinkError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed") from None
        if r is _BROKEN:
            raise self.broken
        if r is _CLOSED:
            raise LinkError(grpc.StatusCode.CANCELLED, "the session was closed by the router")
        if r.WhichOneof("kind") == "error":
            self._inbox.pop(sid, None)   # the verifier closed the session
            raise LinkError(_CODES.get(r.error.code, grpc.StatusCode.UNKNOWN), r.error.message)
        return r

    def open(self, spec: SessionSpec, timeout: float | None) -> "LinkedSession":
        sid = f"{spec.session_id or 's'}-{next(self._ids)}"
        self._inbox[sid] = queue.SimpleQueue()
        if self.broken is not None:
            raise self.broken
        self._send(pb.LinkItem(session_id=sid, open=spec_to_pb(spec)))
        return LinkedSession(self, sid, self._await(sid, timeout).opened.replica)

    def release(self, sid: str) -> None:
        box = self._inbox.pop(sid, None)
        if box is not None:
            box.put(_CLOSED)
            if self.broken is None:
                self._send(pb.LinkItem(session_id=sid, close=pb.Close()))

    def shut(self) -> None:
        with self._cond:
            self._shut = True
            self._cond.notify()
        self._call.cancel()


class LinkedSession:
    """Transport: a session carried on a replica's link."""

    def __init__(self, link: ReplicaLink, sid: str, replica: str):
        self.link, self.sid, self.replica = link, sid, replica

    def cycle(self, req: CycleRequest, timeout: float | None) -> CycleResult:
        if self.sid not in self.link._inbox:
            raise LinkError(grpc.StatusCode.UNAVAILABLE, "session is closed")
        self.link._send(pb.LinkItem(session_id=self.sid, cycle=cycle_to_pb(req)))
        return result_from_pb(self.link._await(self.sid, timeout).result)

    def close(self) -> None:
        self.link.release(self.sid)
