"""Release bundle of 0x0C / 0x0CA: canonical digest, derived release id, drift detection."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ray_moe.release.bundle import (
    BackendManifest,
    PhasePath,
    ReleaseBundle,
    build_release,
    canonical_json,
    report_digest,
)
from ray_moe_dev.testing.fixtures import six_slot_manifest

NAME = "m66-placement-v19-canary-01"


def synthetic_digest(text: str) -> str:
    """The fixture's digests are synthetic (0x0CA): SHA-256 of a label."""
    return hashlib.sha256(text.encode()).hexdigest()


def upstream_reports() -> list[dict]:
    """Nine synthetic Loop 2-10 reports (0x0CA hashes all nine)."""
    return [{"loop": i, "report": f"loop-{i} oracle", "status": "pass"} for i in range(2, 11)]


PHASE_BACKENDS = {
    PhasePath.VARIABLE_PREFILL: BackendManifest(dispatcher="throughput-variable", runner="grouped GEMM",
                                                graph_state="eager"),
    PhasePath.FIXED_BUCKET_DECODE: BackendManifest(dispatcher="low-latency", runner="padded and masked",
                                                   graph_state="decode.bucket4.v19"),
    PhasePath.OVERSIZE_DECODE: BackendManifest(dispatcher="low-latency eager", runner="grouped GEMM",
                                               graph_state="explicit fallback"),
}


def spec_release_kwargs() -> dict:
    return dict(
        checkpoint_version="checkpoint-0042",
        checkpoint_digest=synthetic_digest("checkpoint-0042"),
        placement_generation="placement-v19",
        placement_digest=six_slot_manifest(19).content_digest(),
        topology_version="topology-v3",
        process_group_generation="groups-v19-ep4-etp1",
        route_abi="route-abi-v1",
        dispatch_handle_abi="dispatch-handle-abi-v1",
        precision_roles={"dispatch": "bf16", "combine": "bf16", "gate": "fp32", "accumulation": "fp32"},
        phase_backends=dict(PHASE_BACKENDS),
        graph_manifest_digest=synthetic_digest("decode.bucket4.v19"),
        upstream_reports=upstream_reports(),
    )


def spec_release(name: str = NAME, **overrides) -> ReleaseBundle:
    """The 0x0CA release fixture m66-placement-v19-canary-01 (overrides change single coordinates)."""
    return build_release(name, **{**spec_release_kwargs(), **overrides})


def test_fixture_identity():
    b = spec_release()
    assert b.name == NAME
    assert re.fullmatch(rf"{NAME}@[0-9a-f]{{12}}", b.release_id)
    assert b.release_id == f"{NAME}@{b.bundle_digest[:12]}"
    assert b.bundle_digest == hashlib.sha256(b.canonical_json().encode()).hexdigest()
    assert b.verify(upstream_reports()).ok
    b.require_verified(upstream_reports())
    assert b.checkpoint_version == "checkpoint-0042" and b.topology_version == "topology-v3"
    assert b.process_group_generation == "groups-v19-ep4-etp1"
    assert b.precision_roles == {"dispatch": "bf16", "combine": "bf16", "gate": "fp32", "accumulation": "fp32"}
    assert b.phase_backends["fixed-bucket-decode"].graph_state == "decode.bucket4.v19"
    assert b.phase_backends["oversize-decode"].dispatcher == "low-latency eager"
    assert b.phase_backends["variable-prefill"].runner == "grouped GEMM"
    assert len(b.upstream_report_digests) == 9
    assert b.upstream_report_digests[0] == hashlib.sha256(
        canonical_json(upstream_reports()[0]).encode()).hexdigest()


def test_canonical_json_is_sorted_and_compact():
    text = spec_release().canonical_json()
    assert " " not in text.replace("grouped GEMM", "").replace("padded and masked", "").replace(
        "low-latency eager", "").replace("explicit fallback", "")
    assert ": " not in text and ", " not in text
    body = json.loads(text)
    assert list(body) == sorted(body)
    assert "release_id" not in body and "name" not in body and "bundle_digest" not in body
    assert list(body["precision_roles"]) == sorted(body["precision_roles"])


def test_digest_does_not_depend_on_dict_insertion_order():
    roles = {"accumulation": "fp32", "gate": "fp32", "combine": "bf16", "dispatch": "bf16"}
    backends = dict(reversed(list(PHASE_BACKENDS.items())))
    assert spec_release(precision_roles=roles, phase_backends=backends).release_id == spec_release().release_id


def test_same_coordinates_same_id_and_name_is_not_a_coordinate():
    a, b = spec_release(), spec_release()
    assert a.release_id == b.release_id and a == b
    renamed = spec_release(name="other-name")
    assert renamed.bundle_digest == a.bundle_digest and renamed.release_id != a.release_id


