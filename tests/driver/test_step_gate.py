"""The step gate: a holder learns that another thread waits for it (and drains); re-entrant for its holder."""

from __future__ import annotations

import threading
import time

from ray_moe.driver.step_gate import StepGate


def test_a_waiting_thread_makes_the_gate_contended_until_it_gets_in():
    gate = StepGate()
    got = threading.Event()
    with gate:
        with gate:  # re-entrant for the holder, and the holder never counts as waiting
            assert not gate.contended
        th = threading.Thread(target=lambda: (gate.__enter__(), got.set(), gate.__exit__(None, None, None)))
        th.start()
        deadline = time.time() + 5
        while not gate.contended and time.time() < deadline:
            time.sleep(0.005)
        assert gate.contended and not got.is_set()
    th.join(5)
    assert got.is_set() and not gate.contended
