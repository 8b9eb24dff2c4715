"""Our Llama forward against transformers, KV-cache consistency, checkpoint round trip."""

import pytest
import torch

from services.common.llama import Llama
from tests.conftest import make_tiny


@pytest.mark.parametrize("kw", [{}, {"kv_heads": 4}, {"attention_bias": True}])
def test_logits_match_transformers(tmp_path, kw):
    from transformers import AutoModelForCausalLM

    path = make_tiny(tmp_path / "m", seed=3, **kw)
    ours = Llama.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    x = torch.randint(0, 8192, (2, 40))
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.allclose(ours.forward_train(x), ref, atol=1e-4)
        cache = ours.new_cache(batch=2, capacity=64)
        a, _ = ours(x[:, :25], 0, cache)
        b, _ = ours(x[:, 25:39], 25, cache)
        c, _ = ours(x[:, 39:], 39, cache)
    got = torch.cat([a, b, c], dim=1)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def hf_tiny(tmp_path, cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    return hf


def test_qwen2_biases_load(tmp_path):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    hf = hf_tiny(tmp_path, cfg)
    ours = Llama.from_pretrained(tmp_path)
    x = torch.randint(0, 512, (1, 30))
    with torch.no_grad():
        assert torch.allclose(ours.forward_train(x), hf(x).logits, atol=1e-4)


def test_qwen3_and_mistral_logits_match_transformers(tmp_path):
    """Qwen3's per-head q/k RMSNorm, on the plain and the packed (fused q|k|v, fp16 weights)
    paths; Mistral with full attention."""
    from transformers import MistralConfig, Qwen3Config

    from services.common.packed_linear import fp16_gemm_available, pack_linears

    shape = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    for name, cfg in (
        ("qwen3", Qwen3Config(head_dim=32, **shape)),
        ("mistral", MistralConfig(sliding_window=None, **shape)),
    ):
        hf = hf_tiny(tmp_path / name, cfg)
        ours = Llama.from_pretrained(tmp_path / name)
        assert ours.s.qk_norm == (name == "qwen3")
        x = torch.randint(0, 512, (1, 30))
        with torch.no_grad():
            ref = hf(x).logits
            assert torch.allclose(ours.forward_train(x), ref, atol=1e-4), name
            if fp16_gemm_available():  # packing needs fp16-exact weights: round them, on both sides
                for m in (ours, hf):
                    for p in m.parameters():
                        p.copy_(p.half().float())
                pack_linears(ours)
                logits, _ = ours(x, 0, ours.new_cache(capacity=64))
                assert torch.allclose(logits, hf(x).logits, atol=1e-3), name


def test_checkpoints_this_forward_would_run_wrong_are_refused(tmp_path):
    """Another architecture, a sliding window shorter than the context, or weights the forward
    would leave unused: a clear error at load, never wrong logits."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, MistralConfig, Qwen2Config

    shape = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    hf_tiny(tmp_path / "gpt2", GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; .*llama, qwen2, qwen3, mistral"):
        Llama.from_pretrained(tmp_path / "gpt2")
    hf_tiny(tmp_path / "window", MistralConfig(sliding_window=32, **shape))
    with pytest.raises(ValueError, match=r"sliding-window attention \(32 of 128 positions\) is not supported"):
        Llama.from_pretrained(tmp_path / "window")
    hf_tiny(tmp_path / "qwen2sw", Qwen2Config(use_sliding_window=True, sliding_window=16, **shape))
    with pytest.raises(ValueError, match="sliding-window"):
        Llama.from_pretrained(tmp_path / "qwen2sw")
    hf_tiny(tmp_path / "extra", Qwen2Config(**shape))
    f = tmp_path / "extra" / "model.safetensors"
    state = load_file(str(f))
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # a Qwen3 weight in a Qwen2 config
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weights this Llama-family forward does not use \(layers.0.self_attn.q_norm"):
        Llama.from_pretrained(tmp_path / "extra")
    assert json.loads((tmp_path / "extra" / "config.json").read_text())["model_type"] == "qwen2"


def test_capture_returns_residual_stream_entering_layers(tmp_path):
    m = Llama.from_pretrained(make_tiny(tmp_path / "m", seed=4, layers=3))
    x = torch.randint(0, 8192, (1, 10))
    with torch.no_grad():
        _, hidden = m(x, 0, m.new_cache(capacity=16), capture=(0, 2))
        emb = m.embed_tokens(x)
    assert len(hidden) == 2
    assert torch.equal(hidden[0], emb)
    assert hidden[1].shape == (1, 10, 64)


def test_save_load_roundtrip_fp16(tmp_path):
    m = Llama.from_pretrained(make_tiny(tmp_path / "a", seed=5))
    m.save_pretrained(tmp_path / "b", dtype=torch.float16)
    m2 = Llama.from_pretrained(tmp_path / "b")
    for (n, p), (_, q) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.allclose(p, q, atol=1e-2, rtol=1e-3), n


def test_missing_weights_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny(tmp_path / "m", seed=6)
    state = load_file(str(path / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="norm.weight"):
        Llama.from_pretrained(path)


def test_ragged_batch_equals_separate_forwards(tmp_path):
    m = Llama.from_pretrained(make_tiny(tmp_path / "m", seed=8, layers=2))
    seqs = [torch.randint(0, 8192, (n,)).tolist() for n in (30, 7, 19)]
    # each row already has some cached prefix; feed the next chunk of different lengths
    split = [(25, 5), (3, 4), (18, 1)]
    caches_a = [m.new_cache(capacity=64) for _ in seqs]
    caches_b = [m.new_cache(capacity=64) for _ in seqs]
    with torch.no_grad():
        for s, (p, _), ca, cb in zip(seqs, split, caches_a, caches_b):
            m(torch.tensor([s[:p]]), 0, ca)
            m(torch.tensor([s[:p]]), 0, cb)
        ref = [m(torch.tensor([s[p : p + n]]), p, c, capture=(0, 1)) for s, (p, n), c in zip(seqs, split, caches_a)]
        got, hidden = m.forward_ragged(
            [s[p : p + n] for s, (p, n) in zip(seqs, split)], [p for p, _ in split], caches_b, capture=(0, 1)
        )
    for (lr, hr), lg, hg in zip(ref, got, hidden):
        assert torch.allclose(lr[0], lg, atol=1e-4)
        assert all(torch.allclose(a[0], b, atol=1e-5) for a, b in zip(hr, hg))
    for ca, cb in zip(caches_a, caches_b):
        assert torch.allclose(ca.layers[1][0], cb.layers[1][0], atol=1e-5)


def test_last_only_and_tails_logits_are_the_last_rows(tmp_path):
    """``last_only`` runs the LM head on each row's last position only, ``tails`` on each row's
    last few (a verification's draft and bonus positions, not the prompt's): the same logits,
    and the same captured states."""
    m = Llama.from_pretrained(make_tiny(tmp_path / "m", seed=8, layers=2))
    seqs = [torch.randint(0, 8192, (n,)).tolist() for n in (6, 1, 4)]
    with torch.no_grad():
        full, hf = m.forward_ragged(seqs, [0, 0, 0], [m.new_cache(capacity=16) for _ in seqs], capture=(1,))
        last, _ = m.forward_ragged(seqs, [0, 0, 0], [m.new_cache(capacity=16) for _ in seqs], last_only=True)
        one, _ = m.forward_ragged(seqs[:1], [0], [m.new_cache(capacity=16)], last_only=True)
        tails, ht = m.forward_ragged(
            seqs, [0, 0, 0], [m.new_cache(capacity=16) for _ in seqs], capture=(1,), tails=[3, 1, 4]
        )
        one_tail, h1 = m.forward_ragged(seqs[:1], [0], [m.new_cache(capacity=16)], capture=(1,), tails=[2])
    assert [tuple(x.shape) for x in last] == [(1, 8192)] * 3 and one[0].shape == (1, 8192)
    for f, lg in zip(full, last):
        assert torch.allclose(f[-1:], lg, atol=1e-5)
    assert torch.allclose(full[0][-1:], one[0], atol=1e-5)
    assert [x.shape[0] for x in tails] == [3, 1, 4] and one_tail[0].shape[0] == 2
    for f, lg, n in zip(full, tails, (3, 1, 4)):
        assert torch.allclose(f[-n:], lg, atol=1e-5)
    assert torch.allclose(full[0][-2:], one_tail[0], atol=1e-5)
    assert all(torch.allclose(a[0], b[0], atol=1e-6) for a, b in zip(hf, ht)) and h1[0][0].shape == (6, 64)


def test_sharded_save_loads_in_ours_and_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    m = Llama.from_pretrained(make_tiny(tmp_path / "a", seed=9))
    m.save_pretrained(tmp_path / "b", dtype=torch.float32, max_shard_bytes=400_000)
    shards = sorted(p.name for p in (tmp_path / "b").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "b" / "model.safetensors.index.json").exists()
    x = torch.randint(0, 8192, (1, 12))
    with torch.no_grad():
        ref = m.forward_train(x)
        assert torch.allclose(Llama.from_pretrained(tmp_path / "b").forward_train(x), ref, atol=1e-5)
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b"), dtype=torch.float32).eval()
        assert torch.allclose(hf(x).logits, ref, atol=1e-4)


def test_packed_gemm_equals_fp32_path(tiny_dirs):
    """FBGEMM fp16-weight layers (q|k|v and gate|up fused) on fp16-stored weights give the
    fp32 path's logits, on the ragged path and on the single-row cached path."""
    from torch import nn

    from services.common.packed_linear import PackedLinear, fp16_gemm_available, pack_linears

    assert fp16_gemm_available()
    ref, packed = Llama.from_pretrained(tiny_dirs[0]), Llama.from_pretrained(tiny_dirs[0])
    assert pack_linears(packed) == 0  # the tiny checkpoints are stored in fp32
    for m in (ref, packed):
        for p in m.parameters():
            p.data = p.data.half().float()  # what an fp16 checkpoint loads as
    assert pack_linears(packed) == 7 * ref.s.layers + 1
    assert isinstance(packed.lm_head, PackedLinear) and packed.state_dict().keys() == ref.state_dict().keys()
    assert all(b.self_attn.qkv is not None and b.mlp.gate_up is not None for b in packed.layers)  # fused GEMMs
    seqs, starts = [[5, 17, 300, 42], [9], [7, 8, 9]], [0, 0, 0]
    with torch.inference_mode():
        want, _ = ref.forward_ragged(seqs, starts, [ref.new_cache(1, 16) for _ in seqs])
        got, _ = packed.forward_ragged(seqs, starts, [packed.new_cache(1, 16) for _ in seqs])
        want.append(ref(torch.tensor([seqs[0]]), 0, ref.new_cache(1, 16))[0][0])
        got.append(packed(torch.tensor([seqs[0]]), 0, packed.new_cache(1, 16))[0][0])
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-4) and torch.equal(g.argmax(-1), w.argmax(-1))
    # A layer whose weights are not fp16 values would change results: it stays nn.Linear.
    plain = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears(plain) == 0 and isinstance(plain[0], nn.Linear)


