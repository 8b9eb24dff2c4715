"""`specmesh.v1.Predictor`: the HVD yield predictor as a service."""

from __future__ import annotations

import grpc
import numpy as np

from services.common.grpc_server import build_grpc_server
from services.common.security import internal_token
from services.predictor.features import FEATURES
from services.predictor.mlp import YieldMLP
from services.predictor.wire import MAX_BATCH, SERVICE_NAME
from specmesh.v1 import predictor_pb2 as pb
from specmesh.v1 import predictor_pb2_grpc as pb_grpc


class PredictorServicer(pb_grpc.PredictorServicer):
    def __init__(self, mlp: YieldMLP):
        self.mlp = mlp

    def PredictYield(self, request, context):
        n = len(request.items)
        if not 0 < n <= MAX_BATCH:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"items: send 1..{MAX_BATCH} feature vectors, got {n}")
        bad = next((i for i, it in enumerate(request.items) if len(it.values) != len(FEATURES)), None)
        if bad is not None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"items[{bad}]: expected {len(FEATURES)} values in the order {list(FEATURES)}",
            )
        phi = np.asarray([list(it.values) for it in request.items], dtype=np.float32)
        if not np.isfinite(phi).all():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "items: values must be finite numbers")
        return pb.PredictYieldResponse(predicted_yield=self.mlp.predict(phi).tolist(), features=FEATURES)


def build_predictor_server(mlp: YieldMLP, host: str, port: int, workers: int = 8):
    servicer = PredictorServicer(mlp)
    return build_grpc_server(
        lambda s: pb_grpc.add_PredictorServicer_to_server(servicer, s),
        [SERVICE_NAME],
        host,
        port,
        workers,
        auth_token=internal_token(),  # the internal token, when one is set
    )
