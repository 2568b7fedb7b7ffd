"""The ``ray-moe`` command.

    ray-moe demo                              serve a small MoE on a local Ray instance, checked
    ray-moe status    [--name N]              generations, refcounts, placement, timeline of a deployment
    ray-moe scale     --expert E --replicas R live replica scaling; prints the new generation
    ray-moe rebalance [--name N]              live EPLB rebalance from the load window
    ray-moe drill rollback [--json]           promote a candidate under traffic, inject a fault, roll back
    ray-moe bench NAME [args...]              run bench/NAME.py (python -m bench.NAME)
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from typing import Sequence


def _connect(args: argparse.Namespace):
    from ray_moe.runtime import Runtime

    return Runtime.connect(args.name, address=args.address)


def cmd_demo(args: argparse.Namespace) -> int:
    from ray_moe.demo import run_demo

    return run_demo(args)


def cmd_status(args: argparse.Namespace) -> int:
    rt = _connect(args)
    man = rt.placement()
    gens = rt.generations()
    refs = rt.refcounts()
    body = {
        "deployment": args.name,
        "active_generation": man.generation,
        "generations": {str(g): {"state": s, "refcount": refs.get(g)} for g, s in gens.items()},
        "replica_counts": {str(l): man.replica_counts(l) for l in range(man.num_layers)},
        "slots_per_rank": {str(r): len(man.rank_slots(r)) for r in range(man.num_ranks)},
        "telemetry": rt.telemetry_snapshot(),
        "timeline": rt.timeline()[-args.tail:],
    }
    if args.json:
        print(json.dumps(body, indent=2, default=str))
        return 0
    print(f"deployment {args.name!r}: active generation {man.generation} ({man.placement_version}), "
          f"checkpoint {man.checkpoint_version}")
    print("generation  state     refcount")
    for g, s in sorted(gens.items()):
        print(f"{g:>10}  {s:<8}  {refs.get(g, '-')}")
    print(f"replicas per expert (layer 0): {man.replica_counts(0)}")
    tel = rt.telemetry_table()
    if tel:
        print(tel)
    print("recent control events:")
    for e in body["timeline"]:
        print(f"  #{e['seq']:<4} {e['event']:<12} gen={e['generation']}  {e['detail']}")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    rt = _connect(args)
    g = rt.scale(expert=args.expert, replicas=args.replicas, layer=args.layer)
    print(json.dumps({"new_generation": g, "replica_counts": rt.placement().replica_counts(args.layer or 0)}))
    return 0


def cmd_rebalance(args: argparse.Namespace) -> int:
    rt = _connect(args)
    g = rt.rebalance(migration_aware=not args.no_migration_aware)
    print(json.dumps({"new_generation": g, "replica_counts": rt.placement().replica_counts(0)}))
    return 0


def cmd_drill(args: argparse.Namespace) -> int:
    from ray_moe.apps.drill import run_drill_cli

    return run_drill_cli(args)


def cmd_bench(args: argparse.Namespace) -> int:
    sys.argv = [f"bench.{args.bench}", *args.rest]
    runpy.run_module(f"bench.{args.bench}", run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ray_moe.demo import add_arguments as demo_args

    p = argparse.ArgumentParser(prog="ray-moe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="serve a small MoE on a local Ray instance and check it")
    demo_args(d)
    d.set_defaults(fn=cmd_demo)

    def conn(q: argparse.ArgumentParser) -> None:
        q.add_argument("--name", default="default", help="deployment name (its coordinator is named after it)")
        q.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or auto)")

    s = sub.add_parser("status", help="state of a running deployment")
    conn(s)
    s.add_argument("--json", action="store_true")
    s.add_argument("--tail", type=int, default=12)
    s.set_defaults(fn=cmd_status)

    sc = sub.add_parser("scale", help="set one logical expert's replica count, live")
    conn(sc)
    sc.add_argument("--expert", type=int, required=True)
    sc.add_argument("--replicas", type=int, required=True)
    sc.add_argument("--layer", type=int, default=None)
    sc.set_defaults(fn=cmd_scale)

    rb = sub.add_parser("rebalance", help="EPLB rebalance from the load window, live")
    conn(rb)
    rb.add_argument("--no-migration-aware", action="store_true")
    rb.set_defaults(fn=cmd_rebalance)

    dr = sub.add_parser("drill", help="operational drills")
    drs = dr.add_subparsers(dest="drill", required=True)
    rbk = drs.add_parser("rollback", help="promote a candidate under traffic, inject a fault, roll back")
    rbk.add_argument("--json", action="store_true", help="machine-readable output")
    rbk.add_argument("--fault-at", choices=["canary", "active"], default="active")
    rbk.add_argument("--ranks", type=int, default=4)
    rbk.add_argument("--steps", type=int, default=24)
    rbk.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    rbk.add_argument("--all-faults", action="store_true", help="inject each data-path fault on every rank (the ten-fault sweep always runs: FaultsOK gates promotion)")
    rbk.add_argument("--address", default=None, help="Ray address; 'local' starts a fresh local instance even when "
                     "RAY_ADDRESS is set (default: RAY_ADDRESS, else a local instance)")
    rbk.set_defaults(fn=cmd_drill)

    b = sub.add_parser("bench", help="run a benchmark from bench/")
    b.add_argument("bench")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (ValueError, RuntimeError) as exc:
        print(f"ray-moe {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
