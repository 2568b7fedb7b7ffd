"""The rollback drill on the local Ray instance: the ten faults of spec 0x0E injected into a live deployment,
the ordered rollback of 0x0EA for a candidate faulted at CANARY and at ACTIVE, the promotion gate of 0x0DC,
and every output served during the drill equal to the reference.

Two drills run (one per ``fault_at``), once each for the module; the assertions read their reports. The gate
thresholds are lowered (N_shadow >= 6, N_canary >= 10) to keep the file short on two shared cores; the CLI
uses the spec's (>= 100, >= 200).
"""

from __future__ import annotations

import json
import re

import pytest

from ray_moe.apps.drill import DrillOptions, DrillReport, FaultAt, Progress, render_text, run_drill
from ray_moe.release.faults import FaultKind, SafeOutcome
from ray_moe.release.gate import GateClause, GateThresholds
from ray_moe.release.rollback import STEP_ORDER

THRESHOLDS = GateThresholds(min_shadow=6, min_canary=10)
MODES = (FaultAt.CANARY, FaultAt.ACTIVE)
PROGRESS: dict[FaultAt, Progress] = {}


@pytest.fixture(scope="module")
def reports(ray_session) -> dict[FaultAt, DrillReport]:
    """One drill per fault point. The CANARY drill injects every data-path fault on every rank (all_faults).
    Each keeps its progress lines (``PROGRESS``) without printing them."""
    out = {}
    for mode in MODES:
        opts = DrillOptions(name=f"drill-live-{mode.value}", fault_at=mode, thresholds=THRESHOLDS, steps=6,
                            all_faults=mode is FaultAt.CANARY)
        PROGRESS[mode] = Progress(quiet=True)
        out[mode] = run_drill(opts, progress=PROGRESS[mode])
    return out


def _graph_key_unsupported(report: DrillReport) -> bool:
    row = next(r for r in report.faults if r.fault is FaultKind.GRAPH_KEY_MISMATCH)
    return "not injectable" in row.detail


