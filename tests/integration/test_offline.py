"""The offline batch API (``from specmesh import LLM, SamplingParams``), vLLM's ``LLM``: every
prompt's output in order, equal to the engine's own; requests checked before any decodes."""

import pytest
from prometheus_client import REGISTRY

from services.common.metrics import CYCLES
from services.router.engine import GenerationRequest
from specmesh import LLM, SamplingParams

PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n", "class A:\n    pass\n\nclass", "x = [1, 2"]


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    target, draft = tiny_dirs
    with LLM(
        target, draft=draft, max_num_seqs=3, num_speculative_tokens=4, draft_confidence=0.0, max_new_tokens_limit=200
    ) as llm:
        yield llm


def vanilla(tiny_engine, prompt: str | None, n: int, ids: list[int] | None = None) -> list[int]:
    ids = ids if ids is not None else tiny_engine.encode(prompt, add_special_tokens=True)
    return tiny_engine.generate(GenerationRequest(ids, n, method="vanilla", ignore_eos=True)).result()["token_ids"]


def batched_steps() -> float:
    """Verifier steps so far that verified more than one session."""
    le1 = REGISTRY.get_sample_value("specmesh_verify_batch_size_bucket", {"le": "1.0"}) or 0.0
    return (REGISTRY.get_sample_value("specmesh_verify_batch_size_count") or 0.0) - le1


@pytest.mark.parametrize("method", ["vanilla", "sd", "suffix"])
def test_a_greedy_batch_equals_vanilla_prompt_by_prompt_in_order(llm, tiny_engine, method):
    """Up to max_num_seqs (3) requests decode at once, their cycles in shared verifier steps."""
    before = batched_steps()
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), method=method, use_tqdm=False
    )
    assert batched_steps() > before
    assert [o.prompt for o in outs] == PROMPTS
    for p, o in zip(PROMPTS, outs):
        (c,) = o.outputs
        assert c.token_ids == vanilla(tiny_engine, p, 30), (method, p)
        assert c.finish_reason == "length" and c.text == llm.get_tokenizer().decode(c.token_ids)
        assert o.metrics["cycles"] >= 1


def test_the_default_method_is_the_engines_and_token_id_prompts_work(llm, tiny_engine):
    assert llm.method == llm.engine.default_method
    ids = tiny_engine.encode(PROMPTS[0], add_special_tokens=True)
    (out,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out.prompt is None and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == vanilla(tiny_engine, PROMPTS[0], 12)


def test_seeded_n_completions_repeat_and_differ(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    (a,) = llm.generate(PROMPTS[1], sp, method="sd", use_tqdm=False)
    (b,) = llm.generate([PROMPTS[1]], sp, method="sd", use_tqdm=False)
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # seed + i per completion
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_stop_strings_logprobs_and_per_prompt_params(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (free,) = llm.generate(PROMPTS[0], greedy, use_tqdm=False)
    stop = free.outputs[0].text[5:8]
    outs = llm.generate(
        PROMPTS[:2],
        [
            SamplingParams(temperature=0, max_tokens=40, stop=stop, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    s, lp = outs[0].outputs[0], outs[1].outputs[0]
    assert s.finish_reason == "stop" and s.stop_reason == stop and free.outputs[0].text.startswith(s.text)
    assert stop not in s.text
    assert len(lp.logprobs) == len(lp.token_ids) == 6
    assert all(t in d and 2 <= len(d) <= 3 for t, d in zip(lp.token_ids, lp.logprobs))
    assert lp.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(lp.token_ids, lp.logprobs)))
    for t, d in zip(lp.token_ids, lp.logprobs):  # greedy: the chosen token is the most likely
        assert d[t].rank == 1 and d[t].decoded_token == llm.get_tokenizer().decode([t])
        assert sorted(x.rank for x in d.values()) == [1, 2]
    assert s.logprobs is None and s.cumulative_logprob is None and outs[0].prompt_logprobs is None


def test_prompt_logprobs_are_the_targets(llm, tiny_engine):
    """prompt_logprobs: None for the first prompt token, then each token's log-probability
    given those before it, as the engine reports them."""
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    (out,) = llm.generate(PROMPTS[0], sp, use_tqdm=False)
    ids = tiny_engine.encode(PROMPTS[0], add_special_tokens=True)
    ref = tiny_engine.generate(GenerationRequest(ids, 2, method="vanilla", prompt_logprobs=1)).result()[
        "prompt_logprobs"
    ]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for tok, d, r in zip(ids[1:], out.prompt_logprobs[1:], ref):
        assert d[tok].logprob == pytest.approx(r["logprob"], abs=1e-5)


def test_a_bad_request_fails_before_any_decodes_naming_its_prompt(llm):
    cycles = sum(s.value for m in CYCLES.collect() for s in m.samples if s.name.endswith("_total"))
    bad = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0, top_p=1.5)]
    with pytest.raises(ValueError, match=r"prompt 1: top_p"):
        llm.generate(PROMPTS[:2], bad, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 0: max_tokens"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=100_000), use_tqdm=False)
    with pytest.raises(ValueError, match=r"one per prompt \(2\)"):
        llm.generate(PROMPTS[:2], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 0: must be text"):
        llm.generate([3.5], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 0: method: unknown method 'nope'"):
        llm.generate(PROMPTS[0], method="nope", use_tqdm=False)
    assert sum(s.value for m in CYCLES.collect() for s in m.samples if s.name.endswith("_total")) == cycles


def test_structured_outputs_and_bad_words(llm):
    """vLLM's structured_outputs (a choice, a regex) constrain the output; a bad word is never completed."""
    sp = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes", "no"]})
    outs = llm.generate(PROMPTS, sp, method="sd", use_tqdm=False)
    assert all(o.outputs[0].text in ("yes", "no") for o in outs)
    (out,) = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=6, structured_outputs={"regex": "[0-9]{3}"}),
        use_tqdm=False,
    )
    assert len(out.outputs[0].text) == 3 and out.outputs[0].text.isdigit()
    (free,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    word = llm.get_tokenizer().decode(free.outputs[0].token_ids[:1]).strip()
    assert word  # the greedy output's first word, banned next
    (banned,) = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word]), use_tqdm=False
    )
    assert banned.outputs[0].token_ids[0] != free.outputs[0].token_ids[0]
    with pytest.raises(ValueError, match=r"prompt 0: structured_outputs: set exactly one"):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]}), use_tqdm=False)


TEMPLATE = (
    "{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def test_chat_renders_each_conversation_through_the_template(llm, tiny_engine):
    conv = [{"role": "user", "content": "add two numbers"}]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (one,) = llm.chat(conv, sp, chat_template=TEMPLATE, use_tqdm=False)
    ids = llm.get_tokenizer()("# user: add two numbers\n# assistant:\n", add_special_tokens=False)["input_ids"]
    assert one.prompt_token_ids == ids and one.outputs[0].token_ids == vanilla(tiny_engine, None, 10, ids)
    two = llm.chat(
        [conv, conv + [{"role": "assistant", "content": "ok"}]],
        sp,
        chat_template=TEMPLATE,
        add_generation_prompt=False,
        use_tqdm=False,
    )
    tok = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in two] == [
        tok(t, add_special_tokens=False)["input_ids"]
        for t in ("# user: add two numbers\n", "# user: add two numbers\n# assistant: ok\n")
    ]
    with pytest.raises(ValueError, match=r"conversation 0: messages: the served model has no chat template"):
        llm.chat(conv, sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r"conversation 1: messages\[0\]: must be an object"):
        llm.chat([conv, ["hi"]], sp, chat_template=TEMPLATE, use_tqdm=False)
