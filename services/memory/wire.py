"""The memory service's protobuf edge: its service name and limits."""

from __future__ import annotations

from specmesh.v1 import memory_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Memory"].full_name
MAX_PAIRS = 100_000
