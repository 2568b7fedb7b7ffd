"""GcPauses: the collector's pauses counted from gc.callbacks, the heap frozen and the callback removed on close."""

from __future__ import annotations

import gc

from ray_moe.core.gc_pauses import GcPauses


def test_counts_each_collection_by_generation_and_pause():
    g = GcPauses().install()
    try:
        before = g.counters()
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        c = g.counters()
    finally:
        g.close()
    assert c["gc_collections"] - before["gc_collections"] >= 3  # (a young collection may also run meanwhile)
    assert c["gc_full_collections"] - before["gc_full_collections"] >= 2  # (another thread may trigger one too)
    assert c["gc_pause_us"] >= c["gc_pause_max_us"] > 0
    gc.collect(2)  # closed: no longer counted
    assert g.counters() == c


def test_freeze_moves_the_live_heap_to_the_permanent_generation():
    g = GcPauses()
    held = [[i] for i in range(1000)]  # alive, tracked
    try:
        frozen = g.freeze()
        # frozen objects that die later leave the permanent generation (other threads of this test session run
        # meanwhile), so the count read after may be lower than at the freeze, never higher
        assert frozen >= gc.get_freeze_count() >= len(held)  # (held is alive: its lists stay frozen)
        assert g.counters()["gc_freezes"] == 1 and g.counters()["gc_frozen_objects"] == frozen
        assert not any(o is held for o in gc.get_objects())  # a frozen object is no longer walked
    finally:
        gc.unfreeze()
    assert any(o is held for o in gc.get_objects())


def test_close_is_idempotent_and_install_once():
    g = GcPauses().install().install()
    assert gc.callbacks.count(g._callback) == 1
    g.close()
    g.close()
    assert g._callback not in gc.callbacks
