"""``RemoteDrafter``: the Drafter interface over `specmesh.v1.Drafter` (a shared suffix-cache service)."""

from __future__ import annotations

import logging
import threading

from services.common.grpc_server import channel
from services.common.types import Draft
from services.drafter.base import Drafter
from services.drafter.wire import draft_from_pb
from specmesh.v1 import drafter_pb2 as pb
from specmesh.v1 import drafter_pb2_grpc as pb_grpc

log = logging.getLogger("specmesh.drafter")


class RemoteDrafter(Drafter):
    """The Drafter protocol over `specmesh.v1.Drafter` (e.g. a shared suffix-cache service);
    ``tree``: it asks for speculation trees. A router step is one call (``Step``): what the
    sessions observed since the last one goes with the step's drafts, and whatever a session
    observed before it stops goes before its ``Stop``."""

    def __init__(self, addr: str, name: str = "suffix", timeout_s: float = 2.0, tree: bool = False):
        self.stub = pb_grpc.DrafterStub(channel(addr))
        self.name, self.timeout_s, self.tree = name, timeout_s, tree
        self._observed: list[pb.DrafterObserve] = []
        self._missing: set[str] = set()  # sessions the service answered missing (said once each)
        self._lock = threading.Lock()

    def _take_observed(self) -> list[pb.DrafterObserve]:
        with self._lock:
            observed, self._observed = self._observed, []
        return observed

    def start(self, req_id, prompt, sp=None, rng=None, max_new_tokens: int = 0, *, scope: str | None = None) -> None:
        self.stub.Start(
            pb.DrafterStart(session_id=req_id, prompt_ids=prompt, max_new_tokens=max_new_tokens, scope=scope or ""),
            timeout=self.timeout_s,
        )

    def propose(self, req_id, budget) -> Draft:
        return self.propose_batch([(req_id, budget)])[0]

    def propose_batch(self, asks: list[tuple[str, int]]) -> list[Draft]:
        """The step's drafts; a session the service does not hold (reaped, or the service
        restarted) drafts nothing from then on, and says so once."""
        asked = [pb.DrafterPropose(session_id=r, budget=b, tree=self.tree) for r, b in asks]
        reply = self.stub.Step(pb.DrafterStep(observed=self._take_observed(), asks=asked), timeout=self.timeout_s)
        drafts = []
        for (req_id, _), m in zip(asks, reply.drafts):
            if m.missing and req_id not in self._missing:
                self._missing.add(req_id)
                log.warning("drafter service: session %s is not held there; it decodes without suffix drafts", req_id)
            drafts.append(Draft.empty() if m.missing else draft_from_pb(m))
        return drafts

    def verified(self, req_id, n) -> None:
        """The service keeps no per-draft state, so a cut draft needs no call."""

    def observe(self, req_id, tokens, target_states=None) -> None:
        """Sent with the next step (or before the session's stop)."""
        with self._lock:
            self._observed.append(pb.DrafterObserve(session_id=req_id, tokens=tokens))

    def stop(self, req_id) -> None:
        if observed := self._take_observed():
            self.stub.Step(pb.DrafterStep(observed=observed), timeout=self.timeout_s)
        self._missing.discard(req_id)
        self.stub.Stop(pb.DrafterStop(session_id=req_id), timeout=self.timeout_s)
