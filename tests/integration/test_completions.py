"""n completions of one prompt (vLLM's n): each is its own session, completion i of a seeded
request equals the single request with seed + i, and stopping early frees every session."""

from collections import defaultdict

import pytest

from services.common.types import Sampling
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
    sp = Sampling(temperature=1.0, seed=11)
    completions = eng.generate_all(GenerationRequest(ids, 30, sampling=sp, method=method, n=4))
    steps, ended = collect(completions)
    assert sorted(ended) == [0, 1, 2, 3]
    singles = [
        eng.generate(
            GenerationRequest(ids, 30, sampling=Sampling(temperature=1.0, seed=11 + i), method=method)
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
            GenerationRequest(eng.encode(PROMPT), 200, sampling=Sampling(temperature=1.0), method="sd", n=3)
        )
    )
    for _ in range(4):
        next(it)
    it.close()
    assert wait_for(lambda: not eng.verifier.sessions)


def test_result_after_streaming_reports_that_run_without_running_again(tiny_engine):
    """``Generation.result()`` on a completion already streamed (as the offline ``LLM`` reads its
    stats) reports the streamed run; it does not open a session and decode again (sampled, unseeded:
    a second run would differ)."""
    eng = tiny_engine
    completions = eng.generate_all(
        GenerationRequest(eng.encode(PROMPT), 40, sampling=Sampling(temperature=1.0), method="sd", n=2)
    )
    steps, ended = collect(completions)
    opened = len(eng.verifier.sessions)
    assert sorted(ended) == [0, 1]
    assert [g.result()["token_ids"] for g in completions.gens] == [steps[0], steps[1]]
    assert len(eng.verifier.sessions) == opened == 0


def test_an_async_consumer_streams_the_same_and_cancelled_it_frees_every_session(tiny_engine):
    """``Completions.stream`` (the Ray ingress's Generate): the same outputs as iterating; a
    consumer cancelled mid-stream (its client gone) cancels every completion at once, and
    the scheduler closes their sessions."""
    import asyncio

    eng = tiny_engine
    ids = eng.encode(PROMPT)
    ref = eng.generate(GenerationRequest(ids, 24, method="vanilla")).result()["token_ids"]

    async def collect_async(completions):
        steps = defaultdict(list)
        async for i, step in completions.stream():
            steps[i] += step.token_ids if step is not None else []
        return steps

    steps = asyncio.run(collect_async(eng.generate_all(GenerationRequest(ids, 24, method="sd", n=2))))
    assert steps[0] == ref == steps[1]

    long = eng.generate_all(
        GenerationRequest(ids, 200, sampling=Sampling(temperature=1.0), method="sd", n=3, ignore_eos=True)
    )

    async def cancel_after_first():
        stream = long.stream()
        task = asyncio.ensure_future(anext(stream))
        await task  # the first output: decoding
        while True:  # outputs of one step arrive together: take those already here
            follow = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)
            if not follow.done():
                break
            await follow
        follow.cancel()  # the consumer leaves while waiting for the next output
        with pytest.raises(asyncio.CancelledError):
            await follow
        await stream.aclose()

    asyncio.run(cancel_after_first())
    assert all(g.cancelled for g in long.gens)
    assert wait_for(lambda: not eng.verifier.sessions)
    assert all(len(g.output_ids) < 200 for g in long.gens)


def test_async_streams_wait_for_outputs_without_holding_a_worker_thread(tiny_engine):
    """The Ray ingress serves every stream on one event loop whose default executor has a few
    workers (min(32, cores + 4)): a stream waiting for its next output must not hold one, or
    the streams beyond the workers stall behind those waiting. With one worker, and that one
    taken (after the streams' starts) by a task that ends only once every stream has finished,
    4 streams still finish."""
    import asyncio
    import concurrent.futures
    import threading

    eng = tiny_engine
    ids = eng.encode(PROMPT)
    ref = eng.generate(GenerationRequest(ids, 16, method="vanilla")).result()["token_ids"]

    async def consume(completions):
        return [t for _, step in [x async for x in completions.stream()] if step is not None for t in step.token_ids]

    async def run():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        gens = [eng.generate_all(GenerationRequest(ids, 16, method="sd")) for _ in range(4)]
        streams = [asyncio.ensure_future(consume(g)) for g in gens]
        await asyncio.sleep(0)  # each stream has asked the worker for its start (a short call)
        finished = threading.Event()
        holder = loop.run_in_executor(None, finished.wait, 60)  # then the only worker is taken
        try:
            return await asyncio.wait_for(asyncio.gather(*streams), 20)
        finally:
            finished.set()
            await holder

    assert asyncio.run(run()) == [ref] * 4


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_an_invalid_request(tiny_engine, n):
    with pytest.raises(InvalidRequest, match=r"^n: must be in \[1, 16\]"):
        tiny_engine.generate_all(GenerationRequest(tiny_engine.encode(PROMPT), 8, method="vanilla", n=n))


def test_completions_share_the_scheduler_s_steps_without_a_thread_each(tiny_engine):
    """The engine's scheduler steps every completion (one thread for all of them): the steps
    are fewer than the completions' cycles, and no thread is started per completion."""
    import threading

    eng = tiny_engine
    sp = Sampling(temperature=1.0, seed=3)
    completions = eng.generate_all(GenerationRequest(eng.encode(PROMPT), 24, sampling=sp, method="sd", n=6))
    eng.generate(GenerationRequest(eng.encode(PROMPT), 1, method="vanilla")).result()  # the scheduler's thread runs
    threads, steps = threading.active_count(), eng.scheduler.steps
    most = threads
    for _ in completions:
        most = max(most, threading.active_count())
    cycles = sum(g.stats.cycles for g in completions.gens)
    assert most == threads
    assert eng.scheduler.steps - steps < cycles / 2  # six sessions to most steps
