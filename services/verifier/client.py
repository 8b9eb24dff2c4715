"""The router's typed client of verifier replicas: ``RemoteVerifier`` offers the same
interface as an in-process ``VerifierCore`` (``open`` -> session with ``cycle`` / ``cancel`` /
``close``) and fails a session over to another replica, re-opened with every token committed
so far. Sessions travel on a replica's multiplexed ``Link`` (``ReplicaLink``) or on a stream
of their own (``SessionStream``)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple, cast

import grpc

from services.common.affinity import PrefixAffinity, choose
from services.common.grpc_server import channel, refusal_of
from services.common.metrics import VERIFIER_FAILOVERS, VERIFIERS_LIVE
from services.common.refusals import DeadlineExceeded, Unavailable
from services.common.types import CycleRequest, CycleResult, Session, SessionCancelled, SessionSpec
from services.verifier.backend import CycleEach, Cycles, Deadlines, Done, Outcome
from services.verifier.watch import ReplicaWatch
from services.verifier.wire import cycle_to_pb, result_from_pb, results_from_pb, spec_to_pb, step_to_pb
from specmesh.v1 import verifier_pb2 as pb
from specmesh.v1 import verifier_pb2_grpc as pb_grpc

log = logging.getLogger("specmesh.verifier.client")


class NoReplica(Unavailable):
    """Every verifier replica failed; the router answers UNAVAILABLE."""


_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


class SessionStream:
    """Transport: one bidirectional ``Session`` stream per session."""

    def __init__(self, stub: pb_grpc.VerifierStub, spec: SessionSpec, timeout: float | None, wait_s: float):
        self._q: queue.Queue = queue.Queue()
        self._q.put(pb.SessionRequest(open=spec_to_pb(spec)))
        self._call = stub.Session(iter(self._q.get, None), timeout=timeout)
        self.replica = self._next(wait_s).opened.replica

    def _next(self, wait_s: float) -> pb.SessionResponse:
        """The stream's next reply; ``Stalled`` (the call cancelled) if none comes within ``wait_s``."""
        timer = threading.Timer(wait_s, self._call.cancel)
        timer.start()
        try:
            return next(self._call)
        except StopIteration:
            raise LinkError(grpc.StatusCode.UNAVAILABLE, "session stream ended") from None
        except grpc.RpcError as e:
            if not timer.is_alive() and e.code() == grpc.StatusCode.CANCELLED:
                raise Stalled(wait_s) from e
            raise
        finally:
            timer.cancel()

    def cycle(self, req: CycleRequest, wait_s: float) -> CycleResult:
        self._q.put(pb.SessionRequest(cycle=cycle_to_pb(req)))
        return result_from_pb(self._next(wait_s).result)

    def close(self) -> None:
        self._q.put(None)
        self._call.cancel()


