"""A tensor-parallel verifier replica: one leader process and N − 1 worker processes, each with
its shard of the target (``services/common/tensor_parallel.py``) and a ``TargetRunner`` of its own.

The leader is rank 0 and the replica's runner (``ShardedRunner``): before each call the verifier
makes on it (open a session, a step, a commit, a prefix-cache attach or reset, a close, static
steps on), it sends the call to the workers, which make it on their shards with their own copies
of the sessions. So every rank runs the same forwards in the same order, their collectives meet,
and each rank's K/V caches, rollback and prefix cache stay in step with the leader's without ever
being sent. The logits and captured states come out whole on every rank; the leader's answer the
verifier.

A worker that dies breaks the group: the leader's next call raises, the replica's cycles fail and
the router fails its sessions over as for a dead replica. The workers exit with the leader.
Transport: torch.distributed, gloo on the CPU and NCCL between GPUs (rank r on ``cuda:r`` of the
devices the pod or the Ray placement group gives the replica). No gRPC, Redis or Ray here.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.prefix_cache import ROOT, PrefixCache
from services.common.runtime import free_port
from services.common.types import Verdict
from services.verifier.runner import TargetRunner, TargetSession

log = logging.getLogger("specmesh.verifier")

TIMEOUT = timedelta(seconds=60)  # a collective that waits longer on a dead peer fails


def backend(device: str) -> str:
    """The collectives' transport for a replica on ``device``."""
    return "nccl" if device.startswith("cuda") else "gloo"


class ShardedRunner(TargetRunner):
    """The leader's runner: every call is sent to the workers, then made here (rank 0). One call
    at a time, from any thread (sessions open on request threads while the scheduler steps): a
    call's send and its own work hold one lock, so the workers make the calls in the leader's
    order and no two broadcasts interleave on the group."""

    def __init__(self, model, world: int, workers: list):
        self.world, self.workers = world, workers
        self._lock = threading.RLock()
        self._sids = itertools.count()
        self._prefix: PrefixCache | None = None
        self.on_broken: Callable[[], None] | None = None  # a verifier server: stop, so it is failed over
        self.broken: str | None = None
        super().__init__(model)

    def _send(self, *call: Any) -> None:
        self._guarded(dist.broadcast_object_list, [call], src=0)

    def _guarded(self, fn, *args, **kwargs):
        """``fn`` over the group; a lost rank breaks the replica for good: it says so once and,
        as a server, stops (``on_broken``) so that its sessions fail over and it is restarted."""
        if self.broken:
            raise RuntimeError(f"tensor-parallel replica broken: {self.broken}")
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            self.broken = str(e).splitlines()[0][:200]
            log.error("tensor-parallel replica: a rank is lost (%s); this replica stops", self.broken)
            if self.on_broken is not None:
                self.on_broken()
            raise

    @property  # type: ignore[override]
    def prefix(self) -> PrefixCache | None:
        return self._prefix

    @prefix.setter
    def prefix(self, cache: PrefixCache | None) -> None:
        """Every rank keeps a prefix cache of the same block size and budget (of its own shard's K/V)."""
        with self._lock:
            self._send("prefix", None if cache is None else (cache.block, cache.budget))
            self._prefix = cache

    def use_static_steps(self, graphs: bool) -> None:
        """Every rank's single-session steps take the static path (each rank decides it from the
        same step, so their collectives meet); on GPUs each rank captures its own graphs."""
        with self._lock:
            self._send("static", graphs)
            super().use_static_steps(graphs)

    def open(self, prompt, capacity, root=ROOT, prompt_top=None) -> TargetSession:
        with self._lock:
            st = super().open(prompt, capacity, root, prompt_top)
            st.sid = next(self._sids)
            self._send("open", st.sid, list(prompt), capacity, root, prompt_top)
            return st

    def step(self, verify, prefill, trees=None, gates=None):
        model = self.model
        with self._lock:
            self._send(
                "step",
                [(st.sid, list(d)) for st, d in verify],
                [(st.sid, n) for st, n in prefill],
                trees,
                gates,
                self.capture_layers,
                model.batch_invariant,
            )
            return self._guarded(super().step, verify, prefill, trees, gates)

    def commit(self, st: TargetSession, verdict: Verdict, states: torch.Tensor | None = None) -> None:
        with self._lock:
            # a tensor travels through the host: a pickled CUDA tensor would unpickle on the leader's device
            self._send("commit", st.sid, verdict, None if states is None else states.cpu())
            super().commit(st, verdict, states)

    def attach(self, st: TargetSession):
        with self._lock:
            self._send("attach", st.sid)
            return super().attach(st)

    def clear_prefix(self) -> None:
        with self._lock:
            self._send("clear_prefix")
            super().clear_prefix()

    def close(self, st: TargetSession) -> None:
        with self._lock:
            self._send("close", st.sid)

    def shutdown(self) -> None:
        """Stop the workers and leave the group."""
        try:
            with self._lock:
                self._send("stop")
        except RuntimeError:  # a worker already gone
            pass
        for p in self.workers:
            p.join(timeout=10)
        dist.destroy_process_group()


