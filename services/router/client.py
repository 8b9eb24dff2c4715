"""The typed client of the public API (`specmesh.v1.Generation/Generate`), as `specmesh client`
uses it: TLS and a bearer token, request fields by name, failures as refusals."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from services.common.grpc_server import channel_credentials, refusal_of
from services.common.security import TLSConfig
from specmesh.v1 import generate_pb2 as pb
from specmesh.v1 import generate_pb2_grpc as pb_grpc

OPTIONAL = ("truncate_prompt_tokens", "seed")  # proto3 optional fields: left unset when None


def finish_name(reason: int) -> str:
    return pb.FinishReason.Name(reason)


class GenerateClient:
    def __init__(self, addr: str, tls: TLSConfig | None = None, token: str | None = None):
        tls = tls or TLSConfig()
        self._channel = (
            grpc.secure_channel(addr, channel_credentials(tls)) if tls.enabled else grpc.insecure_channel(addr)
        )
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = [("authorization", f"Bearer {token}")] if token else None

    def generate(
        self, fields: dict, structured: dict | None = None, timeout: float | None = None
    ) -> Iterator[pb.GenerateResponse]:
        """Stream a request's answers. ``fields``: GenerateRequest's fields by name;
        ``structured``: one of json_schema / regex / choice (a list) / json_object."""
        req = pb.GenerateRequest(**{k: v for k, v in fields.items() if k not in OPTIONAL})
        for k in OPTIONAL:
            if fields.get(k) is not None:
                setattr(req, k, fields[k])
        if structured and "choice" in structured:
            req.structured_output.choice.values.extend(structured["choice"])
        elif structured:
            req.structured_output.MergeFrom(pb.StructuredOutput(**structured))
        try:
            yield from self._stub.Generate(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise refusal_of(e, e.code().name) from e

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "GenerateClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
