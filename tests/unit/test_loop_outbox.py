"""Outputs handed to an event loop's streams (services/router/engine.py, LoopOutbox): one wake-up
of the loop for everything put while it was busy, every queue's items in order, nothing kept
for a closed or collected loop."""

import asyncio
import gc
import threading
import weakref

from services.router.engine import LoopOutbox, LoopQueue


def test_puts_while_the_loop_is_busy_cost_one_wake_up_and_keep_each_queues_order():
    loop = asyncio.new_event_loop()
    wakeups = []
    schedule = loop.call_soon_threadsafe
    deliveries = lambda: [a for a in wakeups if getattr(a[0], "__name__", "") == "_deliver"]  # noqa: E731
    loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), schedule(*a))[1]  # type: ignore[method-assign]
    runner = threading.Thread(target=loop.run_forever)
    runner.start()
    try:
        busy, go = threading.Event(), threading.Event()
        schedule(lambda: (busy.set(), go.wait(10)))  # the loop is held: the puts below pile up
        busy.wait(10)
        qs = [LoopQueue(loop) for _ in range(10)]
        for i in range(100):
            qs[i % 10].put(i)
        go.set()
        got = asyncio.run_coroutine_threadsafe(drain(qs, 10), loop).result(10)
        assert len(deliveries()) == 1  # one delivery for the hundred puts
        assert got == [[i for i in range(100) if i % 10 == q] for q in range(10)]
        qs[0].put("next")  # nothing pending: the next put wakes the loop again
        assert asyncio.run_coroutine_threadsafe(drain(qs[:1], 1), loop).result(10) == [["next"]]
        assert len(deliveries()) == 2
    finally:
        schedule(loop.stop)
        runner.join(10)
        loop.close()
    qs[3].put("late")  # the loop is closed: dropped, and the outbox keeps nothing
    assert LoopOutbox.of(loop)._items == []


async def drain(qs, each: int) -> list[list]:
    return [[await q.get() for _ in range(each)] for q in qs]


def test_a_stream_s_queue_does_not_keep_its_loop_alive():
    loop = asyncio.new_event_loop()
    q = LoopQueue(loop)
    loop.close()
    gone = weakref.ref(loop)
    del loop
    gc.collect()
    assert gone() is None
    q.put("after")  # its loop is gone: dropped without error
