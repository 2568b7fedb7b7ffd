"""``python -m ray_moe_bench [--prog P] [NAME [args ...]]``: list the benchmarks, or run one (``ray-moe bench`` runs
this in its own process: the product never imports the benchmarks). An unknown NAME is one line on stderr and exit
code 2; a reader that closes stdout early (``| head``) ends it quietly."""

from __future__ import annotations

import importlib
import os
import sys

from ray_moe_bench import available


def listing() -> str:
    benches = available()
    width = max(map(len, benches), default=0)
    lines = ["benchmarks (ray-moe bench NAME --help for a benchmark's options):"]
    lines += [f"  {name:<{width}}  {doc}" for name, doc in benches.items()]
    lines += ["", "Each writes its result JSON to --out DIR (default: $RAY_MOE_RESULTS_DIR, else ./ray-moe-results)."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    prog = "python -m ray_moe_bench"
    if argv[:1] == ["--prog"] and len(argv) > 1:
        prog, argv = argv[1], argv[2:]
    try:
        if not argv:
            print(listing())
            sys.stdout.flush()
            return 0
        name, rest = argv[0], argv[1:]
        names = available()
        if name not in names:
            print(f"{prog}: error: bench={name!r} is not a benchmark; choose one of: {', '.join(names)}",
                  file=sys.stderr)
            return 2
        module = importlib.import_module(f"ray_moe_bench.{name}")
        sys.argv = [f"{prog} {name}", *rest]  # the benchmark's usage line names the command
        code = module.main(list(rest))
        sys.stdout.flush()
        return code if isinstance(code, int) and not isinstance(code, bool) else 0  # (some return their report)
    except BrokenPipeError:  # stdout closed by the reader: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