def serve_calls(runner: TargetRunner) -> None:
    """A worker: make each call the leader sends on this rank's runner until it says stop."""
    sessions: dict[int, TargetSession] = {}
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        op, *a = box[0]
        if op == "stop":
            return
        if op == "open":
            sid, prompt, capacity, root, top = a
            sessions[sid] = runner.open(prompt, capacity, root, top)
        elif op == "step":
            verify, prefill, trees, gates, runner.capture_layers, runner.model.batch_invariant = a
            runner.step([(sessions[s], d) for s, d in verify], [(sessions[s], n) for s, n in prefill], trees, gates)
        elif op == "commit":
            states = None if a[2] is None else a[2].to(runner.model.norm.weight.device)
            runner.commit(sessions[a[0]], a[1], states)
        elif op == "attach":
            runner.attach(sessions[a[0]])
        elif op == "clear_prefix":
            runner.clear_prefix()
        elif op == "close":
            sessions.pop(a[0], None)
        elif op == "prefix":
            runner.prefix = None if a[0] is None else PrefixCache(*a[0])
        elif op == "static":
            runner.use_static_steps(a[0])


def _join(rank: int, world: int, port: int, device: str) -> None:
    """Join the replica's group as ``rank`` (on GPUs, on device ``cuda:rank``)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )


def _worker(rank: int, world: int, port: int, load, device: str, threads: int) -> None:
    torch.set_num_threads(threads)
    _join(rank, world, port, device)
    try:
        serve_calls(TargetRunner(load(rank, world)))
    except RuntimeError as e:  # the leader is gone
        log.warning("tensor-parallel rank %d: %s; exiting", rank, e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start(world: int, load, device: str = "cpu") -> ShardedRunner:
    """A replica's ``world`` ranks: workers 1..world−1 in processes of their own, this process the
    leader. ``load(rank, world)`` returns a rank's model, sharded, on its device (a picklable
    function). On ``cuda`` the replica needs ``world`` visible GPUs."""
    if device.startswith("cuda") and torch.cuda.device_count() < world:
        raise ValueError(
            f"tensor_parallel {world} on {device}: {torch.cuda.device_count()} GPUs visible; a replica's "
            "ranks take one GPU each (give its pod or Ray placement group that many)"
        )
    port = free_port()
    ctx = mp.get_context("spawn")
    # each rank computes with the leader's torch threads: a spawned process would take every core,
    # and ranks whose idle threads spin on cores another rank needs wait on each other's collectives
    threads = torch.get_num_threads()
    workers = [
        ctx.Process(target=_worker, args=(r, world, port, load, device, threads), daemon=True) for r in range(1, world)
    ]
    for p in workers:
        p.start()
    _join(0, world, port, device)
    return ShardedRunner(load(0, world), world, workers)
