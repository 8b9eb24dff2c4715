"""`specmesh.v1.Drafter`: the suffix-cache drafter as a service. Sessions a router forgets to
stop are reaped after ``idle_s`` without calls."""

from __future__ import annotations

import threading
import time

import grpc

from services.common.grpc_server import build_grpc_server
from services.common.security import internal_token
from services.drafter.suffix import SuffixDrafter
from services.drafter.wire import SERVICE_NAME, draft_to_pb
from specmesh.v1 import drafter_pb2 as pb
from specmesh.v1 import drafter_pb2_grpc as pb_grpc


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, drafter: SuffixDrafter, vocab_size: int, max_budget: int = 64, idle_s: float = 600.0):
        self.drafter, self.vocab, self.max_budget, self.idle_s = drafter, vocab_size, max_budget, idle_s
        self.last_seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def _session(self, sid: str, context) -> None:
        if sid not in self.last_seen:
            context.abort(grpc.StatusCode.NOT_FOUND, f"session_id: {sid!r} is not started (or was reaped)")
        self.last_seen[sid] = time.monotonic()

    def _tokens(self, ids, field: str, context) -> list[int]:
        if any(t >= self.vocab for t in ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: token ids must be < {self.vocab}")
        return list(ids)

    def _reap(self) -> None:
        now = time.monotonic()
        for sid in [s for s, t in self.last_seen.items() if now - t > self.idle_s]:
            self.last_seen.pop(sid, None)
            self.drafter.stop(sid)

    def Start(self, request, context):
        if not request.session_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id: must not be empty")
        prompt = self._tokens(request.prompt_ids, "prompt_ids", context)
        with self._lock:
            self._reap()
            if request.session_id in self.last_seen:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"session_id: {request.session_id!r} already started")
            self.drafter.start(
                request.session_id, prompt, max_new_tokens=request.max_new_tokens, scope=request.scope or None
            )
            self.last_seen[request.session_id] = time.monotonic()
        return pb.DrafterAck()

    def _budget(self, ask, context) -> None:
        self._session(ask.session_id, context)
        if ask.budget > self.max_budget:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"budget: at most {self.max_budget} tokens")

    def Propose(self, request, context):
        self._budget(request, context)
        return draft_to_pb(self.drafter.propose(request.session_id, request.budget, tree=request.tree))

    def Observe(self, request, context):
        self._session(request.session_id, context)
        self.drafter.observe(request.session_id, self._tokens(request.tokens, "tokens", context))
        return pb.DrafterAck()

    def Step(self, request, context):
        """A router step in one call: its observations, then its drafts. A session not started
        here (reaped, or the service restarted) is answered ``missing`` and its observations are
        skipped, so it costs its own drafts, not its step's; a bad budget or token refuses the
        whole step before any of it is applied."""
        for o in request.observed:
            self._tokens(o.tokens, "observed.tokens", context)
        for ask in request.asks:
            if ask.budget > self.max_budget:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"asks.budget: at most {self.max_budget} tokens")
        known = self._touch({o.session_id for o in request.observed} | {a.session_id for a in request.asks})
        for o in request.observed:
            if o.session_id in known:
                self.drafter.observe(o.session_id, list(o.tokens))
        return pb.DraftBatch(
            drafts=[
                draft_to_pb(self.drafter.propose(a.session_id, a.budget, tree=a.tree))
                if a.session_id in known
                else pb.DraftMessage(missing=True)
                for a in request.asks
            ]
        )

    def _touch(self, sids: set[str]) -> set[str]:
        """The sessions of ``sids`` started here, marked as seen now."""
        now = time.monotonic()
        known = {s for s in sids if s in self.last_seen}
        for s in known:
            self.last_seen[s] = now
        return known

    def Stop(self, request, context):
        with self._lock:
            if self.last_seen.pop(request.session_id, None) is not None:
                self.drafter.stop(request.session_id)
        return pb.DrafterAck()


def build_drafter_server(drafter: SuffixDrafter, vocab_size: int, host: str, port: int, workers: int = 16):
    servicer = DrafterServicer(drafter, vocab_size)
    server, bound = build_grpc_server(
        lambda s: pb_grpc.add_DrafterServicer_to_server(servicer, s),
        [SERVICE_NAME],
        host,
        port,
        workers,
        auth_token=internal_token(),  # the internal token, when one is set
    )
    return server, servicer, bound
