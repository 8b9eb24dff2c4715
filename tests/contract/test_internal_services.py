"""Contracts of the internal services: predictor, drafter, memory (parity + every bad input)."""

import math

import grpc
import numpy as np
import pytest

from services.common.config import SuffixConfig
from services.drafter.client import RemoteDrafter
from services.drafter.grpc_server import build_drafter_server
from services.drafter.suffix import SuffixDrafter
from services.memory.client import RemoteCorrectionMemory
from services.memory.correction_memory import LocalCorrectionMemory
from services.memory.grpc_server import build_memory_server
from services.predictor.client import RemotePredictor
from services.predictor.features import FEATURES
from services.predictor.grpc_server import build_predictor_server
from services.predictor.mlp import YieldMLP
from specmesh.v1 import drafter_pb2 as dpb
from specmesh.v1 import drafter_pb2_grpc as dgrpc
from specmesh.v1 import memory_pb2 as mpb
from specmesh.v1 import memory_pb2_grpc as mgrpc
from specmesh.v1 import predictor_pb2 as ppb
from specmesh.v1 import predictor_pb2_grpc as pgrpc
from tests.conftest import corrupt_bytes

VOCAB = 8192


def started(pair):
    server, port = pair[0], pair[-1]
    server.start()
    return server, f"127.0.0.1:{port}"


def code_of(fn, *a):
    with pytest.raises(grpc.RpcError) as e:
        fn(*a, timeout=10)
    return e.value.code()


def fuzz(addr: str, method: str):
    call = grpc.insecure_channel(addr).unary_unary(
        method, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    for blob in (b"\xff\xfe\x00garbage", corrupt_bytes(48)):
        with pytest.raises(grpc.RpcError) as e:
            call(blob, timeout=10)
        assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)  # never INTERNAL


def test_predictor_batches_match_in_process_and_reject_bad_input():
    mlp = YieldMLP()
    server, addr = started(build_predictor_server(mlp, "127.0.0.1", 0))
    try:
        phi = np.random.default_rng(0).normal(size=(5, len(FEATURES))).astype(np.float32)
        assert np.allclose(RemotePredictor(addr).predict(phi), mlp.predict(phi), atol=1e-5)
        stub = pgrpc.PredictorStub(grpc.insecure_channel(addr))
        assert code_of(stub.PredictYield, ppb.PredictYieldRequest()) == grpc.StatusCode.INVALID_ARGUMENT
        short = ppb.PredictYieldRequest(items=[ppb.FeatureVector(values=[1.0, 2.0])])
        assert code_of(stub.PredictYield, short) == grpc.StatusCode.INVALID_ARGUMENT
        nan = ppb.PredictYieldRequest(items=[ppb.FeatureVector(values=[math.nan] * len(FEATURES))])
        assert code_of(stub.PredictYield, nan) == grpc.StatusCode.INVALID_ARGUMENT
        fuzz(addr, "/specmesh.v1.Predictor/PredictYield")
    finally:
        server.stop(0)


