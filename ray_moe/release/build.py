"""Building a release of one live placement generation (spec 0x0C-0x0CB, 0x09D, 0x0E). Pure: no Ray.

* the release coordinates of a placement generation (``ReleaseInputs`` -> ``ReleaseBundle``): checkpoint
  digest from the expert digests, placement digest, process-group generation, ABIs, dtype roles, phase
  backends from the config, the graph manifest digest and the upstream reports it binds;
* the step schedule a release binds (``ray_moe.release.schedule``) and its validation: a schedule with a
  missing completion dependency is rejected and no release binds it (fault 9);
* the load check that refuses a bundle whose process group or topology is not the live one (fault 2).

The rollback drill (the app layer above the runtime) drives these against a live deployment.
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ray_moe.model.config import RuntimeConfig
from ray_moe.release.schedule import buffer_lifetimes, moe_step_buffers, moe_step_tasks, schedule_overlapped, Task
from ray_moe.placement.manifest import PlacementManifest
from ray_moe.release.bundle import (
    BackendManifest,
    PhasePath,
    PrecisionRole,
    ReleaseBundle,
    build_release,
    canonical_json,
    sha256_hex,
)

ROUTE_ABI = "ray-moe.route.v1:ids=int64[L,T,k];gates=float32[L,T,k];r=t*k+j;gate-applied-once-after-expert"
"""Route ABI string every release binds (0x0CB): layout, semantic route order and weighting owner."""

DISPATCH_HANDLE_ABI = "ray-moe.handle.v1:generation-pinned;split-vectors-by-peer-slot;inverse=send-order"
"""Dispatch-handle ABI string (0x0CB): the handle is pinned to one generation, splits are peer-slot indexed."""

UPSTREAM_REPORT_NAMES = ("placement-manifest", "runtime-config", "load-window-provenance", "migration-ledger",
                         "step-schedule")
"""The upstream reports a release binds, in ``upstream_report_digests`` order."""


# ============================================================================================ coordinates
def process_group_generation(group_id: str, epoch: int) -> str:
    """``ep-group-0-e<epoch>``: the process-group coordinate G of a release (0x0C)."""
    if not group_id:
        raise ValueError(f"group_id={group_id!r} must be a non-empty string")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch={epoch!r} must be an int >= 0")
    return f"{group_id}-e{epoch}"


def checkpoint_digest(manifest: PlacementManifest) -> str:
    """SHA-256 of the canonical JSON of every (layer, logical expert) parameter digest of the manifest."""
    digests: dict[str, str] = {}
    for s in manifest.slots:
        key = f"{s.layer}/{s.logical_expert_id}"
        prev = digests.setdefault(key, s.parameter_digest)
        if prev != s.parameter_digest:
            raise ValueError(f"slots[q{s.physical_slot_id}].parameter_digest={s.parameter_digest!r} differs from "
                             f"another replica of (layer, expert) {key} ({prev!r})")
    return sha256_hex(canonical_json(digests))


def precision_roles(cfg: RuntimeConfig) -> dict[str, str]:
    """dtype of each tensor role (0x0AE): activations in the config dtype, gate and accumulation in FP32."""
    payload = cfg.payload_format.value
    dispatch = cfg.dtype if payload == "native" else f"{payload}+{cfg.dtype}-scales"
    return {
        PrecisionRole.DISPATCH.value: dispatch,
        PrecisionRole.COMBINE.value: cfg.dtype,
        PrecisionRole.GATE.value: "float32",
        PrecisionRole.ACCUMULATION.value: "float32",
        PrecisionRole.ROUTER.value: "float32",
    }


def phase_backends(cfg: RuntimeConfig, generation: int) -> dict[str, BackendManifest]:
    """The three phase paths of 0x0CA, from the config: variable prefill, fixed-bucket decode, oversize decode."""
    exchange = cfg.exchange_kind.value
    schedule = cfg.exchange_schedule.value
    runner = cfg.runner.value
    buckets = bool(getattr(cfg, "decode_buckets", False))
    capacity = int(getattr(cfg, "decode_token_capacity", 0) or 0)
    graphs = bool(getattr(cfg, "cuda_graphs", False)) and cfg.device == "cuda"
    decode_state = (f"decode.bucket{capacity}.v{generation}" + (".cuda-graph" if graphs else ".eager-bucket")
                    if buckets else "disabled")
    return {
        PhasePath.VARIABLE_PREFILL.value: BackendManifest(dispatcher=f"throughput-variable/{exchange}/{schedule}",
                                                          runner=runner, graph_state="eager"),
        PhasePath.FIXED_BUCKET_DECODE.value: BackendManifest(dispatcher=f"low-latency/{exchange}",
                                                             runner="padded-masked" if buckets else runner,
                                                             graph_state=decode_state),
        PhasePath.OVERSIZE_DECODE.value: BackendManifest(dispatcher=f"low-latency-eager/{exchange}", runner=runner,
                                                         graph_state="explicit-fallback"),
    }


# ============================================================================================ schedule
class ScheduleCheck(BaseModel):
    """Validation of one step schedule: ``ok`` or the rejection (0x0E: completion dependency absent)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ok: bool
    error: str = ""
    makespan_units: float | None = None
    intervals: dict[str, tuple[float, float]] = Field(default_factory=dict)
    evidence: str = "analytical"