class RemoteSession:
    """A verifier session on some replica; on replica failure (an error, or no answer within the
    replica's budget: ``ReplicaWatch``) it re-opens elsewhere with the prompt plus every token
    committed so far, and retries the cycle (nothing lost or repeated)."""

    def __init__(self, pool: "RemoteVerifier", spec: SessionSpec):
        self.pool, self.spec = pool, spec
        self.tokens = list(spec.prompt_ids)
        self.cancelled = False
        self._t0 = time.monotonic()
        self._connect(exclude=set())

    def _connect(self, exclude: set[str]) -> None:
        """Open the session (prompt + committed so far) on a live replica: the least loaded, or
        one nearly as loaded that holds the prompt's start in its prefix cache."""
        spec = self.spec.resumed(self.tokens[len(self.spec.prompt_ids) :])
        while True:
            addr, left = self.pool.pick(exclude, self.tokens, self.spec.cache_salt), self._timeout()
            try:
                self._t = self.pool.transport(addr, spec, left)
            except grpc.RpcError as e:
                if isinstance(e, Stalled) and left is not None and left <= self.pool.watch.budget(addr):
                    raise DeadlineExceeded("verifier: the request's deadline passed") from e
                if e.code() not in _RETRYABLE and not isinstance(e, Stalled):
                    raise refusal_of(e, "verifier") from e
                log.warning("verifier %s unavailable at open (%s)", addr, _why(e))
                self.pool.failed(addr, "open", e)
                exclude.add(addr)
                continue
            self.addr, self.replica, self._fresh = addr, self._t.replica, True
            self.pool.load[addr] += 1
            self.pool.affinity.placed(self.tokens, addr, self.spec.cache_salt)
            return

    def _timeout(self) -> float | None:
        """The client's deadline, carried to the verifier (re-opens get what is left)."""
        if self.spec.deadline_s is None:
            return self.pool.timeout_s
        return max(0.001, self.spec.deadline_s - (time.monotonic() - self._t0))

    def cycle(self, req: CycleRequest, tried: set[str] | None = None) -> CycleResult:
        tried = set() if tried is None else tried
        while True:
            prefill = len(self.tokens) if self._fresh else 0  # a session's first cycle on a replica prefills
            left, budget = self._timeout(), self.pool.watch.budget(self.addr, prefill)
            t0 = time.monotonic()
            try:
                res = self._t.cycle(req, budget if left is None else min(left, budget))
                break
            except grpc.RpcError as e:
                self._failover(e, left, budget, tried)
        return self._answered(res, t0)

    def _answered(self, res: CycleResult, t0: float) -> CycleResult:
        if not self._fresh:  # a prefill's time is not the replica's pace
            self.pool.watch.answered(self.addr, time.monotonic() - t0)
        self._fresh = False
        self.tokens.extend(res.committed)
        return res

    def _failover(self, e: grpc.RpcError, left: float | None, budget: float, tried: set[str]) -> None:
        """A cycle on this replica failed with ``e``: re-open the session on another (the caller
        retries the cycle there), or raise what the request gets instead."""
        if self.cancelled:
            raise SessionCancelled(f"session {self.spec.session_id} was cancelled") from e
        if isinstance(e, Stalled) and left is not None and left <= budget:
            raise DeadlineExceeded("verifier: the request's deadline passed") from e
        if (e.code() not in _RETRYABLE and not isinstance(e, Stalled)) or self._timeout() == 0.001:
            raise refusal_of(e, "verifier") from e
        log.warning("verifier %s failed (%s); re-opening the session elsewhere", self.addr, _why(e))
        self.pool.failed(self.addr, "cycle", e)
        self._release()
        tried.add(self.addr)
        self._connect(exclude=tried)  # same context, so the same request is valid there

    def post(self, req: CycleRequest, done: Callable[[Outcome], None]) -> "Posting | None":
        """The cycle as a Link item for the caller to post with the step's others
        (``ReplicaLink.post_all``), no thread waiting on it: ``done(outcome)`` comes from the
        link's reader thread, or, after a failure (an error, a broken link, no answer within the
        replica's budget), from a pooled thread once the session has failed over as ``cycle``
        does. None: a transport that cannot post (its own stream), or a cancelled session:
        ``cycle`` it."""
        if not isinstance(self._t, LinkedSession) or self.cancelled:
            return None
        prefill = len(self.tokens) if self._fresh else 0
        left, budget = self._timeout(), self.pool.watch.budget(self.addr, prefill)
        t0 = time.monotonic()

        def answered(outcome: CycleResult | grpc.RpcError) -> None:
            if isinstance(outcome, CycleResult):
                done(self._answered(outcome, t0))
            else:
                self.pool.recover(lambda: self._recover(req, outcome, left, budget), done)

        return self._t.post(req, budget if left is None else min(left, budget), answered)

    def _recover(self, req: CycleRequest, e: grpc.RpcError, left: float | None, budget: float) -> CycleResult:
        tried: set[str] = set()
        self._failover(e, left, budget, tried)
        return self.cycle(req, tried)

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


def _why(e: grpc.RpcError) -> str:
    return "no answer within its budget" if isinstance(e, Stalled) else e.code().name


