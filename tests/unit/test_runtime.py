"""Process-wide GC settings: the start-up heap is frozen unless SPECMESH_GC_FREEZE=0."""

import gc

from services.common.runtime import freeze_startup_heap


def test_freeze_moves_the_live_heap_out_of_collection(monkeypatch):
    gc.unfreeze()
    try:
        monkeypatch.setenv("SPECMESH_GC_FREEZE", "0")
        freeze_startup_heap()
        assert gc.get_freeze_count() == 0
        monkeypatch.delenv("SPECMESH_GC_FREEZE")
        freeze_startup_heap()
        assert gc.get_freeze_count() > 10_000
        assert sum(gc.get_count()) < 100  # collected first: young generations start empty
    finally:
        gc.unfreeze()
