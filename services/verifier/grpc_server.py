"""The verifier's gRPC edge (`specmesh.v1.Verifier`): a thin servicer over a ``Replica``
(admission, checks) and its ``VerifierCore``; the multiplexed ``Link`` stream's server end.
Refusals become status codes here (``status_of``); conversions are in ``wire``."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import grpc

from services.common.grpc_server import build_grpc_server, status_of
from services.common.refusals import Invalid, Refusal
from services.common.security import internal_token
from services.common.types import CycleRequest, CycleResult, SessionCancelled, SessionSpec
from services.verifier import faults
from services.verifier.core import VerifierCore
from services.verifier.replica import Replica
from services.verifier.wire import (
    SERVICE_NAME,
    cycle_from_pb,
    packable,
    result_to_pb,
    results_to_pb,
    spec_from_pb,
    step_from_pb,
)
from specmesh.v1 import verifier_pb2 as pb
from specmesh.v1 import verifier_pb2_grpc as pb_grpc

log = logging.getLogger("specmesh.verifier")


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, sessions: Replica):
        self.sessions = sessions
        self.links: set[LinkServer] = set()
        self.delay_s = faults.cycle_delay_s()

    @property
    def active(self) -> set[str]:
        return self.sessions.active

    def drain(self) -> None:
        """Shutdown: refuse new sessions; each link ends once its sessions are done."""
        self.sessions.drain()
        for link in list(self.links):
            link.end_if_drained()

    def Info(self, request, context):
        core, s = self.sessions.core, self.sessions
        return pb.InfoResponse(
            context_len=core.context_len,
            vocab_size=core.vocab_size,
            max_draft=core.max_draft,
            active_sessions=len(s.active),
            max_sessions=s.max_sessions,
            replica=s.replica,
        )

    def ResetPrefixCache(self, request, context):
        self.sessions.core.clear_prefix_cache()
        return pb.ResetPrefixCacheResponse(replica=self.sessions.replica)

    def Session(self, request_iterator, context):
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        if first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session: the first message must be `open`")
        spec = spec_from_pb(first.open)
        try:
            session = self.sessions.admit(spec)
        except Refusal as e:
            context.abort(status_of(e), str(e))
        context.add_callback(session.cancel)  # the router went away: a cycle in flight stops at the next step
        try:
            yield pb.SessionResponse(opened=pb.Opened(session_id=session.session_id, replica=self.sessions.replica))
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "cycle":
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session: expected `cycle` after `open`")
                req = cycle_from_pb(msg.cycle)
                try:
                    self.sessions.check_cycle(req, spec)
                except Refusal as e:
                    context.abort(status_of(e), str(e))
                if self.delay_s:
                    time.sleep(self.delay_s)
                yield pb.SessionResponse(result=result_to_pb(session.cycle(req)))
        except SessionCancelled:  # the router's stream ended mid-cycle: no one to answer
            log.info("session %s: cancelled mid-cycle", session.session_id)
        finally:
            self.sessions.release(session)

    def Link(self, request_iterator, context):
        link = LinkServer(self, request_iterator, context)
        context.add_callback(link.end)  # a cancelled or broken link unblocks the writer
        self.links.add(link)
        try:
            while (replies := link.next_replies()) is not None:
                yield response_of(replies)
        finally:
            link.end()
            self.links.discard(link)


_READ = object()  # in the reply queue: the reader thread hands reading back to the writer


def response_of(replies: list) -> pb.LinkResponse:
    """One message of queued replies: ``LinkReply``s as they are, a step's results
    (``(session id, CycleResult)``) by column."""
    results = [r for r in replies if isinstance(r, tuple)]
    if not results:
        return pb.LinkResponse(replies=replies)
    singles = [r for r in replies if not isinstance(r, tuple)]
    return pb.LinkResponse(replies=singles, step=results_to_pb(results))


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
        self.opening: set[str] = set()  # sessions opening on a thread of their own (``_open``)
        self.closing: set[str] = set()
        self.ended = self._stopped = False
        self._lock = threading.Lock()
        self._turn = threading.Condition(self._lock)  # the reader thread waits here for its turn
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._posts: list = []  # cycles of the message being read, posted together after it
        self._requests, self._context = requests, context
        self._reader = "writer"  # who reads the next message: "writer" or "thread"
        self._writer_reading = False
        self._thread: threading.Thread | None = None

    def _in_flight(self) -> bool:
        return bool(self.busy or self.opening)

    def _take(self, msg) -> None:
        """Handle one message: its items in order, then its step's cycles, then every cycle
        posted together (the reading thread leads their step when none is running and it would
        not wait)."""
        if self.servicer is not None and self.servicer.delay_s:
            time.sleep(self.servicer.delay_s)
        for item in msg.items:
            self._handle(item)
        if msg.HasField("step"):
            self._take_step(msg.step)
        posts, self._posts = self._posts, []
        if posts:
            self.servicer.sessions.core.batcher.post_all(posts, lead=True)

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
                    self._out.put(_READ)  # the writer may be waiting for a reply that is not coming
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
        replies: list = []  # LinkReply, or a step's (session id, result)
        while True:
            try:
                r = self._out.get(block=block and not replies)
            except queue.Empty:
                return replies
            if r is None:
                self._out.put(None)  # every later call sees the end too
                return replies or None
            if r is _READ:
                block = False  # the writer reads next: take what is queued, wait for nothing
            else:
                replies.append(r)

    def _take_step(self, step: pb.StepCycles) -> None:
        """A step's cycles (``StepCycles``), each handled as a cycle item; their plain results
        go back by column."""
        try:
            cycles = step_from_pb(step)
        except ValueError as e:
            for sid in dict.fromkeys(step.session_ids):
                self._fail(sid, grpc.StatusCode.INVALID_ARGUMENT, f"link step: {e}")
            return
        for sid, req in cycles:
            self._guarded(sid, "cycle", self._cycle, sid, req, True)

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
        except Refusal as e:
            self._fail(sid, status_of(e), str(e))
        except Exception as e:
            log.exception("link item for session %s failed", sid)
            self._fail(sid, grpc.StatusCode.INTERNAL, f"{kind} failed: {e}")

    def _open(self, sid: str, spec: SessionSpec) -> None:
        """Open a session. One whose grammar this replica has not compiled yet opens on a
        thread of its own (a compile may take seconds), so the link's other sessions keep
        cycling; the router sends its cycles only once it is opened."""
        if not sid:
            raise Invalid("link item: session_id must not be empty")
        with self._lock:
            if sid in self.sessions or sid in self.opening:
                raise Invalid(f"link item: session {sid!r} is already open on this link")
            later = spec.grammar is not None and not self.servicer.sessions.core.grammars.cached(spec.grammar)
            if later:
                self.opening.add(sid)
        if later:
            threading.Thread(
                target=self._guarded, args=(sid, "open", self._admit, sid, spec), daemon=True, name=f"open-{sid}"
            ).start()
        else:
            self._admit(sid, spec)

    def _admit(self, sid: str, spec: SessionSpec) -> None:
        try:
            session = self.servicer.sessions.admit(spec)
        finally:
            with self._lock:
                self.opening.discard(sid)
        with self._lock:
            gone = self.ended or sid in self.closing  # closed (or the link ended) while it opened
            if not gone:
                self.sessions[sid] = session
        if gone:
            self.servicer.sessions.release(session)
            with self._lock:
                self.closing.discard(sid)
            self.end_if_drained()
            return
        self._out.put(
            pb.LinkReply(
                session_id=sid,
                opened=pb.Opened(
                    session_id=session.session_id, replica=self.servicer.sessions.replica, step_columns=True
                ),
            )
        )

    def _cycle(self, sid: str, req: CycleRequest, by_column: bool = False) -> None:
        """Post the session's cycle (``by_column``: it came in a step, and its plain result
        goes back in one)."""
        with self._lock:
            session = self.sessions.get(sid)
            if session is None:
                raise Invalid(f"link item: session {sid!r} is not open on this link")
            if sid in self.busy:
                raise Invalid(f"link item: session {sid!r} already has a cycle in flight")
            self.servicer.sessions.check_cycle(req, session.spec)
            self.busy.add(sid)
        self._posts.append((session, req, lambda item: self._done(sid, item, by_column)))

    def _done(self, sid: str, item, by_column: bool = False) -> None:
        """The session is free before its reply is queued: the router sends its next cycle as
        soon as the reply arrives, and the reader must not find it still busy. A plain result
        of a step's cycle queues as it is, converted with the others it leaves with
        (``response_of``)."""
        reply: pb.LinkReply | tuple[str, CycleResult]
        if item.error is None and by_column and packable(item.result):
            reply = (sid, item.result)
        elif item.error is None:
            reply = pb.LinkReply(session_id=sid, result=result_to_pb(item.result))
        elif isinstance(item.error, SessionCancelled):
            log.info("session %s: %s", sid, item.error)
            reply = pb.LinkReply(
                session_id=sid, error=pb.SessionError(code=grpc.StatusCode.CANCELLED.value[0], message=str(item.error))
            )
        else:
            log.error("session %s failed: %s", sid, item.error)
            reply = pb.LinkReply(
                session_id=sid,
                error=pb.SessionError(code=grpc.StatusCode.INTERNAL.value[0], message=f"cycle failed: {item.error}"),
            )
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
                self.closing.add(sid)  # released by _admit once it has opened
                return
            if sid in self.busy:
                self.closing.add(sid)  # closed by _done once its cycle is through,
                self.sessions[sid].cancel()  # which stops at the next step
                return
            self.closing.discard(sid)
            session = self.sessions.pop(sid, None)
        if session is not None:
            self.servicer.sessions.release(session)
        self.end_if_drained()

    def end_if_drained(self) -> None:
        if self.servicer.sessions.draining and not self.sessions:
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
            blocked = self._writer_reading  # waiting for a message that may never come (a drain)
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


def build_verifier_server(
    core: VerifierCore,
    host: str,
    port: int,
    max_sessions: int = 16,
    workers: int = 32,
    max_message_bytes: int = 4 * 1024 * 1024,
):
    servicer = VerifierServicer(Replica(core, max_sessions))
    server, bound = build_grpc_server(
        lambda s: pb_grpc.add_VerifierServicer_to_server(servicer, s),
        [SERVICE_NAME],
        host,
        port,
        workers,
        max_message_bytes,
        auth_token=internal_token(),  # the internal token, when one is set
    )
    return server, servicer, bound
