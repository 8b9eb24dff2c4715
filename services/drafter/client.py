"""``RemoteDrafter``: the Drafter interface over `specmesh.v1.Drafter` (a shared suffix-cache service)."""

from __future__ import annotations

from services.common.grpc_server import channel
from services.common.types import Draft
from services.drafter.base import Drafter
from services.drafter.wire import draft_from_pb
from specmesh.v1 import drafter_pb2 as pb
from specmesh.v1 import drafter_pb2_grpc as pb_grpc


class RemoteDrafter(Drafter):
    """The Drafter protocol over `specmesh.v1.Drafter` (e.g. a shared suffix-cache service);
    ``tree``: it asks for speculation trees."""

    def __init__(self, addr: str, name: str = "suffix", timeout_s: float = 2.0, tree: bool = False):
        self.stub = pb_grpc.DrafterStub(channel(addr))
        self.name, self.timeout_s, self.tree = name, timeout_s, tree

    def start(self, req_id, prompt, sp=None, rng=None, max_new_tokens: int = 0) -> None:
        self.stub.Start(
            pb.DrafterStart(session_id=req_id, prompt_ids=prompt, max_new_tokens=max_new_tokens), timeout=self.timeout_s
        )

    def propose(self, req_id, budget) -> Draft:
        return draft_from_pb(
            self.stub.Propose(
                pb.DrafterPropose(session_id=req_id, budget=budget, tree=self.tree), timeout=self.timeout_s
            )
        )

    def verified(self, req_id, n) -> None:
        """The service keeps no per-draft state, so a cut draft needs no call."""

    def observe(self, req_id, tokens, target_states=None) -> None:
        self.stub.Observe(pb.DrafterObserve(session_id=req_id, tokens=tokens), timeout=self.timeout_s)

    def stop(self, req_id) -> None:
        self.stub.Stop(pb.DrafterStop(session_id=req_id), timeout=self.timeout_s)
