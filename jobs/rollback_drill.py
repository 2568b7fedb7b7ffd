"""Rollback drill against a Ray cluster (spec 0x0E, 0x0EA).

    ray job submit --working-dir . -- python jobs/rollback_drill.py [--fault-at canary|active] [--all-faults]

Starts a drill deployment on the cluster the job runs in (the drill joins ``RAY_ADDRESS``), promotes a
candidate under live traffic, injects the ten faults of 0x0E, rolls the faulted candidate back in the 0x0EA
order, prints one progress line per phase on stderr and the report on stdout, and exits non-zero unless every
safe outcome held and every served output was the reference. The gate uses the spec's thresholds
(N_shadow >= 100, N_canary >= 200).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollback_drill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fault-at", choices=["canary", "active"], default="active")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--all-faults", action="store_true", help="inject each data-path fault on every rank")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--name", default=None, help="deployment name (default: rollback-drill-<random>)")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, which a Ray job sets); "
                   "'local' starts a fresh local instance")
    return p


def main(argv: list[str] | None = None) -> int:
    # 1. the job's working directory is the repository: make ray_moe importable for this driver
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from ray_moe.apps.drill import run_drill_cli

    # 2. run the drill on the cluster and exit with its verdict
    return run_drill_cli(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
