"""Ray Serve application: the same components as the other topologies, as deployments.

- ``GenerationIngress``: the router, serving `specmesh.v1.Generation/Generate` and
  `grpc.health.v1.Health/Check` through Serve's gRPC proxy.
- ``VerifierDeployment``: verifier replicas (target + EAGLE-3 + draft LM + gate), with
  ``ray_actor_options.num_gpus`` from the app args and autoscaling. A session opens on the
  replica holding its prompt's start in its prefix cache (``services/ray_router.py``, within
  ``affinity_slack`` sessions of the least loaded), else where Serve routes. A router step is
  one call per replica (``step``) carrying the cycles of every session it holds, routed as the
  first of them (``multiplexed_model_id = session id``: the request router sends it to the
  replica that session's open went to); a session the replica does not hold (scale-down,
  replica death) is re-opened where Serve routes from the prompt plus the committed tokens,
  as the distributed router's failover does. A replica holds any number of sessions (its
  router closes them; one idle for ``SESSION_IDLE_S`` is closed there).
- ``PredictorDeployment``: the yield predictor, one call per router step over its cache drafts.
- ``MemoryDeployment`` (``shared_memory: true``): the correction memory every verifier replica
  shares without Redis (write-behind through a handle-backed store).
- ``DrafterDeployment`` (``remote_drafter: true``): the suffix cache as a deployment shared by
  router replicas; off by default, as it adds a hop per cycle (the router's own suffix cache
  plus the Redis feed is the default).

    serve run deploy/ray/serve.yaml          # or: import_path services.ray_app:app, args below
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
from ray import serve
from ray.serve.deployment import Deployment
from ray.serve.schema import ReplicaState

from services.common.config import OPTIONS, SERVER_OPTIONS, EngineConfig, ServerConfig
from services.common.exposition import MODEL_NAME_ENV, start_node_exporter
from services.common.types import CycleRequest, CycleResult, Session, SessionCancelled, SessionSpec
from services.drafter.base import Drafter
from services.verifier.backend import Cycles, Done, Outcome

log = logging.getLogger("specmesh.ray")

METRICS_PORT_ENV, METRICS_HOST_ENV = "SPECMESH_NODE_METRICS_PORT", "SPECMESH_NODE_METRICS_HOST"


# The deployments the router calls per cycle, per probe or per report: no access-log line per call
# (a verifier replica logged one per cycle and one per health probe, every 2 s idle or not); the
# ingress keeps its line per request, and errors are logged as they happen.
QUIET = {"enable_access_log": False}


def node_metrics() -> None:
    """Every replica offers to serve its node's specmesh_* metrics (see ``start_node_exporter``)."""
    start_node_exporter(int(os.environ.get(METRICS_PORT_ENV, "0")), os.environ.get(METRICS_HOST_ENV, "0.0.0.0"))


def deployed(cls: Any) -> Deployment:
    """A class under ``@serve.deployment``: a ``Deployment`` at run time, though Ray's typing
    keeps the class's own type."""
    return cls


class SessionMissing(RuntimeError):
    """This replica does not hold the session (routed elsewhere, or evicted)."""


# The app's own args (placement of its tiers); every other arg is an option of the tables in
# ``services/common/config.py``, as ``specmesh serve``'s flags: the engine's (OPTIONS) and the
# public server's (SERVER_OPTIONS: the ingress's max_sessions, max_queue, metrics_port, ...).
APP_ARGS = {
    "verifier_gpus",
    "verifier_replicas",
    "verifier_dtype",
    "verifier_max_sessions",
    "autoscaling",
    "cpus_per_replica",
    "shared_memory",
    "remote_drafter",
    "metrics_host",
    "affinity_slack",
    "ingress_replicas",
}
RENAMED = {
    "max_streams": "max_sessions (the ingress's Generate streams, as `specmesh serve --max-sessions`); "
    "a verifier replica's sessions are verifier_max_sessions",
}
VERIFIER_MAX_SESSIONS = 16  # sessions a verifier replica serves at once (verifier_max_sessions)


def api_token() -> str | None:
    """The API's bearer token on this node (SPECMESH_AUTH_TOKEN). Where the deployment requires
    one (SPECMESH_AUTH_REQUIRED, the chart's auth.enabled) and this node has none, the ingress
    refuses to serve rather than serve open: RuntimeError."""
    token = os.environ.get("SPECMESH_AUTH_TOKEN") or None
    if token is None and os.environ.get("SPECMESH_AUTH_REQUIRED"):
        raise RuntimeError(
            "auth: this deployment requires a bearer token (SPECMESH_AUTH_REQUIRED) but SPECMESH_AUTH_TOKEN "
            "is not set where this ingress replica runs; it will not serve without it"
        )
    return token


