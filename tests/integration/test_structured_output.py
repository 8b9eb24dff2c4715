"""Structured output through the engine: lossless methods equal a plain constrained decoding
loop, sampled and calibrated outputs stay inside the grammar, a re-opened session resumes
the automaton where its output left it, and bad specs are INVALID_ARGUMENT."""

import json
import re

import pytest
import torch

from services.common.structured import StructuredOutput
from services.common.types import Sampling
from services.router.engine import GenerationRequest, InvalidRequest

PROMPTS = ["def add(a, b):\n", "import os\n\nclass Config:\n    def __init__(self", "x = [", "# utils\n"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["int", "str", "list"]},
    },
    "required": ["name", "ok", "kind"],
}
SPECS = [
    StructuredOutput(regex=r"(def|class) [a-z_]{1,12}\([a-z, ]{0,16}\):\n    return [a-z0-9 +*]{1,20}\n"),
    StructuredOutput(json_schema=json.dumps(SCHEMA)),
    StructuredOutput(choice=("alpha", "beta", "gamma delta")),
    StructuredOutput(json_object=True),
]


def constrained_greedy(model, index, ids: list[int], n: int, eos: int) -> list[int]:
    """A plain decoding loop apart from the verifier: the target's full forward, argmax over
    the tokens outlines-core's index allows in the current state."""
    out: list[int] = []
    state = index.get_initial_state()
    for _ in range(n):
        with torch.no_grad():
            x = model.forward_train(torch.tensor([ids + out]))[0, -1].float()
        allowed = torch.tensor(index.get_allowed_tokens(state))
        tok = int(allowed[x[allowed].argmax()])
        if tok == eos:
            break
        out.append(tok)
        state = index.get_next_state(state, tok)
    return out


def matches(spec: StructuredOutput, text: str) -> bool:
    if spec.json_schema:
        obj = json.loads(text)
        return (
            set(obj) == set(SCHEMA["properties"])
            and isinstance(obj["ok"], bool)
            and obj["kind"] in ("int", "str", "list")
        )
    if spec.choice:
        return text in spec.choice
    if spec.json_object:
        return isinstance(json.loads(text), dict)
    return re.fullmatch(spec.regex, text) is not None


@pytest.mark.parametrize("engine", ["tiny_engine", "tiny_eagle_engine"])
@pytest.mark.parametrize("spec", SPECS, ids=["regex", "json_schema", "choice", "json_object"])
def test_lossless_methods_equal_a_plain_constrained_loop(request, engine, spec):
    eng = request.getfixturevalue(engine)
    methods = [m for m in ("vanilla", "sd", "suffix", "eagle3", "hybrid") if m in eng.methods()]
    assert len(methods) >= 3
    grammar = eng.grammars.compile(spec.pattern())
    accepted = finished = 0
    for text in PROMPTS:
        ids = eng.encode(text)
        ref = constrained_greedy(eng.verifier.runner.model, grammar.index, ids, 60, eng.eos_id)
        for method in methods:
            out = eng.generate(GenerationRequest(ids, 60, method=method, structured=spec)).result()
            assert out["token_ids"] == ref, (text, method)
            accepted += out["stats"]["accepted_tokens"]
            if out["finish_reason"] == "eos":
                finished += 1
                assert matches(spec, out["text"]), out["text"]
            else:
                assert grammar.walk(grammar.initial, out["token_ids"]) is not None  # a prefix of a match
    assert accepted > 0 and (finished > 0 or spec.json_object)  # random weights rarely close an object


def test_sampled_and_calibrated_outputs_stay_in_the_grammar(tiny_engine, tiny_eagle_engine):
    spec = SPECS[1]
    done = 0
    for seed in range(6):
        for eng, method, sp in (
            (tiny_engine, "sd", Sampling(temperature=1.0, seed=seed)),
            (tiny_eagle_engine, "eagle3", Sampling(temperature=0.7, seed=seed)),
            (tiny_engine, "csd", Sampling()),
            (tiny_eagle_engine, "hybrid-csd", Sampling()),
        ):
            out = eng.generate(
                GenerationRequest(eng.encode(PROMPTS[seed % 4]), 80, sampling=sp, method=method, structured=spec)
            ).result()
            if out["finish_reason"] == "eos":
                done += 1
                assert matches(spec, out["text"]), (method, out["text"])
    assert done >= 12


def test_a_reopened_session_resumes_the_grammar_where_its_output_left_it(tiny_engine):
    from services.common.types import CycleRequest, SessionSpec

    eng = tiny_engine
    spec = SPECS[0]
    ids = eng.encode(PROMPTS[0])
    whole = eng.generate(GenerationRequest(ids, 40, method="vanilla", structured=spec)).result()["token_ids"]
    assert len(whole) > 12
    s = eng.verifier.open(SessionSpec(ids + whole[:6], 40 - 6, generated=6, grammar=spec.pattern()))
    rest: list[int] = []
    try:
        while len(rest) < len(whole) - 6 and eng.eos_id not in rest:
            rest += s.cycle(CycleRequest()).committed
    finally:
        s.close()
    assert [t for t in rest if t != eng.eos_id] == whole[6:]


@pytest.mark.parametrize(
    "kw,word",
    [
        ({"structured": StructuredOutput(regex="(unclosed")}, "cannot be compiled"),
        ({"structured": StructuredOutput(json_schema="[1, 2")}, "JSON schema"),
        ({"structured": StructuredOutput(regex="a", choice=("a",))}, "exactly one"),
        ({"structured": StructuredOutput(regex="a+"), "ignore_eos": True}, "ignore_eos"),
        ({"structured": StructuredOutput(regex="a+"), "min_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_structured_output_is_an_invalid_request(tiny_engine, kw, word):
    """Refused as the request is made, except a pattern that only its compile can judge: that
    one compiles after admission, and its request fails as it starts."""
    with pytest.raises(InvalidRequest, match=word) as e:
        gen = tiny_engine.generate(GenerationRequest(tiny_engine.encode("x"), 8, method="vanilla", **kw))
        assert word == "cannot be compiled", "refused before it is made"
        gen.result()
    assert str(e.value).startswith("structured_output")
