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
