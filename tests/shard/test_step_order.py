"""Pipelined generation steps run in launch order on a threaded shard (``StepOrder``)."""

from __future__ import annotations

import threading
import time

import pytest

from ray_moe.shard.pipeline import StepOrder
from ray_moe.core.errors import ExchangeTimeoutError


def test_a_step_waits_for_the_one_it_follows():
    order = StepOrder()
    ran: list[str] = []

    def second():
        order.wait_turn("s2", "s1", timeout_s=10)
        ran.append("s2")

    th = threading.Thread(target=second)
    th.start()  # s2 arrives first (a threaded actor may start it first)
    time.sleep(0.05)
    assert ran == []
    order.wait_turn("s1", None, timeout_s=10)
    ran.append("s1")
    order.launched("s1")
    th.join(5)
    assert ran == ["s1", "s2"]
    order.wait_turn("s3", "s1", timeout_s=0.1)  # already launched: no wait


def test_a_step_whose_predecessor_never_ran_times_out_by_name():
    with pytest.raises(ExchangeTimeoutError, match="step 's9': the step it follows \\('s8'\\) did not run"):
        StepOrder().wait_turn("s9", "s8", timeout_s=0.05)
