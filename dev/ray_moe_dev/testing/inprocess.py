"""An in-process deployment: ShardCores on threads over the local exchange, driven by a ControlPlane over a
LocalFleet. The same pure cores the Ray actors wrap, with no Ray: tests of the step, the fence, retirement,
rebalance, scale and rank loss run here in milliseconds."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from ray_moe.control.plane import ControlPlane, LocalFleet
from ray_moe.shard.core import ShardCore
from ray_moe.shard.records import StepRequest, StepResult
from ray_moe.model.config import RuntimeConfig
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.model.source import weight_source
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.core.types import Phase
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
            reqs[r] = StepRequest(step_id=step_id, generation=gen, hidden=tensor_to_wire(hidden[lo:hi]),
                                  topk_ids=None if topk_ids is None else topk_ids[:, lo:hi].contiguous().numpy(),
                                  topk_weights=None if topk_weights is None else topk_weights[:, lo:hi].contiguous().numpy(),
                                  phase=phase)

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
        y = torch.cat([wire_to_tensor(o.hidden, o.hidden_dtype) for o in outs], 0)
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



def generate_inprocess(dep: InProcessDeployment, prompts: list[list[int]], max_new_tokens: int, *,
                       kv_tokens: int = 1024, block_size: int = 8, step_tokens: int = 64,
                       join_after: dict[int, list[list[int]]] | None = None, pipelined: bool = False,
                       decode_steps: int = 1) -> list[list[int]]:
    """Greedy generation over the in-process deployment's shards (the same GenStepRequest path the Ray
    driver uses, no Ray): ``join_after={step: [prompts]}`` submits more prompts between steps.
    ``pipelined``: each step is planned before the previous one is committed, as the Ray driver does (its
    decode items that need the previous step's tokens are deferred to the ranks). ``decode_steps``: the
    scheduler's multi-step decode bound."""
    from ray_moe.shard.records import GenStepRequest
    from ray_moe.model.sampling import SamplingParams
    from ray_moe.driver.scheduler import Scheduler

    infos = [c.load_model(kv_tokens=kv_tokens, block_size=block_size) for c in dep.cores.values()]
    sched = Scheduler(list(dep.group.peer_order), kv_blocks=infos[0]["kv_blocks"], block_size=block_size,
                      max_context=infos[0]["max_context"], step_tokens=step_tokens,
                      eos_token_ids=infos[0]["eos_token_ids"], decode_steps=decode_steps)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    rids = [sched.submit(p, params) for p in prompts]
    out: dict[str, list[int]] = {r: [] for r in rids}
    step = 0
    plan = None
    while plan is not None or sched.pending() or (join_after and any(s >= step for s in join_after)):
        for p in (join_after or {}).pop(step, []):
            rid = sched.submit(p, params)
            rids.append(rid)
            out[rid] = []
        plan = plan if plan is not None else sched.plan()
        units = (plan.has_prefill or not plan.has_decode, plan.has_decode)
        reqs = {r: GenStepRequest(f"gen{step}", dep.generation, plan.items[r], plan.free[r], units, steps=plan.steps)
                for r in dep.group.peer_order}
        with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
            res = dict(zip(reqs, pool.map(lambda r: dep.cores[r].generate_step(reqs[r]), reqs)))
        nxt = sched.plan(ahead=plan) if pipelined else None  # planned before this step's tokens are known
        for ev in sched.commit(plan, {k: v for x in res.values() for k, v in x.tokens.items()}):
            out[ev.request_id].append(ev.token)
        plan = nxt if nxt is not None and not nxt.empty else None
        step += 1
    return [out[r] for r in rids]


__all__ = ["InProcessDeployment", "reference_output", "generate_inprocess"]