def _release_events(report: DrillReport, release_id: str) -> list[str]:
    return [e.event for e in report.timeline if e.source == "release" and e.subject == release_id]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_ten_faults_have_their_safe_outcomes(reports, mode):
    rep = reports[mode]
    assert [r.fault for r in rep.faults] == list(FaultKind)  # all ten, in the spec's order
    for r in rep.faults:
        if r.fault is FaultKind.GRAPH_KEY_MISMATCH:
            continue  # asserted in its own test (the runtime's graph-key fault may be absent)
        assert r.passed and r.observed is r.expected, (r.fault.value, r.detail)
    by = {r.fault: r for r in rep.faults}
    ranks = 4 if rep.options.all_faults else 1
    # 1: the drifted report hashes differently after build -> never VERIFIED
    assert "BUILT -> RETIRED" in by[FaultKind.REPORT_HASH_DRIFT].detail
    assert _release_events(rep, rep.releases["drift-probe"]) == ["BUILT", "BUILT->RETIRED"]
    # 2: another process-group epoch: refused after VERIFIED, nothing staged
    assert _release_events(rep, rep.releases["pg-probe"]) == ["BUILT", "BUILT->VERIFIED", "VERIFIED->RETIRED"]
    assert "nothing staged" in by[FaultKind.PROCESS_GROUP_GENERATION_MISMATCH].detail
    # 3, 7: every rank aborted the step before payload; 4: the faulted rank rejected its output at publish
    # (the others finished their exchanges, so none hangs), the driver published nothing; every retried
    # batch returned the reference output
    for kind in (FaultKind.PEER_COUNT_DISAGREEMENT, FaultKind.FP8_SCALE_COUNT_MISMATCH):
        d = by[kind].detail
        assert d.count("aborted on ranks [0, 1, 2, 3]") == ranks, d
        assert d.count("retry equals the reference") == ranks, d
    d4 = by[FaultKind.CORRUPT_INVERSE_PERMUTATION].detail
    for part in d4.split("; rank ")[:ranks]:
        r = int(part.removeprefix("rank ").split(":")[0])
        listed = part.split("aborted on ranks [")[1].split("]")[0]
        # the faulted rank always aborts; others may too when the driver cancels their in-flight step
        assert r in [int(x) for x in listed.split(",")], d4
    assert d4.count("retry equals the reference") == ranks, d4
    assert "aborted before payload exchange" in by[FaultKind.PEER_COUNT_DISAGREEMENT].detail
    assert "payload rejected before expert compute" in by[FaultKind.FP8_SCALE_COUNT_MISMATCH].detail
    assert "output rejected" in by[FaultKind.CORRUPT_INVERSE_PERMUTATION].detail
    # 5: the stale pin is refused, the same batch replans onto the new active generation
    assert "StaleGenerationError" in by[FaultKind.STALE_HANDLE_ON_NEW_GENERATION].detail
    assert "reference output" in by[FaultKind.STALE_HANDLE_ON_NEW_GENERATION].detail
    # 8: the parity-faulted candidate never entered CANARY
    parity = _release_events(rep, rep.releases["parity"])
    assert "SHADOW->DRAINING" in parity and not any("CANARY" in e for e in parity)
    # 9: the schedule without combine_0's completion dependency is rejected, the valid one passes
    assert "missing dependency" in by[FaultKind.MISSING_COMPLETION_DEPENDENCY].detail
    # 10: rolled back to the prior generation
    assert f"placement-v{rep.generations['initial']} ACTIVE" in by[FaultKind.ACTIVE_CANDIDATE_FAULT].detail


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_graph_key_mismatch_falls_back_eagerly(reports, mode):
    rep = reports[mode]
    if _graph_key_unsupported(rep):
        pytest.xfail("runtime has no 'graph_key' shard fault yet (decode-bucket admission is being implemented)")
    row = next(r for r in rep.faults if r.fault is FaultKind.GRAPH_KEY_MISMATCH)
    assert row.passed and row.observed is SafeOutcome.EXPLICIT_EAGER_FALLBACK, row.detail
    ranks = 4 if rep.options.all_faults else 1
    assert row.detail.count("graph_key_mismatch fallbacks +1") == ranks
    assert row.detail.count("output equals the reference") == ranks


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_rollback_is_ordered_state_transfer(reports, mode):
    rep = reports[mode]
    main = next(r for r in rep.rollbacks if r.purpose == f"fault at {mode.value}")
    assert main.steps == tuple(s.value for s in STEP_ORDER)
    assert main.ok and main.refcount_trace and main.refcount_trace[-1] == 0
    assert main.candidate == rep.releases["candidate"] and main.prior == rep.releases["initial"]
    assert "failed" in main.detected  # detected from a failing step on the candidate
    # the rehearsal and the parity block went through the same order
    assert all(r.ok and r.steps == main.steps for r in rep.rollbacks)
    # on the runtime: stop fence on the candidate, prior takes new dispatch, candidate graphs freed, retired
    g_c, g_p = main.candidate_generation, main.prior_generation
    placement = [(e.subject, e.event) for e in rep.timeline if e.source == "placement"]
    seq = [(f"placement-v{g_c}", "stop-dispatch"), (f"placement-v{g_p}", "activate"),
           (f"placement-v{g_c}", "release-graphs"), (f"placement-v{g_c}", "retire")]
    at = -1
    for x in seq:  # each after the previous one
        assert x in placement[at + 1:], (x, placement[at + 1:])
        at = placement.index(x, at + 1)
    # in the release lifecycle
    cand = _release_events(rep, main.candidate)
    prior = _release_events(rep, main.prior)
    if mode is FaultAt.CANARY:
        assert cand[-3:] == ["SHADOW->CANARY", "CANARY->DRAINING", "DRAINING->RETIRED"]
        assert prior[-1] == "LOADED->ACTIVE"  # never left ACTIVE
    else:
        assert cand[-4:] == ["SHADOW->CANARY", "CANARY->ACTIVE", "ACTIVE->DRAINING", "DRAINING->RETIRED"]
        assert prior[-3:] == ["ACTIVE->DRAINING", "DRAINING->LOADED", "LOADED->ACTIVE"]
    assert rep.final_releases[main.prior] == "ACTIVE" and rep.final_releases[main.candidate] == "RETIRED"
    assert rep.final_generations[str(g_p)] == "ACTIVE" and rep.final_generations[str(g_c)] == "RETIRED"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_every_served_output_is_the_reference(reports, mode):
    tr = reports[mode].traffic
    assert tr.mismatches == 0
    assert tr.lost == 0 and tr.served == tr.submitted  # nothing lost: every batch eventually returned
    assert tr.retried >= 5  # the injected faults made steps fail, and those batches were retried
    cand = next(r for r in tr.by_release if r.release_id == reports[mode].releases["candidate"])
    assert cand.canary >= THRESHOLDS.min_canary and cand.shadow >= THRESHOLDS.min_shadow
    assert cand.shadow_mismatches == 0


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_gate_passes_healthy_candidate_and_blocks_parity(reports, mode):
    rep = reports[mode]
    v = rep.gate
    assert v is not None and v.passed and v.release_id == rep.releases["candidate"]
    assert [r.clause for r in v.results] == list(GateClause)
    # evaluated before the candidate's fault was armed
    notes = [(e.event, e.t) for e in rep.timeline if e.source == "drill" and e.subject == v.release_id]
    t_gate = next(t for ev, t in notes if ev == "gate")
    t_fault = next(t for ev, t in notes if ev == "fault-armed")
    assert t_gate < t_fault
    p = rep.parity_gate
    assert p is not None and not p.passed and p.release_id == rep.releases["parity"]
    assert {GateClause.ROUTE_MISMATCH, GateClause.N_CANARY} <= set(p.failed)
    assert GateClause.HASH_OK not in p.failed and GateClause.MANIFEST_OK not in p.failed


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_report_passes_and_renders(reports, mode):
    rep = reports[mode]
    if _graph_key_unsupported(rep):
        pytest.xfail("runtime has no 'graph_key' shard fault yet")
    assert rep.ok, rep.failures
    text = render_text(rep)
    for section in ("state timeline", "fault table", "gate verdict", "rollbacks", "traffic:", "result: PASS"):
        assert section in text
    again = DrillReport.model_validate_json(json.dumps(rep.model_dump(mode="json")))
    assert again.ok and [r.fault for r in again.faults] == list(FaultKind)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_progress_has_one_line_per_phase(reports, mode):
    rep, lines = reports[mode], PROGRESS[mode].lines
    assert all(re.fullmatch(r"\[drill \d+s\] \S.*", line) for line in lines), lines
    assert all(len(line) < 240 for line in lines)
    body = [line.split("] ", 1)[1] for line in lines]
    assert body[0].startswith(f"rollback drill {rep.options.name}: 4 ranks on cpu, fault at {mode.value}")
    assert body[1] == "ray: using the instance this process already joined"  # the session's instance
    assert [b.split(" ", 2)[1] for b in body if b.startswith("step ")] == [f"{i}/10" for i in range(1, 11)]
    # one line per fault, numbered as in the spec's table, with its observed outcome
    faults = [b for b in body if b.startswith("fault ")]
    assert len(faults) == 10
    for r in rep.faults:
        n = list(FaultKind).index(r.fault) + 1
        want = f"fault {n} {r.fault.value}: {r.observed.value if r.observed else 'nothing'}"
        assert any(b.startswith(want) for b in faults), (want, faults)
    assert "fault 3 peer-count-disagreement: abort before payload exchange (ok)" in body
    assert sum(b.startswith("rollback (") for b in body) == len(rep.rollbacks) == 3
    assert any(b.startswith("gate on the healthy candidate: PROMOTE") for b in body)
    assert body[-1].startswith("result: PASS" if rep.ok else "result: FAIL")
    # seconds since the start, never decreasing
    secs = [int(line[len("[drill "):line.index("s]")]) for line in lines]
    assert secs == sorted(secs)

