"""The rollback drill: a release promoted, faulted and rolled back under live traffic (spec 0x0C-0x0EB).

    from ray_moe.apps.drill import DrillOptions, FaultAt, run_drill
    report = run_drill(DrillOptions(fault_at=FaultAt.ACTIVE), address="local")   # ray-moe drill rollback

A background thread streams explicit-route batches through ``Runtime.forward`` for the whole drill and checks
every returned output against the reference; the ten faults of 0x0E are injected into the live deployment,
candidates go through SHADOW and CANARY to the promotion gate (0x0DC), and a faulted candidate is rolled back
in the 0x0EA order while traffic continues. The drill drives the coordinator only through
``ray_moe.apps.release_client.ReleaseClient`` and the runtime through its public API.

    report.py     DrillOptions, DrillReport and its records, DrillError, render_text
    traffic.py    the live stream: batches with references, serve / shadow / canary, per-release telemetry
    context.py    the state one drill run shares (runtime, release client, stream, records)
    releases.py   admission, staging, gate evidence and the ordered rollback on the live deployment
    faults.py     the fault sweep (faults 1-7, 9)
    scenario.py   the ten steps in order, and the report
    progress.py   ``[drill 12s] ...`` lines on stderr
    run.py        run_drill (Ray, resources, deployment) and the command line
"""

from ray_moe.apps.drill.progress import Progress
from ray_moe.apps.drill.report import (
    DrillError,
    DrillOptions,
    DrillReport,
    FaultAt,
    RollbackSummary,
    TimelineEntry,
    TrafficSummary,
    render_text,
)
from ray_moe.apps.drill.run import drill_config, options_from_args, run_drill, run_drill_cli

__all__ = ["run_drill", "run_drill_cli", "drill_config", "options_from_args", "DrillOptions", "DrillReport",
           "DrillError", "FaultAt", "TimelineEntry", "TrafficSummary", "RollbackSummary", "render_text", "Progress"]
