"""Verifier replica over gRPC (`specmesh.v1.Verifier`), and the router's client for it.

Protobuf lives only here: ``*_to_pb`` / ``*_from_pb`` convert at the edge; the servicer
drives a ``VerifierCore`` and the client (``RemoteVerifier``) offers the same interface as
``VerifierCore`` to the router.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
import grpc

from services.common.grpc_server import build_grpc_server, channel
from services.common.metrics import ACTIVE_SESSIONS, REQUESTS_REJECTED
from services.common.types import SamplingParams
from services.verifier.core import CycleRequest, CycleResult, SessionSpec, VerifierCore
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
                   sampling=pb.Sampling(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed),
                   policy=s.policy, model_drafter=s.model_drafter or "", max_draft=s.max_draft)


def spec_from_pb(o: pb.Open) -> SessionSpec:
    sp = o.sampling
    return SessionSpec(prompt_ids=list(o.prompt_ids), max_new_tokens=o.max_new_tokens,
                       sampling=SamplingParams(sp.temperature, sp.top_p or 1.0, sp.top_k,
                                               sp.seed if sp.HasField("seed") else None),
                       policy=o.policy or "lossless", model_drafter=o.model_drafter or None,
                       max_draft=o.max_draft, session_id=o.session_id)


def cycle_to_pb(c: CycleRequest) -> pb.Cycle:
    return pb.Cycle(draft_ids=c.draft_ids, draft_source=c.draft_source, draft_with=c.draft_with or "",
                    budget=c.budget)


def cycle_from_pb(c: pb.Cycle) -> CycleRequest:
    return CycleRequest(draft_ids=tuple(c.draft_ids), draft_source=c.draft_source or "none",
                        draft_with=c.draft_with or None, budget=c.budget)


def result_to_pb(r: CycleResult) -> pb.CycleResult:
    return pb.CycleResult(committed=r.committed, drafted=r.drafted, accepted=r.accepted, source=r.source,
                          rescued=[pb.RescuedPair(draft=d, target=t) for d, t in r.rescued_pairs],
                          rejected=r.rejected, draft_s=r.draft_s, verify_s=r.verify_s, batch_size=r.batch_size)


def result_from_pb(r: pb.CycleResult) -> CycleResult:
    return CycleResult(committed=list(r.committed), drafted=r.drafted, accepted=r.accepted, source=r.source,
                       rescued_pairs=tuple((p.draft, p.target) for p in r.rescued), rejected=r.rejected,
                       draft_s=r.draft_s, verify_s=r.verify_s, batch_size=max(1, r.batch_size))


# -- server ------------------------------------------------------------------------------------
class BadRequest(ValueError):
    pass


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, core: VerifierCore, max_sessions: int = 16, replica: str | None = None):
        self.core = core
        self.replica = replica or uuid.uuid4().hex[:8]
        self.max_sessions = max_sessions
        self._slots = threading.BoundedSemaphore(max_sessions)
        self._lock = threading.Lock()
        self.active: set[str] = set()

    def Info(self, request, context):
        return pb.InfoResponse(context_len=self.core.context_len, vocab_size=self.core.vocab_size,
                               max_draft=self.core.max_draft, active_sessions=len(self.active),
                               max_sessions=self.max_sessions, replica=self.replica)

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
        if not (s.sampling.temperature >= 0 and 0 < s.sampling.top_p <= 1 and s.sampling.top_k >= 0):
            raise BadRequest("open.sampling: temperature >= 0, top_p in (0, 1], top_k >= 0")

    def _check_cycle(self, c: CycleRequest, spec: SessionSpec) -> None:
        if c.draft_with and c.draft_with != spec.model_drafter:
            raise BadRequest(f"cycle.draft_with: session opened with model_drafter {spec.model_drafter!r}")
        if len(c.draft_ids) > max(spec.max_draft, 0) or c.budget > max(spec.max_draft, 0):
            raise BadRequest(f"cycle: drafts are limited to max_draft={spec.max_draft} tokens")
        if any(t >= self.core.vocab_size for t in c.draft_ids):
            raise BadRequest(f"cycle.draft_ids: ids must be < {self.core.vocab_size}")

    def Session(self, request_iterator, context):
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        if first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session: the first message must be `open`")
        spec = spec_from_pb(first.open)
        try:
            self._check_open(spec)
        except BadRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not self._slots.acquire(blocking=False):
            REQUESTS_REJECTED.labels("RESOURCE_EXHAUSTED").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"verifier {self.replica} is at its limit of {self.max_sessions} sessions")
        session = self.core.open(spec)
        with self._lock:
            self.active.add(session.session_id)
            ACTIVE_SESSIONS.set(len(self.active))
        try:
            yield pb.SessionResponse(opened=pb.Opened(session_id=session.session_id, replica=self.replica))
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "cycle":
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session: expected `cycle` after `open`")
                req = cycle_from_pb(msg.cycle)
                try:
                    self._check_cycle(req, spec)
                except BadRequest as e:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                if FAULT_CYCLE_DELAY_S:
                    time.sleep(FAULT_CYCLE_DELAY_S)
                yield pb.SessionResponse(result=result_to_pb(session.cycle(req)))
        finally:
            session.close()
            with self._lock:
                self.active.discard(session.session_id)
                ACTIVE_SESSIONS.set(len(self.active))
            self._slots.release()


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


class RemoteSession:
    """A verifier session on some replica; on replica failure it re-opens elsewhere with the
    prompt plus every token committed so far, and retries the cycle (nothing lost or repeated)."""

    def __init__(self, pool: "RemoteVerifier", spec: SessionSpec):
        self.pool, self.spec = pool, spec
        self.tokens = list(spec.prompt_ids)
        self.generated = 0
        self._t0 = time.monotonic()
        self._connect(exclude=set())

    def _connect(self, exclude: set[str]) -> None:
        """Open the session (prompt + committed so far) on the least-loaded live replica."""
        spec = SessionSpec(**{**self.spec.__dict__, "prompt_ids": list(self.tokens),
                              "max_new_tokens": max(1, self.spec.max_new_tokens - self.generated)})
        while True:
            addr = self.pool.pick(exclude)
            q: queue.Queue = queue.Queue()
            q.put(pb.SessionRequest(open=spec_to_pb(spec)))
            call = self.pool.stub(addr).Session(iter(q.get, None), timeout=self._timeout())
            try:
                self.replica = next(call).opened.replica
            except grpc.RpcError as e:
                if e.code() not in _RETRYABLE:
                    raise
                log.warning("verifier %s unavailable at open (%s)", addr, e.code().name)
                exclude.add(addr)
                continue
            self.addr, self._q, self._call = addr, q, call
            self.pool.load[addr] += 1
            return

    def _timeout(self) -> float | None:
        """The client's deadline, carried to the verifier stream (re-opens get what is left)."""
        if self.spec.deadline_s is None:
            return self.pool.timeout_s
        return max(0.001, self.spec.deadline_s - (time.monotonic() - self._t0))

    def cycle(self, req: CycleRequest) -> CycleResult:
        tried: set[str] = set()
        while True:
            try:
                self._q.put(pb.SessionRequest(cycle=cycle_to_pb(req)))
                res = result_from_pb(next(self._call).result)
                break
            except (grpc.RpcError, StopIteration) as e:
                code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
                if code not in _RETRYABLE or self._timeout() == 0.001:
                    raise
                log.warning("verifier %s failed (%s); re-opening the session elsewhere", self.addr, code.name)
                self._release()
                tried.add(self.addr)
                self._connect(exclude=tried)  # same context, so the same request is valid there
        self.tokens.extend(res.committed)
        self.generated += len(res.committed)
        return res

    def _release(self) -> None:
        self._q.put(None)
        self._call.cancel()
        self.pool.load[self.addr] -= 1

    def close(self) -> None:
        self._release()


class RemoteVerifier:
    """Router-side view of verifier replicas: least-loaded placement, session affinity."""

    def __init__(self, addresses: list[str], timeout_s: float | None = None, max_message_bytes: int = 4 << 20):
        if not addresses:
            raise ValueError("at least one verifier address is required")
        self.channels = {a: channel(a, max_message_bytes) for a in addresses}
        self._stubs = {a: pb_grpc.VerifierStub(ch) for a, ch in self.channels.items()}
        self.load = {a: 0 for a in addresses}
        self.timeout_s = timeout_s
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

    def pick(self, exclude: set[str]) -> str:
        live = [a for a in self.load if a not in exclude]
        if not live:
            raise NoReplica(f"no live verifier replica among {sorted(self.load)}")
        return min(live, key=lambda a: self.load[a])

    def open(self, spec: SessionSpec) -> RemoteSession:
        return RemoteSession(self, spec)

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    # the router's engine asks these of any verifier
    policies: dict = {}
    memory = None
