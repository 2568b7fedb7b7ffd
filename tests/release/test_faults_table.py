"""The ten faults of 0x0E and their declared safe outcomes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.release.faults import (
    FAULT_TABLE,
    FaultKind,
    FaultReport,
    FaultResult,
    SafeOutcome,
    check_fault,
    expected_outcome,
    fault_report,
)

REL = "m66-placement-v19-canary-01"

# The 0x0E table, row by row, as printed in the spec.
SPEC_TABLE = [
    ("Loop 2-10 report hash drifts", "reject build"),
    ("process-group generation differs", "reject load"),
    ("peer route counts disagree", "abort before payload exchange"),
    ("inverse permutation is corrupt", "reject output before publish"),
    ("stale handle reaches new active generation", "reject handle and replan"),
    ("graph key differs", "explicit eager fallback"),
    ("FP8 scale count differs", "reject payload before expert compute"),
    ("runner parity differs", "block canary"),
    ("completion dependency is absent", "reject schedule"),
    ("active candidate faults", "roll back to prior generation"),
]


def test_table_matches_the_spec_row_by_row():
    rows = [(FAULT_TABLE[k].injected, FAULT_TABLE[k].outcome.value) for k in FaultKind]
    assert rows == SPEC_TABLE
    assert len(FaultKind) == len(SafeOutcome) == 10


def test_each_fault_has_a_distinct_outcome():
    assert {s.outcome for s in FAULT_TABLE.values()} == set(SafeOutcome)


@pytest.mark.parametrize(
    "fault, outcome",
    [
        (FaultKind.REPORT_HASH_DRIFT, SafeOutcome.REJECT_BUILD),
        (FaultKind.PEER_COUNT_DISAGREEMENT, SafeOutcome.ABORT_BEFORE_PAYLOAD_EXCHANGE),
        (FaultKind.STALE_HANDLE_ON_NEW_GENERATION, SafeOutcome.REJECT_HANDLE_AND_REPLAN),
        (FaultKind.GRAPH_KEY_MISMATCH, SafeOutcome.EXPLICIT_EAGER_FALLBACK),
        (FaultKind.ACTIVE_CANDIDATE_FAULT, SafeOutcome.ROLL_BACK_TO_PRIOR_GENERATION),
    ],
)
def test_expected_outcomes(fault, outcome):
    assert expected_outcome(fault) is outcome
    assert expected_outcome(fault.value) is outcome


def test_check_fault_passes_only_on_the_declared_outcome():
    ok = check_fault(FaultKind.GRAPH_KEY_MISMATCH, "explicit eager fallback")
    assert ok.passed and ok.expected is SafeOutcome.EXPLICIT_EAGER_FALLBACK
    # a rejection is "safe" in general but not the declared outcome: eager fallback must not be a refusal
    wrong = check_fault(FaultKind.GRAPH_KEY_MISMATCH, SafeOutcome.REJECT_SCHEDULE, "refused the step")
    assert not wrong.passed
    silent = check_fault(FaultKind.PEER_COUNT_DISAGREEMENT, None, "entered all-to-all")
    assert not silent.passed and silent.observed is None


def test_expected_must_come_from_the_table():
    with pytest.raises(ValueError, match="expected='reject load' but the 0x0E table requires 'reject build'"):
        FaultResult(fault=FaultKind.REPORT_HASH_DRIFT, expected=SafeOutcome.REJECT_LOAD,
                    observed=SafeOutcome.REJECT_LOAD)


def test_bad_names():
    with pytest.raises(ValueError, match="fault='disk-full'"):
        check_fault("disk-full", None)
    with pytest.raises(ValueError, match="observed='shrug'"):
        check_fault(FaultKind.REPORT_HASH_DRIFT, "shrug")


def all_passing():
    return [check_fault(k, s.outcome) for k, s in FAULT_TABLE.items()]


def test_report_passes_only_when_all_ten_are_covered_and_safe():
    assert fault_report(REL, all_passing()).passed
    nine = fault_report(REL, all_passing()[:9])
    assert not nine.passed and nine.missing == (FaultKind.ACTIVE_CANDIDATE_FAULT,)
    assert nine.describe() == ("active-candidate-fault: not injected",)
    results = all_passing()
    results[2] = check_fault(FaultKind.PEER_COUNT_DISAGREEMENT, None, "rank 1 entered the collective")
    results[5] = check_fault(FaultKind.GRAPH_KEY_MISMATCH, SafeOutcome.BLOCK_CANARY)
    bad = fault_report(REL, results)
    assert not bad.passed
    assert [r.fault for r in bad.failed] == [FaultKind.PEER_COUNT_DISAGREEMENT, FaultKind.GRAPH_KEY_MISMATCH]
    assert bad.describe() == (
        "peer-count-disagreement: expected 'abort before payload exchange', observed nothing "
        "(rank 1 entered the collective)",
        "graph-key-mismatch: expected 'explicit eager fallback', observed 'block canary'",
    )


def test_report_rejects_duplicates_and_round_trips():
    with pytest.raises(ValueError, match="results\\[1\\].fault='report-hash-drift' is reported twice"):
        fault_report(REL, [all_passing()[0], all_passing()[0]])
    rep = fault_report(REL, all_passing())
    assert FaultReport.model_validate_json(rep.model_dump_json()) == rep


@settings(deadline=None, max_examples=60)
@given(st.dictionaries(st.sampled_from(list(FaultKind)), st.one_of(st.none(), st.sampled_from(list(SafeOutcome)))))
def test_report_passed_iff_complete_and_every_outcome_declared(observed):
    rep = fault_report(REL, [check_fault(k, o) for k, o in observed.items()])
    expected = len(observed) == 10 and all(o is FAULT_TABLE[k].outcome for k, o in observed.items())
    assert rep.passed == expected
    assert len(rep.missing) == 10 - len(observed)
