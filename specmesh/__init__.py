"""specmesh: generated protobuf/gRPC code for its API (``specmesh.v1``, from protos/; do not
edit), and the offline batch API, as vLLM's: ``from specmesh import LLM, SamplingParams``
(``services/router/offline.py``; imported on first use, so API clients need no torch)."""

_OFFLINE = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob")


def __getattr__(name: str):
    if name in _OFFLINE:
        from services.router import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'specmesh' has no attribute {name!r}")
