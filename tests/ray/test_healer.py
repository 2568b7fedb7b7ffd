"""RankHealer's policy without Ray: retries with backoff, lineages, left-out events."""

from __future__ import annotations

import time

import pytest

from ray_moe.ray.healer import RankHealer


def _wait(healer: RankHealer, n: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while (len(healer.events) < n or healer.healing) and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(healer.events)


def test_a_failed_start_is_retried_then_heals():
    calls = []

    def add_rank():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise RuntimeError("no GPU free yet")
        return 7

    h = RankHealer(add_rank, retries=3, backoff_s=0.01)
    try:
        h.lost([2])
        ev = _wait(h, 3)
        assert [e.get("attempt") for e in ev[:2]] == [1, 2] and "no GPU free yet" in ev[0]["error"]
        assert ev[2]["lost"] == 2 and ev[2]["replacement"] == 7 and ev[2]["attempts"] == 3 and ev[2]["seconds"] > 0
        assert calls[2] - calls[1] >= calls[1] - calls[0] >= 0.009  # backoff doubles
        assert not h.healing
    finally:
        h.close()


def test_a_line_that_keeps_dying_is_left_out():
    ids = iter(range(10, 20))
    h = RankHealer(lambda: next(ids), retries=2, backoff_s=0.0)
    try:
        h.lost([1])
        assert _wait(h, 1)[-1]["replacement"] == 10
        h.lost([10])  # the replacement died: same line, second loss
        assert _wait(h, 2)[-1]["replacement"] == 11
        h.lost([11])  # third loss of the line: over heal_retries=2
        last = _wait(h, 3)[-1]
        assert last["lost"] == 11 and last["left_out"] and "lost 3 shards" in last["reason"]
        h.lost([5])  # another line still heals
        assert _wait(h, 4)[-1] == {"lost": 5, "replacement": 12, "attempts": 1, "seconds": pytest.approx(0, abs=1)}
    finally:
        h.close()


def test_every_attempt_failing_is_left_out_and_bad_config_refused():
    def boom():
        raise OSError("actor start failed")

    h = RankHealer(boom, retries=2, backoff_s=0.0)
    try:
        h.lost([0])
        ev = _wait(h, 3)
        assert [e.get("attempt") for e in ev[:2]] == [1, 2]
        assert ev[2] == {"lost": 0, "left_out": True, "reason": "2 start attempts failed"}
    finally:
        h.close()
    with pytest.raises(ValueError, match="retries=0"):
        RankHealer(boom, retries=0)
