"""``RemotePredictor``: ``YieldMLP.predict`` over `specmesh.v1.Predictor`."""

from __future__ import annotations

import numpy as np

from services.common.grpc_server import channel
from specmesh.v1 import predictor_pb2 as pb
from specmesh.v1 import predictor_pb2_grpc as pb_grpc


class RemotePredictor:
    """Drop-in for ``YieldMLP.predict`` over the network (batches go in one call)."""

    def __init__(self, addr: str, timeout_s: float = 1.0):
        self.stub = pb_grpc.PredictorStub(channel(addr))
        self.timeout_s = timeout_s

    def predict(self, phi: np.ndarray) -> np.ndarray:
        rows = np.atleast_2d(phi)
        resp = self.stub.PredictYield(
            pb.PredictYieldRequest(items=[pb.FeatureVector(values=r.tolist()) for r in rows]), timeout=self.timeout_s
        )
        return np.asarray(resp.predicted_yield, dtype=np.float32)