COORDINATE_CHANGES = {
    "checkpoint_version": "checkpoint-0043",
    "checkpoint_digest": synthetic_digest("checkpoint-0043"),
    "placement_generation": "placement-v20",
    "placement_digest": six_slot_manifest(20).content_digest(),
    "topology_version": "topology-v4",
    "process_group_generation": "groups-v20-ep2-etp2",
    "route_abi": "route-abi-v2",
    "dispatch_handle_abi": "dispatch-handle-abi-v2",
    "precision_roles": {"dispatch": "fp8_e4m3", "combine": "bf16", "gate": "fp32", "accumulation": "fp32"},
    "phase_backends": {**PHASE_BACKENDS, PhasePath.FIXED_BUCKET_DECODE: BackendManifest(
        dispatcher="low-latency", runner="padded and masked", graph_state="decode.bucket8.v19")},
    "graph_manifest_digest": synthetic_digest("decode.bucket8.v19"),
    "upstream_reports": [*upstream_reports()[:-1], {"loop": 10, "report": "loop-10 oracle", "status": "changed"}],
}


@pytest.mark.parametrize("field", sorted(COORDINATE_CHANGES))
def test_any_coordinate_change_gives_a_new_release_id(field):
    base = spec_release()
    changed = spec_release(**{field: COORDINATE_CHANGES[field]})
    assert changed.name == base.name
    assert changed.release_id != base.release_id
    assert changed.bundle_digest != base.bundle_digest


def test_upstream_report_drift_rejects_build():
    b = spec_release()
    reports = upstream_reports()
    reports[3] = {**reports[3], "status": "fail"}
    check = b.verify(reports)
    assert not check.ok
    assert len(check.failures) == 1 and check.failures[0].startswith("upstream_report_digests[3]=")
    with pytest.raises(ValueError, match="reject build: upstream_report_digests\\[3\\]"):
        b.require_verified(reports)
    check = b.verify(reports[:8])
    assert "upstream reports: 8 given, bundle binds 9" in check.failures


def test_in_memory_coordinate_drift_is_detected():
    b = spec_release()
    b.precision_roles["dispatch"] = "fp8_e4m3"  # a frozen model still holds a mutable dict
    check = b.verify()
    assert not check.ok
    assert any("hash drift" in f for f in check.failures)
    assert any(f.startswith(f"release_id={b.release_id}") for f in check.failures)


def test_model_copy_bypassing_validation_is_caught_by_verify():
    drifted = spec_release().model_copy(update={"topology_version": "topology-v4"})
    assert not drifted.verify().ok


def test_json_round_trip_and_tampered_json_is_rejected():
    b = spec_release()
    assert ReleaseBundle.model_validate_json(b.model_dump_json()) == b
    body = json.loads(b.model_dump_json())
    body["process_group_generation"] = "groups-v20-ep2-etp2"
    with pytest.raises(ValidationError, match="bundle_digest="):
        ReleaseBundle.model_validate(body)
    body = json.loads(b.model_dump_json())
    body["release_id"] = f"{NAME}@000000000000"
    with pytest.raises(ValidationError, match="release_id="):
        ReleaseBundle.model_validate(body)


def test_manifest_cross_check():
    b = spec_release()
    assert b.manifest_failures(six_slot_manifest(19)) == ()
    fails = b.manifest_failures(six_slot_manifest(18))
    assert any(f.startswith("placement_generation=placement-v19 but manifest is placement-v18") for f in fails)
    assert any(f.startswith("placement_digest=") for f in fails)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(name="bad@name"), "name='bad@name'"),
        (dict(checkpoint_digest="abc"), "checkpoint_digest='abc'"),
        (dict(placement_digest="Z" * 64), "placement_digest="),
        (dict(precision_roles={"weights": "int4"}), "precision_roles\\['weights'\\]"),
        (dict(precision_roles={}), "precision_roles=\\{\\}"),
        (dict(phase_backends={"training": BackendManifest(dispatcher="a", runner="b", graph_state="c")}),
         "phase_backends\\['training'\\]"),
        (dict(upstream_reports=[]), "upstream_report_digests"),
        (dict(topology_version=""), "topology_version"),
    ],
)
def test_bad_input_names_the_field(change, message):
    name = change.pop("name", NAME)
    with pytest.raises(ValueError, match=message):
        spec_release(name=name, **change)


def test_build_needs_reports_or_digests_not_both():
    kw = spec_release_kwargs()
    with pytest.raises(ValueError, match="give exactly one"):
        build_release(NAME, **kw, upstream_report_digests=[report_digest(r) for r in upstream_reports()])
    kw.pop("upstream_reports")
    b = build_release(NAME, **kw, upstream_report_digests=[report_digest(r) for r in upstream_reports()])
    assert b == spec_release()


@settings(deadline=None, max_examples=30)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20))
def test_route_abi_change_changes_id_unless_equal(abi):
    b = spec_release(route_abi=abi)
    assert (b.release_id == spec_release().release_id) == (abi == "route-abi-v1")
    assert b.verify().ok
