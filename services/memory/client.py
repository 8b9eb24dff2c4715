"""The correction memory over `specmesh.v1.Memory`: a store for ``WriteBehindMemory``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import grpc

from services.common.grpc_server import channel
from services.memory.correction_memory import Pair
from services.memory.write_behind import StoreUnavailable, WriteBehindMemory
from specmesh.v1 import memory_pb2 as pb
from specmesh.v1 import memory_pb2_grpc as pb_grpc


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
        self._call(
            self.stub.RecordPairs,
            pb.RecordPairsRequest(pairs=[pb.PairCount(draft=d, target=t, count=n) for (d, t), n in batch.items()]),
        )

    def offer_prior(self, counts: dict[Pair, float]) -> None:
        """The memory service holds the prior (its own store installs it)."""

    def replace_prior(self, counts: dict[Pair, float]) -> None:
        raise StoreUnavailable(
            "set the calibration prior on the memory service (python -m training calibrate --redis-url)"
        )

    def retry_in(self) -> float:
        return 0.5


class RemoteCorrectionMemory(WriteBehindMemory):
    """The OCM a verifier shares through the memory service."""

    def __init__(
        self, addr: str, flush_interval_s: float = 0.5, refresh_interval_s: float = 2.0, spill_dir: Path | None = None
    ):
        super().__init__(GrpcStore(addr), flush_interval_s, refresh_interval_s, spill_dir=spill_dir)
