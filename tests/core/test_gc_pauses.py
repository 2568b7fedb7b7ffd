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


def test_deferred_young_collections_run_at_safe_points_and_close_restores_the_policy():
    """Deferred: allocating many tracked objects between safe points triggers no automatic collection below the
    safety net; each safe point collects once ``young`` objects accumulated, in the generation the thresholds
    name (gen 1 after t1 young ones); close restores Python's thresholds."""
    before = gc.get_threshold()
    g = GcPauses().install()
    held: list = []
    try:
        g.defer_to_safe_points(young=2_000, safety=1_000_000)
        assert gc.get_threshold() == (1_000_000, *before[1:])
        gc.collect()  # counts from zero
        c0 = g.counters()
        gens = []
        for _ in range(before[1] + 3):
            held.append([[i] for i in range(3_000)])  # 3,000 tracked objects alive: past ``young``
            gen = g.safe_point()
            assert gen is not None
            gens.append(gen)
            assert g.safe_point() is None  # nothing accumulated since: no collection
        c = g.counters()
        ran = c["gc_collections"] - c0["gc_collections"]
        assert c["gc_safe_point_collections"] - c0["gc_safe_point_collections"] == len(gens)
        # no automatic collection (3,000 objects a round, the net at 1,000,000); one other thread's explicit
        # gc.collect (Ray's) may land meanwhile
        assert len(gens) <= ran <= len(gens) + 1
        assert gens[:before[1]] == [0] * before[1] and 1 in gens[before[1]:]  # gen 1 once t1 young ones ran
    finally:
        g.close()
    assert gc.get_threshold() == before
    assert g.safe_point() is None  # closed: the policy is Python's again


def test_defer_refuses_a_safety_net_below_young():
    import pytest

    g = GcPauses()
    with pytest.raises(ValueError, match="young=10, safety=5"):
        g.defer_to_safe_points(young=10, safety=5)
    assert g.safe_point() is None
