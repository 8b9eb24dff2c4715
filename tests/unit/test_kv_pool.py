"""Pooled K/V slots (services/common/kv_pool.py): a ragged forward over pooled caches gives the
per-session forward's logits and K/V, whatever mix of rows it holds, and slots come back."""

import gc

import torch

from services.common.kv_pool import GROUP_MAX_ROW, KVPool, plan_groups
from services.common.llama import Llama
from tests.conftest import make_tiny


def _prefilled(m: Llama, prompts: list[list[int]], capacities: list[int]):
    caches = [m.new_cache(1, c) for c in capacities]
    for p, c in zip(prompts, caches):
        m(torch.tensor([p]), 0, c)
    return caches


def test_pooled_ragged_forward_equals_per_session_attention(tmp_path):
    """Rows of different lengths, a token tree, a prompt chunk, a cache in another segment
    (capacity bucket) and an unpooled cache, in one forward: logits, captured states and every
    row's K/V match the per-session path's; the short rows of one segment attend together, the
    chunk and the rest alone."""
    m = Llama.from_pretrained(make_tiny(tmp_path / "m", seed=3, layers=2))
    torch.manual_seed(0)
    prompts = [torch.randint(1, 8000, (n,)).tolist() for n in (30, 7, 19, 12, 25)]
    feeds = [torch.randint(1, 8000, (n,)).tolist() for n in (5, 1, 4, 3, 2)]
    feeds[0] += torch.randint(1, 8000, (GROUP_MAX_ROW,)).tolist()  # row 0: a prompt chunk, attends alone
    trees = [None, None, [-1, 0, 0, 1], None, None]  # row 2's feed is a token tree
    capacities = [64, 64, 64, 300, 64]  # row 3 lands in the 512 bucket
    starts = [len(p) for p in prompts]
    with torch.inference_mode():
        ref_caches = _prefilled(m, prompts, capacities)
        want, want_h = m.forward_ragged(feeds, starts, ref_caches, capture=(1,), trees=trees)
        pool = m.use_kv_pool(slots=4)
        caches = _prefilled(m, prompts[:4], capacities[:4])
        m.kv_pool = None
        caches.append(_prefilled(m, prompts[4:], capacities[4:])[0])  # an unpooled cache beside them
        assert [c.segment is not None for c in caches] == [True] * 4 + [False]
        assert len({id(c.segment) for c in caches[:4]}) == 2 and pool.used == 4
        got, got_h = m.forward_ragged(feeds, starts, caches, capture=(1,), trees=trees)
        lens = [len(f) for f in feeds]
        groups, alone = plan_groups(
            caches, [sum(lens[:r]) for r in range(5)], lens, starts, [None] * 5, sum(lens), "cpu"
        )
    assert [g.tokens.tolist() for g in groups] == [list(range(lens[0], lens[0] + lens[1] + lens[2]))]  # rows 1 and 2
    assert alone == [0, 3, 4]
    for w, g in zip(want, got):
        assert torch.allclose(w, g, atol=1e-4) and torch.equal(w.argmax(-1), g.argmax(-1))
    for w, g in zip(want_h, got_h):
        assert torch.allclose(w[0], g[0], atol=1e-5)
    for rc, c, st, f in zip(ref_caches, caches, starts, feeds):
        for (rk, rv), (k, v) in zip(rc.layers, c.layers):
            assert torch.allclose(rk[:, :, : st + len(f)], k[:, :, : st + len(f)], atol=1e-5)
            assert torch.allclose(rv[:, :, : st + len(f)], v[:, :, : st + len(f)], atol=1e-5)


def test_pooled_rows_attend_in_one_call_per_layer(tmp_path, monkeypatch):
    """Three sessions of one segment: the per-session attention runs for none of them."""
    import services.common.llama as llama

    m = Llama.from_pretrained(make_tiny(tmp_path / "m", seed=4, layers=2))
    m.use_kv_pool()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    calls = []
    original = llama.attend_rows
    monkeypatch.setattr(llama, "attend_rows", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.inference_mode():
        caches = _prefilled(m, prompts, [32] * 3)
        m.forward_ragged([[1], [2, 3], [4]], [3, 2, 4], caches)
    assert calls == []


def test_slots_come_back_when_caches_are_collected_and_the_lowest_is_reused():
    from services.common.kv_pool import pooled_cache
    from services.common.llama import KVCache, LlamaShape

    s = LlamaShape(
        vocab=16,
        hidden=8,
        layers=2,
        heads=2,
        kv_heads=2,
        head_dim=4,
        intermediate=16,
        eps=1e-5,
        max_positions=64,
        tie_embeddings=True,
        attention_bias=False,
        qk_norm=False,
    )
    pool = KVPool(s, torch.float32, "cpu", slots=2, min_capacity=16, max_capacity=64)
    caches = [pooled_cache(KVCache, *pool.take(10), 10) for _ in range(3)]  # the third opens a second segment
    assert [c.slot for c in caches] == [0, 1, 0] and caches[0].segment is not caches[2].segment
    assert pool.used == 3 and caches[0].layers[0][0].shape == (1, 2, 10, 4)
    del caches[0]
    gc.collect()
    assert pool.used == 2
    again = pooled_cache(KVCache, *pool.take(12), 12)
    assert again.slot == 0 and pool.used == 3
    assert pool.take(65) is None  # above max_capacity: not pooled
    assert pool.bucket(10) == 16 and pool.bucket(17) == 32


def test_the_pool_is_off_unless_asked_for_from_every_front():
    """CLI (--kv-pool), Ray args (kv_pool, as Helm's verifier.kvPool renders it) and the
    default config: off unless asked for."""
    import argparse

    from services.cli import _serve_parser
    from services.cli import engine_config as cli_config
    from services.common.config import EngineConfig
    from services.ray_app import engine_config as ray_config

    assert EngineConfig().kv_pool is False
    assert ray_config({}).kv_pool is False and ray_config({"kv_pool": False}).kv_pool is False
    assert ray_config({"kv_pool": True}).kv_pool is True and ray_config({"kv_pool": "true"}).kv_pool is True
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="cmd"))
    assert cli_config(parser.parse_args(["serve"])).kv_pool is False
    assert cli_config(parser.parse_args(["serve", "--kv-pool"])).kv_pool is True