def test_drafter_service_matches_local_and_guards_sessions():
    server, servicer, port = build_drafter_server(SuffixDrafter(SuffixConfig()), VOCAB, "127.0.0.1", 0)
    server.start()
    addr = f"127.0.0.1:{port}"
    try:
        local, remote = SuffixDrafter(SuffixConfig()), RemoteDrafter(addr)
        prompt = [5, 6, 7, 8, 9, 5, 6, 7]
        for d in (local, remote):
            d.start("s", prompt)
        assert remote.propose("s", 8).token_ids == local.propose("s", 8).token_ids == [8, 9, 5]  # ≤ match_len (3)
        for d in (local, remote):
            d.observe("s", [8, 9])
        assert remote.propose("s", 8).token_ids == local.propose("s", 8).token_ids
        # a speculation tree on request: "1 2" was followed by 3 and by 5, both drafted
        branchy = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2]
        for d in (local, remote):
            d.start("t", branchy)
        tree = RemoteDrafter(addr, "suffix-tree", tree=True).propose("t", 8)
        want = local.propose("t", 8, tree=True)
        assert (tree.token_ids, tree.parents) == (want.token_ids, want.parents) and tree.is_tree
        assert not remote.propose("t", 8).is_tree
        remote.start("salted", prompt, scope="tenant-a")  # a tenant's scope reaches the service
        assert servicer.drafter.states["salted"].scope == "tenant-a" and servicer.drafter.scoped
        stub = dgrpc.DrafterStub(grpc.insecure_channel(addr))
        assert code_of(stub.Start, dpb.DrafterStart(session_id="s", prompt_ids=[1])) == grpc.StatusCode.ALREADY_EXISTS
        assert code_of(stub.Start, dpb.DrafterStart(session_id="", prompt_ids=[1])) == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            code_of(stub.Start, dpb.DrafterStart(session_id="x", prompt_ids=[VOCAB]))
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        assert code_of(stub.Propose, dpb.DrafterPropose(session_id="nope", budget=4)) == grpc.StatusCode.NOT_FOUND
        assert (
            code_of(stub.Propose, dpb.DrafterPropose(session_id="s", budget=10_000)) == grpc.StatusCode.INVALID_ARGUMENT
        )
        assert (
            code_of(stub.Observe, dpb.DrafterObserve(session_id="s", tokens=[VOCAB + 5]))
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        # a router step is one call: the observations since the last, then every session's draft
        for d in (local, remote):
            d.observe("s", [5, 6])
            d.observe("t", [1, 2])
        batch = remote.propose_batch([("s", 8), ("t", 8)])
        assert [b.token_ids for b in batch] == [local.propose("s", 8).token_ids, local.propose("t", 8).token_ids]
        # a step with a bad budget or token is refused whole: nothing of it applied
        seq = list(servicer.drafter.states["s"].seq)
        for bad in (
            dpb.DrafterStep(
                observed=[dpb.DrafterObserve(session_id="s", tokens=[7])],
                asks=[dpb.DrafterPropose(session_id="s", budget=10_000)],
            ),
            dpb.DrafterStep(
                observed=[dpb.DrafterObserve(session_id="s", tokens=[7]), dpb.DrafterObserve(tokens=[VOCAB])]
            ),
        ):
            assert (
                code_of(stub.Step, bad) == grpc.StatusCode.INVALID_ARGUMENT and servicer.drafter.states["s"].seq == seq
            )
        # a session the service does not hold costs only its own draft: answered missing, the rest served
        reply = stub.Step(
            dpb.DrafterStep(
                observed=[
                    dpb.DrafterObserve(session_id="s", tokens=[7]),
                    dpb.DrafterObserve(session_id="nope", tokens=[1]),
                ],
                asks=[dpb.DrafterPropose(session_id="nope", budget=4), dpb.DrafterPropose(session_id="s", budget=4)],
            )
        )
        assert [m.missing for m in reply.drafts] == [True, False] and servicer.drafter.states["s"].seq == seq + [7]
        local.observe("s", [7])
        assert list(reply.drafts[1].token_ids) == local.propose("s", 4).token_ids
        lost = RemoteDrafter(addr)
        assert lost.propose_batch([("nope", 4), ("s", 4)])[0].token_ids == []  # drafts nothing, fails nothing
        # what a session observed before it stops reaches the service before its Stop
        remote.observe("t", [3, 4])
        tail = servicer.drafter.states["t"].seq[-2:]
        remote.stop("t")
        assert tail == [1, 2] and list(servicer.drafter.global_cache.outputs)[-1][-2:] == (3, 4)
        remote.stop("s")
        assert "s" not in servicer.drafter.states and "s" not in servicer.last_seen
        servicer.idle_s = 0.0  # forgotten sessions are reaped on the next Start
        remote.start("forgotten", [1, 2])
        remote.start("next", [1, 2])
        assert "forgotten" not in servicer.drafter.states
        for m in ("Start", "Propose", "Observe", "Stop", "Step"):
            fuzz(addr, f"/specmesh.v1.Drafter/{m}")
    finally:
        server.stop(0)


def test_memory_service_aggregates_clients_and_rejects_bad_input():
    backing = LocalCorrectionMemory()
    server, _, port = build_memory_server(backing, VOCAB, "127.0.0.1", 0)
    server.start()
    addr = f"127.0.0.1:{port}"
    try:
        a = RemoteCorrectionMemory(addr, flush_interval_s=0.05, refresh_interval_s=0.05)
        b = RemoteCorrectionMemory(addr, flush_interval_s=0.05, refresh_interval_s=0.05)
        a.record([(3, 4)] * 2)
        b.record([(3, 4), (5, 6)])
        a.close()
        b.close()
        assert backing.lookup(3, 4) == 3 and backing.lookup(5, 6) == 1
        c = RemoteCorrectionMemory(addr)
        assert c.lookup(3, 4) == 3  # a new verifier starts from the shared counts
        c.close()
        stub = mgrpc.MemoryStub(grpc.insecure_channel(addr))
        for bad in (
            mpb.PairCount(draft=VOCAB, target=1, count=1),
            mpb.PairCount(draft=1, target=2, count=0),
            mpb.PairCount(draft=1, target=2, count=0.5),
            mpb.PairCount(draft=1, target=2, count=1e9),
        ):
            assert code_of(stub.RecordPairs, mpb.RecordPairsRequest(pairs=[bad])) == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(stub.PublishOutput, mpb.PublishOutputRequest(tokens=[1])) == grpc.StatusCode.FAILED_PRECONDITION
        for m in ("RecordPairs", "FetchSnapshot", "PublishOutput"):
            if m != "FetchSnapshot":
                fuzz(addr, f"/specmesh.v1.Memory/{m}")
    finally:
        server.stop(0)
