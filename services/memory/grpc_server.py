"""`specmesh.v1.Memory`: the correction memory (and the suffix-cache output feed) as a service."""

from __future__ import annotations

import grpc

from services.common.grpc_server import build_grpc_server
from services.common.security import internal_token
from services.memory.wire import MAX_PAIRS, SERVICE_NAME
from specmesh.v1 import memory_pb2 as pb
from specmesh.v1 import memory_pb2_grpc as pb_grpc


class MemoryServicer(pb_grpc.MemoryServicer):
    def __init__(self, memory, vocab_size: int, publish=None):
        self.memory, self.vocab, self.publish = memory, vocab_size, publish

    def RecordPairs(self, request, context):
        if len(request.pairs) > MAX_PAIRS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pairs: at most {MAX_PAIRS} per call")
        for p in request.pairs:
            if p.draft >= self.vocab or p.target >= self.vocab or not 0 < p.count <= 1e6 or p.count != int(p.count):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"pairs: token ids < {self.vocab} and whole counts in [1, 1e6] expected",
                )
        self.memory.record((p.draft, p.target) for p in request.pairs for _ in range(int(p.count)))
        return pb.RecordPairsResponse(pairs=len(self.memory))

    def FetchSnapshot(self, request, context):
        return pb.Snapshot(
            pairs=[pb.PairCount(draft=d, target=t, count=n) for (d, t), n in self.memory.snapshot().items()]
        )

    def PublishOutput(self, request, context):
        if self.publish is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the memory service runs without Redis; start it with --redis-url to share outputs",
            )
        if any(t >= self.vocab for t in request.tokens):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"tokens: ids must be < {self.vocab}")
        self.publish(list(request.tokens))
        return pb.PublishOutputResponse()


def build_memory_server(memory, vocab_size: int, host: str, port: int, publish=None, workers: int = 16):
    servicer = MemoryServicer(memory, vocab_size, publish)
    server, bound = build_grpc_server(
        lambda s: pb_grpc.add_MemoryServicer_to_server(servicer, s),
        [SERVICE_NAME],
        host,
        port,
        workers,
        auth_token=internal_token(),  # the internal token, when one is set
    )
    return server, servicer, bound