def server_config(args: dict) -> ServerConfig:
    """The ingress's server settings from the app's args (``ServerConfig.from_mapping``, as
    ``specmesh serve``'s flags); the bearer token from the environment, never from args."""
    return replace(
        ServerConfig.from_mapping(args),
        auth_token=api_token(),
        admin_token=os.environ.get("SPECMESH_ADMIN_TOKEN") or None,
    )


def engine_config(args: dict) -> EngineConfig:
    """The app's args as the engine's config, through the option table (``EngineConfig.from_mapping``,
    as ``specmesh serve``'s flags): the device follows ``verifier_gpus``; an arg that is neither
    the app's nor an engine option is refused, naming it."""
    from services.router.engine import METHODS

    renamed = [f"{old} is now {new}" for old, new in RENAMED.items() if old in args]
    if renamed:
        raise ValueError("; ".join(renamed))
    unknown = sorted(set(args) - APP_ARGS - set(OPTIONS) - set(SERVER_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown arg(s) {', '.join(unknown)}; the app's: {', '.join(sorted(APP_ARGS))}; "
            "the engine's and the server's: docs/configuration.md (`specmesh serve`)"
        )
    values = {k: v for k, v in args.items() if k in OPTIONS}
    gpus = float(args.get("verifier_gpus", 0))
    values.setdefault("device", "cuda" if gpus > 0 else "cpu")
    values.setdefault("dtype", args.get("verifier_dtype", "bfloat16") if gpus > 0 else "float32")
    return EngineConfig.from_mapping(values, METHODS)


def verifier_placement(cfg: EngineConfig, cpus: float, gpus: float) -> dict:
    """A tensor-parallel verifier replica's placement group: one bundle, on one node, holding the
    CPUs and the GPUs of all its ranks (the replica's actor takes them, and the rank processes it
    starts see them: a rank per GPU). On GPUs it needs one GPU per rank (``verifier_gpus``)."""
    if cfg.tensor_parallel <= 1:
        return {}
    if gpus > 0 and gpus != cfg.tensor_parallel:
        raise ValueError(
            f"tensor_parallel {cfg.tensor_parallel} with verifier_gpus {gpus:g}: a replica's ranks take "
            "one GPU each; set verifier_gpus to tensor_parallel"
        )
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {})}
    return {"placement_group_bundles": [bundle], "placement_group_strategy": "STRICT_PACK"}


class SessionTable:
    """A replica's open sessions by id; one not used for ``idle_s`` (its router gone without
    closing it) is closed at the next ``put``."""

    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self._sessions: dict[str, Any] = {}
        self._used: dict[str, float] = {}
        self._lock = threading.Lock()

    def put(self, sid: str, session) -> None:
        """Hold ``session`` as ``sid`` (closing one held under it before, and the idle ones)."""
        now = time.monotonic()
        with self._lock:
            stale = [k for k, t in self._used.items() if now - t > self.idle_s or k == sid]
            closing = [self._sessions.pop(k) for k in stale]
            for k in stale:
                del self._used[k]
            self._sessions[sid], self._used[sid] = session, now
        for old in closing:
            old.close()

    def get(self, sid: str):
        with self._lock:
            session = self._sessions.get(sid)
            if session is not None:
                self._used[sid] = time.monotonic()
            return session

    def pop(self, sid: str):
        with self._lock:
            self._used.pop(sid, None)
            return self._sessions.pop(sid, None)

    def __len__(self) -> int:
        return len(self._sessions)


@serve.deployment(logging_config=QUIET)
class MemoryDeployment:
    def __init__(self, args: dict):
        node_metrics()
        from services.verifier.core import open_memory

        self.memory = open_memory(replace(engine_config(args), memory_addr=None, ocm_snapshot=None))

    def write(self, batch: dict) -> int:
        self.memory.record(p for p, n in batch.items() for _ in range(int(n)))
        return len(self.memory)

    def read(self) -> dict:
        return self.memory.snapshot()


@serve.deployment(max_ongoing_requests=1000, logging_config=QUIET)
class AbortBoard:
    """The ingress replicas' aborts (``AbortLog``): each posts its own and long-polls for the
    others', so an abort reaches every ingress replica, wherever Serve's proxy sent it."""

    def __init__(self):
        from services.router.admission import AbortLog

        self.log = AbortLog()
        self._posted = asyncio.Event()

    async def post(self, origin: str, request_id: str | None, wall: float) -> int:
        seq = self.log.post(origin, request_id, wall)
        self._posted.set()
        self._posted.clear()
        return seq

    async def since(self, seq: int, wait_s: float = 5.0):
        """The entries after ``seq``; with none yet, waits up to ``wait_s`` for one."""
        if self.log.since(seq)[0] == seq:
            try:
                await asyncio.wait_for(self._posted.wait(), wait_s)
            except TimeoutError:
                pass
        return self.log.since(seq)


