"""Communication-compute overlap as a dependency schedule (spec 0x09B-0x09F): the eleven-task fixture's
serialized and overlapped tables, H_optimistic, the compute/communication intersection, buffer lifetimes
derived from the schedule, and the failure lab's rejections."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.release.lifetimes import check_release
from ray_moe.release.schedule import (
    BufferUse,
    Claim,
    Schedule,
    ScheduledTask,
    SchedulePolicy,
    StepStreams,
    Task,
    buffer_lifetimes,
    compare,
    moe_step_buffers,
    moe_step_tasks,
    schedule_operations,
    schedule_overlapped,
    schedule_serialized,
    validate_tasks,
)


def fixture_tasks() -> tuple[Task, ...]:
    """The eleven tasks of spec 0x09B."""
    return moe_step_tasks(route_units=1, pack_units=(1, 1), dispatch_units=(3, 3), shared_units=5,
                          expert_units=(4, 2), combine_units=(2, 2), reduce_units=1)


SERIALIZED = {
    "route_plan": (0, 1), "pack_0": (1, 2), "pack_1": (2, 3), "dispatch_0": (3, 6), "dispatch_1": (6, 9),
    "shared_path": (9, 14), "expert_0": (14, 18), "expert_1": (18, 20), "combine_0": (20, 22),
    "combine_1": (22, 24), "reduce": (24, 25),
}
OVERLAPPED = {
    "route_plan": (0, 1), "pack_0": (1, 2), "pack_1": (2, 3), "dispatch_0": (2, 5), "dispatch_1": (5, 8),
    "shared_path": (1, 6), "expert_0": (6, 10), "expert_1": (10, 12), "combine_0": (10, 12),
    "combine_1": (12, 14), "reduce": (14, 15),
}
LIFETIMES = {  # spec 0x09D: allocated, last consumer ends (= release)
    "send_0": (1, 5), "send_1": (2, 8), "receive_0": (5, 10), "receive_1": (8, 12),
    "expert_out_0": (10, 12), "expert_out_1": (12, 14), "shared_out": (6, 15),
    "combined_0": (12, 15), "combined_1": (14, 15),
}


def test_fixture_dag_matches_spec_table():
    t = {x.name: x for x in fixture_tasks()}
    assert len(t) == 11
    assert {n: (x.units, x.stream) for n, x in t.items()} == {
        "route_plan": (1, "control"), "pack_0": (1, "pack"), "pack_1": (1, "pack"),
        "dispatch_0": (3, "communication"), "dispatch_1": (3, "communication"), "shared_path": (5, "compute"),
        "expert_0": (4, "compute"), "expert_1": (2, "compute"), "combine_0": (2, "communication"),
        "combine_1": (2, "communication"), "reduce": (1, "compute"),
    }
    assert t["expert_1"].deps == ("dispatch_1",)  # dispatch_0 does not authorize expert_1
    assert t["combine_1"].deps == ("expert_1",)  # expert_0 does not authorize combine_1
    assert set(t["reduce"].deps) == {"combine_0", "combine_1", "shared_path"}


def test_serialized_schedule():
    s = schedule_serialized(fixture_tasks())
    assert s.policy is SchedulePolicy.SERIALIZED and s.evidence == "analytical"
    assert s.intervals == SERIALIZED
    assert s.makespan == s.total_units == 25


def test_overlapped_schedule_reproduces_the_spec_table():
    s = schedule_overlapped(fixture_tasks())
    assert s.policy is SchedulePolicy.OVERLAPPED
    assert s.intervals == OVERLAPPED
    assert s.makespan == 15


def test_overlap_report():
    r = compare(fixture_tasks())
    assert r.evidence == "analytical"
    assert (r.serialized_units, r.overlapped_units, r.hidden_units) == (25, 15, 10)
    assert r.compute_comm_overlap_units == 8
    # 8 of the 10 hidden units overlap compute with communication: not all hidden time is communication
    assert r.compute_comm_overlap_units < r.hidden_units
    d = r.as_dict()
    assert d["evidence"] == "analytical" and d["overlapped"] == OVERLAPPED


def test_busy_unions():
    s = schedule_overlapped(fixture_tasks())
    assert s.busy(["compute"]) == [(1, 12), (14, 15)]
    assert s.busy(["communication"]) == [(2, 8), (10, 14)]
    assert s.overlap_units(["pack"], ["communication"]) == 1  # pack_1 [2,3) under dispatch_0


def test_buffer_lifetimes_derived_from_schedule():
    s = schedule_overlapped(fixture_tasks())
    led = buffer_lifetimes(s, moe_step_buffers(2))
    assert led.evidence == "analytical"
    assert {b.name: (b.start, b.end) for b in led.buffers} == LIFETIMES
    assert led["send_1"].last_completion == "dispatch_1"
    assert led["shared_out"].last_completion == "reduce"


def test_buffer_lifetimes_follow_the_schedule_not_a_table():
    slow = moe_step_tasks(route_units=1, pack_units=(1, 1), dispatch_units=(3, 6), shared_units=5,
                          expert_units=(4, 2), combine_units=(2, 2), reduce_units=1)
    s = schedule_overlapped(slow)
    led = buffer_lifetimes(s, moe_step_buffers(2))
    assert s.interval("dispatch_1") == (5, 11)
    assert (led["send_1"].start, led["send_1"].end) == (2, 11)
    assert (led["receive_1"].start, led["receive_1"].end) == (11, 13)


def test_schedule_passes_last_reader_release_check():
    s = schedule_overlapped(fixture_tasks())
    uses = moe_step_buffers(2)
    led = buffer_lifetimes(s, uses)
    report = check_release(led.buffers, schedule_operations(s, uses))
    assert dict((b, tau) for b, _, tau in report.last_reader) == {n: e for n, (_, e) in LIFETIMES.items()}


@pytest.mark.parametrize(
    "buffer, release, needle",
    [
        ("send_1", 3, "early send release"),  # released when pack_1 ends; dispatch_1 still reads it
        ("shared_out", 6, "early output release"),  # released when the shared FC2 ends; reduce still reads it
        ("expert_out_0", 11, "early expert release"),  # reused while combine_0 is in flight
    ],
)
def test_early_release_is_rejected(buffer, release, needle):
    s = schedule_overlapped(fixture_tasks())
    uses = moe_step_buffers(2)
    bufs = tuple(dataclasses.replace(b, end=release) if b.name == buffer else b
                 for b in buffer_lifetimes(s, uses).buffers)
    with pytest.raises(ValueError, match=needle):
        check_release(bufs, schedule_operations(s, uses))


def test_consumer_must_wait_for_producer():
    s = schedule_overlapped(fixture_tasks())
    with pytest.raises(ValueError, match="missing dependency: 'expert_1' consumes buffer 'receive_0'"):
        buffer_lifetimes(s, (BufferUse("receive_0", "dispatch_0", ("expert_1",)),))
    with pytest.raises(ValueError, match="'ghost' is not in the schedule"):
        buffer_lifetimes(s, (BufferUse("x", "ghost", ("reduce",)),))


def test_claim_at_producer_start_vs_completion():
    s = schedule_overlapped(fixture_tasks())
    led = buffer_lifetimes(s, (BufferUse("a", "expert_0", ("combine_0",), Claim.PRODUCER_START),
                               BufferUse("b", "expert_0", ("combine_0",))))
    assert (led["a"].start, led["b"].start) == (6, 10)


# ---------------------------------------------------------------------------------------------- validation


def _given(intervals: dict[str, tuple[float, float]], tasks=None) -> Schedule:
    tasks = {t.name: t for t in (tasks or fixture_tasks())}
    return Schedule(tuple(ScheduledTask(tasks[n], s, e) for n, (s, e) in intervals.items()))


def test_given_schedule_accepts_the_spec_tables():
    assert _given(OVERLAPPED).makespan == 15
    assert _given(SERIALIZED).makespan == 25


def test_expert_starting_at_dispatch_launch_is_rejected():
    bad = dict(OVERLAPPED, expert_0=(2, 6))
    with pytest.raises(ValueError, match="dependency violated: 'expert_0' starts at 2 before its dependency "
                                         "'dispatch_0' completes at 5"):
        _given(bad)


def test_two_communication_tasks_on_one_stream_collide():
    bad = dict(OVERLAPPED, dispatch_1=(3, 6), expert_1=(10, 12))
    with pytest.raises(ValueError, match="stream collision: 'dispatch_0' \\[2,5\\) and 'dispatch_1' \\[3,6\\)"):
        _given(bad)


def test_duration_mismatch_is_rejected():
    with pytest.raises(ValueError, match="expert_1: interval \\[10,11\\) does not match duration 2"):
        _given(dict(OVERLAPPED, expert_1=(10, 11)))


def test_missing_dependency_is_rejected():
    tasks = fixture_tasks() + (Task("late", 1, "compute", ("ghost",)),)
    for fn in (schedule_overlapped, schedule_serialized, validate_tasks):
        with pytest.raises(ValueError, match="missing dependency: task 'late' waits for undeclared task 'ghost'"):
            fn(tasks)


def test_cycle_is_rejected():
    tasks = tuple(dataclasses.replace(t, deps=("reduce",)) if t.name == "route_plan" else t for t in fixture_tasks())
    with pytest.raises(ValueError, match="cyclic dependency"):
        schedule_overlapped(tasks)
    with pytest.raises(ValueError, match="cyclic dependency"):
        schedule_serialized(tasks)
    with pytest.raises(ValueError, match="cyclic dependency: task 'x' depends on itself"):
        Task("x", 1, "compute", ("x",))


def test_stream_issue_order_deadlock_is_rejected():
    # combine_0 is issued to the communication stream before dispatch_0, which it transitively waits for
    t = {x.name: x for x in fixture_tasks()}
    order = ["route_plan", "pack_0", "pack_1", "combine_0", "dispatch_0", "dispatch_1", "shared_path",
             "expert_0", "expert_1", "combine_1", "reduce"]
    with pytest.raises(ValueError, match="stream order deadlock"):
        schedule_overlapped([t[n] for n in order])
    assert schedule_serialized([t[n] for n in order]).makespan == 25  # one-at-a-time order is still legal


def test_duplicate_and_bad_fields():
    with pytest.raises(ValueError, match="duplicate task name 'a'"):
        validate_tasks([Task("a", 1, "s"), Task("a", 1, "s")])
    with pytest.raises(ValueError, match=r"a.units=-1: expected a finite duration >= 0"):
        Task("a", -1, "s")
    with pytest.raises(ValueError, match=r"a.stream=''"):
        Task("a", 1, "")
    with pytest.raises(ValueError, match="x.consumers: empty"):
        BufferUse("x", "a", ())
    with pytest.raises(ValueError, match="dispatch_units: 1 entries for 2 chunks"):
        moe_step_tasks(route_units=1, pack_units=(1, 1), dispatch_units=(3,), shared_units=None,
                       expert_units=(1, 1), combine_units=(1, 1), reduce_units=1)


# ---------------------------------------------------------------------------------------------- generality


def test_three_chunks_without_shared_path_and_custom_streams():
    streams = StepStreams(communication="nccl", compute="experts")
    tasks = moe_step_tasks(route_units=0.5, pack_units=(0.25,) * 3, dispatch_units=(1.5, 1.0, 2.0),
                           shared_units=None, expert_units=(2.0, 1.0, 0.5), combine_units=(1.0,) * 3,
                           reduce_units=0.5, streams=streams)
    r = compare(tasks, compute_streams=("experts",), communication_streams=("nccl",))
    assert r.serialized_units == pytest.approx(sum(t.units for t in tasks))
    assert r.overlapped_units < r.serialized_units
    led = buffer_lifetimes(r.overlapped, moe_step_buffers(3, shared=False))
    assert len(led.buffers) == 12
    assert led["combined_2"].end == r.overlapped.makespan


@st.composite
def random_dags(draw):
    n = draw(st.integers(1, 9))
    streams = ["a", "b", "c"]
    tasks = []
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), unique=True, max_size=3)) if i else []
        tasks.append(Task(f"t{i}", draw(st.integers(0, 5)), draw(st.sampled_from(streams)),
                          tuple(f"t{j}" for j in deps)))
    return tuple(tasks)


def _critical_path(tasks):
    end = {}
    for t in tasks:  # listed in topological order by construction
        end[t.name] = max((end[d] for d in t.deps), default=0) + t.units
    return max(end.values())


@settings(max_examples=60, deadline=None)
@given(tasks=random_dags())
def test_overlapped_schedule_is_valid_and_bounded(tasks):
    ov = schedule_overlapped(tasks)  # Schedule validates deps, durations and stream exclusion itself
    se = schedule_serialized(tasks)
    per_stream = {}
    for t in tasks:
        per_stream[t.stream] = per_stream.get(t.stream, 0) + t.units
    assert max(_critical_path(tasks), max(per_stream.values())) <= ov.makespan <= se.makespan
    assert se.makespan == sum(t.units for t in tasks)
    # in-order issue per stream: each task starts exactly when its last predecessor (dep or stream) ends
    prev = {}
    for t in tasks:
        e = ov[t.name]
        lim = [ov[d].end for d in t.deps] + ([ov[prev[t.stream]].end] if t.stream in prev else [])
        assert e.start == max(lim, default=0)
        prev[t.stream] = t.name
