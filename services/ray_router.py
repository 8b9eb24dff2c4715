"""Ray Serve request router for the verifier deployment: session affinity and prefix
affinity, as the distributed router's placement does them (``services/common/affinity.py``).

- A session's later calls (steps, cancel, close; its multiplexed id is the session id) go to
  the replica its ``open`` went to, which holds its KV cache: the one the call names
  (``home=``, the caller learned it from the open's answer), else the one this router placed
  it on. Serve's own multiplexed routing learns where an id lives only once the replica
  reports it, so a cycle right after an open could land elsewhere (and re-open the session
  there), and a close that lands elsewhere closes nothing.
- A session's ``open`` goes to the replica that holds the longest start of its prompt in its
  prefix cache, when that replica has at most ``slack`` sessions more than the least loaded;
  else to the least loaded. Sessions are counted over every router (each ingress replica has
  its own): a verifier replica reports its open sessions (``record_routing_stats``, every
  ``request_routing_stats_period_s``), and this router adds the ones it opened and removes the
  ones it closed since (``session_loads``).
- A prefix-cache reset (``clear_prefix_cache(cleared)``) goes to a replica not in
  ``cleared`` while there is one, so a caller reaches each replica in turn; this router's
  affinity forgets what that replica held. (Another ingress replica's router learns of the
  reset only as its sessions find no cached blocks there.)
- Everything else (a session whose replica is gone) is routed as Serve routes by
  default (power of two choices).

    VerifierDeployment.options(request_router_config=RequestRouterConfig(
        request_router_class="services.ray_router:PrefixAffinityRequestRouter",
        request_router_kwargs={"slack": 2}, request_routing_stats_period_s=1.0))
"""

from __future__ import annotations

import time

# Serve's default router (power of two choices, multiplex and locality aware) is not part of
# its public surface; it is the base every call but a placed `open` falls through to.
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from services.common.affinity import PrefixAffinity, choose, session_loads, unreported
from services.common.types import SessionSpec

# Longer than a replica's report takes to arrive (its period, 1 s, plus the controller's
# broadcast): a session this router closed is left out of reports for this long, and one it
# opened that a report taken this long after does not list is gone.
REPORT_LAG_S = 10.0


def _home(pending_request) -> str:
    """The replica a session call names as the session's (``home=``), else ""."""
    if pending_request is None:
        return ""
    return str(pending_request.kwargs.get("home") or "")


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
        self.placed: dict[str, tuple[str, float]] = {}  # session id → (replica id, when), sessions this router opened
        self.closed: dict[str, float] = {}  # session id → when this router closed it

    def loads(self, by_id: dict) -> dict[str, int]:
        """Open sessions per replica, every router's (``session_loads``)."""
        now = time.monotonic()
        self.closed = {s: t for s, t in self.closed.items() if now - t < REPORT_LAG_S}
        stats = {rid: r.routing_stats for rid, r in by_id.items() if "sessions" in (r.routing_stats or {})}
        taken = {rid: (st.get("at", 0.0), st["sessions"]) for rid, st in stats.items()}
        for sid in unreported(self.placed, taken, REPORT_LAG_S):  # its close was cancelled with its stream
            del self.placed[sid]
        reported = {rid: sessions for rid, (_, sessions) in taken.items()}
        return session_loads(by_id, reported, {s: rid for s, (rid, _) in self.placed.items()}, self.closed)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        # Sorted, so that routers that see the same loads break ties the same way.
        by_id = {r.replica_id.unique_id: r for r in sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)}
        sid = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if pending_request is not None and pending_request.metadata.call_method == "clear_prefix_cache" and by_id:
            cleared = set(pending_request.args[0])
            return [[next((r for rid, r in by_id.items() if rid not in cleared), next(iter(by_id.values())))]]
        spec = _opened(pending_request)
        home = _home(pending_request) or self.placed.get(sid, ("", 0.0))[0]
        if spec is None and home in by_id:
            return [[by_id[home]]]
        if spec is None or not by_id:
            return await super().choose_replicas(candidate_replicas, pending_request)
        best = choose(
            list(by_id), self.loads(by_id), self.affinity.holders(spec.prompt_ids, spec.cache_salt), self.slack
        )
        return [[by_id[best]], [r for rid, r in by_id.items() if rid != best]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        sid, rid = pending_request.metadata.multiplexed_model_id, replica_id.unique_id
        spec = _opened(pending_request)
        if spec is not None:
            self.affinity.placed(spec.prompt_ids, rid, spec.cache_salt)
            self.placed[sid] = (rid, time.time())  # a re-open moves it; wall time, as the reports'
            self.closed.pop(sid, None)
        elif pending_request.metadata.call_method == "close" and self.placed.pop(sid, None) is not None:
            self.closed[sid] = time.monotonic()
        elif pending_request.metadata.call_method == "clear_prefix_cache":
            self.affinity.forget(rid)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.unique_id
        self.affinity.forget(rid)
        self.placed = {s: (r, t) for s, (r, t) in self.placed.items() if r != rid}