class RayMemoryStore:
    """MemoryStore over MemoryDeployment (the write-behind layer keeps the hot path local)."""

    def __init__(self, handle):
        self.handle = handle

    def read(self):
        from collections import Counter

        return Counter(self.handle.read.remote().result())

    def write(self, batch) -> None:
        self.handle.write.remote(dict(batch)).result()

    def offer_prior(self, counts) -> None:
        """The memory deployment's backend holds the prior."""

    def replace_prior(self, counts) -> None:
        raise NotImplementedError("load the calibration prior into the memory deployment's backend")

    def retry_in(self) -> float:
        return 0.5


@serve.deployment(logging_config=QUIET)
class DrafterDeployment:
    """The suffix-cache drafter as a deployment; sessions routed by multiplexed id."""

    def __init__(self, args: dict):
        from services.common.runtime import freeze_startup_heap, tune_gc
        from services.drafter.suffix import SuffixDrafter

        node_metrics()

        tune_gc()
        self.drafter = SuffixDrafter(engine_config(args).suffix)
        freeze_startup_heap()

    def start(self, prompt: list[int], max_new_tokens: int, scope: str | None = None) -> None:
        self.drafter.start(serve.get_multiplexed_model_id(), prompt, max_new_tokens=max_new_tokens, scope=scope)

    def propose(self, budget: int, tree: bool = False):
        return self.drafter.propose(serve.get_multiplexed_model_id(), budget, tree=tree)

    def observe(self, tokens: list[int]) -> None:
        self.drafter.observe(serve.get_multiplexed_model_id(), tokens)

    def stop(self) -> None:
        self.drafter.stop(serve.get_multiplexed_model_id())


class RayDrafter(Drafter):
    """The Drafter interface over DrafterDeployment; ``tree``: it asks for speculation trees."""

    def __init__(self, handle, name: str = "suffix", tree: bool = False):
        self.handle, self.name, self.tree = handle, name, tree

    def _h(self, req_id: str):
        return self.handle.options(multiplexed_model_id=req_id)

    def start(self, req_id, prompt, sp=None, rng=None, max_new_tokens: int = 0, *, scope: str | None = None) -> None:
        self._h(req_id).start.remote(list(prompt), max_new_tokens, scope).result()

    def propose(self, req_id, budget):
        return self._h(req_id).propose.remote(budget, self.tree).result()

    def observe(self, req_id, tokens, target_states=None) -> None:
        self._h(req_id).observe.remote(list(tokens)).result()

    def stop(self, req_id) -> None:
        self._h(req_id).stop.remote()


SESSION_IDLE_S = 600.0  # a replica closes a session no call has used for this long (its router is gone)