class RemoteVerifier:
    """Router-side view of verifier replicas: least-loaded placement with prefix affinity,
    session affinity."""

    in_process = False  # VerifierBackend: the replicas answer each cycle later
    split_at = 128  # VerifierBackend (bench/results/control_plane_batched_after.md, control_plane_lanes_ab/)

    def __init__(
        self,
        addresses: list[str],
        timeout_s: float | None = None,
        max_message_bytes: int = 4 << 20,
        link: bool = True,
        affinity_slack: int | None = 2,
        watch: ReplicaWatch | None = None,
        start_timeout_s: float = 600.0,
    ):
        """``start_timeout_s``: how long to wait at start for a replica to answer (replicas
        start beside the router and load their models first, as pods of one release do).
        ``link``: all sessions on a replica share one multiplexed ``Link`` stream (one
        message per step each way); else each session has its own ``Session`` stream.
        ``affinity_slack``: a new session may go to a replica with up to this many sessions
        more than the least loaded when that replica holds the longest start of its prompt
        (``services/common/affinity.py``); 0 = only among the least loaded; None = off.
        ``watch``: when a replica counts as hung, and how long a failed one is left out."""
        if not addresses:
            raise ValueError("at least one verifier address is required")
        self.channels = {a: channel(a, max_message_bytes) for a in addresses}
        self._stubs = {a: pb_grpc.VerifierStub(ch) for a, ch in self.channels.items()}
        self.load = {a: 0 for a in addresses}
        self.affinity, self.affinity_slack = PrefixAffinity(), affinity_slack
        self.timeout_s = timeout_s
        self.watch = watch or ReplicaWatch()
        self.link = link
        self._links: dict[str, ReplicaLink] = {}
        self._links_lock = threading.Lock()
        # specmesh_verifiers_live: the replicas not left out of placement, at each scrape
        VERIFIERS_LIVE.labels("router").set_function(lambda: len(self.load) - len(self.watch.out(self.load)))
        info = self._info(start_timeout_s)
        self.context_len, self.vocab_size = info.context_len, info.vocab_size
        self.max_draft = dict(info.max_draft)
        self._cycles = CycleEach()  # cycles that cannot be posted, and failovers
        self.deadlines = Deadlines()

    def step(self, cycles: Cycles, done: Done) -> None:
        """The router's step (``VerifierBackend``): every session's cycle on a Link goes out in
        one message per replica and its outcome is applied as its reply comes (no thread waits
        on it); sessions on streams of their own cycle on pooled threads."""
        sends: dict[ReplicaLink, list[Posting]] = {}
        rest: list[int] = []
        for i, (session, req) in enumerate(cycles):
            posting = session.post(req, partial(done, i)) if isinstance(session, RemoteSession) else None
            if posting is None:
                rest.append(i)
            else:
                sends.setdefault(posting.link, []).append(posting)
        for link, postings in sends.items():
            link.post_all(postings, wait_s=SEND_WAIT_S)  # out before the router's deferred work
        if rest:
            self._cycles.step([cycles[i] for i in rest], lambda j, outcome: done(rest[j], outcome))

    def lane(self, session: Session) -> str:
        """The replica the session is on (``VerifierBackend``)."""
        return cast(RemoteSession, session).addr

    def recover(self, fn: Callable[[], CycleResult], done: Callable[[Outcome], None]) -> None:
        """``fn`` (a failover and the cycle again) on a pooled thread, its outcome to ``done``."""
        self._cycles.run(fn, done)

    def _info(self, within_s: float) -> pb.InfoResponse:
        """The first replica's answer to Info, asking each in turn until one answers or
        ``within_s`` seconds pass (then RuntimeError naming the last failure)."""
        end, last = time.monotonic() + within_s, None
        while True:
            for addr, stub in self._stubs.items():
                try:
                    left = max(0.1, min(30.0, end - time.monotonic()))
                    return stub.Info(pb.InfoRequest(), timeout=left, wait_for_ready=True)
                except grpc.RpcError as e:
                    last = e
            left = end - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no verifier replica answered within {within_s:.0f} s: {last}")
            log.warning("no verifier replica answers yet (%s); waiting up to %.0f s more", _why(last), left)

    def live(self, timeout_s: float = 1.0) -> int:
        """Replicas that answer ``Info`` within ``timeout_s`` now (health checks ask this, and
        each answer or silence is a probe for ``watch``)."""
        n = 0
        for addr, stub in self._stubs.items():
            try:
                stub.Info(pb.InfoRequest(), timeout=timeout_s)
                n += 1
                self.watch.probed(addr, True)
            except grpc.RpcError:
                self.watch.probed(addr, False)
        return n

    def failed(self, addr: str, stage: str, e: grpc.RpcError) -> None:
        """A session left ``addr`` after ``e``: it is left out of placement for a while (one
        failure of the replica however many of its sessions report it), and a replica that hung
        has its link broken so every session on it moves now."""
        VERIFIER_FAILOVERS.labels("hang" if isinstance(e, Stalled) else stage).inc()
        self.affinity.forget(addr)
        if self.watch.usable(addr):
            quarantine = self.watch.failed(addr)
            log.warning("verifier %s left out of placement for %.0f s", addr, quarantine)
        if isinstance(e, Stalled):
            with self._links_lock:
                link = self._links.pop(addr, None)
            if link is not None:
                link.shut()

    def stub(self, addr: str) -> pb_grpc.VerifierStub:
        return self._stubs[addr]

    def pick(self, exclude: set[str], tokens: Sequence[int] = (), salt: str = "") -> str:
        out = exclude | self.watch.out(self.load)
        live = [a for a in self.load if a not in out]
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
        wait = self.watch.budget(addr) if timeout is None else min(timeout, self.watch.budget(addr))
        if not self.link:
            return SessionStream(self._stubs[addr], spec, timeout, wait)
        with self._links_lock:
            link = self._links.get(addr)
            if link is None or link.broken is not None:
                link = self._links[addr] = ReplicaLink(self._stubs[addr], addr, self.deadlines)
        return link.open(spec, wait)

    def close(self) -> None:
        self._cycles.close()
        self.deadlines.close()
        with self._links_lock:
            for link in self._links.values():
                link.shut()
        for ch in self.channels.values():
            ch.close()


