"""n completions of one prompt (vLLM's n): each is its own session, completion i of a seeded
request equals the single request with seed + i, and stopping early frees every session."""

from collections import defaultdict

import pytest

from services.common.types import SamplingParams
from services.router.engine import GenerationRequest, InvalidRequest
from tests.conftest import wait_for

PROMPT = "def add(a, b):\n"


def collect(completions):
    steps, ended = defaultdict(list), []
    for i, step in completions:
        if step is None:
            ended.append(i)
        else:
            steps[i] += step.token_ids
    return steps, ended


@pytest.mark.parametrize("method", ["vanilla", "sd"])
def test_seeded_completions_equal_single_requests_with_seed_plus_index(tiny_engine, method):
    eng = tiny_engine
    ids = eng.encode(PROMPT)
    sp = SamplingParams(temperature=1.0, seed=11)
    completions = eng.generate_all(GenerationRequest(ids, 30, sampling=sp, method=method, n=4))
    steps, ended = collect(completions)
    assert sorted(ended) == [0, 1, 2, 3]
    singles = [
        eng.generate(
            GenerationRequest(ids, 30, sampling=SamplingParams(temperature=1.0, seed=11 + i), method=method)
        ).result()["token_ids"]
        for i in range(4)
    ]
    assert [steps[i] for i in range(4)] == singles
    assert [g.output_ids for g in completions.gens] == singles
    assert len({tuple(s) for s in singles}) > 1  # different seeds, different samples
    assert wait_for(lambda: not eng.verifier.sessions)


def test_greedy_completions_are_the_greedy_output(tiny_engine):
    eng = tiny_engine
    ids = eng.encode(PROMPT)
    ref = eng.generate(GenerationRequest(ids, 24, method="vanilla")).result()["token_ids"]
    steps, ended = collect(eng.generate_all(GenerationRequest(ids, 24, method="sd", n=3)))
    assert sorted(ended) == [0, 1, 2] and all(steps[i] == ref for i in range(3))


def test_stopping_early_frees_every_session(tiny_engine):
    eng = tiny_engine
    it = iter(
        eng.generate_all(
            GenerationRequest(eng.encode(PROMPT), 200, sampling=SamplingParams(temperature=1.0), method="sd", n=3)
        )
    )
    for _ in range(4):
        next(it)
    it.close()
    assert wait_for(lambda: not eng.verifier.sessions)


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_an_invalid_request(tiny_engine, n):
    with pytest.raises(InvalidRequest, match=r"^n: must be in \[1, 16\]"):
        tiny_engine.generate_all(GenerationRequest(tiny_engine.encode(PROMPT), 8, method="vanilla", n=n))
