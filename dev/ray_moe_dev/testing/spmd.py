"""A multi-process SPMD launcher for GPU tests and benchmarks, without Ray.

    results = run_spmd(fn, world_size=2, args=(cfg,), backend="nccl", timeout_s=300)

``fn(exchange, rank, *args)`` runs once per rank; its (picklable) results come back in rank order.

Backends:

* ``"nccl"``: one process per GPU (``torch.multiprocessing`` spawn context). Process r selects
  ``cuda:r``; rank 0 creates the NCCL unique id and hands it to the others through a queue; every
  rank builds ``NcclExchange(rank, ProcessGroupSpec.identity(P), uid, timeout_s=exchange_timeout_s,
  device="cuda:r")`` and calls ``fn``.
* ``"local"``: one thread per rank over ``LocalExchangeGroup`` on CPU (the same ``fn``, for tests
  without a GPU). ``exchange.device`` does not exist there; use :func:`exchange_device`.
* ``"process"``: one CPU process per rank and ``exchange=None``: the launcher itself (and, with
  ``torch_dist=True``, a gloo ``torch.distributed`` group) tested without a GPU.

``torch_dist=True`` also initialises ``torch.distributed`` in every process (NCCL for ``"nccl"``,
gloo for ``"process"``) with ``init_method=tcp://127.0.0.1:<port>``, the port chosen free by the
parent, so a benchmark can time ``dist.all_to_all_single`` beside our exchange in the same process.

Failure handling (a test using this must never hang):

1. A rank whose ``fn`` raises reports its exception type, message and formatted traceback (and the
   pickled exception when it pickles) and exits without tearing NCCL down.
2. A rank process that exits without a report is a failure, unless its rank is in ``may_exit``
   (fault tests: a peer that dies on purpose); its result is then ``None``.
3. After the first failure the other ranks get ``grace_s`` more seconds (their exchange watchdogs
   fire within ``exchange_timeout_s``), then they are killed.
4. The whole run is killed after ``timeout_s`` seconds.
5. Failures are raised in the parent as :class:`SpmdError` (``SpmdTimeoutError`` when only timeouts
   happened), naming every failed rank with its traceback; ``__cause__`` is the first rank's original
   exception when it could be unpickled.

The only environment this module touches is :func:`child_environment`, applied in each child before
any CUDA or NCCL initialisation (``NCCL_NVLS_ENABLE=0``: NVLink multicast stays off).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import threading
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Sequence

BACKENDS = ("nccl", "local", "process")
_SETUP_TIMEOUT_S = 120.0  # unique-id hand-out and torch.distributed rendezvous


# --------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class RankFailure:
    """Why one rank produced no result.

    kind: ``exception`` (fn or setup raised), ``exited`` (process ended without a report),
    ``killed`` (still running after another rank failed and the grace period ended) or ``timeout``
    (still running when the whole run timed out).
    """

    rank: int
    kind: str
    exc_type: str
    message: str
    traceback: str = ""
    exitcode: int | None = None
    exception_bytes: bytes | None = None

    def exception(self) -> BaseException | None:
        """The original exception object, when it survived pickling."""
        if self.exception_bytes is None:
            return None
        try:
            exc = pickle.loads(self.exception_bytes)
        except Exception:  # noqa: BLE001 - an exception class the parent cannot rebuild
            return None
        return exc if isinstance(exc, BaseException) else None

    def describe(self) -> str:
        head = f"rank {self.rank} [{self.kind}] {self.exc_type}: {self.message}"
        if self.exitcode is not None:
            head += f" (exit code {self.exitcode})"
        if self.traceback:
            body = "\n".join("    " + line for line in self.traceback.rstrip().splitlines())
            head += "\n" + body
        return head


class SpmdError(RuntimeError):
    """One or more ranks of an SPMD run failed; ``failures`` holds one record per failed rank."""

    def __init__(self, message: str, failures: Sequence[RankFailure]):
        super().__init__(message)
        self.failures = tuple(failures)

    def failure(self, rank: int) -> RankFailure | None:
        return next((f for f in self.failures if f.rank == rank), None)

    @property
    def exc_types(self) -> dict[int, str]:
        """Failed rank -> exception type name (``exited`` / ``killed`` / ``timeout`` kinds included)."""
        return {f.rank: f.exc_type for f in self.failures}

    def __reduce__(self):
        return (SpmdError, (str(self), self.failures))


class SpmdTimeoutError(SpmdError):
    """Ranks were still running when the run's time limit (or the grace after a failure) ran out."""

    def __reduce__(self):
        return (SpmdTimeoutError, (str(self), self.failures))


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one child process needs besides ``fn`` and its arguments (picklable)."""

    rank: int
    world_size: int
    backend: str
    exchange_timeout_s: float
    dist_port: int | None
    setup_timeout_s: float = _SETUP_TIMEOUT_S

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.backend == "nccl" else "gloo"


# ------------------------------------------------------------------------------------- environment
def child_environment() -> dict[str, str]:
    """Every environment variable the launcher sets in a child process, before CUDA/NCCL start.

    NCCL_NVLS_ENABLE=0 keeps NVLink multicast (NVLS) off: on the shared GPU hosts a program that
    uses it can take the GPUs out of service. It is set explicitly even when inherited.
    """
    return {"NCCL_NVLS_ENABLE": "0"}


def _apply_child_environment() -> None:
    os.environ.update(child_environment())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the torch.distributed rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exchange_device(exchange: Any):
    """The torch device a rank's tensors live on: ``exchange.device`` for NCCL, else CPU."""
    import torch

    dev = getattr(exchange, "device", None)
    return torch.device(dev) if dev is not None else torch.device("cpu")


