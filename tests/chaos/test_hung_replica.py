"""A verifier replica that stops answering (SIGSTOP) mid-stream: its sessions move to another
replica with every token so far, identical to vanilla greedy; it is left out of placement while
stopped and comes back once it answers again. An idle link to a stopped replica is dropped by
keepalive."""

import signal
import time

import pytest
from prometheus_client import REGISTRY

from services.router.engine import GenerationRequest
from services.verifier.client import ReplicaLink
from services.verifier.watch import ReplicaWatch
from specmesh.v1 import generate_pb2 as gpb
from tests.fleet import router, start_verifier, stop, stream_ids

PROMPT = "def add(a, b):\n"


def failovers(stage: str) -> float:
    return REGISTRY.get_sample_value("specmesh_verifier_failovers_total", {"stage": stage}) or 0.0


def until(cond, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.1)
    return cond()


@pytest.mark.parametrize("link", [True, False], ids=["link", "stream"])
def test_a_stopped_replica_is_failed_over_and_comes_back_when_it_answers(tiny_dirs, tiny_engine, link):
    stopped, addr_stopped = start_verifier(tiny_dirs, delay_ms=40)
    other, addr_other = start_verifier(tiny_dirs)
    watch = ReplicaWatch(floor_s=1.0, first_quarantine_s=1.0)
    engine, server, _, stub = router(tiny_dirs, [addr_stopped, addr_other], link=link, watch=watch)
    pool = engine.verifier
    ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode(PROMPT), 60, method="vanilla")).result()
    try:
        pool.load[addr_other] = 100  # steer the session to the replica about to stop
        hangs = failovers("hang")
        call = stub.Generate(gpb.GenerateRequest(prompt=PROMPT, max_new_tokens=60, method="sd"), timeout=120)
        ids = list(next(call).token_ids)
        stopped.send_signal(signal.SIGSTOP)
        final = None
        for m in call:
            ids += m.token_ids
            final = m
        assert ids == ref["token_ids"] and final.finish_reason == gpb.FINISH_REASON_LENGTH
        assert failovers("hang") == hangs + 1
        # while stopped, health probes keep it out: new sessions go to the other replica
        assert until(lambda: pool.live() == 1 and not watch.usable(addr_stopped), 10)
        assert stream_ids(stub, PROMPT, 20, "sd") == ref["token_ids"][:20]
        stopped.send_signal(signal.SIGCONT)
        assert until(lambda: pool.live() == 2 and watch.usable(addr_stopped), 60)
        assert pool.pick(set()) == addr_stopped  # back in placement (the other is steered away)
        assert stream_ids(stub, PROMPT, 60, "sd") == ref["token_ids"]
        assert failovers("hang") == hangs + 1
    finally:
        stopped.send_signal(signal.SIGCONT)
        server.stop(0)
        engine.close()
        stop([stopped, other])


def test_keepalive_drops_an_idle_link_to_a_stopped_replica(tiny_dirs):
    """No cycle in flight, so no budget runs out: the channel's keepalive ping goes unanswered
    and the link breaks (within keepalive time + timeout: 10 + 5 s), so the next session on it
    re-opens rather than waiting on a dead connection."""
    from services.common.grpc_server import channel
    from specmesh.v1 import verifier_pb2_grpc as pb_grpc

    proc, addr = start_verifier(tiny_dirs)
    ch = channel(addr)
    link = ReplicaLink(pb_grpc.VerifierStub(ch), addr)
    try:
        time.sleep(0.5)
        assert link.broken is None
        proc.send_signal(signal.SIGSTOP)
        assert until(lambda: link.broken is not None, 30)
        assert link.broken.code().name == "UNAVAILABLE"
    finally:
        proc.send_signal(signal.SIGCONT)
        link.shut()
        ch.close()
        stop([proc])


