"""WriteBehindMemory's flush contract, over an in-process store (the Redis paths are in
tests/integration/test_redis_memory.py and tests/chaos/test_redis_faults.py)."""

import threading
from collections import Counter

from services.memory.write_behind import WriteBehindMemory


class SlowStore:
    """A store whose first write waits until ``release`` is set."""

    def __init__(self) -> None:
        self.written: Counter = Counter()
        self.entered, self.release = threading.Event(), threading.Event()

    def read(self) -> Counter:
        return Counter(self.written)

    def write(self, batch: Counter) -> None:
        self.entered.set()
        self.release.wait(10)
        self.written.update(batch)

    def replace_prior(self, counts) -> None: ...

    def offer_prior(self, counts) -> None: ...

    def retry_in(self) -> float:
        return 0.0


def test_a_flush_returns_only_once_a_batch_another_thread_had_in_flight_is_written():
    store = SlowStore()
    memory = WriteBehindMemory(store, flush_interval_s=3600)
    try:
        memory.record([(1, 2)] * 3)
        first = threading.Thread(target=memory.flush)
        first.start()
        assert store.entered.wait(5)  # the batch is in flight; pending is empty now
        second = threading.Thread(target=memory.flush)
        second.start()
        second.join(0.3)
        assert second.is_alive(), "flush returned while an earlier batch was still being written"
        store.release.set()
        second.join(5)
        first.join(5)
        assert store.written == Counter({(1, 2): 3})
    finally:
        store.release.set()
        memory.close(timeout_s=1)
