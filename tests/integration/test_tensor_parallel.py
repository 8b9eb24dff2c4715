"""Tensor-parallel shards of our Llama forward (services/common/tensor_parallel.py), run as N
gloo processes against the same model on one process: logits within float32 rounding and the
same greedy tokens, for a whole sequence, a cached prefill and decode, and a ragged step with a
token tree; GQA with fewer KV heads than ranks replicates them."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.llama import Llama
from services.common.runtime import free_port
from services.common.tensor_parallel import shard, split_check
from tests.conftest import make_tiny

TOL = 1e-4  # float32: the all-reduce adds the ranks' partial sums in another order than one GEMM


def outputs(model: Llama) -> list[torch.Tensor]:
    """The forwards a verifier runs, on fixed inputs: logits of each."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.s.vocab, (2, 12))
    out = [model.forward_train(ids)]
    cache = model.new_cache(1, 32)
    prefill, _ = model(ids[:1, :8], 0, cache)
    step, _ = model(ids[:1, 8:9], 8, cache)
    out += [prefill, step]
    caches = [model.new_cache(1, 32), model.new_cache(1, 32)]
    rows, _ = model.forward_ragged([ids[0, :6].tolist(), ids[1, :9].tolist()], [0, 0], caches)
    tree, _ = model.forward_ragged(
        [ids[0, 6:10].tolist(), ids[1, 9:10].tolist()], [6, 9], caches, tails=[4, 1], trees=[[-1, 0, 0, 1], None]
    )
    return out + rows + tree


def rank_main(rank: int, world: int, port: int, path: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        whole = [t.detach() for t in outputs(Llama.from_pretrained(path))]
        model = shard(Llama.from_pretrained(path), rank, world)
        parts = [t.detach() for t in outputs(model)]
        diff = max(float((a - b).abs().max()) for a, b in zip(whole, parts))
        same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(whole, parts))
        results.put((rank, diff, same, model.s.heads, model.s.kv_heads, model.layers[0].self_attn.k_proj.out_features))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, kv_heads", [(2, 2), (4, 2)])
def test_a_sharded_target_gives_one_devices_logits_and_tokens(tmp_path, world, kv_heads):
    path = make_tiny(tmp_path / "tiny", seed=5, layers=2, hidden=64, kv_heads=kv_heads)
    results = mp.get_context("spawn").Queue()
    mp.start_processes(
        rank_main, (world, free_port(), str(path), results), nprocs=world, join=True, start_method="spawn"
    )
    got = sorted(results.get(timeout=60) for _ in range(world))
    for rank, diff, same, heads, kv, k_rows in got:
        assert diff < TOL and same, (rank, diff)
        assert heads == 4 // world and kv == max(1, kv_heads // world)  # each rank its share of the heads
        assert k_rows == kv * 16  # head_dim 16: only its KV heads' rows


@pytest.mark.parametrize("path, world", [("models/target", 2), ("build/models/smollm2", 3)])
def test_the_bundled_and_the_real_target_split_as_they_run_on_one_device(path, world):
    """The bundled target over 2 ranks; SmolLM2-135M-Instruct (9 heads, 3 KV heads: `make setup`
    converts it) over 3, one KV head each."""
    from pathlib import Path

    assert (Path(path) / "config.json").exists(), f"{path}: missing (make setup converts the real target)"
    results = mp.get_context("spawn").Queue()
    mp.start_processes(rank_main, (world, free_port(), path, results), nprocs=world, join=True, start_method="spawn")
    for rank, diff, same, *_ in sorted(results.get(timeout=120) for _ in range(world)):
        assert diff < 5 * TOL and same, (rank, diff)