def serving(addr: str, timeout_s: float) -> bool:
    """Whether a verifier answers ``Info`` at ``addr`` within ``timeout_s`` (a start-up check)."""
    with channel(addr) as ch:
        try:
            pb_grpc.VerifierStub(ch).Info(pb.InfoRequest(), timeout=timeout_s, wait_for_ready=True)
            return True
        except grpc.RpcError:
            return False


class LinkError(grpc.RpcError):
    """A session's failure reported over a link (or the link's own), shaped like a gRPC error."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Stalled(LinkError):
    """No answer came within the wait given: the replica is hung, unless the wait was the
    request's own deadline."""

    def __init__(self, wait_s: float):
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {wait_s:.3g} s")


_CODES = {c.value[0]: c for c in grpc.StatusCode}
_BROKEN = object()
_CLOSED = object()  # put in a session's inbox when the router closes it: a waiting cycle ends


# how long a step's sender waits for its message to leave (``ReplicaLink.send_all``)
SEND_WAIT_S = 0.002


class ReplicaLink:
    """The router's end of one multiplexed ``Link`` to a replica. Sessions queue items and
    posted cycles; the request generator sends all queued as one message (the cycles by
    column, ``StepCycles``, where the replica reads them so); a reader thread hands each reply
    to its session. A broken link fails every session on it with UNAVAILABLE (they re-open
    elsewhere)."""

    def __init__(self, stub: pb_grpc.VerifierStub, addr: str, deadlines: "Deadlines | None" = None):
        self.addr = addr
        self.broken: grpc.RpcError | None = None
        self._cond = threading.Condition()
        self._items: list[pb.LinkItem] = []
        self._cycles: list[tuple[str, CycleRequest]] = []  # posted cycles, sent after the items
        self._queued = self._sent = 0  # messages queued; of them, sent (gRPC asked for the next)
        self._shut = False
        self._inbox: dict[str, queue.SimpleQueue] = {}
        self._waiters: dict[str, Callable] = {}  # sid -> the posted cycle's callback (its reply, once)
        self._timers: dict[str, list] = {}  # sid -> the posted cycle's deadline (cancelled once answered)
        self._deadlines = deadlines or Deadlines()
        self._ids = itertools.count()
        self.columns = False  # the replica reads a step by column (its Opened says so)
        self._call = stub.Link(self._requests())
        threading.Thread(target=self._read, name=f"link-{addr}", daemon=True).start()

    def _requests(self):
        while True:
            with self._cond:
                while not self._items and not self._cycles and not self._shut:
                    self._cond.wait()
                items, self._items = self._items, []
                cycles, self._cycles = self._cycles, []
                queued = self._queued
            if items or cycles:
                yield pb.LinkRequest(items=items, step=step_to_pb(cycles) if cycles else None)
                with self._cond:  # gRPC asks for the next message once this one is sent
                    self._sent = queued
                    self._cond.notify_all()
            elif self._shut:
                return

    def _send(self, item: pb.LinkItem) -> None:
        self.send_all([item])

    def send_all(
        self, items: list[pb.LinkItem], wait_s: float = 0.0, cycles: Sequence[tuple[str, CycleRequest]] = ()
    ) -> None:
        """Queue ``items`` and ``cycles`` (session id, request) together: they leave in one
        message. ``wait_s``: wait (at most that long) until it has left, so the sender's thread
        gives the GIL to gRPC's sending one at once rather than after its own switch interval
        (a step's message: see ``RemoteVerifier.step``)."""
        with self._cond:
            self._items.extend(items)
            self._cycles.extend(cycles)
            self._queued += 1
            queued = self._queued
            self._cond.notify_all()
            if wait_s:
                self._cond.wait_for(lambda: self._sent >= queued or self._shut or self.broken is not None, wait_s)

    def _take_waiter(self, sid: str, expected: Callable | None = None) -> Callable | None:
        """The session's posted-cycle callback, taken once (only ``expected`` if given); its
        deadline is cancelled."""
        with self._cond:
            waiter = self._waiters.get(sid)
            if waiter is None or (expected is not None and waiter is not expected):
                return None
            timer = self._timers.pop(sid, None)
            waiter = self._waiters.pop(sid)
        if timer is not None:
            self._deadlines.cancel(timer)
        return waiter

    def _deliver(self, sid: str, r) -> None:
        """A reply (or ``_BROKEN`` / ``_CLOSED``) to the session's posted cycle, else its inbox."""
        self._deliver_all([(sid, r)])

    def _deliver_all(self, replies: list[tuple[str, object]]) -> None:
        """``_deliver`` for each ``(sid, reply)``, taking the lock and cancelling their
        deadlines once for all (a step's replies come in one message). A reply may be a
        ``CycleResult`` already (a step's, read by column)."""
        with self._cond:
            taken = [(sid, r, self._waiters.pop(sid, None)) for sid, r in replies]
            timers = [t for sid, _, w in taken if w is not None and (t := self._timers.pop(sid, None)) is not None]
        if timers:
            self._deadlines.cancel_all(timers)
        for sid, r, waiter in taken:
            if waiter is None:
                if (box := self._inbox.get(sid)) is not None:
                    box.put(r)
                continue
            if isinstance(r, CycleResult):
                waiter(r)
                continue
            try:
                outcome = result_from_pb(self._unwrap(sid, r).result)
            except grpc.RpcError as e:
                outcome = e
            waiter(outcome)

    def post_all(self, postings: list[Posting], wait_s: float = 0.0) -> None:
        """Send the postings' cycles in one message, expecting each one's reply:
        ``answered(result or error)`` once, from the reader thread; ``Stalled`` if none comes
        within its ``wait_s``. Rule: a step's postings take each lock once, not once each.
        ``wait_s``: as ``send_all``."""
        posted, refused = [], []
        with self._cond:
            for p in postings:
                if self.broken is not None or p.sid not in self._inbox:
                    refused.append(p)
                else:
                    self._waiters[p.sid] = p.answered
                    posted.append(p)
        for p in refused:  # answered on the deadline thread, not in the caller's step
            error = self.broken or LinkError(grpc.StatusCode.UNAVAILABLE, "session is closed")
            self._deadlines.add(0.0, partial(p.answered, error))
        if self.broken is not None:  # it broke meanwhile, after the reader failed the waiters it had
            self._deliver_all([(p.sid, _BROKEN) for p in posted])
        timed = [(p, p.wait_s) for p in posted if p.wait_s is not None]
        timers = self._deadlines.add_all([(w, partial(self._stalled, p.sid, p.answered, w)) for p, w in timed])
        late = []
        with self._cond:
            for (p, _), timer in zip(timed, timers):
                if self._waiters.get(p.sid) is p.answered:  # (not answered meanwhile)
                    self._timers[p.sid] = timer
                else:
                    late.append(timer)
        if late:
            self._deadlines.cancel_all(late)
        if self.columns:
            self.send_all([], wait_s, [(p.sid, p.req) for p in postings])
        else:  # a replica of an older release (during a rolling upgrade) reads cycle items
            self.send_all([pb.LinkItem(session_id=p.sid, cycle=cycle_to_pb(p.req)) for p in postings], wait_s)

    def _stalled(self, sid: str, answered: Callable, wait_s: float) -> None:
        if self._take_waiter(sid, answered) is not None:  # not yet answered: the session leaves this replica
            self.release(sid)
            answered(Stalled(wait_s))

    def _read(self) -> None:
        err: grpc.RpcError = LinkError(grpc.StatusCode.UNAVAILABLE, f"link to {self.addr} ended")
        try:
            for msg in self._call:
                replies: list[tuple[str, object]] = [(r.session_id, r) for r in msg.replies]
                if msg.HasField("step"):
                    replies += results_from_pb(msg.step)
                self._deliver_all(replies)
        except grpc.RpcError as e:
            err = LinkError(
                e.code() if e.code() in _RETRYABLE else grpc.StatusCode.UNAVAILABLE,
                f"link to {self.addr}: {e.details()}",
            )
        except ValueError as e:  # a reply that does not parse: the link is not to be trusted
            log.error("link to %s: %s", self.addr, e)
            self._call.cancel()
            err = LinkError(grpc.StatusCode.UNAVAILABLE, f"link to {self.addr}: {e}")
        self.broken = err
        self._deliver_all([(sid, _BROKEN) for sid in list(self._waiters)])
        for box in list(self._inbox.values()):
            box.put(_BROKEN)

    def _await(self, sid: str, timeout: float | None) -> pb.LinkReply:
        try:
            r = self._inbox[sid].get(timeout=timeout)
        except queue.Empty:
            self.release(sid)
            raise Stalled(timeout or 0.0) from None
        return self._unwrap(sid, r)

    def _unwrap(self, sid: str, r) -> pb.LinkReply:
        """The reply, or the error it stands for."""
        if r is _BROKEN:
            assert self.broken is not None  # set before _BROKEN is posted
            raise self.broken
        if r is _CLOSED:
            raise LinkError(grpc.StatusCode.CANCELLED, "the session was closed by the router")
        if r.WhichOneof("kind") == "error":
            self._inbox.pop(sid, None)  # the verifier closed the session
            raise LinkError(_CODES.get(r.error.code, grpc.StatusCode.UNKNOWN), r.error.message)
        return r

    def open(self, spec: SessionSpec, timeout: float | None) -> "LinkedSession":
        sid = f"{spec.session_id or 's'}-{next(self._ids)}"
        self._inbox[sid] = queue.SimpleQueue()
        if self.broken is not None:
            raise self.broken
        self._send(pb.LinkItem(session_id=sid, open=spec_to_pb(spec)))
        opened = self._await(sid, timeout).opened
        self.columns = opened.step_columns
        return LinkedSession(self, sid, opened.replica)

    def release(self, sid: str) -> None:
        box = self._inbox.pop(sid, None)
        self._deliver(sid, _CLOSED)  # a posted cycle ends (only a posted one: the box is gone)
        if box is not None:
            box.put(_CLOSED)
            if self.broken is None:
                self._send(pb.LinkItem(session_id=sid, close=pb.Close()))

    def shut(self) -> None:
        with self._cond:
            self._shut = True
            self._cond.notify()
        self._call.cancel()


class Posting(NamedTuple):
    """A cycle to post on a link (``ReplicaLink.post_all``): its request, how long its reply
    may take (None: no limit), and who gets it."""

    link: ReplicaLink
    sid: str
    req: CycleRequest
    wait_s: float | None
    answered: Callable


class LinkedSession:
    """Transport: a session carried on a replica's link."""

    def __init__(self, link: ReplicaLink, sid: str, replica: str):
        self.link, self.sid, self.replica = link, sid, replica

    def cycle(self, req: CycleRequest, timeout: float | None) -> CycleResult:
        if self.sid not in self.link._inbox:
            raise LinkError(grpc.StatusCode.UNAVAILABLE, "session is closed")
        self.link._send(pb.LinkItem(session_id=self.sid, cycle=cycle_to_pb(req)))
        return result_from_pb(self.link._await(self.sid, timeout).result)

    def post(self, req: CycleRequest, wait_s: float | None, answered: Callable) -> Posting:
        return Posting(self.link, self.sid, req, wait_s, answered)

    def close(self) -> None:
        self.link.release(self.sid)