@pytest.mark.parametrize("kw", [{}, {"kv_heads": 4}])
def test_the_static_forward_equals_the_eager_one(tmp_path, kw):
    """forward_static (positions as a tensor, attention over a width of the cache, masked) gives
    the eager forward's logits for a prefill, decode steps and a 5-token verification, whatever
    width holds the step, and a rolled-back draft's stale K/V past a position do not leak into it."""
    path = make_tiny(tmp_path / "m", seed=5, **kw)
    m = Llama.from_pretrained(path)
    x = torch.randint(0, 8192, (1, 30))
    eager, static = m.new_cache(1, 64), m.new_cache(1, 64)
    with torch.inference_mode():
        a, _ = m(x[:, :20], 0, eager)
        b, _ = m.forward_static(x[:, :20], torch.arange(20), static, 64)
        assert torch.allclose(a, b, atol=1e-5)
        junk = torch.randint(0, 8192, (1, 5))
        m.forward_static(junk, torch.arange(20, 25), static, 64)  # a draft that is then rolled back
        for i in range(20, 25):  # decode steps over the stale positions
            a, _ = m(x[:, i : i + 1], i, eager)
            b, _ = m.forward_static(x[:, i : i + 1], torch.tensor([i]), static, 32)  # a narrower width
            assert torch.allclose(a, b, atol=1e-5), (i, (a - b).abs().max())
        a, seen_a = m(x[:, 25:30], 25, eager, capture=(0, 1))  # a verification: each row sees those before it
        b, seen_b = m.forward_static(x[:, 25:30], torch.arange(25, 30), static, 48, capture=(0, 1))
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert all(torch.allclose(h, g, atol=1e-5) for h, g in zip(seen_a, seen_b, strict=True))  # EAGLE-3's features