def step_tasks(num_chunks: int) -> tuple[Task, ...]:
    """The release's MoE step DAG over ``num_chunks`` peer segments (analytical units, 0x09B)."""
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks!r} must be an int >= 1")
    return moe_step_tasks(route_units=1, pack_units=[1] * num_chunks, dispatch_units=[2] * num_chunks,
                          shared_units=None, expert_units=[3] * num_chunks, combine_units=[2] * num_chunks,
                          reduce_units=1)


def check_step_schedule(tasks: Sequence[Task], num_chunks: int) -> ScheduleCheck:
    """Validate a step schedule before a release may bind it.

    1. The DAG itself (names, declared dependencies, acyclicity) and the in-order stream schedule.
    2. Every buffer's consumers wait (transitively) for its producer's completion (0x09D): a consumer that
       does not is a missing completion dependency, and the schedule is rejected.
    """
    try:
        sched = schedule_overlapped(tasks)
        buffer_lifetimes(sched, moe_step_buffers(num_chunks, shared=any(t.name == "shared_path" for t in tasks)))
    except ValueError as exc:
        return ScheduleCheck(ok=False, error=str(exc))
    return ScheduleCheck(ok=True, makespan_units=float(sched.makespan),
                         intervals={k: (float(a), float(b)) for k, (a, b) in sched.intervals.items()})


