"""Ray Serve request router for the verifier deployment: session affinity and prefix
affinity, as the distributed router's placement does them (``services/router/affinity.py``).

- A session's later calls (cycles, close; its multiplexed id is the session id) go to the
  replica its ``open`` went to, which holds its KV cache. Serve's own multiplexed routing
  learns where an id lives only once the replica reports it, so a cycle right after an open
  could land elsewhere (and re-open the session there).
- A session's ``open`` goes to the replica that holds the longest start of its prompt in its
  prefix cache, when that replica has at most ``slack`` sessions more (as this router counts
  its own opens and closes) than the least loaded.
- Everything else (an open no replica holds, a session whose replica is gone or full) is
  routed as Serve routes by default (power of two choices).

    VerifierDeployment.options(request_router_config=RequestRouterConfig(
        request_router_class="services.ray_router:PrefixAffinityRequestRouter",
        request_router_kwargs={"slack": 2}))
"""
from __future__ import annotations

from collections import Counter

# Serve's default router (power of two choices, multiplex and locality aware) is not part of
# its public surface; it is the base every call but a placed `open` falls through to.
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from services.router.affinity import PrefixAffinity, choose
from services.verifier.core import SessionSpec


def _opened(pending_request) -> SessionSpec | None:
    """The spec of an ``open`` call, else None."""
    if pending_request is None or pending_request.metadata.call_method != "open":
        return None
    spec = pending_request.args[0] if pending_request.args else pending_request.kwargs.get("spec")
    return spec if isinstance(spec, SessionSpec) else None


class PrefixAffinityRequestRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, slack: int = 2, **kwargs) -> None:
        self.slack = slack
        self.affinity = PrefixAffinity()
        self.sessions: Counter[str] = Counter()   # replica id → sessions this router opened there
        self.placed: dict[str, str] = {}           # session id → replica id

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        sid = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        spec = _opened(pending_request)
        if spec is None and self.placed.get(sid) in by_id:
            return [[by_id[self.placed[sid]]]]
        if spec is not None and candidate_replicas:
            held = self.affinity.holders(spec.prompt_ids, spec.cache_salt)
            best = choose(list(by_id), {rid: self.sessions[rid] for rid in by_id}, held, self.slack)
            if held.get(best):
                return [[by_id[best]], [r for rid, r in by_id.items() if rid != best]]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        meta, rid = pending_request.metadata, replica_id.unique_id
        spec = _opened(pending_request)
        if spec is not None:
            self.affinity.placed(spec.prompt_ids, rid, spec.cache_salt)
            old = self.placed.get(meta.multiplexed_model_id)   # a re-open moves the session
            if old is not None and self.sessions[old] > 0:
                self.sessions[old] -= 1
            self.placed[meta.multiplexed_model_id] = rid
            self.sessions[rid] += 1
        elif meta.call_method == "close" and self.placed.pop(meta.multiplexed_model_id, None) is not None:
            self.sessions[rid] = max(0, self.sessions[rid] - 1)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.unique_id
        self.affinity.forget(rid)
        self.sessions.pop(rid, None)
        self.placed = {s: r for s, r in self.placed.items() if r != rid}
