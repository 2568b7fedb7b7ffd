"""An elastic operation whose expert copy hangs, on local Ray: the copy stage's deadline aborts it, the coordinator
answers ``status`` all along (the operation in flight, its stage and progress), traffic keeps flowing on the prior
generation with correct outputs, the staged copy is freed on its shard when it lands late, and the recorded event
names the stage and the rank. Then the same change goes through.

Weights are tagged (expert e's output is (e+1) x a shared function), so a route served by the wrong expert shows
up in the output. Spread placement of 8 experts on 4 ranks x 3 slots: expert 4 lives on rank 1 only.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch
from ray_moe_dev.testing.reference import reference_moe

import ray_moe
from ray_moe.control.operations import OperationStage, StageDeadlineError
from ray_moe.model.source import weight_source
from ray_moe.shard.fault_wrappers import HANG_COPY_S

COPY_S = 2.0
CFG = dict(num_ranks=4, num_experts=8, hidden_size=16, ffn_size=32, top_k=2, slots_per_rank=3, seed=11,
           tagged_weights=True, exchange_timeout_s=20.0, name="deadlines", deadlines={"copy_s": COPY_S})


def _step_error(rt, src, step: int) -> float:
    g = torch.Generator().manual_seed(700 + step)
    t = 9
    h = torch.randn(t, rt.cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(rt.cfg.num_experts, generator=g)[:2] for _ in range(t)])
    w = torch.rand(t, 2, generator=g)
    y = rt.forward(h, ids, w)
    ref = reference_moe(h.double(), ids, w, lambda e: src.expert(0, e))
    return float((y.double() - ref).abs().max())


def _held(rt) -> dict[int, int]:
    return {r: st["experts_held"] for r, st in rt.shard_status().items()}


def test_a_hung_copy_is_aborted_by_its_deadline_and_traffic_stays_on_the_prior_generation(ray_session):
    rt = ray_moe.Runtime.start(ray_moe.RuntimeConfig(**CFG))
    src = weight_source(rt.cfg)
    stop = threading.Event()
    served: list[tuple[float, float]] = []  # (time, max error) of every step
    errors: list[BaseException] = []
    polls: list[tuple[float, dict]] = []  # (seconds the status call took, status()["operation"])

    def traffic() -> None:
        step = 0
        while not stop.is_set():
            try:
                served.append((time.monotonic(), _step_error(rt, src, step)))
            except BaseException as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)
                return
            step += 1

    def poll() -> None:
        while not stop.is_set():
            t = time.monotonic()
            op = ray.get(rt.coordinator.status.remote(), timeout=10)["operation"]
            polls.append((time.monotonic() - t, op))
            time.sleep(0.1)

    try:
        g0 = rt.placement().generation
        assert rt.placement().replica_counts(0)[4] == 1
        held0 = _held(rt)
        armed = [r for r in range(4) if r != 1]  # the new copy of expert 4 goes to one of these
        for r in armed:
            ray.get(rt.coordinator.inject_fault.remote(r, "hang_copy", 1))
        threads = [threading.Thread(target=traffic, daemon=True), threading.Thread(target=poll, daemon=True)]
        for th in threads:
            th.start()
        while len(served) < 3:
            time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(StageDeadlineError) as err:
            rt.scale(4, 2)
        took = time.monotonic() - t0
        e = err.value
        assert e.stage is OperationStage.COPY and len(e.ranks) == 1 and e.ranks[0] in armed
        assert COPY_S <= took < HANG_COPY_S - 0.5, took  # ended by the deadline, not by the copy landing
        # the prior generation keeps serving, with correct outputs, during and after the abort
        n_abort = len(served)
        while len(served) < n_abort + 3 and not errors:
            time.sleep(0.05)
        stop.set()
        for th in threads:
            th.join(timeout=20)
        assert not errors, errors
        assert max(err for _, err in served) < 1e-4
        assert sum(1 for t, _ in served if t0 < t < t0 + took) >= 1  # steps were served while the copy hung
        assert rt.placement().generation == g0 and rt.generations()[g0] == "ACTIVE"
        # status answered while the operation was in flight, and showed its stage and progress
        assert max(s for s, _ in polls) < 2.0, [s for s, _ in polls]
        flying = [op["in_flight"] for _, op in polls if op["in_flight"] is not None]
        assert flying and flying[-1]["stage"] == "copy" and flying[-1]["copies_planned"] == 1
        assert flying[-1]["stage_deadline_s"] == COPY_S and flying[-1]["elapsed_s"] > 0.5
        assert flying[-1]["reason"] == "scale expert 4 to 2 replicas" and flying[-1]["copies_done"] == 0
        op = ray.get(rt.coordinator.status.remote())["operation"]
        assert op["in_flight"] is None and op["recent"][-1]["outcome"] == "aborted"
        assert op["recent"][-1]["late_ranks"] == [e.ranks[0]]
        events = [ev for ev in rt.timeline() if ev["event"] == "deadline"]
        assert events and "stage copy" in events[-1]["detail"] and f"rank(s) [{e.ranks[0]}]" in events[-1]["detail"]
        # nothing staged stays held: now, and after the hung copy landed (the fleet frees it then)
        assert _held(rt) == held0
        time.sleep(max(0.0, t0 + HANG_COPY_S + 0.5 - time.monotonic()))
        deadline = time.monotonic() + 10.0
        while _held(rt) != held0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _held(rt) == held0
        fired = {r: st["counters"].get("fault_hang_copy", 0) for r, st in rt.shard_status().items()}
        assert fired[e.ranks[0]] == 1 and sum(fired.values()) == 1
        # disarmed, the same change goes through and serves
        for r in armed:
            ray.get(rt.coordinator.inject_fault.remote(r, "hang_copy", 0))
        g1 = rt.scale(4, 2)
        assert g1 > g0 and rt.placement().replica_counts(0)[4] == 2
        assert _step_error(rt, src, 999) < 1e-4
        done = ray.get(rt.coordinator.status.remote())["operation"]["recent"][-1]
        assert done["outcome"] == "done" and done["copies_done"] == 1 and done["bytes_copied"] > 0
    finally:
        stop.set()
        rt.shutdown()
