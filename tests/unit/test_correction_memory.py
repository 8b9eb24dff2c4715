"""In-process OCM: counts, sliding-window decay, prior restore, snapshot files."""

import pytest

from services.memory.correction_memory import LocalCorrectionMemory, OCMConfig
from services.memory.snapshot import load_snapshot, save_snapshot


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


def test_counts_and_window_decay():
    clock = Clock()
    m = LocalCorrectionMemory(OCMConfig(bucket_seconds=10, num_buckets=3), clock)
    m.record([(1, 2), (1, 2), (3, 4)])
    assert m.lookup(1, 2) == 2 and m.lookup(3, 4) == 1 and m.lookup(2, 1) == 0 and len(m) == 2
    clock.t += 10
    m.record([(1, 2)])
    assert m.lookup(1, 2) == 3
    clock.t += 20  # the first bucket leaves the 3-bucket window
    m.record([])
    assert m.lookup(1, 2) == 1 and m.lookup(3, 4) == 0 and len(m) == 1
    clock.t += 30
    assert m.snapshot() == {}


def test_prior_survives_decay_and_restore_keeps_online_counts(tmp_path):
    clock = Clock()
    m = LocalCorrectionMemory(OCMConfig(bucket_seconds=10, num_buckets=2), clock)
    m.record([(5, 6)])
    m.restore({(7, 8): 4.0, (5, 6): 1.0})
    assert m.lookup(7, 8) == 4 and m.lookup(5, 6) == 2
    clock.t += 100
    m.record([])
    assert m.lookup(7, 8) == 4 and m.lookup(5, 6) == 1
    save_snapshot(tmp_path / "s.json", m.snapshot(), {"note": "x"})
    assert load_snapshot(tmp_path / "s.json") == {(7, 8): 4.0, (5, 6): 1.0}


def test_snapshot_format_is_checked(tmp_path):
    (tmp_path / "bad.json").write_text('{"pairs": []}')
    with pytest.raises(ValueError, match="not an OCM snapshot"):
        load_snapshot(tmp_path / "bad.json")