@serve.deployment(logging_config=QUIET)
class VerifierDeployment:
    def __init__(self, args: dict, memory=None):
        node_metrics()
        from services.common.runtime import tune_gc

        tune_gc()
        self.core = self.build_core(args)
        self.core.declare_capacity(int(args.get("verifier_max_sessions", VERIFIER_MAX_SESSIONS)))
        self.sessions = SessionTable(SESSION_IDLE_S)
        self._memory_handle = memory  # bound lazily: the constructor runs in the event loop
        # opens, and the threads that post a step's cycles (the batcher's stepper runs the steps)
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="verifier")
        from services.common.runtime import freeze_startup_heap

        freeze_startup_heap()

    def build_core(self, args: dict):
        """The replica's verifier core, from the app's args."""
        from transformers import AutoTokenizer

        from services.verifier.core import VerifierCore

        cfg = engine_config(args)
        eos = AutoTokenizer.from_pretrained(str(cfg.target)).eos_token_id
        return VerifierCore.from_config(cfg, eos)

    async def _in_pool(self, fn, *a):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *a)

    def _share_memory(self) -> None:
        """With a memory deployment, replace the local correction memory (first call, in a thread)."""
        if self._memory_handle is None:
            return

        from services.memory.write_behind import WriteBehindMemory

        self.core.set_memory(WriteBehindMemory(RayMemoryStore(self._memory_handle)))
        self._memory_handle = None

    def info(self) -> dict:
        return {
            "context_len": self.core.context_len,
            "vocab_size": self.core.vocab_size,
            "max_draft": dict(self.core.max_draft),
        }

    async def open(self, spec: SessionSpec) -> str:
        """Open the session here; the replica's id, where its router sends its steps."""
        await self._in_pool(self._share_memory)
        self.sessions.put(spec.session_id, await self._in_pool(self.core.open, spec))
        return serve.get_replica_context().replica_id.unique_id

    async def step(self, items: list[tuple[str, CycleRequest]], home: str = "") -> list[Outcome]:
        """One router step's cycles of the sessions held here, verified with every other
        router's (the replica's batcher): each a ``CycleResult``, or the exception that failed
        it (``SessionMissing``: not held here). ``home`` (here, on every session call) is the
        replica the caller's open went to, read only by the request router, which sends the
        call there."""
        loop = asyncio.get_running_loop()
        outcomes: list[Any] = [None] * len(items)
        waits, posts = [], []
        for i, (sid, req) in enumerate(items):
            session = self.sessions.get(sid)
            if session is None:
                outcomes[i] = SessionMissing(sid)
                continue
            answer = loop.create_future()
            waits.append((i, answer))
            posts.append((session, req, partial(_answer, loop, answer)))
        if posts:
            self.core.batcher.post_all(posts)  # queued for the batcher's stepper: the loop does not wait
        for i, answer in waits:
            outcomes[i] = await answer
        return outcomes

    def cancel(self, home: str = "") -> None:
        """The session's client went away: its cycle in flight ends with ``SessionCancelled`` at
        the verifier's next step (a prompt prefilling in chunks included)."""
        session = self.sessions.get(serve.get_multiplexed_model_id())
        if session is not None:
            session.cancel()

    async def clear_prefix_cache(self, cleared: list[str]) -> dict:
        """Forget this replica's cached prompt blocks unless it is among ``cleared`` (the
        request router sends this call to a replica not yet cleared while there is one)."""
        me = serve.get_replica_context().replica_id.unique_id
        if me in cleared:
            return {"replica": me, "cleared": False}
        await self._in_pool(self.core.clear_prefix_cache)
        return {"replica": me, "cleared": True}

    def record_routing_stats(self) -> dict:
        """For the request routers of every ingress replica: the sessions open here."""
        return {
            "sessions": list(self.core.sessions.copy()),
            "replica": serve.get_replica_context().replica_id.unique_id,
            "at": time.time(),  # when listed: a session opened after this is not absent from it
        }

    async def close(self, home: str = "") -> dict:
        """Close the session if held here and this is its ``home`` (a close meant for another
        replica, where a session re-opened here after a failover was, must not close this
        one); where the call landed and whether it closed one."""
        me = serve.get_replica_context().replica_id.unique_id
        session = self.sessions.pop(serve.get_multiplexed_model_id()) if home in ("", me) else None
        if session is not None:
            await self._in_pool(session.close)
        return {"replica": me, "closed": session is not None}


def _answer(loop: asyncio.AbstractEventLoop, answer: asyncio.Future, item) -> None:
    """A posted cycle's outcome, from the batcher's thread to the awaiting call."""
    outcome = item.error if item.error is not None else item.result
    loop.call_soon_threadsafe(answer.set_result, outcome)


MAX_REPLICAS = 1024  # a prefix-cache reset that reaches more replicas than this is looping


class RaySession:
    def __init__(self, handle, spec: SessionSpec):
        """Opened in the request's thread, in its context (Serve's request context: a client
        gone during the open cancels it); its cycles go out with the router's steps."""
        self.spec = replace(spec, session_id=spec.session_id or uuid.uuid4().hex)
        self.h = handle.options(multiplexed_model_id=self.spec.session_id)
        self.tokens = list(spec.prompt_ids)
        self.cancelled = False
        self.replica = ""  # the replica that holds it
        self._context = contextvars.copy_context()
        self._open()

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    def _open(self) -> None:
        spec = self.spec.resumed(self.tokens[len(self.spec.prompt_ids) :])
        self.replica = self._context.copy().run(self.h.open.remote, spec).result()

    def settle(self, outcome: Outcome) -> Outcome:
        """A cycle's outcome as its request sees it: the committed tokens kept (for a re-open);
        any failure of a cancelled session is its cancellation."""
        if isinstance(outcome, CycleResult):
            self.tokens.extend(outcome.committed)
        elif self.cancelled:
            return SessionCancelled(f"session {self.session_id} was cancelled")
        return outcome

    def cycle(self, req: CycleRequest) -> CycleResult:
        """One cycle alone (a step of one); a replica that does not hold the session re-opens it."""
        try:
            outcome = self.h.step.remote([(self.session_id, req)], home=self.replica).result()[0]
        except Exception as e:  # noqa: BLE001 - Ray's wrapping of the call's failure
            outcome = e
        if isinstance(outcome, SessionMissing) and not self.cancelled:
            return self.failover(req)
        return _raised(self.settle(outcome))

    def failover(self, req: CycleRequest) -> CycleResult:
        """Re-open where Serve routes (from the prompt plus the committed tokens), and cycle there."""
        try:
            old = self.replica
            self._open()
            if old and old != self.replica:  # a step that went elsewhere left it open there
                _CLOSER.submit(close_at, self.h, old)
            outcome = self.h.step.remote([(self.session_id, req)], home=self.replica).result()[0]
        except Exception as e:  # noqa: BLE001
            outcome = e
        return _raised(self.settle(outcome))

    def cancel(self) -> None:
        """The client went away (any thread): the replica stops the cycle in flight at the
        verifier's next step (``VerifierDeployment.cancel``)."""
        self.cancelled = True
        self.h.cancel.remote(home=self.replica)

    def close(self) -> None:
        """Not waited for: closed on its replica from a background thread (``close_at``)."""
        _CLOSER.submit(close_at, self.h, self.replica)


