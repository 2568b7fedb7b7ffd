"""The ray-moe command.

    ray-moe serve MODEL [--data-parallel-size N] [--device cuda] [--port 8000]
                                              OpenAI-compatible completions and chat (Ray Serve) over a
                                              deployment, on a private Ray instance unless --address is given
                                              (vllm serve's flags: apps/serve_flags.py)
    ray-moe status    [--name N] [--all]      generations, refcounts, placement, timeline of a deployment,
                                              the autopilot's last decisions, the operation in flight
    ray-moe scale     --expert E --replicas R live replica scaling; prints the new generation
    ray-moe rebalance [--name N]              live EPLB rebalance from the load window
    ray-moe demo                              serve a small MoE on a local Ray instance, checked
    ray-moe drill rollback [--json]           promote a candidate under traffic, inject a fault, roll back
    ray-moe bench [NAME [args...]]            list the benchmarks, or run one (python -m ray_moe_bench NAME, in its
                                              own process: the product never imports the benchmarks)

status, scale and rebalance reach the deployment a ray-moe serve on this machine runs (its state file in
~/.ray-moe, or $RAY_MOE_STATE_DIR; --name, else the only one), never another cluster's; with --address
HOST:PORT (or RAY_ADDRESS; 'auto': the cluster `ray start` runs here) the deployment on that cluster. Token
authentication is turned on by itself when the deployment's Ray runs with it, or when this machine holds a
token (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH, RAY_AUTH_TOKEN); a RAY_AUTH_MODE the shell sets is kept
(`ray get-auth-token` on a head node prints its token). apps/connect.py says how.

Errors print one line; output into a closed pipe (`ray-moe status | head`) ends quietly. Exit codes: 0 ok, 1 failure (no cluster, authentication refused, a failed
operation), 2 bad input (an unknown deployment, expert, benchmark, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Sequence

from ray_moe.apps.connect import BadInput, connect_deployment
from ray_moe.apps.serve_flags import DEFAULT_RANKS, add_serve_arguments, normalize_serve_args
from ray_moe.apps.status_lines import autopilot_lines, members_lines, operation_lines

RETIRED_SHOWN = 3  # ray-moe status lists the last few RETIRED generations (--all: every generation)


def _connect(args: argparse.Namespace):
    """The deployment a status / scale / rebalance command means (``apps/connect.py``)."""
    return connect_deployment(args)


def shown_generations(gens: dict[int, str], *, show_all: bool = False,
                      retired: int = RETIRED_SHOWN) -> tuple[dict[int, str], int]:
    """The generations ``status`` lists: every one that is not RETIRED (ACTIVE, DRAINING, staged) and the
    last ``retired`` RETIRED ones, oldest first; ``show_all`` lists all. Returns (shown, hidden count)."""
    if show_all:
        return dict(sorted(gens.items())), 0
    old = sorted(g for g, s in gens.items() if s == "RETIRED")
    keep = set(old[-retired:] if retired > 0 else [])
    shown = {g: s for g, s in sorted(gens.items()) if s != "RETIRED" or g in keep}
    return shown, len(gens) - len(shown)


def cmd_demo(args: argparse.Namespace) -> int:
    from ray_moe.apps.demo import run_demo

    return run_demo(args)


def shard_lines(status: dict[int, dict]) -> dict[str, dict]:
    """Per rank: steps served, generation steps, captured-graph replays, deferred decode inputs, multi-step
    decode calls, the device time its generation steps took (CUDA; 0 on CPU), a failed CUDA-graph capture
    (its steps then run eagerly: slower, still exact), and the fused kernels its model took (CUDA: norm
    layers, rotary; what kept transformers' own and why; None without a model), prompt tokens served from its
    prefix cache out of those looked up, and its KV block pool (free / held / cached blocks, evictions)."""
    keys = ("steps", "generate_steps", "graph_replays", "deferred_tokens", "multi_step_requests",
            "prefix_hit_tokens", "prefix_lookup_tokens")
    return {str(r): {**{k: int(st.get("counters", {}).get(k, 0)) for k in keys},
                     "device_busy_s": st.get("counters", {}).get("device_busy_us", 0) / 1e6,
                     "capture_error": st.get("capture_error"), "fused_kernels": st.get("fused_kernels"),
                     "kv_blocks": st.get("kv_blocks")}
            for r, st in sorted(status.items())}


def prefix_line(sh: dict) -> str:
    """``; prefix cache 48 of 160 prompt tokens (30.0%), blocks 10 held / 4 cached / 50 free, 2 evicted``, or ""
    before any prefill."""
    looked, hit, kv = sh.get("prefix_lookup_tokens", 0), sh.get("prefix_hit_tokens", 0), sh.get("kv_blocks")
    if not looked:
        return ""
    out = f"; prefix cache {hit} of {looked} prompt tokens ({100.0 * hit / looked:.1f}%)"
    if kv:
        out += f", blocks {kv['held']} held / {kv['cached']} cached / {kv['free']} free, {kv['evictions']} evicted"
    return out


def fused_line(fk: dict | None) -> str:
    """``; fused kernels: 97 norm layers, rotary, 48 routers, 48 qkv`` (and what kept transformers' own), or ""
    when none were tried."""
    if not fk or not (fk["norm_layers"] or fk["rotary_modules"] or fk.get("router_layers") or fk.get("qkv_modules")
                      or fk["skipped"]):
        return ""
    took = [f"{fk['norm_layers']} norm layers"] if fk["norm_layers"] else []
    took += ["rotary"] if fk["rotary_modules"] else []
    took += [f"{fk['router_layers']} routers"] if fk.get("router_layers") else []
    took += [f"{fk['qkv_modules']} qkv"] if fk.get("qkv_modules") else []
    kept = "; ".join(f"{k.rsplit('.', 1)[-1]}: {v}" for k, v in sorted(fk["skipped"].items()))
    return (f"; fused kernels: {', '.join(took) or 'none'}"
            + (f" (transformers' own kept for {kept})" if kept else ""))


def _control_status(rt) -> dict:
    """The coordinator's ``status()``: generations, the autopilot (``eplb``), the operation in flight."""
    from ray_moe.ray.remote import call

    return call(rt.coordinator.status.remote())


def cmd_status(args: argparse.Namespace) -> int:
    rt = _connect(args)
    ctl = _control_status(rt)
    man = rt.placement()
    gens, hidden = shown_generations(rt.generations(), show_all=args.all)
    refs = rt.refcounts()
    body = {
        "deployment": args.name,
        "active_generation": man.generation,
        "generations": {str(g): {"state": s, "refcount": refs.get(g)} for g, s in gens.items()},
        "generations_hidden": hidden,
        "replica_counts": {str(l): man.replica_counts(l) for l in range(man.num_layers)},
        "slots_per_rank": {str(r): len(man.rank_slots(r)) for r in range(man.num_ranks)},
        "replica_floors": rt.floors(),
        "telemetry": rt.telemetry_snapshot(),
        "timeline": rt.timeline()[-args.tail:],
        "shards": shard_lines(rt.shard_status()),
        "autopilot": ctl.get("eplb"),
        "operation": ctl.get("operation"),
        "members": {k: ctl.get(k) for k in ("target", "members", "converged", "healer", "scaler", "changes")},
    }
    if args.json:
        print(json.dumps(body, indent=2, default=str))
        return 0
    print(f"deployment {args.name!r}: active generation {man.generation} ({man.placement_version}), "
          f"checkpoint {man.checkpoint_version}")
    print("generation  state     refcount")
    for g, s in sorted(gens.items()):
        print(f"{g:>10}  {s:<8}  {refs.get(g, '-')}")
    if hidden:
        print(f"({hidden} older RETIRED generation(s) not shown; --all lists every generation)")
    print(f"replicas per expert (layer 0): {man.replica_counts(0)}")
    floors = body["replica_floors"]
    print("replica floors (set by scale, kept by rebalance): " + (", ".join(
        f"expert {f['expert']} layer {f['layer']} >= {f['replicas']}" for f in floors) if floors else "none"))
    print("shards (steps served; generation: steps, captured-graph replays, decode inputs deferred to the rank):")
    for r, sh in body["shards"].items():
        gen = (f"generation {sh['generate_steps']} steps ({sh['multi_step_requests']} multi-step calls), "
               f"{sh['graph_replays']} graph replays, {sh['deferred_tokens']} deferred"
               + (f", {sh['device_busy_s']:.2f} s on the device" if sh["device_busy_s"] else "")
               if sh["generate_steps"] else "no generation")
        print(f"  rank {r}: {sh['steps']} steps, {gen}" + fused_line(sh["fused_kernels"]) + prefix_line(sh)
              + (f"; CAPTURE FAILED (steps run eagerly): {sh['capture_error']}" if sh["capture_error"] else ""))
    tel = rt.telemetry_table()
    if tel:
        print(tel)
    for line in members_lines(ctl) + autopilot_lines(body["autopilot"]) + operation_lines(body["operation"]):
        print(line)
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


def eplb_flag(text: str):
    """``--eplb off|auto|periodic:N`` as the deployment's ``eplb`` policy (``RuntimeConfig.eplb``)."""
    from ray_moe.control.autopilot import parse_eplb

    try:
        return parse_eplb(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("eplb=", "--eplb=", 1)) from None


def bounded_int(least: int):
    """An argparse type: an integer >= ``least``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{n} must be >= {least}")
        return n

    return parse


def serve_config_fields(args: argparse.Namespace) -> dict:
    """The RuntimeConfig fields ``ray-moe serve``'s flags set: ``quantization`` (--quantization), ``payload_format``
    (--payload-format), ``eplb`` (--eplb), ``heal_retries``
    (--heal-retries) and, when --min-ranks or --max-ranks is given, ``scaling`` (enabled, min 1 and max
    --ranks unless given). Flags that were not parsed (another caller's namespace) set nothing."""
    from ray_moe.model.config import ScalingPolicy

    out: dict = {}
    if getattr(args, "quantization", None) is not None:
        out["quantization"] = args.quantization
    if getattr(args, "payload_format", None) is not None:
        out["payload_format"] = args.payload_format
    if getattr(args, "eplb", None) is not None:
        out["eplb"] = args.eplb
    if getattr(args, "heal_retries", None) is not None:
        out["heal_retries"] = args.heal_retries
    lo, hi = getattr(args, "min_ranks", None), getattr(args, "max_ranks", None)
    ranks = getattr(args, "ranks", None) or DEFAULT_RANKS
    if lo is not None or hi is not None:
        lo, hi = lo or 1, hi or max(ranks, lo or 1)
        if lo > hi:
            raise BadInput(f"--min-ranks={lo} exceeds --max-ranks={hi}")
        if not lo <= ranks <= hi:
            raise BadInput(f"--ranks={ranks} is outside [--min-ranks={lo}, --max-ranks={hi}]")
        out["scaling"] = ScalingPolicy(enabled=True, min_ranks=lo, max_ranks=hi)
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    """A private local Ray instance unless ``--address`` / ``RAY_ADDRESS`` names a cluster (``run_server``
    checks the options and the address first, joins or starts Ray, and says where it runs)."""
    from ray_moe.apps.serve_run import preflight
    from ray_moe.core.env import read_env

    normalize_serve_args(args, BadInput)
    preflight(args, read_env())  # a taken address, an impossible device: refused before the server's imports
    fields = serve_config_fields(args)
    from ray_moe.apps.server import run_server

    return run_server(args, config_fields=fields)


def cmd_drill(args: argparse.Namespace) -> int:
    from ray_moe.apps.drill import run_drill_cli

    return run_drill_cli(args)


BENCH_HOW = ("the benchmarks ship with the repository, not with the installed package: clone it and install from "
             "the checkout (git clone <ray-moe repository> && cd ray-moe && pip install -e .), then run ray-moe bench "
             "there (or python -m ray_moe_bench NAME with its bench/ and dev/ folders on PYTHONPATH)")


def bench_folder() -> Path | None:
    """The checkout's ``bench/`` folder (beside this package when it was installed with ``pip install -e .``), where
    the benchmarks (``ray_moe_bench``) live; None in an installed package."""
    root = Path(__file__).resolve().parents[2]
    return root / "bench" if (root / "bench" / "ray_moe_bench" / "__init__.py").is_file() else None


def cmd_bench(args: argparse.Namespace) -> int:
    """``python -m ray_moe_bench [NAME args]`` in its own process (the product never imports the benchmarks), the
    checkout's ``bench/`` and ``dev/`` first on its path; its exit code is the command's."""
    import importlib.util
    import subprocess

    folder = bench_folder()
    paths = [] if folder is None else [str(folder), str(folder.parent / "dev")]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if folder is None and importlib.util.find_spec("ray_moe_bench") is None:  # located, not imported
        raise BadInput(BENCH_HOW)
    sys.stdout.flush()
    return subprocess.call([sys.executable, "-m", "ray_moe_bench", "--prog", "ray-moe bench",
                            *([args.bench] if args.bench else []), *args.rest], env=env)


def exit_code(exc: BaseException) -> int:
    """2 for bad input (a ValueError behind any wrappers, not a connection failure), 1 for other failures."""
    from ray_moe.core.errors import root_cause

    cause = root_cause(exc)
    return 2 if isinstance(cause, ValueError) else 1


def build_parser() -> argparse.ArgumentParser:
    from ray_moe.apps.demo import add_arguments as demo_args

    p = argparse.ArgumentParser(prog="ray-moe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--traceback", action="store_true", help="on an error, print the full traceback too")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", allow_abbrev=False, help="serve a small MoE on a local Ray instance and check it")
    demo_args(d)
    d.set_defaults(fn=cmd_demo)

    def conn(q: argparse.ArgumentParser) -> None:
        q.add_argument("--name", default=None, help="deployment name (ray-moe serve --name); default: the only one "
                                                    "running")
        q.add_argument("--address", default=None,
                       help="a Ray cluster HOST:PORT, or 'auto' for the one `ray start` runs on this machine (default: "
                            "RAY_ADDRESS, else the deployments ray-moe serve runs on this machine, by their state "
                            "files)")

    s = sub.add_parser("status", allow_abbrev=False, help="state of a running deployment")
    conn(s)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--tail", type=int, default=12, help="control events to show (default 12)")
    s.add_argument("--all", action="store_true",
                   help=f"list every generation (default: ACTIVE, DRAINING and the last {RETIRED_SHOWN} RETIRED)")
    s.set_defaults(fn=cmd_status)

    sc = sub.add_parser("scale", allow_abbrev=False, help="set one logical expert's replica count, live")
    conn(sc)
    sc.add_argument("--expert", type=int, required=True, help="logical expert id")
    sc.add_argument("--replicas", type=int, required=True, help="copies it should have (at most one per rank)")
    sc.add_argument("--layer", type=int, default=None, help="MoE layer (default: every layer)")
    sc.set_defaults(fn=cmd_scale)

    rb = sub.add_parser("rebalance", allow_abbrev=False, help="EPLB rebalance from the load window, live")
    conn(rb)
    rb.add_argument("--no-migration-aware", action="store_true",
                    help="solve EPLB from scratch instead of keeping slots that need not move")
    rb.set_defaults(fn=cmd_rebalance)

    sv = sub.add_parser("serve", help="serve a model: OpenAI-compatible completions and chat over Ray Serve",
                        description="Serve a Hugging Face MoE folder (vllm serve's flags where ray-moe has the same "
                                    "knob) on a private Ray instance, or on the cluster --address / RAY_ADDRESS names: "
                                    "POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize, GET "
                                    "/v1/models, /health and /metrics, until Ctrl-C or SIGTERM. It refuses an "
                                    "address something already listens on, and a Serve instance on the cluster "
                                    "that listens elsewhere than --host/--port, before any shard starts.",
                        allow_abbrev=False)
    add_serve_arguments(sv, bounded_int, eplb_flag)
    sv.set_defaults(fn=cmd_serve)

    dr = sub.add_parser("drill", allow_abbrev=False, help="operational drills")
    drs = dr.add_subparsers(dest="drill", required=True)
    rbk = drs.add_parser("rollback", allow_abbrev=False, help="promote a candidate under traffic, inject a fault, roll back")
    rbk.add_argument("--json", action="store_true", help="machine-readable output")
    rbk.add_argument("--fault-at", choices=["canary", "active"], default="active")
    rbk.add_argument("--ranks", type=int, default=4)
    rbk.add_argument("--steps", type=int, default=24)
    rbk.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    rbk.add_argument("--all-faults", action="store_true", help="inject each data-path fault on every rank (the ten-fault sweep always runs: FaultsOK gates promotion)")
    rbk.add_argument("--address", default=None, help="Ray address; 'local' starts a fresh local instance even when "
                     "RAY_ADDRESS is set (default: RAY_ADDRESS, else a local instance)")
    rbk.set_defaults(fn=cmd_drill)

    b = sub.add_parser("bench", allow_abbrev=False, help="list the benchmarks, or run one", usage="ray-moe bench [NAME [args ...]]",
                       description="Without NAME, list the benchmarks; with NAME, run one (its options follow NAME).",
                       epilog="The benchmarks live in the repository's bench/ folder (a checkout installed with "
                              "pip install -e .); each runs as python -m ray_moe_bench NAME, in its own process.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("bench", nargs="?", metavar="NAME", help="benchmark to run")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments (NAME --help lists them)")
    b.set_defaults(fn=cmd_bench)
    return p


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush into the closed pipe raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor behind stdout (a test's capture): nothing to flush there
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; an error prints one line (the root cause, no Ray banner) and returns 1 or 2."""
    from ray_moe.core.errors import error_line

    args = build_parser().parse_args(argv)
    try:
        code = int(args.fn(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at the interpreter's exit
        return code
    except BrokenPipeError:  # stdout closed by the reader (`| head`): stop quietly, as other tools do
        _silence_stdout()
        return 0
    except KeyboardInterrupt:
        print(f"ray-moe {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        if args.traceback:
            traceback.print_exc()
        print(f"ray-moe {args.command}: error: {error_line(exc)}", file=sys.stderr)
        return exit_code(exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

