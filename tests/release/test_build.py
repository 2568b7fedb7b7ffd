"""Building a release of one placement generation (release/build.py): coordinates, the bound step schedule
(fault 9: a missing completion dependency is rejected and no release binds it), the bundle, the load check
(fault 2: another process-group epoch or topology is refused), and the package staying pure (no Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ray_moe.model.config import RuntimeConfig
from ray_moe.release.schedule import Task
from ray_moe.release.build import (
    UPSTREAM_REPORT_NAMES,
    ReleaseInputs,
    build_release_bundle,
    check_step_schedule,
    checkpoint_digest,
    load_refusals,
    process_group_generation,
    step_tasks,
)
from ray_moe_dev.testing.fixtures import six_slot_manifest

CFG = RuntimeConfig(num_ranks=4, num_experts=4, hidden_size=8, ffn_size=16, top_k=2, slots_per_rank=2)


def inputs(generation: int = 19, **update) -> ReleaseInputs:
    base = ReleaseInputs(name="m66-placement-v19", config=CFG, manifest=six_slot_manifest(generation),
                         group_id="ep-group-0", group_epoch=3, topology_version="topology-v3",
                         load_provenance={"observations": 12}, migration_ledger={"copies": 0},
                         schedule=check_step_schedule(step_tasks(4), 4))
    return base.model_copy(update=update)


def test_process_group_generation():
    assert process_group_generation("ep-group-0", 3) == "ep-group-0-e3"
    for bad in (("", 0), ("g", -1), ("g", True)):
        with pytest.raises(ValueError):
            process_group_generation(*bad)


def test_checkpoint_digest_is_per_expert_and_refuses_diverged_replicas():
    m = six_slot_manifest(19)
    assert checkpoint_digest(m) == checkpoint_digest(six_slot_manifest(20))  # placement is not checkpoint
    first = m.slots[0]
    twin = next(s for s in m.slots[1:] if s.logical_expert_id == first.logical_expert_id)
    bad = m.model_copy(update={"slots": tuple(s.model_copy(update={"parameter_digest": "other"}) if s is twin else s
                                              for s in m.slots)})
    with pytest.raises(ValueError, match="differs from another replica"):
        checkpoint_digest(bad)


def test_step_schedule_binds_completion_dependencies():
    ok = check_step_schedule(step_tasks(4), 4)
    assert ok.ok and ok.makespan_units and ok.evidence == "analytical"
    tasks = tuple(Task(t.name, t.units, t.stream, tuple(d for d in t.deps if d != "expert_0"))
                  if t.name == "combine_0" else t for t in step_tasks(4))
    broken = check_step_schedule(tasks, 4)
    assert not broken.ok and "missing dependency" in broken.error
    with pytest.raises(ValueError, match="rejected step schedule"):
        build_release_bundle(inputs(schedule=broken))
    with pytest.raises(ValueError):
        step_tasks(0)


def test_bundle_is_deterministic_and_binds_its_reports():
    b1, reports = build_release_bundle(inputs())
    b2, _ = build_release_bundle(inputs())
    assert b1.release_id == b2.release_id and b1.release_id.startswith("m66-placement-v19@")
    assert [r["report"] for r in reports] == list(UPSTREAM_REPORT_NAMES)
    assert b1.verify(reports).ok and not b1.manifest_failures(six_slot_manifest(19))
    assert b1.process_group_generation == "ep-group-0-e3" and b1.placement_generation == "placement-v19"
    # another load window is another release
    b3, _ = build_release_bundle(inputs(load_provenance={"observations": 13}))
    assert b3.release_id != b1.release_id
    other, _ = build_release_bundle(inputs(), process_group_override="ep-group-0-e4")
    assert other.process_group_generation == "ep-group-0-e4" and other.release_id != b1.release_id


def test_load_refusals_name_every_mismatch():
    b, _ = build_release_bundle(inputs())
    live = dict(live_process_group="ep-group-0-e3", live_topology="topology-v3")
    assert load_refusals(b, **live, manifest=six_slot_manifest(19)) == ()
    assert load_refusals(b, **live, manifest=None) == ()
    out = load_refusals(b, live_process_group="ep-group-0-e4", live_topology="topology-v4",
                        manifest=six_slot_manifest(20))
    assert any("process_group_generation=ep-group-0-e3" in r for r in out)
    assert any("topology_version=topology-v3" in r for r in out)
    assert any("placement_generation=placement-v19" in r for r in out)


def test_release_package_is_pure():
    """No Ray, and nothing of the runtime, the actors, the test oracles or the apps, in ``ray_moe.release``."""
    code = (
        "import sys, pkgutil, importlib, ray_moe.release as p\n"
        "mods = [m.name for m in pkgutil.iter_modules(p.__path__, 'ray_moe.release.')]\n"
        "[importlib.import_module(m) for m in mods]\n"
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.') or m.startswith(("
        "'ray_moe.runtime', 'ray_moe.shard', 'ray_moe_dev.testing', 'ray_moe.apps')))\n"
        "print(len(mods), bad)\n"
    )
    root = str(Path(__file__).resolve().parents[2])  # this checkout's ray_moe, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=root).stdout.split(" ", 1)
    assert int(out[0]) >= 6 and out[1].strip() == "[]", out