_CLOSER = ThreadPoolExecutor(4, thread_name_prefix="ray-close")
CLOSE_TRIES = 5


def close_at(handle, home: str, timeout_s: float = 60.0) -> bool:
    """Close a session (``handle`` carries its id) on ``home``, its replica. A close names its
    replica and the request router sends it there, yet Serve was seen (2 of 140 closes sent at
    once) handing one to the other replica, where it closes nothing and the session stays open
    on its own: the answer says where the call landed, and one that landed elsewhere is sent
    again, up to ``CLOSE_TRIES`` times. Whether a session was closed."""
    for _ in range(CLOSE_TRIES):
        try:
            answer = handle.close.remote(home=home).result(timeout_s=timeout_s)
        except Exception as e:  # noqa: BLE001 - its replica gone or not answering: nothing left to close
            log.warning("closing a session on replica %s failed: %s", home, e)
            return False
        if answer["closed"] or not home or answer["replica"] == home:
            return bool(answer["closed"])
    log.warning("a session's close reached other replicas than its own (%s) %d times", home, CLOSE_TRIES)
    return False


def _raised(outcome: Outcome) -> CycleResult:
    if isinstance(outcome, BaseException):
        raise outcome
    assert isinstance(outcome, CycleResult), "a step settles every cycle"
    return outcome