# ============================================================================================ bundle
class ReleaseInputs(BaseModel):
    """Everything a release of one placement generation binds (the upstream reports among them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    config: RuntimeConfig
    manifest: PlacementManifest
    group_id: str
    group_epoch: int = Field(ge=0)
    topology_version: str
    load_provenance: dict[str, Any]
    migration_ledger: dict[str, Any]
    schedule: ScheduleCheck


def upstream_reports(inputs: ReleaseInputs) -> tuple[dict[str, Any], ...]:
    """The reports a release hashes, in ``UPSTREAM_REPORT_NAMES`` order (each a JSON mapping)."""
    return (
        {"report": UPSTREAM_REPORT_NAMES[0], "body": inputs.manifest.model_dump(mode="json",
                                                                               exclude={"state", "in_flight_refcount"})},
        {"report": UPSTREAM_REPORT_NAMES[1], "body": inputs.config.model_dump(mode="json")},
        {"report": UPSTREAM_REPORT_NAMES[2], "body": dict(inputs.load_provenance)},
        {"report": UPSTREAM_REPORT_NAMES[3], "body": dict(inputs.migration_ledger)},
        {"report": UPSTREAM_REPORT_NAMES[4], "body": inputs.schedule.model_dump(mode="json")},
    )


def graph_manifest_digest(inputs: ReleaseInputs) -> str:
    """Digest of the graph manifest Q: decode-bucket geometry, the placement it is keyed to, the step schedule."""
    cfg = inputs.config
    body = {
        "placement_generation": inputs.manifest.placement_version,
        "placement_digest": inputs.manifest.content_digest(),
        "decode_buckets": bool(getattr(cfg, "decode_buckets", False)),
        "decode_token_capacity": getattr(cfg, "decode_token_capacity", None),
        "decode_slot_capacity": getattr(cfg, "decode_slot_capacity", None),
        "cuda_graphs": bool(getattr(cfg, "cuda_graphs", False)) and cfg.device == "cuda",
        "step_schedule": inputs.schedule.model_dump(mode="json"),
    }
    return sha256_hex(canonical_json(body))


def build_release_bundle(inputs: ReleaseInputs, *, process_group_override: str | None = None
                         ) -> tuple[ReleaseBundle, tuple[dict[str, Any], ...]]:
    """The release bundle of ``inputs`` and the upstream reports it binds.

    1. Coordinates: C (checkpoint version + digest of the expert digests), P (placement generation + manifest
       content digest), T, G (``process_group_override`` names another epoch: the fault-2 probe), A, D, B, Q.
    2. ``build_release`` hashes the reports and the coordinates and derives ``name@digest[:12]``.
    """
    if not inputs.schedule.ok:
        raise ValueError(f"schedule: a release cannot bind a rejected step schedule ({inputs.schedule.error})")
    m = inputs.manifest
    reports = upstream_reports(inputs)
    bundle = build_release(
        inputs.name,
        checkpoint_version=m.checkpoint_version,
        checkpoint_digest=checkpoint_digest(m),
        placement_generation=m.placement_version,
        placement_digest=m.content_digest(),
        topology_version=inputs.topology_version,
        process_group_generation=process_group_override or process_group_generation(inputs.group_id,
                                                                                    inputs.group_epoch),
        route_abi=ROUTE_ABI,
        dispatch_handle_abi=DISPATCH_HANDLE_ABI,
        precision_roles=precision_roles(inputs.config),
        phase_backends=phase_backends(inputs.config, m.generation),
        graph_manifest_digest=graph_manifest_digest(inputs),
        upstream_reports=reports,
    )
    return bundle, reports


def load_refusals(bundle: ReleaseBundle, *, live_process_group: str, live_topology: str,
                  manifest: PlacementManifest | None) -> tuple[str, ...]:
    """Why a verified bundle may not be loaded on the live deployment (empty: loadable).

    1. Its process-group generation must be the live communicator's (a bundle built for another epoch would
       enter collectives with the wrong membership).
    2. Its topology version must be the live one.
    3. Its placement coordinates must match the manifest it binds (``manifest_failures``).
    """
    out: list[str] = []
    if bundle.process_group_generation != live_process_group:
        out.append(f"process_group_generation={bundle.process_group_generation} but the live group is "
                   f"{live_process_group}")
    if bundle.topology_version != live_topology:
        out.append(f"topology_version={bundle.topology_version} but the live topology is {live_topology}")
    if manifest is not None:
        out.extend(bundle.manifest_failures(manifest))
    return tuple(out)


__all__ = [
    "ROUTE_ABI", "DISPATCH_HANDLE_ABI", "UPSTREAM_REPORT_NAMES", "process_group_generation", "checkpoint_digest",
    "precision_roles", "phase_backends", "ScheduleCheck", "step_tasks", "check_step_schedule", "ReleaseInputs",
    "upstream_reports", "graph_manifest_digest", "build_release_bundle", "load_refusals",
]
