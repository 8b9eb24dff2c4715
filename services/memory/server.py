"""`specmesh.v1.Memory`: the correction memory and the suffix-cache feed behind one service,
and ``GrpcStore``, the write-behind store verifiers use to share it through this service."""
from __future__ import annotations

from collections import Counter

import grpc

from services.common.grpc_server import build_grpc_server, channel
from services.memory.correction_memory import Pair
from services.memory.write_behind import StoreUnavailable, WriteBehindMemory
from specmesh.v1 import memory_pb2 as pb
from specmesh.v1 import memory_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Memory"].full_name
MAX_PAIRS = 100_000


class MemoryServicer(pb_grpc.MemoryServicer):
    def __init__(self, memory, vocab_size: int, publish=None):
        self.memory, self.vocab, self.publish = memory, vocab_size, publish

    def RecordPairs(self, request, context):
        if len(request.pairs) > MAX_PAIRS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pairs: at most {MAX_PAIRS} per call")
        for p in request.pairs:
            if p.draft >= self.vocab or p.target >= self.vocab or not 0 < p.count <= 1e6 or p.count != int(p.count):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"pairs: token ids < {self.vocab} and whole counts in [1, 1e6] expected")
        self.memory.record((p.draft, p.target) for p in request.pairs for _ in range(int(p.count)))
        return pb.RecordPairsResponse(pairs=len(self.memory))

    def FetchSnapshot(self, request, context):
        return pb.Snapshot(pairs=[pb.PairCount(draft=d, target=t, count=n) for (d, t), n in self.memory.snapshot().items()])

    def PublishOutput(self, request, context):
        if self.publish is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "the memory service runs without Redis; start it with --redis-url to share outputs")
        if any(t >= self.vocab for t in request.tokens):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"tokens: ids must be < {self.vocab}")
        self.publish(list(request.tokens))
        return pb.PublishOutputResponse()


def build_memory_server(memory, vocab_size: int, host: str, port: int, publish=None, workers: int = 16):
    servicer = MemoryServicer(memory, vocab_size, publish)
    server, bound = build_grpc_server(lambda s: pb_grpc.add_MemoryServicer_to_server(servicer, s), [SERVICE_NAME],
                                      host, port, workers)
    return server, servicer, bound


class GrpcStore:
    """MemoryStore over the memory service (the prior is managed on the service's side)."""

    def __init__(self, addr: str, timeout_s: float = 1.0):
        self.stub = pb_grpc.MemoryStub(channel(addr))
        self.timeout_s = timeout_s

    def _call(self, fn, req):
        try:
            return fn(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise StoreUnavailable(f"memory service: {e.code().name}") from e

    def read(self) -> Counter:
        snap = self._call(self.stub.FetchSnapshot, pb.FetchSnapshotRequest())
        return Counter({(p.draft, p.target): p.count for p in snap.pairs})

    def write(self, batch: Counter) -> None:
        self._call(self.stub.RecordPairs, pb.RecordPairsRequest(
            pairs=[pb.PairCount(draft=d, target=t, count=n) for (d, t), n in batch.items()]))

    def has_prior(self) -> bool:
        return True

    def replace_prior(self, counts: dict[Pair, float]) -> None:
        raise StoreUnavailable("set the calibration prior on the memory service (specmesh calibrate --redis-url)")

    def retry_in(self) -> float:
        return 0.5


class RemoteCorrectionMemory(WriteBehindMemory):
    """The OCM a verifier shares through the memory service."""

    def __init__(self, addr: str, flush_interval_s: float = 0.5, refresh_interval_s: float = 2.0):
        super().__init__(GrpcStore(addr), flush_interval_s, refresh_interval_s)
