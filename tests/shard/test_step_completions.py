"""Completions of steps done on the device run exactly once, by the launching thread between a piecewise step's
pieces or by the generation thread's queue, whichever comes first (``StepCompletions``); and the piecewise replay
calls its ``between`` hook after every hole, never after the last piece."""

from __future__ import annotations

import threading

import pytest

from ray_moe.model.piecewise import PiecewiseGraph
from ray_moe.shard.pipeline import StepCompletions


def test_the_launching_thread_runs_due_completions_in_order_and_the_queue_then_skips_them():
    done: list[str] = []
    c = StepCompletions()
    jobs = [c.add(lambda n=n: done.append(n) or n) for n in ("s1", "s2")]
    assert c.run_ready() == 2 and done == ["s1", "s2"]
    assert c.run_ready() == 0
    for job in jobs:
        c.run_queued(job)  # the generation thread's turn comes later: nothing runs twice
    assert done == ["s1", "s2"] and [j.result(1) for j in jobs] == ["s1", "s2"]


def test_the_queue_runs_a_completion_no_launch_reached_and_the_launch_then_skips_it():
    done: list[str] = []
    c = StepCompletions()
    job = c.add(lambda: done.append("s1") or 7)
    c.run_queued(job)
    assert c.run_ready() == 0 and done == ["s1"] and job.result(1) == 7


def test_a_completion_error_goes_to_its_waiter_not_to_the_launch_around_it():
    c = StepCompletions()

    def boom():
        raise RuntimeError("step s1: its tokens could not be read")

    bad, good = c.add(boom), c.add(lambda: "s2")
    assert c.run_ready() == 2  # (no error raised here: the launch goes on)
    with pytest.raises(RuntimeError, match="step s1"):
        bad.result(1)
    assert good.result(1) == "s2"


def test_a_waiter_whose_completion_never_runs_times_out():
    job = StepCompletions().add(lambda: None)
    with pytest.raises(TimeoutError, match="did not run within"):
        job.result(0.05)


def test_racing_threads_run_every_completion_exactly_once():
    c = StepCompletions()
    counts = [0] * 400
    lock = threading.Lock()

    def bump(i):
        with lock:
            counts[i] += 1
        return i

    jobs = [c.add(lambda i=i: bump(i)) for i in range(len(counts))]
    stop = threading.Event()

    def launcher():
        while not stop.is_set():
            c.run_ready()

    threads = [threading.Thread(target=launcher) for _ in range(3)]
    for th in threads:
        th.start()
    for job in jobs:
        c.run_queued(job)
    stop.set()
    for th in threads:
        th.join(5)
    assert counts == [1] * len(counts)
    assert [j.result(1) for j in jobs] == list(range(len(counts)))


class _Part:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def replay(self) -> None:
        self.log.append(self.name)

    def run(self, plan, kernels) -> None:
        self.log.append(self.name)


@pytest.mark.parametrize("between", [True, False])
def test_piecewise_replay_calls_between_after_each_hole(between):
    log: list[str] = []
    graph = PiecewiseGraph({})
    graph.pieces = [_Part(f"p{i}", log) for i in range(3)]
    graph.holes = [_Part(f"h{i}", log) for i in range(2)]
    graph.output = "out"
    hook = (lambda: log.append("b")) if between else None
    assert graph.replay({}, plan=None, kernels=None, between=hook) == "out"
    want = ["p0", "h0", "b", "p1", "h1", "b", "p2"]
    assert log == (want if between else [x for x in want if x != "b"])
