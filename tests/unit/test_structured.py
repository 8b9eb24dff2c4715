"""Structured output: patterns, token bytes, the token automaton and its row masks."""

import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from services.common.structured import GrammarCompiler, GrammarError, StructuredOutput, escape, token_bytes
from tests.conftest import TOKENIZER


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, len(tok.get_vocab()))


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_token_bytes_spell_the_text_back(tok):
    """Every ordinary token maps to its bytes: the ids of a text spell the text's UTF-8,
    multi-byte characters split across tokens included."""
    spelled = {i: b for b, ids in token_bytes(tok).items() for i in ids}
    text = 'def f(x):\n\t"héllo ✓ 日本"  # ok\n'
    assert b"".join(spelled[i] for i in encode(tok, text)) == text.encode()
    assert tok.eos_token_id not in spelled


def test_choice_is_escaped_and_matches_exactly(tok, compiler):
    choices = ("a.b*", "(x|y)", "-1 [ok]", "plain")
    g = compiler.compile(StructuredOutput(choice=choices).pattern())
    for c in choices:
        state = g.walk(g.initial, encode(tok, c))
        assert state is not None and g.allowed(state)[tok.eos_token_id], c
    assert g.walk(g.initial, encode(tok, "aXb")) is None
    assert re.fullmatch(escape("a.b*"), "a.b*") and not re.fullmatch(escape("a.b*"), "axbb")


def test_eos_only_where_the_match_is_whole(tok, compiler):
    g = compiler.compile(r"[0-9]{2,3}")
    one = g.walk(g.initial, encode(tok, "4"))
    assert not g.allowed(one)[tok.eos_token_id] and not g.allowed(g.initial)[tok.eos_token_id]
    two = g.walk(g.initial, encode(tok, "42"))
    assert g.allowed(two)[tok.eos_token_id]
    assert g.next(two, tok.eos_token_id) is None  # nothing follows the end


def test_mask_rows_follow_the_draft_and_stop_at_a_forbidden_token(tok, compiler):
    g = compiler.compile(r"(yes|no), (yes|no)")
    yes, comma, x = encode(tok, "yes")[0], encode(tok, ",")[0], encode(tok, "x")[0]
    logits = torch.zeros(4, g.vocab_size)
    rows = g.mask_rows(logits, g.initial, [yes, x, yes])
    allowed0 = torch.isfinite(rows[0])
    assert allowed0[yes] and not allowed0[x] and not allowed0[comma]
    assert torch.isfinite(rows[1][comma]) and not torch.isfinite(rows[1][yes])  # after "yes": the comma
    assert torch.isfinite(rows[2]).all() and torch.isfinite(rows[3]).all()  # after the forbidden x: untouched
    assert torch.isfinite(logits).all()  # the input is not changed


@pytest.mark.parametrize(
    "spec,word",
    [
        (StructuredOutput(), "exactly one"),
        (StructuredOutput(regex="a", choice=("a",)), "exactly one"),
        (StructuredOutput(json_schema="{not json"), "JSON schema"),
        (StructuredOutput(json_schema='{"type": "nonsense"}'), "JSON schema"),
        (StructuredOutput(choice=("a", "")), "non-empty"),
        (StructuredOutput(regex="a" * 40000), "at most"),
    ],
)
def test_bad_specs_say_what_to_fix(spec, word):
    with pytest.raises(GrammarError, match=word):
        spec.pattern()


def test_bad_regex_is_a_grammar_error_and_good_ones_are_cached(compiler):
    from services.common.metrics import GRAMMAR_COMPILES

    def count(outcome):
        return GRAMMAR_COMPILES.labels(outcome)._value.get()

    before = {k: count(k) for k in ("invalid", "compiled", "cached")}
    with pytest.raises(GrammarError, match="cannot be compiled"):
        compiler.compile("(unclosed")
    assert compiler.compile("[a-z]{3}") is compiler.compile("[a-z]{3}")
    assert {k: count(k) - v for k, v in before.items()} == {"invalid": 1, "compiled": 1, "cached": 1}


def test_schema_pattern_accepts_instances_only(tok, compiler):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "k": {"enum": ["a", "b"]}},
        "required": ["n", "k"],
    }
    g = compiler.compile(StructuredOutput(json_schema=json.dumps(schema)).pattern())
    good = g.walk(g.initial, encode(tok, '{"n": 12, "k": "b"}'))
    assert good is not None and g.allowed(good)[tok.eos_token_id]
    assert g.walk(g.initial, encode(tok, '{"n": "12"')) is None


def test_an_exploding_pattern_is_refused_in_time_and_the_worker_comes_back(tok):
    """Some short patterns take minutes to compile (bounded repetitions inside bounded
    repetitions); the compile worker is killed at the limit and respawned for the next one."""
    import time

    compiler = GrammarCompiler(tok, len(tok.get_vocab()), timeout_s=2)
    try:
        t = time.monotonic()
        with pytest.raises(GrammarError, match="too complex"):
            compiler.compile(r"(    [ -~]{0,100}\n){1,16}")
        assert time.monotonic() - t < 10
        g = compiler.compile(r"(    [^\n]*\n){1,16}")  # the unbounded form compiles at once
        assert g.walk(g.initial, encode(tok, "    return x\n")) is not None
    finally:
        compiler.close()


@pytest.mark.parametrize(
    "text,ok",
    [
        ('{"a": [1, {"b": null}], "c": "x"}', False),  # an object inside an array: two levels
        ('{"a": 1,\n    "b": [true, -2.5e3], "c": {"d": "e"}}', True),
        ("{}", True),
        ('{"a": "q\\"x"}', True),
        ("[1]", False),
        ('{"a": 01}', False),
    ],
)
def test_json_object_accepts_objects_with_one_level_of_nesting(tok, compiler, text, ok):
    g = compiler.compile(StructuredOutput(json_object=True).pattern())
    state = g.walk(g.initial, encode(tok, text))
    assert (state is not None and bool(g.allowed(state)[tok.eos_token_id])) == ok
    if ok:
        assert isinstance(json.loads(text), dict)


def test_masks_are_cached_per_state_up_to_the_limit(tok, compiler, monkeypatch):
    import services.common.structured as structured

    monkeypatch.setattr(structured, "MASKS_CACHED", 3)
    g = compiler.compile(r"[0-9]{1,8}")
    state = g.initial
    masks = []
    for digit in "1234567":
        masks.append(g.allowed(state))
        assert g.allowed(state) is masks[-1]  # cached while in use
        state = g.next(state, encode(tok, digit)[0])
    assert len(g._masks) == 3


def test_the_compile_worker_tells_a_regex_too_long_from_a_bad_schema(tok):
    """Its own error type, not a message prefix, says which refusal the caller words."""
    from services.common.grammar_worker import RegexTooLong

    compiler = GrammarCompiler(tok, len(tok.get_vocab()))
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    try:
        with pytest.raises(RegexTooLong, match="at most 10"):
            compiler.workers[0].schema_regex(schema, 10)
        with pytest.raises(ValueError) as bad:
            compiler.workers[0].schema_regex(json.dumps({"type": "no-such-type"}), 10_000)
        assert not isinstance(bad.value, RegexTooLong)
        assert compiler.workers[0].schema_regex(schema, 10_000).startswith(r"\{")
    finally:
        compiler.close()
