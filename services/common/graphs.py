"""Static steps: single-session target steps in static shapes (``Llama.forward_static``), and
on a GPU replayed from CUDA graphs, so a decode or a verification launches one graph rather
than a kernel per operation.

A graph is captured at a session's first step of each length and attention width (its cache,
step length and width fixed, positions and tokens copied into the graph's own input buffers at
every replay; the width grows by ``llama.STATIC_BUCKET`` positions), and dropped with the
session's cache. A session's graphs share one memory pool, made by its first capture and gone
with its last graph: a pool handle kept past its graphs cannot be captured into again (torch's
allocator asserts ``use_count > 0``, seen on an H200 when a second session captured into a process
pool that the first session's graphs had taken down). The outputs are copied out of the graph's
buffers, which its next replay overwrites."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from services.common.llama import KVCache, Llama

Step = tuple[torch.Tensor, list[torch.Tensor]]


class StaticSteps:
    def __init__(self, model: Llama, graphs: bool):
        """``graphs``: replay CUDA graphs (a CUDA model); else run ``forward_static`` eagerly
        (the same arithmetic, the reference the graphs are checked against)."""
        self.model, self.graphs = model, graphs
        self.captured: dict[tuple, tuple] = {}
        self.pools: dict[int, Any] = {}  # id(cache) -> the pool its graphs share

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, width: int, capture: tuple[int, ...] = ()
    ) -> Step:
        if not self.graphs:
            return self.model.forward_static(ids, positions, cache, width, capture)
        key = (id(cache), tuple(ids.shape), width, capture)
        if key not in self.captured:
            self.captured[key] = self._capture(ids, positions, cache, width, capture)
            weakref.finalize(cache, self.captured.pop, key, None)  # the session's graphs go with its cache
            if id(cache) not in self.pools:
                self.pools[id(cache)] = self.captured[key][0].pool()
                weakref.finalize(cache, self.pools.pop, id(cache), None)  # and their pool with them
        graph, static_ids, static_positions, (logits, hidden) = self.captured[key]
        static_ids.copy_(ids)
        static_positions.copy_(positions)
        graph.replay()
        return logits.clone(), [h.clone() for h in hidden]

    def _capture(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, width: int, capture: tuple[int, ...]
    ):
        static_ids, static_positions = ids.clone(), positions.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a first run outside the capture (kernels load, workspaces settle)
            self.model.forward_static(static_ids, static_positions, cache, width, capture)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pools.get(id(cache))):  # None: a new pool
            out = self.model.forward_static(static_ids, static_positions, cache, width, capture)
        return graph, static_ids, static_positions, out
