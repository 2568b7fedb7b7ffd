# ======================================================================================================
#  HOW THE DRIVER REACHES THE RANKS (the step transport)
#
#   next_step() ──> (live ranks, the generation a new step pins, a step id)
#   launch(StepRequest by rank) ──> handles (returns at once)   gather(handles) ──> StepResult by rank, or the
#   first failure (a failed rank releases its peers)   recover(failure) ──> stale: the generation refreshed;
#   dead rank: regrouped away   account(results) ──> the driver's books
#   submit(build requests) = next_step + launch + gather, replanned after a recoverable failure
#
#   RayTransport (ray_moe.ray.transport): the shard actors of a deployment.
#   LocalTransport (ray_moe_dev.testing.inprocess): ShardCores on threads, no Ray, the same loop above them.
# ======================================================================================================
"""The interface between the driver's step loops (``rt.forward``, the generation loop) and the ranks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, Sequence

from ray_moe.core.errors import ExchangeTimeoutError, RankDeadError, StaleGenerationError
from ray_moe.core.types import Phase
from ray_moe.driver.step_gate import StepGate
from ray_moe.moe.exchange.mailbox import ExchangeAborted
from ray_moe.shard.records import StepRequest, StepResult

# a step that failed with one of these is replanned (a stale generation, a dead rank, an aborted exchange)
RECOVERABLE = (StaleGenerationError, RankDeadError, ExchangeAborted, ExchangeTimeoutError)

Requests = Callable[[list[int], str, int], dict[int, StepRequest]]


class StepTransport(ABC):
    """One deployment's ranks as the driver's loops see them. ``gate`` is held across steps (a pipelined
    generation loop holds it across consecutive steps) and taken by operations that need no step in flight.
    Every rank of a step gets one ``StepRequest`` (of either ``StepKind``: the same interface carries
    ``rt.forward``'s expert-only steps and the generation loop's) and answers one ``StepResult``."""

    max_attempts: int = 400

    def __init__(self) -> None:
        self.gate = StepGate()

    @abstractmethod
    def members(self) -> list[int]:
        """The live ranks, in the process group's peer order."""

    @abstractmethod
    def load_model(self, ranks: Sequence[int], **options: Any) -> list[dict[str, Any]]:
        """Host the model on ``ranks`` (``ShardCore.load_model`` options); each rank's limits."""

    @abstractmethod
    def prepare_steps(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        """Capture the step lattice on every one of ``ranks`` at once (``ShardCore.prepare_steps``); each
        rank's report."""

    @abstractmethod
    def status_of(self, ranks: Sequence[int]) -> list[dict[str, Any]]:
        """Each of ``ranks``' status (``ShardCore.status``)."""

    @abstractmethod
    def next_step(self, pinned: int | None = None) -> tuple[list[int], int, str]:
        """(live ranks, the generation a new step pins (``pinned`` if given), a fresh step id)."""

    @abstractmethod
    def launch(self, reqs: Mapping[int, StepRequest]) -> dict[int, Any]:
        """Send every rank its share of one step; returns at once with a handle per rank."""

    @abstractmethod
    def gather(self, step_id: str, reqs: Mapping[int, StepRequest],
               handles: Mapping[int, Any]) -> dict[int, StepResult]:
        """Every rank's result of a launched step; the first failure is raised after the others are released."""

    @abstractmethod
    def recover(self, exc: BaseException, *, pinned: int | None = None, attempt: int = 0) -> None:
        """After a failed step (nothing in flight): refresh a stale generation, regroup away dead ranks;
        re-raise what cannot be recovered (a pinned step's stale generation, a failure with every rank alive)."""

    @abstractmethod
    def account(self, results: Mapping[int, StepResult], ranks: Sequence[int], phase: Phase, tokens: int,
                ms: float) -> None:
        """Book one served step."""

    def submit(self, requests: Requests, pinned: int | None = None) -> tuple[list[int], dict[int, StepResult]]:
        """One step, SPMD on every live rank: ``requests(ranks, step_id, generation)`` builds each rank's share.

        1. next_step: the live ranks and the generation to pin;
        2. launch + gather;
        3. on a recoverable failure, recover (refresh / regroup) and go to 1 with a fresh step id;
        4. after ``max_attempts`` stale refusals, StaleGenerationError."""
        for attempt in range(self.max_attempts):
            ranks, gen, step_id = self.next_step(pinned)
            reqs = requests(ranks, step_id, gen)
            try:
                return ranks, self.gather(step_id, reqs, self.launch(reqs))
            except RECOVERABLE as exc:
                self.recover(exc, pinned=pinned, attempt=attempt)
        raise StaleGenerationError(f"no generation accepted the step after {self.max_attempts} attempts")


__all__ = ["StepTransport", "RECOVERABLE", "Requests"]