# ------------------------------------------------------------------------------------------ public
def run_spmd(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    backend: str = "nccl",
    timeout_s: float = 300.0,
    exchange_timeout_s: float = 60.0,
    torch_dist: bool = False,
    may_exit: Sequence[int] = (),
    grace_s: float | None = None,
    teardown_s: float = 30.0,
) -> list[Any]:
    """Run ``fn(exchange, rank, *args)`` on ``world_size`` ranks; results in rank order.

    timeout_s: wall-clock limit of the whole run (processes are killed after it).
    exchange_timeout_s: the ``NcclExchange`` / ``LocalExchangeGroup`` watchdog of one exchange round.
    torch_dist: also initialise ``torch.distributed`` in each process (not with ``backend="local"``).
    may_exit: ranks allowed to end their process without a report (their result is ``None``).
    grace_s: after the first failure, how long the other ranks may still run (default
        ``exchange_timeout_s + 15``).
    teardown_s: after every rank reported, how long a process may take to exit before it is killed
        (a teardown hang never fails a run whose results are in).
    ``fn`` and ``args`` must pickle (module-level functions) for the process backends; results must
    pickle too (CUDA tensors in a result are moved to the CPU first).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if timeout_s <= 0 or exchange_timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} and exchange_timeout_s={exchange_timeout_s} must be > 0")
    bad = [r for r in may_exit if not 0 <= int(r) < world_size]
    if bad:
        raise ValueError(f"may_exit={list(may_exit)}: rank(s) {bad} outside [0, {world_size})")
    grace = exchange_timeout_s + 15.0 if grace_s is None else float(grace_s)
    if backend == "local":
        if torch_dist:
            raise ValueError("torch_dist=True needs one process per rank: use backend='nccl' or 'process'")
        if may_exit:
            raise ValueError("may_exit: threads of backend='local' cannot exit their process")
        return _run_threads(fn, world_size, args, timeout_s, exchange_timeout_s, grace)
    if backend == "nccl":
        _check_gpus(world_size)
    return _run_processes(fn, world_size, args, backend, timeout_s, exchange_timeout_s, torch_dist,
                          frozenset(int(r) for r in may_exit), grace, teardown_s)


def _check_gpus(world_size: int) -> None:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < world_size:
        raise RuntimeError(f"backend='nccl' with world_size={world_size} needs {world_size} CUDA devices, found {n}")


# ------------------------------------------------------------------------------------ child side
def _to_host(obj: Any) -> Any:
    """CUDA tensors (also inside lists, tuples and dicts) -> CPU tensors, so the parent can unpickle."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, list):
        return [_to_host(x) for x in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_to_host(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    return obj


def _failure_report(rank: int, exc: BaseException) -> RankFailure:
    try:
        blob: bytes | None = pickle.dumps(exc)
        pickle.loads(blob)  # only keep what the parent can rebuild
    except Exception:  # noqa: BLE001
        blob = None
    return RankFailure(rank=rank, kind="exception", exc_type=type(exc).__name__, message=str(exc),
                       traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                       exception_bytes=blob)


def _share_unique_id(spec: WorkerSpec, uid_queue: Any) -> bytes:
    """Rank 0 creates the NCCL unique id and posts one copy per other rank; the others take one."""
    if spec.rank == 0:
        from ray_moe.moe.exchange.nccl import new_unique_id

        uid = new_unique_id()
        for _ in range(spec.world_size - 1):
            uid_queue.put(uid)
        return uid
    try:
        return uid_queue.get(timeout=spec.setup_timeout_s)
    except queue_mod.Empty:
        raise TimeoutError(
            f"rank {spec.rank}: no NCCL unique id from rank 0 within {spec.setup_timeout_s:.0f}s"
        ) from None


def _init_torch_dist(spec: WorkerSpec) -> None:
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if spec.dist_backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", spec.rank)
    dist.init_process_group(
        backend=spec.dist_backend,
        init_method=f"tcp://127.0.0.1:{spec.dist_port}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.setup_timeout_s),
        **kwargs,
    )


def _run_rank(spec: WorkerSpec, fn: Callable[..., Any], args: tuple, uid_queue: Any) -> tuple[Any, Callable[[], None]]:
    """Steps of one rank: device, exchange, optional torch.distributed, fn. Returns the (host) result
    and the teardown to run after the result has been reported."""
    import torch

    exchange = None
    # 1. device and communicator
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank)
        uid = _share_unique_id(spec, uid_queue)
        from ray_moe.moe.exchange.nccl import NcclExchange
        from ray_moe.placement.topology import ProcessGroupSpec

        exchange = NcclExchange(spec.rank, ProcessGroupSpec.identity(spec.world_size), uid,
                                timeout_s=spec.exchange_timeout_s, device=f"cuda:{spec.rank}")
    # 2. the baseline's torch.distributed group
    if spec.dist_port is not None:
        _init_torch_dist(spec)
    # 3. the rank function; a raise skips teardown (peers may be gone: destroy could block)
    result = fn(exchange, spec.rank, *args)
    # 4. queued work finishes under the watchdog before any host copy can block on it
    aborted = bool(getattr(exchange, "_aborted", False))
    if exchange is not None and not aborted:
        exchange.wait(f"rank {spec.rank}: end of the rank function")
    result = _to_host(result)

    def teardown() -> None:
        if exchange is not None and not aborted:
            exchange.close()
        if spec.dist_port is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    return result, teardown


def _worker_main(spec: WorkerSpec, fn: Callable[..., Any], args: tuple, uid_queue: Any, result_queue: Any) -> None:
    """Entry point of a child process.

    1. apply the child environment; 2. run the rank; 3. report ``("ok", rank, pickled result)`` or
    ``("err", rank, RankFailure)`` and flush; 4. tear down after success only (a hang there cannot
    lose the report: the parent kills stragglers); 5. ``os._exit`` past interpreter teardown, where
    NCCL / CUDA destructors can block on a dead or aborted peer.
    """
    status = 0
    teardown: Callable[[], None] | None = None
    try:
        _apply_child_environment()
        result, teardown = _run_rank(spec, fn, args, uid_queue)
        message: tuple = ("ok", spec.rank, pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        status, teardown = 1, None
        message = ("err", spec.rank, _failure_report(spec.rank, exc))
    try:
        result_queue.put(message)
    except BaseException as exc:  # noqa: BLE001 - e.g. an unpicklable failure record
        status = 1
        result_queue.put(("err", spec.rank, RankFailure(spec.rank, "exception", type(exc).__name__,
                                                        f"could not send the rank's report: {exc}")))
    result_queue.close()
    result_queue.join_thread()
    if teardown is not None:
        try:
            teardown()
        except BaseException:  # noqa: BLE001 - the result is already reported
            pass
    os._exit(status)


# ----------------------------------------------------------------------------------- parent side
def _run_processes(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    backend: str,
    timeout_s: float,
    exchange_timeout_s: float,
    torch_dist: bool,
    may_exit: frozenset[int],
    grace_s: float,
    teardown_s: float,
) -> list[Any]:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    uid_queue = ctx.Queue()
    result_queue = ctx.Queue()
    port = free_port() if torch_dist else None
    procs = []
    for r in range(world_size):
        spec = WorkerSpec(rank=r, world_size=world_size, backend=backend,
                          exchange_timeout_s=exchange_timeout_s, dist_port=port,
                          setup_timeout_s=min(_SETUP_TIMEOUT_S, timeout_s))
        procs.append(ctx.Process(target=_worker_main, args=(spec, fn, args, uid_queue, result_queue),
                                 name=f"spmd-rank{r}", daemon=False))
    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    try:
        for p in procs:
            p.start()
        _collect(procs, result_queue, results, failures, may_exit, timeout_s, grace_s)
        for r, p in enumerate(procs):  # ranks already judged killed / timed out go now
            if r in failures and failures[r].kind in ("killed", "timeout"):
                _kill(p, 5.0)
        _reap(procs, teardown_s if not failures else 5.0)
    finally:
        for p in procs:
            if p.is_alive():
                _kill(p, 5.0)
        for q in (uid_queue, result_queue):
            q.close()
            q.cancel_join_thread()
    if failures:
        _raise(failures, world_size)
    return [results[r] for r in range(world_size)]


def _collect(procs, result_queue, results: dict[int, Any], failures: dict[int, RankFailure],
             may_exit: frozenset[int], timeout_s: float, grace_s: float) -> None:
    """Read reports until every rank is accounted for, a failure's grace ran out, or the run timed out."""
    world = len(procs)
    deadline = time.monotonic() + timeout_s
    grace_end: float | None = None

    def take(message: tuple) -> None:
        status, rank, body = message
        if rank in results or rank in failures:
            return
        if status == "ok":
            try:
                results[rank] = pickle.loads(body)
            except Exception as exc:  # noqa: BLE001
                failures[rank] = _failure_report(rank, exc)
        else:
            failures[rank] = body

    def drain(wait_s: float) -> None:
        end = time.monotonic() + wait_s
        while True:
            try:
                take(result_queue.get(timeout=max(0.0, end - time.monotonic())))
            except queue_mod.Empty:
                return

    while len(results) + len(failures) < world:
        now = time.monotonic()
        limit = deadline if grace_end is None else min(deadline, grace_end)
        if now >= limit:
            break
        try:
            take(result_queue.get(timeout=min(0.2, limit - now)))
        except queue_mod.Empty:
            pass
        # a process that is gone without a report: drain what it may have flushed, then judge it
        gone = [r for r, p in enumerate(procs) if r not in results and r not in failures and not p.is_alive()]
        if gone:
            drain(1.0)
            for r in gone:
                if r in results or r in failures:
                    continue
                if r in may_exit:
                    results[r] = None
                else:
                    failures[r] = RankFailure(rank=r, kind="exited", exc_type="ProcessExited",
                                              message="the rank's process ended without a report",
                                              exitcode=procs[r].exitcode)
        if failures and grace_end is None:
            grace_end = time.monotonic() + grace_s
    timed_out = time.monotonic() >= deadline
    for r in range(world):
        if r not in results and r not in failures:
            if timed_out:
                failures[r] = RankFailure(rank=r, kind="timeout", exc_type="Timeout",
                                          message=f"still running after the run's limit of {timeout_s:.0f}s; killed")
            else:
                failures[r] = RankFailure(rank=r, kind="killed", exc_type="Killed",
                                          message=f"still running {grace_s:.0f}s after another rank failed; killed")


def _kill(p, wait_s: float) -> None:
    p.terminate()
    p.join(wait_s)
    if p.is_alive():
        p.kill()
        p.join(wait_s)


def _reap(procs, teardown_s: float) -> None:
    end = time.monotonic() + teardown_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            _kill(p, 5.0)


def _spmd_error(failures: dict[int, RankFailure], world_size: int) -> SpmdError:
    """One error naming every failed rank; the ranks that raised or exited come first (they explain why
    the others were killed or timed out)."""
    ordered = [failures[r] for r in sorted(failures)]
    primary = [f for f in ordered if f.kind in ("exception", "exited")] or ordered
    lines = [f"{len(ordered)} of {world_size} rank(s) failed"]
    lines += [f.describe() for f in primary]
    lines += [f.describe() for f in ordered if f not in primary]
    cls = SpmdError if any(f.kind in ("exception", "exited") for f in ordered) else SpmdTimeoutError
    return cls("\n".join(lines), ordered)


def _raise(failures: dict[int, RankFailure], world_size: int) -> None:
    err = _spmd_error(failures, world_size)
    cause = next((e for e in (f.exception() for f in err.failures if f.kind == "exception") if e is not None), None)
    raise err from cause


# ------------------------------------------------------------------------------ threads (local)
def _run_threads(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float,
                 exchange_timeout_s: float, grace_s: float) -> list[Any]:
    """backend='local': one daemon thread per rank over a ``LocalExchangeGroup`` (CPU)."""
    from ray_moe.moe.exchange.local import LocalExchangeGroup
    from ray_moe.placement.topology import ProcessGroupSpec

    group = LocalExchangeGroup(ProcessGroupSpec.identity(world_size), timeout_s=exchange_timeout_s)
    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    caught: dict[int, BaseException] = {}
    done = threading.Condition()

    def body(rank: int) -> None:
        try:
            out = fn(group.endpoint(rank), rank, *args)
            with done:
                results[rank] = out
                done.notify_all()
        except BaseException as exc:  # noqa: BLE001 - reported below
            report = replace(_failure_report(rank, exc), exception_bytes=None)
            with done:
                failures[rank] = report
                caught[rank] = exc
                done.notify_all()

    threads = [threading.Thread(target=body, args=(r,), name=f"spmd-local-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    grace_end: float | None = None
    with done:
        while len(results) + len(failures) < world_size:
            if failures and grace_end is None:
                grace_end = time.monotonic() + grace_s
            limit = deadline if grace_end is None else min(deadline, grace_end)
            left = limit - time.monotonic()
            if left <= 0:
                break
            done.wait(timeout=min(left, 0.5))
        timed_out = time.monotonic() >= deadline
        for r in range(world_size):
            if r not in results and r not in failures:
                kind = "timeout" if timed_out else "killed"
                failures[r] = RankFailure(rank=r, kind=kind, exc_type=kind.capitalize(),
                                          message="thread still running; abandoned (daemon thread)")
        snapshot = dict(failures)
    if snapshot:
        err = _spmd_error(snapshot, world_size)
        cause = next((caught[f.rank] for f in err.failures if f.rank in caught), None)
        raise err from cause
    return [results[r] for r in range(world_size)]
