"""`specmesh.v1.Predictor/PredictYield` (batched) and its client; protobuf stays here."""
from __future__ import annotations


import grpc
import numpy as np

from services.common.grpc_server import build_grpc_server, channel
from services.predictor.features import FEATURES
from services.predictor.mlp import YieldMLP
from specmesh.v1 import predictor_pb2 as pb
from specmesh.v1 import predictor_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Predictor"].full_name
MAX_BATCH = 4096


class PredictorServicer(pb_grpc.PredictorServicer):
    def __init__(self, mlp: YieldMLP):
        self.mlp = mlp

    def PredictYield(self, request, context):
        n = len(request.items)
        if not 0 < n <= MAX_BATCH:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"items: send 1..{MAX_BATCH} feature vectors, got {n}")
        bad = next((i for i, it in enumerate(request.items) if len(it.values) != len(FEATURES)), None)
        if bad is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"items[{bad}]: expected {len(FEATURES)} values in the order {list(FEATURES)}")
        phi = np.asarray([list(it.values) for it in request.items], dtype=np.float32)
        if not np.isfinite(phi).all():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "items: values must be finite numbers")
        return pb.PredictYieldResponse(predicted_yield=self.mlp.predict(phi).tolist(), features=FEATURES)


def build_predictor_server(mlp: YieldMLP, host: str, port: int, workers: int = 8):
    servicer = PredictorServicer(mlp)
    return build_grpc_server(lambda s: pb_grpc.add_PredictorServicer_to_server(servicer, s), [SERVICE_NAME],
                             host, port, workers)


class RemotePredictor:
    """Drop-in for ``YieldMLP.predict`` over the network (batches go in one call)."""

    def __init__(self, addr: str, timeout_s: float = 1.0):
        self.stub = pb_grpc.PredictorStub(channel(addr))
        self.timeout_s = timeout_s

    def predict(self, phi: np.ndarray) -> np.ndarray:
        rows = np.atleast_2d(phi)
        resp = self.stub.PredictYield(pb.PredictYieldRequest(items=[pb.FeatureVector(values=r.tolist()) for r in rows]),
                                      timeout=self.timeout_s)
        return np.asarray(resp.predicted_yield, dtype=np.float32)


