"""The target's cached side of training (training/target_cache.py): what it stores equals the
target's forward, a stopped fill resumes, a cache of other weights is refused, and the EAGLE-3
trainer reads the same labels and features from it as from the live target."""

import argparse
import json
import random

import numpy as np
import pytest
import torch

from services.common.llama import Llama
from services.drafter.replay import Trace, save_traces
from training.pretrain import weights_digest
from training.target_cache import TargetCache, build, sparse_probs

AUX = "0,1,1"  # the tiny heads' feature layers


@pytest.fixture(scope="module")
def cache_dir(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("target-cache")
    rng = random.Random(3)
    traces = [
        Trace(f"t{i}", [rng.randrange(1, 8192) for _ in range(rng.randrange(8, 30))], [5, 6, 7] * (i + 3), 64)
        for i in range(7)
    ]
    save_traces(root / "traces.jsonl", traces)
    build(cache_args(tiny_dirs[0], root))
    return root


def cache_args(target, root, **kw) -> argparse.Namespace:
    args = dict(target=target, traces=str(root / "traces.jsonl"), corpus_tokens=0, aux_layers=AUX, top_k=8192)
    args |= dict(out=root / "cache", batch_tokens=64, bf16="off", threads=1) | kw
    return argparse.Namespace(**args)


def live(target: Llama, ids: torch.Tensor):
    with torch.no_grad():
        logits, hidden = target.forward_train(ids, capture=(0, 1, 1))
    return torch.log_softmax(logits, -1), torch.cat(hidden, -1)


def test_cached_labels_and_features_are_the_targets(tiny_dirs, cache_dir):
    target = Llama.from_pretrained(tiny_dirs[0])
    cache = TargetCache.open(cache_dir / "cache", {"target": weights_digest(tiny_dirs[0]), "aux_layers": [0, 1, 1]})
    b = cache.batch([0, 3, 6])
    logp, feats = live(target, b["ids"])
    valid = torch.arange(b["ids"].shape[1])[None, :] < b["lengths"][:, None]
    assert torch.equal(b["topk_ids"][..., 0][valid], logp.argmax(-1)[valid])
    stored = torch.gather(logp, -1, b["topk_ids"])[valid]
    assert torch.allclose(b["topk_logp"][valid], stored, atol=2e-2)  # float16 log-probabilities
    assert torch.allclose(b["feats"].float()[valid], feats[valid], rtol=1e-2, atol=1e-2)  # bfloat16
    assert (b["topk_logp"][~valid] == float("-inf")).all()
    # every token's whole distribution kept (top_k = vocabulary): the labels are the softmax
    probs = sparse_probs(b["topk_ids"], b["topk_logp"], torch.arange(8192), 8192)
    assert torch.allclose(probs[valid], logp.exp()[valid], atol=1e-3)


def test_a_stopped_fill_resumes_where_it_stopped(tiny_dirs, cache_dir):
    cache = TargetCache.open(cache_dir / "cache")
    before = np.array(cache.topk_ids), np.array(cache.feats)
    meta = json.loads((cache_dir / "cache/meta.json").read_text())
    writable = TargetCache(cache_dir / "cache", meta, mode="r+")
    writable.topk_ids[:] = 0
    writable.feats[:] = 0
    writable.topk_ids.flush()
    writable.feats.flush()
    (cache_dir / "cache/meta.json").write_text(json.dumps({**meta, "done": 0}))
    with pytest.raises(SystemExit, match="0 of 7 sequences"):
        TargetCache.open(cache_dir / "cache")
    build(cache_args(tiny_dirs[0], cache_dir))
    again = TargetCache.open(cache_dir / "cache")
    assert np.array_equal(again.topk_ids, before[0]) and np.array_equal(again.feats, before[1])


def test_a_cache_of_other_weights_or_layers_is_refused(cache_dir):
    with pytest.raises(SystemExit, match="target="):
        TargetCache.open(cache_dir / "cache", {"target": "0123456789abcdef"})
    with pytest.raises(SystemExit, match="aux_layers="):
        TargetCache.open(cache_dir / "cache", {"aux_layers": [1, 2]})


def test_eagle3_reads_from_the_cache_what_the_target_gives(tiny_dirs, cache_dir):
    from training.eagle3 import new_head, target_side

    target = Llama.from_pretrained(tiny_dirs[0])
    cache = TargetCache.open(cache_dir / "cache")
    seqs = [cache.sequence(i) for i in range(7)]
    head, vocab_ids = new_head(target, (0, 1, 1), seqs, 4096, "cpu")  # a reduced draft vocabulary
    a = target_side(target, None, seqs, [1, 4], head, vocab_ids, "cpu")
    b = target_side(target, cache, seqs, [1, 4], head, vocab_ids, "cpu")
    valid = torch.arange(a[0].shape[1])[None, :] < a[1][:, None]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.allclose(a[2][valid], b[2][valid], rtol=1e-2, atol=1e-2)
    assert torch.allclose(a[3][valid], b[3][valid], atol=1e-3)
    assert torch.equal(a[4][valid], b[4][valid])