def test_the_static_forward_compiles_once_for_every_position(tmp_path):
    """Static shapes are what CUDA graphs need: compiled with dynamic=False, one graph serves a
    decode step at every position its width holds (no recompilation), with the eager step's
    greedy tokens."""
    import torch._dynamo

    path = make_tiny(tmp_path / "m", seed=6)
    m = Llama.from_pretrained(path)
    torch._dynamo.reset()
    step = torch.compile(m.forward_static, dynamic=False)
    eager, static = m.new_cache(1, 48), m.new_cache(1, 48)
    tok_e = tok_s = torch.tensor([[7]])
    compiled_before = None
    with torch.inference_mode():
        for i in range(12):
            tok_e = m(tok_e, i, eager)[0][:, -1].argmax(-1, keepdim=True)
            tok_s = step(tok_s, torch.tensor([i]), static, 48)[0][:, -1].argmax(-1, keepdim=True)
            assert torch.equal(tok_e, tok_s), i
            if i == 1:
                compiled_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled_before


def test_a_static_steps_width_is_the_first_bucket_that_holds_it():
    from services.common.llama import STATIC_BUCKET, static_width

    assert static_width(1, 4096) == STATIC_BUCKET
    assert static_width(STATIC_BUCKET, 4096) == STATIC_BUCKET
    assert static_width(STATIC_BUCKET + 1, 4096) == 2 * STATIC_BUCKET
    assert static_width(1000, 1024) == 1024 and static_width(1000, 900) == 900  # never past the cache
