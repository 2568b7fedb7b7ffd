"""Entry points of the rollback drill: join (or start) Ray, check the cluster can hold the deployment, start
it, run the drill, shut it down; and the ``ray-moe drill rollback`` / ``jobs/rollback_drill.py`` command.

    report = run_drill(DrillOptions(fault_at=FaultAt.ACTIVE), address="local", progress=Progress())

``address``: ``"local"`` always starts a fresh local Ray instance (even when ``RAY_ADDRESS`` is set); another
address joins that cluster; None joins ``RAY_ADDRESS`` when it is set, else starts a local instance. A process
that already called ``ray.init`` keeps its instance. A Ray instance the drill started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import uuid
from typing import Callable, Mapping

import ray

from ray_moe.apps.drill.progress import Progress
from ray_moe.apps.drill.report import DrillError, DrillOptions, DrillReport, FaultAt, render_text
from ray_moe.apps.drill.scenario import Drill
from ray_moe.model.config import RuntimeConfig
from ray_moe.core.env import read_env

RESOURCE_POLL_S = 1.0


def drill_config(options: DrillOptions) -> RuntimeConfig:
    """The deployment a drill runs on: small, tagged weights (a wrong expert shows in the output)."""
    return RuntimeConfig(num_ranks=options.ranks, num_experts=options.num_experts, hidden_size=options.hidden_size,
                         ffn_size=options.ffn_size, top_k=options.top_k, slots_per_rank=options.slots_per_rank,
                         device=options.device, dtype="float32", seed=options.seed, name=options.name,
                         tagged_weights=True, exchange_timeout_s=20.0)


def deployment_resources(cfg: RuntimeConfig) -> dict[str, float]:
    """What the deployment's placement group reserves: ``actor_cpus`` per rank (and one GPU per rank on CUDA)."""
    need = {"CPU": cfg.num_ranks * cfg.actor_cpus}
    if cfg.device == "cuda":
        need["GPU"] = float(cfg.num_ranks)
    return need


def connect(address: str | None, cfg: RuntimeConfig, progress: Progress) -> bool:
    """Join or start Ray for the drill; True when this call started a local instance (the drill stops it)."""
    if ray.is_initialized():
        progress("ray: using the instance this process already joined")
        return False
    env = read_env()
    if address == "local" or (address is None and env.ray_address is None):
        num_cpus = max(4, math.ceil(deployment_resources(cfg)["CPU"]) + 2)
        ray.init(address="local", num_cpus=num_cpus, namespace=env.namespace, include_dashboard=False,
                 log_to_driver=False)
        progress(f"ray: started a local instance ({num_cpus} CPUs)")
        return True
    target = address or env.ray_address
    ray.init(address=target, namespace=env.namespace, log_to_driver=False)
    progress(f"ray: joined {target}")
    return False


def shortfall(need: Mapping[str, float], available: Mapping[str, float],
              total: Mapping[str, float]) -> dict[str, tuple[float, float, float]]:
    """Resources the cluster cannot give now: name -> (needed, available, total)."""
    return {k: (v, float(available.get(k, 0.0)), float(total.get(k, 0.0)))
            for k, v in need.items() if float(available.get(k, 0.0)) + 1e-9 < v}


def describe_shortfall(cfg: RuntimeConfig, short: Mapping[str, tuple[float, float, float]]) -> str:
    per = {"CPU": cfg.actor_cpus, "GPU": 1.0}
    return "; ".join(f"the deployment needs {need:g} {k} ({cfg.num_ranks} ranks x {per.get(k, 1.0):g}), "
                     f"{avail:g} of {tot:g} available" for k, (need, avail, tot) in short.items())