def reads_main(rank: int, world: int, port: int, path: str, results) -> None:
    """Greedy reads of a vocabulary-split step against one device's reads of the whole logits:
    random logits with many ties (the first maximal id wins, across ranks too), and a runner's
    step on a sharded target that keeps no logits against one that gathers them."""
    from services.common.tensor_parallel import VocabParallel, greedy_reads
    from services.verifier.policies import _read_on_device
    from services.verifier.runner import TargetRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ok = True
        for seed in range(20):
            g = torch.Generator().manual_seed(seed)
            logits = torch.randint(0, 4, (9, 24), generator=g).float() + torch.randn(9, 24, generator=g).round() * 0.5
            gated = [
                (r, int(torch.randint(0, 24, (1,), generator=g)), int(k)) for r, k in [(0, 1), (3, 5), (4, 2), (8, 9)]
            ]
            head = VocabParallel(torch.nn.Linear(1, 24 // world), world, rank * (24 // world))
            local = logits[:, rank * (24 // world) : (rank + 1) * (24 // world)]
            ok &= greedy_reads(local, head, gated) == _read_on_device(logits, gated)
            ok &= greedy_reads(local, head, []) == (_read_on_device(logits, [])[0], [], [])
        model = shard(Llama.from_pretrained(path), rank, world)
        runner = TargetRunner(model)
        drafts = [[5, 9, 14], [7]]
        plain = [runner.open(list(range(20 + i, 30 + i)), 64) for i in range(2)]
        split = [runner.open(list(range(20 + i, 30 + i)), 64) for i in range(2)]
        rows, _ = runner.step(list(zip(plain, drafts)), [])
        reads, _ = runner.step(list(zip(split, drafts)), [], None, [0, 3])
        gated = [(s + j, drafts[1][j], 3) for s, _ in rows.spans[1:] for j in range(len(drafts[1]))]
        ok &= reads.logits is None and reads.spans == rows.spans
        ok &= reads.reads == _read_on_device(rows.logits, gated)
        results.put((rank, ok))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_greedy_reads_of_a_vocabulary_split_step_are_one_devices_without_gathering_the_logits(tmp_path, world):
    path = make_tiny(tmp_path / "tiny", seed=5, layers=2, hidden=64)
    results = mp.get_context("spawn").Queue()
    mp.start_processes(
        reads_main, (world, free_port(), str(path), results), nprocs=world, join=True, start_method="spawn"
    )
    assert sorted(results.get(timeout=60) for _ in range(world)) == [(r, True) for r in range(world)]


def test_a_target_that_does_not_split_evenly_is_refused_naming_what_to_set(tmp_path):
    model = Llama.from_pretrained(make_tiny(tmp_path / "tiny", seed=5, layers=1, hidden=64))
    with pytest.raises(ValueError, match="4 attention heads do not split evenly over 3 ranks"):
        split_check(model, 3)


def test_a_verifier_replica_split_over_two_processes_decodes_as_one(tiny_dirs, tiny_eagle3):
    """`--tensor-parallel 2`: the replica's leader sends each runner call to its worker, both run
    their shards in step (K/V, rollback, prefix cache per rank): every method's tokens equal the
    single-process engine's (chains and trees), greedy and seeded sampling, a repeated prompt read from the prefix
    cache; closing the engine stops the worker."""
    from services.common.config import EngineConfig
    from services.common.types import Sampling
    from services.router.engine import Engine, GenerationRequest

    base = dict(target=tiny_dirs[0], draft=tiny_dirs[1], eagle3=tiny_eagle3, predictor=None, ocm_snapshot=None)
    one = Engine(EngineConfig(**base))
    two = Engine(EngineConfig(**base, tensor_parallel=2))
    try:
        workers = two.verifier.runner.workers
        assert len(workers) == 1 and workers[0].is_alive()
        prompt = one.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 3)
        asks = [(m, Sampling()) for m in ("vanilla", "sd", "suffix", "csd", "eagle3", "suffix-tree", "eagle3-tree")] + [
            ("sd", Sampling(temperature=1.0, seed=3))
        ]
        for method, sp in asks + asks[:2]:  # the repeats attach the prompt's cached blocks
            req = GenerationRequest(prompt, 24, method=method, sampling=sp)
            want = one.generate(req).result()
            got = two.generate(req).result()
            assert got["token_ids"] == want["token_ids"], (method, sp)
        assert got["cached_prompt_tokens"] > 0
        concurrent_requests_match(one, two)
    finally:
        one.close()
        two.close()
    workers[0].join(timeout=10)
    assert not workers[0].is_alive()


def concurrent_requests_match(one, two) -> None:
    """Requests arriving together: sessions open on their own threads while the scheduler steps
    (every call to the workers in the leader's order, none interleaved), the same tokens."""
    import threading

    from services.router.engine import GenerationRequest

    prompts = [one.encode(f"x{i} = [") for i in range(4)]
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = two.generate(GenerationRequest(prompts[i], 20, method="sd")).result()["token_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == {
        i: one.generate(GenerationRequest(p, 20, method="sd")).result()["token_ids"] for i, p in enumerate(prompts)
    }


@pytest.mark.parametrize("option", [{"kv_pool": True}, {"static_steps": True}], ids=["kv-pool", "static-steps"])
def test_a_replica_split_over_two_processes_serves_with_per_rank_options(tiny_dirs, option):
    """`--kv-pool` with `--tensor-parallel 2`: each rank pools its own shard's K/V slots.
    `--static-steps`: every rank runs its single-session steps in static shapes (eagerly on the
    CPU); requests alone and together give one process's tokens."""
    from services.common.config import EngineConfig
    from services.router.engine import Engine, GenerationRequest

    base = dict(target=tiny_dirs[0], draft=tiny_dirs[1], eagle3=None, predictor=None, ocm_snapshot=None)
    one = Engine(EngineConfig(**base))
    two = Engine(EngineConfig(**base, tensor_parallel=2, **option))
    try:
        model = two.verifier.runner.model
        assert model.kv_pool is not None if "kv_pool" in option else model.static_steps is not None
        prompt = one.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
        for method in ("vanilla", "sd", "suffix"):
            req = GenerationRequest(prompt, 24, method=method)
            assert two.generate(req).result()["token_ids"] == one.generate(req).result()["token_ids"], method
        concurrent_requests_match(one, two)
    finally:
        one.close()
        two.close()
