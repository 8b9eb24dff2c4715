"""Cycle batcher and batched drafting: sessions step together, each keeps its own result."""

import threading
import time

import torch

from services.common.llama import Llama
from services.common.sampling import make_rng
from services.common.types import Sampling
from services.drafter.draft_lm import DraftLMDrafter
from services.verifier.batcher import CycleBatcher


def run_sessions(batcher: CycleBatcher, requests: dict[str, int]) -> dict[str, object]:
    out: dict[str, object] = {}

    def run(name: str, req: int) -> None:
        try:
            out[name] = batcher.submit(name, req)
        except Exception as e:
            out[name] = e

    for name in requests:
        batcher.opened(name)
    threads = [threading.Thread(target=run, args=kv) for kv in requests.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_open_sessions_share_one_step_and_failures_stay_per_session():
    steps: list[list[str]] = []

    def step(batch):
        steps.append(sorted(b.session for b in batch))
        for b in batch:
            if b.request < 0:
                b.error = ValueError(f"{b.session}: bad request")
            else:
                b.result = b.request * 10

    batcher = CycleBatcher(step, window_s=5.0)  # the window only ends early when all have submitted
    out = run_sessions(batcher, {"a": 1, "b": 2, "c": -1})
    assert steps == [["a", "b", "c"]]
    assert out["a"] == 10 and out["b"] == 20
    assert isinstance(out["c"], ValueError) and "c: bad request" in str(out["c"])


def test_a_crashing_step_fails_every_waiter_and_the_next_step_runs():
    calls = []

    def step(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("forward failed")
        for b in batch:
            b.result = "ok"

    batcher = CycleBatcher(step, window_s=5.0)
    out = run_sessions(batcher, {"a": 1, "b": 1})
    assert all(isinstance(v, RuntimeError) for v in out.values())
    assert batcher.submit("a", 1) == "ok"


def test_lone_session_runs_inline_without_waiting_for_closed_ones():
    batcher = CycleBatcher(
        lambda batch: [setattr(b, "result", threading.current_thread()) for b in batch], window_s=5.0
    )
    batcher.opened("a")
    batcher.opened("b")
    batcher.closed("b")
    t0 = time.monotonic()
    assert batcher.submit("a", 0) is threading.current_thread()
    assert time.monotonic() - t0 < 2.5  # the 5 s window is not awaited: only one session is open


def test_posted_cycles_are_a_whole_step_that_waits_for_no_one():
    """``post_all`` (a router's step over the link or Serve) does not block, and its cycles
    wait for no one: a blocking ``submit`` in its window for another session joins them and
    the step runs at once; each item reaches its callback with its own result or error."""
    steps: list[list[str]] = []

    def step(batch):
        steps.append(sorted(b.session for b in batch))
        for b in batch:
            if b.request < 0:
                b.error = ValueError("bad")
            else:
                b.result = b.request + 1

    batcher = CycleBatcher(step, window_s=5.0)
    for name in "cd":  # per-session streams: c's step waits its window for d
        batcher.opened(name)
    got: dict[str, object] = {}
    done = threading.Event()

    def callback(item):
        got[item.session] = (item.result, item.error, threading.current_thread().name)
        if len(got) == 2:
            done.set()

    t0 = time.monotonic()
    c = threading.Thread(target=lambda: got.__setitem__("c", batcher.submit("c", 5)))
    c.start()
    while not batcher._running and time.monotonic() < t0 + 5:  # c leads, in its window
        time.sleep(0.01)
    batcher.post_all([("a", 1, callback), ("b", -1, callback)])
    c.join(5)
    assert done.wait(5) and time.monotonic() - t0 < 2.5  # d was not waited for
    assert steps == [["a", "b", "c"]] and got["c"] == 6
    assert got["a"][:2] == (2, None) and isinstance(got["b"][1], ValueError)
    batcher.closed("c")
    batcher.closed("d")
    batcher.post_all([("a", 7, callback)])  # a posted cycle alone: the stepper leads it
    end = time.monotonic() + 5
    while got["a"][0] != 8 and time.monotonic() < end:
        time.sleep(0.01)
    assert got["a"][0] == 8 and got["a"][2] == "cycle-stepper"


def test_a_poster_leads_a_step_when_none_is_running_else_the_stepper_runs_it_next():
    """``post_all(lead=True)`` (the link's reader) runs the step in the calling thread when no
    step is running, though a per-session stream's session is expected; behind a running step
    its cycles queue and the stepper runs them as soon as that step ends."""
    threads: list[tuple[list[str], str]] = []
    release = threading.Event()

    def step(batch):
        threads.append((sorted(b.session for b in batch), threading.current_thread().name))
        if "slow" in [b.session for b in batch]:
            release.wait(5)
        for b in batch:
            b.result = b.request + 1

    batcher = CycleBatcher(step, window_s=5.0)
    got: dict[str, int] = {}
    callback = lambda item: got.__setitem__(item.session, item.result)  # noqa: E731
    batcher.opened("a")
    batcher.opened("stream")  # expected, never submits
    t0 = time.monotonic()
    batcher.post_all([("a", 1, callback)], lead=True)  # no hand-off, no wait for the stream
    assert got == {"a": 2} and threads == [(["a"], threading.current_thread().name)]
    assert time.monotonic() - t0 < 2.5
    slow = threading.Thread(target=batcher.post_all, args=([("slow", 0, callback)],), kwargs={"lead": True})
    slow.start()
    while len(threads) < 2 and time.monotonic() < t0 + 5:
        time.sleep(0.01)
    batcher.post_all([("a", 3, callback), ("b", 5, callback)], lead=True)  # behind slow: returns at once
    assert "a" in got and got["a"] == 2
    release.set()
    slow.join(5)
    end = time.monotonic() + 5
    while len(got) < 3 and time.monotonic() < end:
        time.sleep(0.01)
    assert threads[2] == (["a", "b"], "cycle-stepper") and got == {"a": 4, "b": 6, "slow": 1}


def test_a_session_that_missed_the_window_is_not_awaited_again():
    """After a step without ``b``, the next step does not wait for it; once back it is expected."""
    steps: list[list[str]] = []
    batcher = CycleBatcher(
        lambda batch: [steps.append(sorted(b.session for b in batch))] + [setattr(b, "result", 1) for b in batch],
        window_s=0.3,
    )
    batcher.opened("a")
    batcher.opened("b")
    t0 = time.monotonic()
    batcher.submit("a", 0)  # waits the window for the fresh session b, which never comes
    waited = time.monotonic() - t0
    t0 = time.monotonic()
    batcher.submit("a", 0)  # b is no longer expected: no wait
    assert waited >= 0.25 and time.monotonic() - t0 < 0.25
    out = run_sessions_opened(batcher, {"a": 0, "b": 0})
    assert out == {"a": 1, "b": 1}  # b, back, is served again


def run_sessions_opened(batcher: CycleBatcher, requests: dict[str, int]) -> dict[str, object]:
    out: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda k=k, v=v: out.__setitem__(k, batcher.submit(k, v))) for k, v in requests.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_batched_draft_lm_proposals_equal_one_at_a_time(tiny_dirs):
    model = Llama.from_pretrained(tiny_dirs[1])
    prompts = {"a": [5, 17, 300, 42, 9], "b": [7, 7, 8], "c": list(range(100, 130))}
    budgets = {"a": 4, "b": 0, "c": 6}

    def drafter() -> DraftLMDrafter:
        d = DraftLMDrafter(model)
        for k, p in prompts.items():
            d.start(k, p, Sampling(), make_rng(0))
        return d

    one, many = drafter(), drafter()
    for _ in range(3):  # several cycles: cache reuse and rollback across batched proposals
        singles = {k: one.propose(k, b).token_ids for k, b in budgets.items()}
        batched = dict(zip(budgets, (d.token_ids for d in many.propose_batch(list(budgets.items())))))
        assert batched == singles
        assert [len(v) for v in batched.values()] == [4, 0, 6]
        for k, toks in singles.items():
            kept = toks[:2] + [1]  # a partial acceptance plus a correction
            one.observe(k, kept)
            many.observe(k, kept)


def test_absorbed_prompt_chunks_draft_what_the_whole_prompt_drafts(tiny_dirs):
    """A chunked prefill feeds the draft LM the prompt a chunk at a time (``absorb``); the
    drafts that follow are those of the prompt fed at once, and the newest token stays pending."""
    model = Llama.from_pretrained(tiny_dirs[1])
    prompt = list(range(100, 130))
    a, b = DraftLMDrafter(model), DraftLMDrafter(model)
    for d in (a, b):
        d.start("r", prompt, Sampling(), make_rng(0))
    for upto in (8, 16, 27, 40):  # the last asks past the prompt: capped
        a.absorb("r", upto)
        assert a.states["r"].cache_len == min(upto, len(prompt) - 1)
    assert a.propose("r", 4).token_ids == b.propose("r", 4).token_ids
    for d in (a, b):
        d.observe("r", [1, 2])
    assert a.propose("r", 4).token_ids == b.propose("r", 4).token_ids


def test_batched_sampled_drafts_return_q_per_position(tiny_dirs):
    model = Llama.from_pretrained(tiny_dirs[1])
    d = DraftLMDrafter(model)
    d.start("s", [5, 6, 7], Sampling(temperature=0.8, seed=3), torch.Generator().manual_seed(3))
    d.start("g", [5, 6, 7], Sampling(), make_rng(0))
    s, g = d.propose_batch([("s", 3), ("g", 3)])
    assert s.probs is not None and s.probs.shape == (3, model.s.vocab)
    assert torch.allclose(s.probs.sum(-1), torch.ones(3), atol=1e-4)
    assert g.probs is None and len(g.token_ids) == 3


def test_an_item_left_unfinished_is_stepped_again_before_it_returns():
    """A step may advance a cycle without finishing it (``again``: a prompt prefilled in chunks).
    That item goes first in the next step, which waits its window for the sessions of the last
    one (chunks are fed beside the decoding sessions); its callback sees only the final result,
    once; the other sessions' cycles finish in the step that advanced it."""
    steps: list[list[str]] = []
    left = {"long": 2}  # steps before the long prompt's cycle can finish

    def step(batch):
        steps.append([b.session for b in batch])
        for b in batch:
            if b.session == "long" and left["long"] > 0:
                left["long"] -= 1
                b.again = True
            else:
                b.result = (b.session, len(steps))

    batcher = CycleBatcher(step, window_s=0.3)
    got: list = []
    t0 = time.monotonic()
    batcher.post_all([("long", 0, got.append), ("short", 0, got.append)])  # one router step
    end = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < end:
        time.sleep(0.01)
    assert [item.result for item in got] == [("short", 1), ("long", 3)]  # long's callback once, at the end
    assert steps == [["long", "short"], ["long"], ["long"]]
    assert time.monotonic() - t0 > 0.3  # the carried chunk waited out the window for short


def test_the_chunk_fault_delay_holds_only_steps_that_feed_a_chunk():
    """``chunk_delay_s`` (fault injection for tests that cancel a prefill in flight): a step
    that feeds a carried chunk waits it first; a step of fresh cycles does not."""
    began: list[tuple[list[str], float]] = []
    left = {"long": 2}

    def step(batch):
        began.append(([b.session for b in batch], time.monotonic()))
        for b in batch:
            if b.session == "long" and left["long"] > 0:
                left["long"] -= 1
                b.again = True
            else:
                b.result = b.session

    batcher = CycleBatcher(step, window_s=0.0, chunk_delay_s=0.25)
    got: list = []
    t0 = time.monotonic()
    batcher.post_all([("long", 0, got.append)])
    end = time.monotonic() + 5
    while not got and time.monotonic() < end:
        time.sleep(0.01)
    assert [s for s, _ in began] == [["long"], ["long"], ["long"]]
    assert began[0][1] - t0 < 0.2  # the fresh cycle ran at once
    assert began[1][1] - began[0][1] >= 0.25 and began[2][1] - began[1][1] >= 0.25  # each chunk waited
