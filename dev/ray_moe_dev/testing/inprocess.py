"""An in-process deployment: ShardCores on threads over the local exchange, driven by a ControlPlane over a
LocalFleet. The same pure cores the Ray actors wrap, with no Ray: tests of the step, the fence, retirement,
rebalance, scale and rank loss run here in milliseconds."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import torch

from ray_moe.control.plane import ControlPlane, LocalFleet
from ray_moe.shard.core import ShardCore
from ray_moe.shard.records import ExpertOnlyInput, StepKind, StepRequest, StepResult
from ray_moe.model.config import RuntimeConfig
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.model.source import weight_source
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.core.errors import StaleGenerationError
from ray_moe.core.types import Phase
from ray_moe.driver.loop import GenerationLoop
from ray_moe.driver.transport import StepTransport
from ray_moe.model.sampling import SamplingParams
from ray_moe.core.wire import tensor_to_wire, wire_to_tensor


class InProcessDeployment:
    """``num_ranks`` ShardCores, one local exchange group, one ControlPlane (generation 0 deployed)."""

    def __init__(self, cfg: RuntimeConfig, *, timeout_s: float = 20.0, device: str = "cpu") -> None:
        self.cfg = cfg
        self.topology = Topology.single_node(cfg.num_ranks)
        self.cores = {r: ShardCore(r, cfg, weight_source(cfg), topology=self.topology, device=device)
                      for r in range(cfg.num_ranks)}
        self.timeout_s = timeout_s
        self.group = ProcessGroupSpec(group_id="ep-group-0", peer_order=tuple(range(cfg.num_ranks)), epoch=0)
        self._connect(self.group)
        self.plane = ControlPlane(cfg, LocalFleet(self.cores), self.topology, self.group)
        self.generation = self.plane.deploy_initial()
        self._ids = itertools.count()

    def _connect(self, group: ProcessGroupSpec) -> None:
        ex = LocalExchangeGroup(group, timeout_s=self.timeout_s)
        for r in group.peer_order:
            self.cores[r].set_exchange(ex.endpoint(r))

    def regroup(self, members: Sequence[int]) -> ProcessGroupSpec:
        """A new process group (next epoch) over ``members``, endpoints rebuilt."""
        self.group = ProcessGroupSpec(group_id=self.group.group_id, peer_order=tuple(members),
                                      epoch=self.group.epoch + 1)
        self._connect(self.group)
        return self.group

    def step(self, hidden: torch.Tensor, topk_ids: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
             *, phase: Phase = Phase.PREFILL, generation: int | None = None) -> tuple[torch.Tensor, dict[int, Any]]:
        """One step: tokens split over the group's ranks in order, as the driver does. Routes [T, k] (every
        layer) or [L, T, k]. Returns (output [T, d], per-rank StepResult or the exception it raised)."""
        ranks = list(self.group.peer_order)
        parts = torch.tensor_split(torch.arange(hidden.shape[0]), len(ranks))
        gen = self.generation if generation is None else generation
        step_id = f"s{next(self._ids)}"
        if topk_ids is not None and topk_ids.dim() == 2:
            topk_ids = topk_ids.unsqueeze(0).expand(self.cfg.num_layers, *topk_ids.shape)
            topk_weights = topk_weights.unsqueeze(0).expand(self.cfg.num_layers, *topk_weights.shape)
        reqs = {}
        for r, idx in zip(ranks, parts):
            lo, hi = (int(idx[0]), int(idx[-1]) + 1) if idx.numel() else (0, 0)
            reqs[r] = StepRequest(step_id, gen, StepKind.EXPERT_ONLY, ExpertOnlyInput(
                hidden=tensor_to_wire(hidden[lo:hi]),
                topk_ids=None if topk_ids is None else topk_ids[:, lo:hi].contiguous().numpy(),
                topk_weights=None if topk_weights is None else topk_weights[:, lo:hi].contiguous().numpy(),
                phase=phase))

        def run(r: int) -> Any:
            try:
                return self.cores[r].step(reqs[r])
            except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
                return exc

        with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
            results = dict(zip(ranks, pool.map(run, ranks)))
        outs = [results[r] for r in ranks]
        if any(isinstance(o, Exception) for o in outs):
            return torch.empty(0), results
        y = torch.cat([wire_to_tensor(o.output.hidden, o.output.hidden_dtype) for o in outs], 0)
        return y, results

    @staticmethod
    def errors(results: dict[int, Any]) -> dict[int, Exception]:
        return {r: o for r, o in results.items() if isinstance(o, Exception)}

    @staticmethod
    def paths(results: dict[int, StepResult]) -> set[str]:
        return {ls.path for o in results.values() if not isinstance(o, Exception) for ls in o.layers}


def reference_output(cfg: RuntimeConfig, hidden: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor) -> torch.Tensor:
    """The naive reference of one step with the same routes in every layer (float64)."""
    from ray_moe_dev.testing.reference import reference_moe

    src = weight_source(cfg)
    h = hidden.double()
    for layer in range(cfg.num_layers):
        y = reference_moe(h, topk_ids, topk_weights, lambda e, layer=layer: src.expert(layer, e))
        h = h + y if cfg.residual else y
    return h



class LocalTransport(StepTransport):
    """The step transport over an ``InProcessDeployment``: every rank's share runs on its own thread (ranks
    run steps SPMD and pipelined steps overlap, as the actors do). The driver's real loops run over it."""

    def __init__(self, dep: InProcessDeployment) -> None:
        super().__init__()
        self.dep = dep
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=4 * max(1, len(dep.cores)), thread_name_prefix="local-rank")
        self.steps = 0  # served steps (account)

    def members(self) -> list[int]:
        return list(self.dep.group.peer_order)

    def load_model(self, ranks: Sequence[int], **options: Any) -> list[dict[str, Any]]:
        return [self.dep.cores[r].load_model(**options) for r in ranks]

    def status_of(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        return [self.dep.cores[r].status() for r in ranks]

    def prepare_steps(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        futures = [self._pool.submit(self.dep.cores[r].prepare_steps) for r in ranks]  # (at once: SPMD)
        return [f.result(timeout=self.dep.timeout_s * 10) for f in futures]

    def next_step(self, pinned: int | None = None) -> tuple[list[int], int, str]:
        gen = self.dep.generation if pinned is None else pinned
        return self.members(), gen, f"gen{next(self._ids)}"

    def launch(self, reqs: Mapping[int, StepRequest]) -> dict[int, Future]:
        return {r: self._pool.submit(self.dep.cores[r].step, req) for r, req in reqs.items()}

    def gather(self, step_id: str, reqs: Mapping[int, StepRequest],
               handles: Mapping[int, Future]) -> dict[int, StepResult]:
        results, first = {}, None
        for r, fut in handles.items():
            try:
                results[r] = fut.result(timeout=self.dep.timeout_s * 3)
            except BaseException as exc:  # noqa: BLE001 - the first failure is raised after every rank returned
                first = first or exc
        if first is not None:
            raise first
        return results

    def recover(self, exc: BaseException, *, pinned: int | None = None, attempt: int = 0) -> None:
        if isinstance(exc, StaleGenerationError) and pinned is None:
            self.dep.generation = self.dep.plane.registry.active()
            return
        raise exc

    def account(self, results: Mapping[int, StepResult], ranks: Sequence[int], phase: Phase, tokens: int,
                ms: float) -> None:
        self.steps += 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def generate_inprocess(dep: InProcessDeployment, prompts: list[list[int]], max_new_tokens: int, *,
                       kv_tokens: int = 1024, block_size: int = 8, step_tokens: int = 64,
                       join_after: dict[int, list[list[int]]] | None = None, pipelined: bool = True,
                       decode_steps: int = 1, timeout_s: float = 120.0) -> list[list[int]]:
    """Greedy generation over the in-process deployment's shards through the driver's real generation loop
    (``GenerationLoop`` over a ``LocalTransport``: the same planning, pipelining, deferred tokens and commits as
    a Ray deployment). ``join_after={step: [prompts]}`` submits more prompts once the loop has served that many
    steps. ``pipelined`` is kept for callers: the loop always plans step n+1 before step n's tokens are known.
    ``decode_steps``: the scheduler's multi-step decode bound."""
    del pipelined
    transport = LocalTransport(dep)
    loop = GenerationLoop(transport, device="cpu", kv_tokens=kv_tokens, block_size=block_size,
                          step_tokens=step_tokens, decode_steps=decode_steps)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    try:
        handles = [loop.submit(p, params) for p in prompts]
        for step, late in sorted((join_after or {}).items()):
            deadline = time.monotonic() + timeout_s
            while loop.steps < step and not all(h.done.is_set() for h in handles):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the loop served {loop.steps} steps, not {step}, in {timeout_s} s")
                time.sleep(0.001)
            handles += [loop.submit(p, params) for p in late]
        return [h.result(timeout_s) for h in handles]
    finally:
        loop.close()
        transport.close()


def run_requests(dep: InProcessDeployment, requests: Sequence[tuple[list[int], SamplingParams]], *,
                 decode_steps: int = 1, timeout_s: float = 120.0) -> tuple[list, int, int]:
    """Each (prompt, sampling params) through the driver's real generation loop over ``dep`` (8-token steps,
    8-token cache blocks): (the finished request handles, the steps the loop served, the steps it launched
    while the previous one was in flight)."""
    handles, stats = serve_requests(dep, requests, decode_steps=decode_steps, timeout_s=timeout_s)
    return handles, stats["steps"], stats["overlapped"]


def serve_requests(dep: InProcessDeployment, requests: Sequence[tuple[list[int], SamplingParams]], *,
                   after: Sequence[Sequence[tuple[list[int], SamplingParams]]] = (), decode_steps: int = 1,
                   timeout_s: float = 120.0, **loop_options: Any) -> tuple[list, dict[str, Any]]:
    """``run_requests`` with the loop's options (``GenerationLoop``'s keywords; default 8-token steps and
    blocks, 1024 cache tokens) and waves: each group of ``after`` is submitted once every earlier request is
    done. Returns (the finished handles in submission order, {"steps", "overlapped", "prefix": the loop's
    ``prefix_stats()``})."""
    transport = LocalTransport(dep)
    opts = {"kv_tokens": 1024, "block_size": 8, "step_tokens": 8, **loop_options}
    loop = GenerationLoop(transport, device="cpu", decode_steps=decode_steps, **opts)
    try:
        handles: list = []
        for wave in (requests, *after):
            new = [loop.submit(p, params) for p, params in wave]
            for h in new:
                h.result(timeout_s)
            handles += new
        return handles, {"steps": loop.steps, "overlapped": loop.overlapped, "prefix": loop.prefix_stats()}
    finally:
        loop.close()
        transport.close()


class RouteSpy:
    """Wraps an executor (``moe_forward(layer, hidden, topk_ids, topk_weights)``) and keeps the routes of its
    last call per layer (``ids``: layer -> [T, k])."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ids: dict[int, torch.Tensor] = {}

    def moe_forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        self.ids[layer] = topk_ids.clone()
        return self.inner.moe_forward(layer, hidden, topk_ids, topk_weights)


__all__ = ["InProcessDeployment", "LocalTransport", "reference_output", "generate_inprocess", "run_requests",
           "serve_requests", "RouteSpy"]
