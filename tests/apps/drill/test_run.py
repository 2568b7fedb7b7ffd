"""The drill's entry points without a deployment: progress lines on stderr, the bounded wait for the CPUs the
deployment needs (with the numbers in the message), the command line, and the pure fault inputs."""

from __future__ import annotations

import io
import re

import pytest

from ray_moe.apps.drill import DrillError, DrillOptions, FaultAt, Progress, drill_config, options_from_args
from ray_moe.apps.drill.probes import drift_report, without_dependency
from ray_moe.apps.drill.run import deployment_resources, wait_for_resources
from ray_moe.apps.drill.traffic import classify_failure
from ray_moe.apps.cli import build_parser
from ray_moe.core.errors import CountAgreementError, RouteValidationError, StaleGenerationError
from ray_moe.release.build import check_step_schedule, step_tasks
from ray_moe.release.faults import SafeOutcome


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


# ============================================================================================ progress
def test_progress_lines_go_to_stderr_with_elapsed_seconds(capsys):
    clock = FakeClock()
    p = Progress(clock=clock)
    p("ray: started a local instance (4 CPUs)")
    clock.t += 12.4
    p("fault 3 peer-count-disagreement: abort before payload exchange (ok)")
    out = capsys.readouterr()
    assert out.out == ""  # the report owns stdout
    assert out.err.splitlines() == ["[drill 0s] ray: started a local instance (4 CPUs)",
                                    "[drill 12s] fault 3 peer-count-disagreement: abort before payload exchange (ok)"]
    assert p.lines == out.err.splitlines()


def test_progress_quiet_and_stream():
    buf = io.StringIO()
    Progress(buf)("step 1/10 warm up")
    assert re.fullmatch(r"\[drill \d+s\] step 1/10 warm up\n", buf.getvalue())
    quiet = Progress.silent()
    quiet("kept, not printed")
    assert quiet.lines == ["[drill 0s] kept, not printed"]


# ============================================================================================ resources
CFG = drill_config(DrillOptions(name="res-test", ranks=4))


def test_deployment_resources():
    assert deployment_resources(CFG) == {"CPU": 4 * CFG.actor_cpus}
    gpu = drill_config(DrillOptions(name="res-test", ranks=4, device="cuda"))
    assert deployment_resources(gpu) == {"CPU": 4 * gpu.actor_cpus, "GPU": 4.0}


def test_enough_resources_returns_at_once():
    p = Progress.silent()
    wait_for_resources(CFG, wait_s=30, progress=p, available=lambda: {"CPU": 2.0}, total=lambda: {"CPU": 2.0},
                       sleep=pytest.fail)
    assert p.lines == []


def test_short_cluster_waits_bounded_and_names_the_numbers():
    clock, p = FakeClock(), Progress.silent()
    with pytest.raises(DrillError) as info:
        wait_for_resources(CFG, wait_s=5, progress=p, available=lambda: {"CPU": 0.5}, total=lambda: {"CPU": 8.0},
                           sleep=clock.sleep, clock=clock)
    msg = str(info.value)
    assert "needs 2 CPU (4 ranks x 0.5), 0.5 of 8 available" in msg and "after 5s" in msg
    assert len(p.lines) == 1 and "waiting up to 5s for resources" in p.lines[0] and "needs 2 CPU" in p.lines[0]
    assert 105.0 <= clock.t <= 106.0  # bounded by wait_s


def test_resources_freed_while_waiting():
    clock, p = FakeClock(), Progress.silent()
    free = iter([{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 3.0}])
    wait_for_resources(CFG, wait_s=60, progress=p, available=lambda: next(free), total=lambda: {"CPU": 4.0},
                       sleep=clock.sleep, clock=clock)
    assert p.lines[-1].endswith("resources available") and clock.t == 102.0


def test_too_small_local_instance_fails_without_waiting():
    with pytest.raises(DrillError, match=r"too small.*needs 2 CPU .*1 of 1 available"):
        wait_for_resources(CFG, wait_s=60, progress=Progress.silent(), fixed_size=True,
                           available=lambda: {"CPU": 1.0}, total=lambda: {"CPU": 1.0}, sleep=pytest.fail)


# ============================================================================================ command line
def test_cli_parses_the_address():
    args = build_parser().parse_args(["drill", "rollback", "--address", "local", "--fault-at", "canary", "--json"])
    assert args.address == "local" and args.json
    opts = options_from_args(args)
    assert opts.fault_at is FaultAt.CANARY and opts.name.startswith("rollback-drill-")
    assert build_parser().parse_args(["drill", "rollback"]).address is None


# ============================================================================================ fault inputs
def test_drift_report_changes_one_report():
    reports = ({"report": "a", "body": {}}, {"report": "b", "body": {"x": 1}}, {"report": "c", "body": {}})
    drifted = drift_report(reports, 1)
    assert drifted[1]["body"] == {"x": 1, "drift": 1} and drifted[0] == reports[0] and reports[1]["body"] == {"x": 1}
    with pytest.raises(ValueError):
        drift_report(reports, 3)


def test_without_dependency_breaks_the_schedule():
    tasks = step_tasks(2)
    broken = without_dependency(tasks, "combine_0", "expert_0")
    assert "expert_0" not in next(t for t in broken if t.name == "combine_0").deps
    assert "missing dependency" in check_step_schedule(broken, 2).error
    with pytest.raises(ValueError, match="no dependency"):
        without_dependency(tasks, "combine_0", "route_plan")
    with pytest.raises(ValueError, match="not in the task list"):
        without_dependency(tasks, "combine_9", "expert_9")


def test_classify_failure():
    assert classify_failure(CountAgreementError("step aborted before payload exchange")) \
        is SafeOutcome.ABORT_BEFORE_PAYLOAD_EXCHANGE
    assert classify_failure(CountAgreementError("payload rejected before expert compute")) \
        is SafeOutcome.REJECT_PAYLOAD_BEFORE_EXPERT_COMPUTE
    assert classify_failure(RouteValidationError("output rejected before publish")) \
        is SafeOutcome.REJECT_OUTPUT_BEFORE_PUBLISH
    assert classify_failure(StaleGenerationError("refused")) is SafeOutcome.REJECT_HANDLE_AND_REPLAN
    assert classify_failure(RuntimeError("injected fault")) is None
