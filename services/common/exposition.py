"""Where the metrics are served beyond one process: a Ray node's sum over its replica processes
(``PROMETHEUS_MULTIPROC_DIR``), with vLLM's names read from the same sums."""

from __future__ import annotations

import os

MODEL_NAME_ENV = "SPECMESH_SERVED_MODEL_NAME"  # the model_name of a node's vLLM-named metrics


def node_registry():
    """The sum over every process of this node's ``PROMETHEUS_MULTIPROC_DIR``, specmesh's names and
    vLLM's (read from the same sums, ``model_name`` from ``SPECMESH_SERVED_MODEL_NAME``)."""
    from prometheus_client import CollectorRegistry, multiprocess

    from services.common.vllm_metrics import VllmNames

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    sums = multiprocess.MultiProcessCollector(None)
    registry.register(VllmNames(os.environ.get(MODEL_NAME_ENV, "target"), families=sums.collect))
    return registry


def start_node_exporter(port: int, host: str = "0.0.0.0", retry_s: float = 10.0) -> bool:
    """Serve the sum over every process of this node's ``PROMETHEUS_MULTIPROC_DIR`` on ``port``
    (``node_registry``).

    Rule: every replica calls it; whichever binds the port first serves, the others retry
    every ``retry_s`` so the endpoint outlives the replica serving it. A process that exits
    marks itself dead, so live-mode gauges drop its values. Returns False without the
    multiprocess directory (nothing to aggregate) or without a port.
    """
    import atexit
    import threading
    import time

    from prometheus_client import multiprocess, start_http_server

    if not port or not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return False
    atexit.register(multiprocess.mark_process_dead, os.getpid())
    registry = node_registry()

    def bind() -> None:
        while True:
            try:
                start_http_server(port, addr=host, registry=registry)
                return
            except OSError:
                time.sleep(retry_s)

    threading.Thread(target=bind, daemon=True, name="specmesh-node-metrics").start()
    return True
