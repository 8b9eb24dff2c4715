"""Refusals: why a request is not served, as plain values. Admission and validation raise or
return these; each edge maps them to its own code (gRPC status in ``common/grpc_server.py``,
HTTP status in ``router/http_server.py``), so no algorithm knows a transport."""

from __future__ import annotations


class Refusal(Exception):
    """A request refused; ``str()`` says what to fix or when to retry."""


class Invalid(Refusal, ValueError):
    """A field is wrong (gRPC INVALID_ARGUMENT, HTTP 400)."""


class Overloaded(Refusal):
    """No capacity now; retry later (RESOURCE_EXHAUSTED, 429)."""


class Unavailable(Refusal):
    """The service cannot serve at all now: shutting down, no live replica (UNAVAILABLE, 503)."""


class DeadlineExceeded(Refusal):
    """The client's deadline passed before it was served (DEADLINE_EXCEEDED, 504)."""


class Cancelled(Refusal):
    """The client went away while it waited (CANCELLED, 499)."""
