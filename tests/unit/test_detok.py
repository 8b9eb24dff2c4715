from transformers import AutoTokenizer

from services.router.detok import Detokenizer
from tests.conftest import TOKENIZER


def test_streamed_text_equals_full_decode_including_multibyte():
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    text = "def f(x):\n    return x  # café ✓ 数据 🙂\n\tprint('ok')\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = Detokenizer(tok)
    pieces = [d.push(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_add_no_text_unless_asked():
    """vLLM's skip_special_tokens: the end-of-sequence token (streamed with ignore_eos) adds no
    text by default, and reads as written without it; streamed text equals the full decode
    with the same setting either way."""
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    eos = tok.eos_token_id
    ids = (
        tok("x = 1", add_special_tokens=False)["input_ids"] + [eos] + tok(" # é", add_special_tokens=False)["input_ids"]
    )
    skipped = "".join(map(Detokenizer(tok).push, ids))
    kept = "".join(map(Detokenizer(tok, skip_special_tokens=False).push, ids))
    assert skipped == tok.decode(ids, skip_special_tokens=True) == "x = 1 # é"
    assert kept == tok.decode(ids) == "x = 1<|endoftext|> # é"