def verifiers_live(handle, timeout_s: float = 2.0) -> int:
    """Verifier replicas that take sessions now: 0 unless one answers ``info`` within
    ``timeout_s``; then Serve's count of the deployment's running replicas (1 when Serve's
    status cannot be read)."""
    try:
        handle.info.remote().result(timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - a timeout, no replica, a replica dying: none answers
        return 0
    try:
        status = serve.status().applications[handle.app_name]
        return max(1, status.deployments[handle.deployment_name].replica_states.get(ReplicaState.RUNNING, 0))
    except Exception:  # noqa: BLE001 - the controller busy or restarting: one answered
        return 1


class RayVerifier:
    """The router's verifier interface over the Serve deployment."""

    in_process = False  # VerifierBackend: the replicas answer each cycle later
    split_at = 64  # VerifierBackend: a Serve call's round trip is longer (bench/results/control_plane_lanes_ab/)

    def __init__(self, handle):
        self.handle = handle
        info = handle.info.remote().result()
        self.context_len, self.vocab_size, self.max_draft = info["context_len"], info["vocab_size"], info["max_draft"]
        self._pool = ThreadPoolExecutor(64, thread_name_prefix="ray-step")  # a call per replica in flight, failovers

    def step(self, cycles: Cycles, done: Done) -> None:
        """The router's step (``VerifierBackend``): one call per replica with every cycle of the
        sessions it holds; each outcome as its replica answers."""
        ours = cast(list[tuple[RaySession, CycleRequest]], cycles)  # the sessions this backend opened
        by_replica: dict[str, list[int]] = {}
        for i, (session, _) in enumerate(ours):
            by_replica.setdefault(session.replica, []).append(i)
        for idx in by_replica.values():
            self._pool.submit(self._on_replica, [ours[i] for i in idx], [partial(done, i) for i in idx])

    def lane(self, session: Session) -> str:
        """The replica that holds the session (``VerifierBackend``)."""
        return cast(RaySession, session).replica

    def _on_replica(self, cycles: list[tuple[RaySession, CycleRequest]], dones: list) -> None:
        try:
            home = cycles[0][0]
            call = home.h.step.remote([(s.session_id, r) for s, r in cycles], home=home.replica)
            outcomes: list[Outcome] = call.result()
        except Exception as e:  # noqa: BLE001 - the call failed: every cycle of it
            outcomes = [e] * len(cycles)
        for (session, req), outcome, done in zip(cycles, outcomes, dones):
            if isinstance(outcome, SessionMissing) and not session.cancelled:
                self._pool.submit(_reported, partial(session.failover, req), done)
            else:
                done(session.settle(outcome))

    def open(self, spec: SessionSpec) -> RaySession:
        return RaySession(self.handle, spec)

    def live(self, timeout_s: float = 2.0) -> int:
        return verifiers_live(self.handle, timeout_s)

    def clear_prefix_cache(self) -> None:
        """Every verifier replica forgets its cached prompt blocks: one call per replica, each
        routed to a replica not yet cleared (``PrefixAffinityRequestRouter``), until a call
        reaches one already cleared, which means none is left."""
        cleared: list[str] = []
        while len(cleared) <= MAX_REPLICAS:
            answer = self.handle.clear_prefix_cache.remote(cleared).result()
            if not answer["cleared"]:
                return
            cleared.append(answer["replica"])
        raise RuntimeError(f"prefix cache: still clearing after {MAX_REPLICAS} replicas")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reported(fn, done: Callable[[Outcome], None]) -> None:
    try:
        outcome: Outcome = fn()
    except BaseException as e:  # noqa: BLE001 - the cycle's own failure, reported to its request
        outcome = e
    done(outcome)


@serve.deployment(logging_config=QUIET)
class PredictorDeployment:
    def __init__(self, path: str):
        node_metrics()
        from services.predictor.mlp import YieldMLP

        self.mlp = YieldMLP.load(Path(path))

    def predict(self, phi: np.ndarray) -> list[float]:
        """ŷ for every row: a router step's cache drafts come in one call."""
        return self.mlp.predict(np.atleast_2d(phi)).tolist()


class RayPredictor:
    def __init__(self, handle):
        self.handle = handle

    def predict(self, phi: np.ndarray) -> np.ndarray:
        return np.asarray(self.handle.predict.remote(np.atleast_2d(phi)).result(), dtype=np.float32)


@serve.deployment
@serve.ingress()
class GenerationIngress:
    def __init__(self, verifier, predictor, args: dict, drafter=None, aborts=None):
        node_metrics()
        import threading

        from services.common.runtime import tune_gc

        tune_gc()  # the router holds the suffix trees
        from services.router.admission import ActiveSessions

        self._handles, self._args, self._drafter = (verifier, predictor), args, drafter
        cfg = server_config(args)
        self._max_sessions = cfg.max_sessions  # Generate streams; each completion a session
        self._stats = cfg.response_stats  # final messages say how they were decoded
        self._engine = None
        self._lock = threading.Lock()
        self._origin = uuid.uuid4().hex
        self._board = aborts  # AbortBoard, with more than one ingress replica
        # this replica's completions, gRPC and HTTP: what Abort reaches (and, through the board, the others')
        self._active = ActiveSessions(self._post_abort if aborts is not None else None)
        if aborts is not None:
            threading.Thread(target=self._relay_aborts, name="abort-relay", daemon=True).start()
        self._live: int | None = None  # verifier replicas live at the last probe (None: not yet probed)
        threading.Thread(target=self._follow_verifiers, name="verifier-health", daemon=True).start()

    def _follow_verifiers(self) -> None:
        """Build the engine now (the first request then finds it ready), then probe the verifier
        replicas every HEALTH_PERIOD_S: gRPC health and /health follow, and
        ``specmesh_verifiers_live``."""
        from services.common.metrics import VERIFIERS_LIVE, known_methods
        from services.router.grpc_server import HEALTH_PERIOD_S

        try:
            known_methods(self.engine.methods())
        except Exception as e:  # noqa: BLE001 - a request builds it again and answers the error
            log.warning("engine: %s", e)
        while True:
            self._live = verifiers_live(self._handles[0])
            VERIFIERS_LIVE.labels("router").set(self._live)
            time.sleep(HEALTH_PERIOD_S)

    def _serving(self) -> bool:
        return (self._live if self._live is not None else verifiers_live(self._handles[0])) > 0

    def _post_abort(self, request_id: str | None, wall: float) -> None:
        self._board.post.remote(self._origin, request_id, wall)  # not awaited: the abort answers now

    def _relay_aborts(self) -> None:
        """Apply the other ingress replicas' aborts as they come (a long poll on the board)."""
        from services.router.admission import relay

        seq, failing = 0, False
        while True:
            try:
                seq, entries = self._board.since.remote(seq).result(timeout_s=30)
                relay(entries, self._origin, self._active)
                failing = False
            except Exception as e:  # noqa: BLE001 - the board restarting, a timeout: poll again
                if not failing:
                    log.warning("abort relay: %s; retrying", e)
                failing = True
                time.sleep(1.0)

    @property
    def engine(self):
        """Built on first use, in Serve's request thread pool: the constructor runs inside the
        replica's event loop, where blocking on another deployment is not allowed."""
        with self._lock:
            if self._engine is None:
                from services.assembly import build_engine

                verifier, predictor = self._handles
                drafter = self._drafter
                self._engine = build_engine(
                    engine_config(self._args),
                    RayVerifier(verifier),
                    suffix=(lambda name, tree: RayDrafter(drafter, name, tree=tree)) if drafter is not None else None,
                    predictor=RayPredictor(predictor) if predictor is not None else None,
                )
                from services.common.runtime import freeze_startup_heap

                freeze_startup_heap()
        return self._engine

    @staticmethod
    def _authorized(grpc_context) -> None:
        from services.router.grpc_server import check_token_under_serve

        check_token_under_serve(grpc_context, api_token())

    def Abort(self, request, grpc_context):
        """The completions of a request id (or all) on this ingress replica, gRPC's and HTTP's;
        the other ingress replicas end theirs as the ``AbortBoard`` tells them."""
        from services.common.refusals import Refusal
        from services.router.grpc_server import check_admin_under_serve, refuse_under_serve
        from services.router.wire import abort_response, abort_target

        check_admin_under_serve(grpc_context, api_token(), os.environ.get("SPECMESH_ADMIN_TOKEN"))
        try:
            target = abort_target(request)
        except Refusal as e:
            refuse_under_serve(grpc_context, e)
        return abort_response(self._active.abort(target))

    async def Generate(self, request, grpc_context):
        """Server streaming, on the replica's event loop: when the client goes away Serve cancels
        this call, which cancels its completions at once (``Completions.stream``). A status set on
        grpc_context survives only if we then raise (Serve)."""
        from services.common.refusals import Refusal
        from services.router.admission import check_completions
        from services.router.grpc_server import refuse_under_serve
        from services.router.wire import final_to_pb, request_from_pb, step_to_pb

        self._authorized(grpc_context)
        engine = await asyncio.to_thread(lambda: self.engine)
        try:
            # off the event loop: validation tokenizes and compiles grammars, and admission may wait
            req = await asyncio.to_thread(request_from_pb, request, engine)
            check_completions(req.n, self._max_sessions)  # Serve counts streams, not their completions
            completions = await asyncio.to_thread(engine.generate_all, req)
            await asyncio.to_thread(completions.prepare)  # its grammar: Serve has admitted the stream
        except Refusal as e:
            refuse_under_serve(grpc_context, e)
        self._active.add(completions.gens)
        try:
            async for i, step in completions.stream():
                yield (step_to_pb(step, i) if step is not None else final_to_pb(completions.gens[i], i, self._stats))
        finally:
            self._active.remove(completions.gens)

    def __serve_build_asgi_app__(self):
        """The OpenAI-compatible HTTP API through Serve's HTTP proxy, over the same engine (built
        on a request thread at first use). Admission as for gRPC: max_sessions streams, max_queue waiting."""
        from services.router import openai_api as oa
        from services.router.admission import Admission
        from services.router.http_server import build_app

        cfg = server_config(self._args)
        template = cfg.chat_template.read_text() if cfg.chat_template else None
        return build_app(
            lambda: self.engine,
            Admission(cfg.max_sessions, cfg.max_queue),
            cfg,
            oa.served_names(cfg.served_model_name or "target"),
            template,
            active=self._active,
            live=lambda: int(self._serving()),
        )

    def Check(self, request):
        """SERVING while a verifier replica answers, NOT_SERVING while none does."""
        from services.router.grpc_server import health_status

        return health_status(self._serving())

    async def Watch(self, request, grpc_context):
        """The status now, then each change (checked every half second) until the client leaves;
        with the API token only (a stream held open), on the event loop (no thread held per stream)."""
        from services.router.grpc_server import health_status

        self._authorized(grpc_context)
        last = None
        while True:
            serving = await asyncio.to_thread(self._serving)
            if serving != last:
                yield health_status(serving)
                last = serving
            await asyncio.sleep(0.5)


def app(args: dict):
    """Application builder (``import_path: services.ray_app:app``); ``args`` from the Serve config.

    - The app's own (``APP_ARGS``): verifier_gpus, verifier_replicas, verifier_dtype,
      verifier_max_sessions (16: a verifier replica's sessions), autoscaling{min,max,target},
      cpus_per_replica, shared_memory, remote_drafter, metrics_host, affinity_slack (2: prefix
      affinity's allowance when placing a session on a verifier replica, ``services/ray_router.py``),
      ingress_replicas (1: the router tier's replicas; with more, an ``AbortBoard`` carries each
      one's aborts to the others).
    - The public server's, as ``specmesh serve``'s flags (``SERVER_OPTIONS``), for the ingress:
      max_sessions (Generate streams per ingress replica), max_queue, metrics_port,
      health_check_timeout, chat_template, served_model_name, allowed_origins, ...
    - The engine's, as ``specmesh serve``'s flags (``OPTIONS``): models_dir, redis_url,
      prefill_chunk, prefix_cache_mb, max_model_len, ...

    Metrics: every replica process writes to a per-application multiprocess directory on its
    node, and one replica per node serves the node's sum on ``metrics_port`` (default 9400).
    """
    from services.router import openai_api as oa

    cfg, scfg = engine_config(args), server_config(args)
    cpus = float(args.get("cpus_per_replica", 1))
    env = {
        "env_vars": {
            "PROMETHEUS_MULTIPROC_DIR": f"/tmp/specmesh_metrics/{uuid.uuid4().hex[:12]}",
            METRICS_PORT_ENV: str(scfg.metrics_port),
            METRICS_HOST_ENV: str(args.get("metrics_host", "0.0.0.0")),
            MODEL_NAME_ENV: oa.served_names(scfg.served_model_name or "target")[0],
        }
    }

    def actor(num_cpus: float, num_gpus: float = 0.0) -> dict:
        return {"num_cpus": num_cpus, "num_gpus": num_gpus, "runtime_env": env}

    auto = args.get("autoscaling")
    scaling: dict[str, Any] = (
        {
            "autoscaling_config": {
                "min_replicas": auto["min_replicas"],
                "max_replicas": auto["max_replicas"],
                "target_ongoing_requests": auto["target_ongoing_requests"],
            }
        }
        if auto
        else {"num_replicas": int(args.get("verifier_replicas", 1))}
    )
    small = actor(min(cpus, 0.5))
    memory = (
        deployed(MemoryDeployment).options(ray_actor_options=small).bind(args) if args.get("shared_memory") else None
    )
    drafter = (
        deployed(DrafterDeployment).options(ray_actor_options=small).bind(args) if args.get("remote_drafter") else None
    )
    # A session's open goes to the replica holding its prompt's start (services/ray_router.py).
    # Each replica reports its open sessions every second, for the routers of every ingress replica.
    routing = {  # RequestRouterConfig's fields
        "request_router_class": "services.ray_router:PrefixAffinityRequestRouter",
        "request_router_kwargs": {"slack": int(args.get("affinity_slack", 2))},
        "request_routing_stats_period_s": 1.0,
    }
    verifier = (
        deployed(VerifierDeployment)
        .options(
            ray_actor_options=actor(cpus, float(args.get("verifier_gpus", 0))),
            max_ongoing_requests=int(args.get("verifier_max_sessions", VERIFIER_MAX_SESSIONS)) * 4,
            request_router_config=routing,
            **verifier_placement(cfg, cpus, float(args.get("verifier_gpus", 0))),
            **scaling,
        )
        .bind(args, memory)
    )
    predictor = None
    if cfg.predictor and (Path(cfg.predictor) / "config.json").exists():
        predictor = (
            deployed(PredictorDeployment).options(ray_actor_options=actor(min(cpus, 0.5))).bind(str(cfg.predictor))
        )
    # Admission as in the other topologies: max_sessions Generate streams per ingress replica (each
    # holds one of Serve's sync-method threads), max_queue waiting; beyond that Serve's
    # back-pressure answers RESOURCE_EXHAUSTED.
    ingress = int(args.get("ingress_replicas", 1))
    aborts = deployed(AbortBoard).options(ray_actor_options={"num_cpus": 0}).bind() if ingress > 1 else None
    return (
        deployed(GenerationIngress)
        .options(
            num_replicas=ingress,
            ray_actor_options=actor(cpus),
            max_ongoing_requests=scfg.max_sessions,
            max_queued_requests=scfg.max_queue,
        )
        .bind(verifier, predictor, args, drafter, aborts)
    )