def wait_for_resources(cfg: RuntimeConfig, *, wait_s: float, progress: Progress, fixed_size: bool = False,
                       available: Callable[[], Mapping[str, float]] = ray.available_resources,
                       total: Callable[[], Mapping[str, float]] = ray.cluster_resources,
                       sleep: Callable[[float], None] = time.sleep,
                       clock: Callable[[], float] = time.monotonic) -> None:
    """Return once the cluster has the deployment's CPUs (and GPUs) free; else wait at most ``wait_s``, saying
    what is missing, and raise ``DrillError`` with the numbers. ``fixed_size``: the cluster cannot grow (a
    local instance), so a total below the need fails at once."""
    need = deployment_resources(cfg)
    short = shortfall(need, available(), total())
    if not short:
        return
    what = describe_shortfall(cfg, short)
    hint = "free them (another deployment may hold them), lower --ranks, or run on --address local"
    if fixed_size and any(tot + 1e-9 < n for n, _, tot in short.values()):
        raise DrillError(f"the cluster is too small for the drill deployment: {what}; {hint}")
    progress(f"waiting up to {wait_s:.0f}s for resources: {what}")
    deadline = clock() + wait_s
    while clock() < deadline:
        sleep(min(RESOURCE_POLL_S, max(0.0, deadline - clock())))
        short = shortfall(need, available(), total())
        if not short:
            progress("resources available")
            return
    raise DrillError(f"the cluster lacks the resources of the drill deployment after {wait_s:.0f}s: "
                     f"{describe_shortfall(cfg, short)}; {hint}")


def run_drill(options: DrillOptions, *, address: str | None = None, progress: Progress | None = None) -> DrillReport:
    """Start a deployment, run the drill, shut the deployment down (and a Ray instance the drill started)."""
    from ray_moe.runtime import Runtime

    if not isinstance(options, DrillOptions):
        raise ValueError(f"options={type(options).__name__} is not DrillOptions")
    progress = progress or Progress.silent()
    cfg = drill_config(options)
    t = options.thresholds
    progress(f"rollback drill {options.name}: {options.ranks} ranks on {options.device}, fault at "
             f"{options.fault_at.value}, gate N_shadow >= {t.min_shadow}, N_canary >= {t.min_canary}")
    owns = connect(address, cfg, progress)
    try:
        wait_for_resources(cfg, wait_s=options.resource_wait_s, progress=progress, fixed_size=owns)
        t0 = time.monotonic()
        rt = Runtime.start(cfg)
        progress(f"deployment {cfg.name!r} started: {cfg.num_ranks} ranks on {cfg.device} "
                 f"({time.monotonic() - t0:.1f}s)")
        try:
            report = Drill(options, rt, progress=progress).run()
        finally:
            t0 = time.monotonic()
            rt.shutdown()
            progress(f"deployment shut down ({time.monotonic() - t0:.1f}s)")
        tr = report.traffic
        progress(f"result: {'PASS' if report.ok else 'FAIL'} ({sum(r.passed for r in report.faults)}/"
                 f"{len(report.faults)} faults safe, {tr.served}/{tr.submitted} batches served, "
                 f"{tr.mismatches} mismatches)")
        return report
    finally:
        if owns:
            t0 = time.monotonic()
            ray.shutdown()
            progress(f"ray: local instance stopped ({time.monotonic() - t0:.1f}s)")


def options_from_args(args: argparse.Namespace) -> DrillOptions:
    """``ray-moe drill rollback`` / ``jobs/rollback_drill.py`` arguments -> DrillOptions (spec thresholds)."""
    name = getattr(args, "name", None) or f"rollback-drill-{uuid.uuid4().hex[:6]}"
    return DrillOptions(name=name, fault_at=FaultAt(args.fault_at), ranks=args.ranks, steps=args.steps,
                        device=args.device, all_faults=bool(args.all_faults))


def run_drill_cli(args: argparse.Namespace) -> int:
    """Run the drill with progress lines on stderr; print the report on stdout (text, or one JSON object with
    ``--json``); 0 iff it passed."""
    report = run_drill(options_from_args(args), address=getattr(args, "address", None), progress=Progress())
    if getattr(args, "json", False):
        print(json.dumps(report.model_dump(mode="json")))
    else:
        print(render_text(report))
    return 0 if report.ok else 1


__all__ = ["drill_config", "deployment_resources", "connect", "wait_for_resources", "run_drill",
           "options_from_args", "run_drill_cli"]
