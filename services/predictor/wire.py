"""The predictor service's protobuf edge: its service name and limits."""

from __future__ import annotations

from specmesh.v1 import predictor_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Predictor"].full_name
MAX_BATCH = 4096
