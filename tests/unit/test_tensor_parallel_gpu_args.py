"""What a tensor-parallel replica does on GPUs that a CPU can check: the ranks talk over NCCL, rank
r loads its shard on cuda:r, and a replica that sees fewer GPUs than ranks is refused before it
starts a process (the NCCL path itself runs only on a multi-GPU machine)."""

from dataclasses import replace

import pytest
import torch

from services.common.config import EngineConfig
from services.verifier import core, sharded


def test_ranks_talk_nccl_on_gpus_and_gloo_on_the_cpu():
    assert sharded.backend("cuda") == "nccl" and sharded.backend("cuda:0") == "nccl"
    assert sharded.backend("cpu") == "gloo"


def test_rank_r_loads_its_shard_on_cuda_r(monkeypatch):
    seen = []
    monkeypatch.setattr(core, "_load", lambda path, cfg, rank=0, world=1: seen.append((cfg.device, rank, world)))
    core._load_shard(replace(EngineConfig(), device="cuda"), 2, 4)
    core._load_shard(replace(EngineConfig(), device="cpu"), 1, 2)
    assert seen == [("cuda:2", 2, 4), ("cpu", 1, 2)]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs: the refusal cannot show")
def test_a_replica_seeing_fewer_gpus_than_ranks_is_refused_before_starting():
    with pytest.raises(
        ValueError, match="tensor_parallel 2 on cuda: .* GPUs visible; a replica's ranks take one GPU each"
    ):
        sharded.start(2, lambda rank, world: None, "cuda")


def test_a_worker_turns_static_steps_on_as_the_leader_does(monkeypatch):
    """With `--static-steps` every rank takes the static path for the same steps: on GPUs the
    leader's graph capture runs its forward (and its all-reduces) to warm up, which a worker on
    the eager path would not meet. The leader sends it (``use_static_steps``) and a worker makes it
    on its runner, with the leader's choice of graphs."""
    calls = iter([("static", True), ("stop",)])
    monkeypatch.setattr(sharded.dist, "broadcast_object_list", lambda box, src: box.__setitem__(0, next(calls)))
    seen = []

    class Runner:
        def use_static_steps(self, graphs: bool) -> None:
            seen.append(graphs)

    sharded.serve_calls(Runner())  # type: ignore[arg-type]
    assert seen == [True]
