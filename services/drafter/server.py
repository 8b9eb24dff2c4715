"""`specmesh.v1.Drafter`: the suffix-cache drafter as a service, and its client.

Sessions a router forgets to stop are reaped after ``idle_s`` without calls.
"""
from __future__ import annotations

import threading
import time

import grpc

from services.common.grpc_server import build_grpc_server, channel
from services.common.types import Draft
from services.drafter.base import Drafter
from services.drafter.suffix import SuffixDrafter
from specmesh.v1 import drafter_pb2 as pb
from specmesh.v1 import drafter_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name


def draft_to_pb(d: Draft) -> pb.DraftMessage:
    return pb.DraftMessage(token_ids=d.token_ids, parents=d.parents, token_probs=d.token_probs, score=d.score,
                           match_len=d.match_len, source=d.source, tree=d.features.get("tree", ""))


def draft_from_pb(m: pb.DraftMessage) -> Draft:
    return Draft(token_ids=list(m.token_ids), parents=list(m.parents), score=m.score, source=m.source,
                 match_len=m.match_len, token_probs=list(m.token_probs), features={"tree": m.tree})


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
            self.drafter.start(request.session_id, prompt, max_new_tokens=request.max_new_tokens)
            self.last_seen[request.session_id] = time.monotonic()
        return pb.DrafterAck()

    def Propose(self, request, context):
        self._session(request.session_id, context)
        if request.budget > self.max_budget:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"budget: at most {self.max_budget} tokens")
        return draft_to_pb(self.drafter.propose(request.session_id, request.budget, tree=request.tree))

    def Observe(self, request, context):
        self._session(request.session_id, context)
        self.drafter.observe(request.session_id, self._tokens(request.tokens, "tokens", context))
        return pb.DrafterAck()

    def Stop(self, request, context):
        with self._lock:
            if self.last_seen.pop(request.session_id, None) is not None:
                self.drafter.stop(request.session_id)
        return pb.DrafterAck()


def build_drafter_server(drafter: SuffixDrafter, vocab_size: int, host: str, port: int, workers: int = 16):
    servicer = DrafterServicer(drafter, vocab_size)
    server, bound = build_grpc_server(lambda s: pb_grpc.add_DrafterServicer_to_server(servicer, s), [SERVICE_NAME],
                                      host, port, workers)
    return server, servicer, bound


class RemoteDrafter(Drafter):
    """The Drafter protocol over `specmesh.v1.Drafter` (e.g. a shared suffix-cache service);
    ``tree``: it asks for speculation trees."""

    def __init__(self, addr: str, name: str = "suffix", timeout_s: float = 2.0, tree: bool = False):
        self.stub = pb_grpc.DrafterStub(channel(addr))
        self.name, self.timeout_s, self.tree = name, timeout_s, tree

    def start(self, req_id, prompt, sp=None, rng=None, max_new_tokens: int = 0) -> None:
        self.stub.Start(pb.DrafterStart(session_id=req_id, prompt_ids=prompt, max_new_tokens=max_new_tokens),
                        timeout=self.timeout_s)

    def propose(self, req_id, budget) -> Draft:
        return draft_from_pb(self.stub.Propose(pb.DrafterPropose(session_id=req_id, budget=budget, tree=self.tree),
                                               timeout=self.timeout_s))

    def verified(self, req_id, n) -> None:
        """The service keeps no per-draft state, so a cut draft needs no call."""

    def observe(self, req_id, tokens, target_states=None) -> None:
        self.stub.Observe(pb.DrafterObserve(session_id=req_id, tokens=tokens), timeout=self.timeout_s)

    def stop(self, req_id) -> None:
        self.stub.Stop(pb.DrafterStop(session_id=req_id), timeout=self.timeout_s)
