"""The step transport over a deployment's shard actors (``ray_moe.driver.transport.StepTransport``).

It holds what a step needs to reach the ranks, as the coordinator last said (``adopt`` of a ``MembershipView``):
the shard handles, the process group (members and epoch), the topology, the cached ACTIVE generation; and the
step ids. It never changes membership: a rank found dead is reported (``MembershipFollower.report_dead``) and the
step runs again on the membership the coordinator's loop settles. The coordinator is asked for the generation
only when a shard reports the cached one stale.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import ray

from ray_moe.core.errors import RankDeadError, StaleGenerationError, root_cause
from ray_moe.core.types import Phase
from ray_moe.driver.books import StepBooks
from ray_moe.driver.transport import StepTransport
from ray_moe.model.config import RuntimeConfig
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.shard.records import StepRequest, StepResult


class RayTransport(StepTransport):
    """Steps over Ray actor calls: ONE call per rank per step (``ExpertShardActor.step``), results fetched as
    they complete; a failed or dead rank releases its peers (``abort_step``) instead of letting them wait
    for the exchange watchdog. ``on_step(results, ranks, phase, tokens, ms)`` books a served step."""

    def __init__(self, cfg: RuntimeConfig, coordinator: Any, view: Any, books: StepBooks,
                 on_step: Callable[..., None]) -> None:
        super().__init__()
        self.cfg = cfg
        self.coordinator = coordinator
        self.books = books
        self.on_step = on_step
        self.shards: dict[int, Any] = {}
        self.group: ProcessGroupSpec | None = None
        self.topology: Topology | None = None
        self.generation: int | None = None
        self.epoch = -1
        self.lost_ranks: list[int] = []
        self.follower: Any = None  # the driver's MembershipFollower (joins on the first step, reports the dead)
        self._step_ids = itertools.count()
        self.adopt(view)

    def adopt(self, view: Any) -> None:
        """The membership the coordinator settled (a ``MembershipView``); an older one than held is ignored."""
        if view is None or view.epoch < self.epoch:
            return
        self.shards = dict(view.handles)
        self.group = view.group
        self.topology = view.topology
        self.epoch = view.epoch
        self.lost_ranks = list(view.lost)
        if view.generation is not None:
            self.generation = view.generation

    # ---------------------------------------------------------------- StepTransport
    def members(self) -> list[int]:
        return list(self.group.peer_order)

    def load_model(self, ranks: Sequence[int], **options: Any) -> list[dict[str, Any]]:
        return ray.get([self.shards[r].load_model.remote(**options) for r in ranks]) if ranks else []

    def prepare_steps(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        return ray.get([self.shards[r].prepare_steps.remote() for r in ranks]) if ranks else []

    def status_of(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        return ray.get([self.shards[r].status.remote() for r in ranks]) if ranks else []

    def next_step(self, pinned: int | None = None) -> tuple[list[int], int, str]:
        if self.follower is not None and not self.follower.stepping:
            self.follower.join()  # (the caller holds the gate) every membership change waits for this driver now
        if self.generation is None:
            self.refresh_generation()
        gen = self.generation if pinned is None else pinned
        return list(self.group.peer_order), gen, f"s{next(self._step_ids)}-{uuid.uuid4().hex[:8]}"

    def launch(self, reqs: Mapping[int, StepRequest]) -> dict[int, "ray.ObjectRef"]:
        return {r: self.shards[r].step.remote(req) for r, req in reqs.items()}

    def gather(self, step_id: str, reqs: Mapping[int, StepRequest],
               handles: Mapping[int, "ray.ObjectRef"]) -> dict[int, StepResult]:
        pending = list(handles.values())
        by_ref = {ref: r for r, ref in handles.items()}
        results: dict[int, StepResult] = {}
        first_error: BaseException | None = None
        while pending:
            if len(pending) == 1:  # the last (or only) one: no wait round first
                ref, pending = pending[0], []
            else:
                done, pending = ray.wait(pending, num_returns=1)
                ref = done[0]
            try:
                results[by_ref[ref]] = ray.get(ref)
            except BaseException as exc:  # noqa: BLE001 - classified below
                cause = root_cause(exc)
                if isinstance(exc, ray.exceptions.RayActorError):
                    cause = RankDeadError(f"rank {by_ref[ref]} died during step {step_id}", ranks=(by_ref[ref],))
                if first_error is None:
                    first_error = cause
                    if not isinstance(cause, StaleGenerationError) and pending:
                        # a failed or dead rank: release its peers instead of letting them wait for the watchdog
                        for r in reqs:
                            if r != by_ref[ref]:
                                try:
                                    self.shards[r].abort_step.remote(step_id, f"rank {by_ref[ref]} failed: "
                                                                               f"{type(cause).__name__}")
                                except Exception:  # noqa: BLE001
                                    pass
        if first_error is not None:
            if not isinstance(first_error, StaleGenerationError):
                self.books.count("failed_steps")
            raise first_error
        return results

    def recover(self, exc: BaseException, *, pinned: int | None = None, attempt: int = 0) -> None:
        if isinstance(exc, StaleGenerationError):
            self.books.count("stale_retries")
            if pinned is not None:
                raise exc
            if attempt >= 2:  # still refused: this driver may have missed a membership change (evicted from a fence)
                self.adopt(ray.get(self.coordinator.view.remote()))
            self.refresh_generation(backoff=attempt > 0)
            return
        dead = self.dead_ranks()
        if not dead or self.follower is None:
            raise exc
        self.follower.report_dead(dead)  # back once the coordinator regrouped them away

    def account(self, results: Mapping[int, StepResult], ranks: Sequence[int], phase: Phase, tokens: int,
                ms: float) -> None:
        self.on_step(results, ranks, phase, tokens, ms)

    # ---------------------------------------------------------------- generations
    def refresh_generation(self, backoff: bool = False) -> None:
        if backoff:
            time.sleep(0.002)
        self.generation = self.active_generation()

    def active_generation(self, patience_s: float = 0.25) -> int | None:
        """The coordinator's ACTIVE generation. While the coordinator restarts (it does not answer within
        ``patience_s``), the generation every live shard has ACTIVE serves instead: the shards pin each step
        themselves, so traffic keeps flowing even when a publish landed just before the coordinator died."""
        ref = self.coordinator.active_generation.remote()  # retried by Ray across a restart
        while True:
            try:
                return ray.get(ref, timeout=patience_s)
            except ray.exceptions.GetTimeoutError:
                pass
            try:
                seen = set(ray.get([self.shards[r].active_generation.remote() for r in self.group.peer_order],
                                   timeout=10))
            except Exception:  # noqa: BLE001 - a dead shard: wait for the coordinator
                seen = set()
            if len(seen) == 1 and None not in seen:
                return seen.pop()

    # ---------------------------------------------------------------- membership
    def dead_ranks(self, timeout_s: float = 10.0) -> list[int]:
        """Ranks of the current group whose actor no longer answers."""
        refs = {r: self.shards[r].ping.remote() for r in self.group.peer_order}
        dead = []
        for r, ref in refs.items():
            try:
                ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(r)
        return dead


def fetch_outputs(results: dict[int, StepResult], ranks: list[int]) -> list[np.ndarray]:
    """Every rank's expert-only output array; CUDA shards hand large outputs over as object-store refs (one get)."""
    out = [results[r].output.hidden for r in ranks]
    refs = [(i, h) for i, h in enumerate(out) if isinstance(h, ray.ObjectRef)]
    if refs:
        for (i, _), arr in zip(refs, ray.get([ref for _, ref in refs])):
            out[i] = arr
    return out


__all__ = ["RayTransport", "fetch_outputs"]