@pytest.mark.parametrize("method", ["sd", "hybrid"])
def test_a_seeded_sampled_stream_is_vanillas_own_across_a_failover(tiny_dirs, tiny_engine, method):
    """Seeded draws are keyed by output position, so a session re-opened on another replica
    after a kill -9 draws what the first would have: the stream equals vanilla's seeded one."""
    from services.common.types import Sampling

    dying, addr_dying = start_verifier(tiny_dirs, delay_ms=40)
    other, addr_other = start_verifier(tiny_dirs)
    engine, server, _, stub = router(tiny_dirs, [addr_dying, addr_other])
    sp = Sampling(temperature=0.8, top_p=0.95, seed=7)
    ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode(PROMPT), 60, sp, method="vanilla")).result()
    try:
        engine.verifier.load[addr_other] = 100
        req = gpb.GenerateRequest(prompt=PROMPT, max_new_tokens=60, method=method, temperature=0.8, top_p=0.95, seed=7)
        call = stub.Generate(req, timeout=120)
        ids = list(next(call).token_ids)
        dying.kill()
        for m in call:
            ids += m.token_ids
        assert ids == ref["token_ids"]
    finally:
        server.stop(0)
        engine.close()
        stop([dying, other])


def test_a_verifier_with_an_internal_token_serves_only_peers_that_send_it(
    tiny_dirs, tiny_engine, tmp_path, monkeypatch
):
    """Internal services require the internal token (SPECMESH_INTERNAL_TOKEN_FILE) as a bearer
    token: a peer without it is UNAUTHENTICATED, health probes stay open, and the router, whose
    channels send it, generates as before."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.security import INTERNAL_TOKEN_ENV
    from specmesh.v1 import verifier_pb2 as vpb
    from specmesh.v1 import verifier_pb2_grpc as vgrpc

    secret = tmp_path / "internal-token"
    secret.write_text("s3cret-internal\n")
    proc, addr = start_verifier(tiny_dirs, env={INTERNAL_TOKEN_ENV: str(secret)})
    try:
        with grpc.insecure_channel(addr) as ch:
            with pytest.raises(grpc.RpcError) as e:
                vgrpc.VerifierStub(ch).Info(vpb.InfoRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        monkeypatch.setenv(INTERNAL_TOKEN_ENV, str(secret))
        engine, server, _, stub = router(tiny_dirs, [addr])
        try:
            ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode(PROMPT), 20, method="vanilla")).result()
            assert stream_ids(stub, PROMPT, 20, "sd") == ref["token_ids"]
        finally:
            server.stop(0)
            engine.close()
    finally:
        stop([proc])


def test_a_tensor_parallel_replica_that_loses_a_rank_is_failed_over_and_stops(tiny_dirs, tiny_engine):
    """A replica split over two processes (--tensor-parallel 2) whose worker rank is killed
    mid-stream: the leader's next step finds the group broken, the replica stops as a dead one
    would, and its session moves to another replica with every token so far, identical to
    vanilla greedy."""
    import os
    import subprocess

    split, addr_split = start_verifier(tiny_dirs, delay_ms=40, env={"SPECMESH_TENSOR_PARALLEL": "2"})
    other, addr_other = start_verifier(tiny_dirs)
    engine, server, _, stub = router(tiny_dirs, [addr_split, addr_other])
    ref = tiny_engine.generate(GenerationRequest(tiny_engine.encode(PROMPT), 60, method="vanilla")).result()
    try:
        workers = subprocess.run(["pgrep", "-P", str(split.pid), "-f", "spawn_main"], capture_output=True, text=True)
        (worker,) = [int(p) for p in workers.stdout.split()]  # the replica's one worker rank
        engine.verifier.load[addr_other] = 100
        call = stub.Generate(gpb.GenerateRequest(prompt=PROMPT, max_new_tokens=60, method="sd"), timeout=120)
        ids = list(next(call).token_ids)
        os.kill(worker, signal.SIGKILL)
        for m in call:
            ids += m.token_ids
        assert ids == ref["token_ids"]
        assert until(lambda: split.poll() is not None, 30)  # the broken replica stopped
        assert b"a rank is lost" in split.stderr.read()
    finally:
        server.stop(0)
        engine.close()
        stop([split, other])
