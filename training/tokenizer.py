"""Byte-level BPE tokenizer shared by the target and every drafter.

`python -m training.tokenizer --out models/tokenizer` trains it on the training split and
saves `tokenizer.json` + `tokenizer_config.json`, loadable with `AutoTokenizer`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.corpus import EOS, training_texts

VOCAB_SIZE = 8192


def bpe(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (EOS the one special token) trained on ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def train_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> None:
    from transformers import PreTrainedTokenizerFast

    t0 = time.time()
    texts = training_texts(seed=seed)
    tok = bpe(texts, vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=None,
        pad_token=EOS,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    print(
        f"[tokenizer] vocab={tok.get_vocab_size()} docs={len(texts)} time={time.time() - t0:.1f}s -> {out}", flush=True
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("models/tokenizer"))
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args()
    train_tokenizer(args.out, args.vocab_size)


if __name__ == "__main__":
    main()
