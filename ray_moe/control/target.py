# ======================================================================================================
#  THE DEPLOYMENT'S TARGET AND THE NEXT RECONCILE STEP (pure: no Ray)
#
#   policies set the target ──────────────> DeploymentTarget (ranks, ranks asked out, rebalance on join)
#     a caller (Runtime.add_rank / remove_rank), the scaler (load), the healer (a line left out, healing off)
#   the coordinator's loop, every wake:   next_step(target, rank records, heal policy)
#     REGROUP_DEAD (dead members out) > REMOVE (a rank asked out, or one too many) > REPLACE (a lost rank's line,
#     its backoff passed) > ADD (one rank short) > HOLD (converged, or a replacement backing off)
#   one step at a time, until HOLD: the state converges to the target (Ray Serve's deployment_state, for ranks)
# ======================================================================================================
"""What a deployment should be (``DeploymentTarget``), what each of its ranks is (``RankRecord`` with a
``RankState`` and the placement-group bundle it runs in), and the next step that brings the one towards the other
(``next_step``). The coordinator owns one target and one loop that applies these steps (``ray_moe.ray.reconciler``);
drivers never change membership themselves."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_moe.core.errors import RequestError


class RankState(str, Enum):
    """One rank's life. STARTING: its actor is being created in its bundle; LIVE: a member of the process group;
    DRAINING: asked out, its slots being evacuated; DEAD: found dead, still in the group until the survivors are
    regrouped; GONE: out of the group for good (its record stays: global ranks are never reused)."""

    STARTING = "starting"
    LIVE = "live"
    DRAINING = "draining"
    DEAD = "dead"
    GONE = "gone"


RANK_TRANSITIONS: dict[RankState, frozenset[RankState]] = {
    RankState.STARTING: frozenset({RankState.LIVE, RankState.GONE}),  # GONE: a start that failed
    RankState.LIVE: frozenset({RankState.DRAINING, RankState.DEAD}),
    RankState.DRAINING: frozenset({RankState.GONE, RankState.DEAD, RankState.LIVE}),  # LIVE: an evacuation failed
    RankState.DEAD: frozenset({RankState.GONE}),
    RankState.GONE: frozenset(),
}


@dataclass(frozen=True)
class BundleRef:
    """A placement-group bundle: the group's id (hex) and the bundle's index in it."""

    group: str
    index: int

    def as_list(self) -> list:
        return [self.group, self.index]


@dataclass
class RankRecord:
    """One global rank: its state, the bundle it runs in, the Ray node its actor ran on (None before it
    started), the first rank of its line (itself, unless it replaced a lost rank), the rank it replaced, and whether
    it died (GONE after a death, not a removal)."""

    rank: int
    state: RankState
    bundle: BundleRef | None = None
    node: str | None = None
    lineage: int | None = None
    replaces: int | None = None
    died: bool = False

    def __post_init__(self) -> None:
        self.state = RankState(self.state)
        if self.lineage is None:
            self.lineage = self.rank

    def move(self, to: RankState) -> None:
        """The transition to ``to`` (``RANK_TRANSITIONS``); another one raises naming both states."""
        to = RankState(to)
        if to is self.state:
            return
        if to not in RANK_TRANSITIONS[self.state]:
            raise RequestError(f"rank {self.rank}: state {self.state.value} -> {to.value} is not a transition "
                               f"(allowed: {sorted(s.value for s in RANK_TRANSITIONS[self.state])})")
        self.state = to

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state.value, "bundle": None if self.bundle is None else self.bundle.as_list(),
                "node": self.node, "lineage": self.lineage, "replaces": self.replaces, "died": self.died}


class DeploymentTarget(BaseModel):
    """The deployment the coordinator converges to. ``ranks``: live ranks; ``remove``: ranks asked out by id (each
    drained, then stopped); ``rebalance_on_join``: a joining rank gets an EPLB placement over the new group (once
    load was observed); ``version`` counts the changes; ``reason`` / ``set_by`` say who set it last and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(default=0, ge=0)
    ranks: int = Field(ge=1)
    remove: tuple[int, ...] = ()
    rebalance_on_join: bool = True
    reason: str = "start"
    set_by: str = "start"

    @model_validator(mode="after")
    def _check(self) -> "DeploymentTarget":
        if len(set(self.remove)) != len(self.remove) or any(r < 0 for r in self.remove):
            raise ValueError(f"remove={list(self.remove)}: distinct rank ids >= 0")
        return self

    def changed(self, *, set_by: str, reason: str, **fields: Any) -> "DeploymentTarget":
        """The next version with ``fields`` changed (validated: a bad value raises naming it, nothing changes)."""
        try:
            return DeploymentTarget.model_validate({**self.model_dump(), **fields, "version": self.version + 1,
                                                    "set_by": set_by, "reason": reason})
        except ValueError as exc:
            raise RequestError(f"target: {', '.join(f'{k}={v!r}' for k, v in fields.items())}: {exc}") from None


class ReconcileAction(str, Enum):
    """What the loop does next (``next_step``)."""

    REGROUP_DEAD = "regroup_dead"  # dead members out: survivors regrouped, a generation without them published
    REMOVE = "remove"  # one rank out: its slots evacuated under traffic, then regrouped away and stopped
    REPLACE = "replace"  # a lost rank's line: a new rank in the lost one's bundle (or a fresh one: its node gone)
    ADD = "add"  # one more rank: a free bundle of the deployment, else a fresh one
    HOLD = "hold"  # converged, or waiting (a replacement backing off)


@dataclass(frozen=True)
class ReconcileStep:
    action: ReconcileAction
    ranks: tuple[int, ...] = ()  # REGROUP_DEAD: the dead; REMOVE: the rank; REPLACE: the lost rank
    reason: str = ""


def live_ranks(records: Mapping[int, RankRecord]) -> list[int]:
    return sorted(r for r, rec in records.items() if rec.state in (RankState.LIVE, RankState.DRAINING))


def next_step(target: DeploymentTarget, records: Mapping[int, RankRecord], *, replace_due: tuple[int, ...] = (),
              replace_pending: bool = False, dead_blocked: bool = False) -> ReconcileStep:
    """The next step towards ``target`` from ``records``. ``replace_due``: lost ranks whose replacement may start
    now (``HealPolicy.due``), oldest first; ``replace_pending``: a replacement waits for its backoff;
    ``dead_blocked``: regrouping the dead failed and waits for its retry (nothing else moves meanwhile)."""
    dead = tuple(sorted(r for r, rec in records.items() if rec.state is RankState.DEAD))
    if dead:
        if dead_blocked:
            return ReconcileStep(ReconcileAction.HOLD, dead, "regrouping the dead failed: waiting to retry")
        return ReconcileStep(ReconcileAction.REGROUP_DEAD, dead, f"ranks {list(dead)} found dead")
    live = live_ranks(records)
    for r in target.remove:
        if r in live:
            return ReconcileStep(ReconcileAction.REMOVE, (r,), f"rank {r} asked out ({target.reason})")
    if len(live) < target.ranks:
        if replace_due:
            return ReconcileStep(ReconcileAction.REPLACE, (replace_due[0],), f"rank {replace_due[0]} was lost")
        if replace_pending:
            return ReconcileStep(ReconcileAction.HOLD, (), "a replacement backs off before its next attempt")
        return ReconcileStep(ReconcileAction.ADD, (), f"{len(live)} live ranks, target {target.ranks}")
    if len(live) > target.ranks:
        keep = [r for r in live if r not in target.remove]
        return ReconcileStep(ReconcileAction.REMOVE, (max(keep or live),),
                             f"{len(live)} live ranks, target {target.ranks}")
    return ReconcileStep(ReconcileAction.HOLD, (), "converged")


__all__ = ["BundleRef", "DeploymentTarget", "RANK_TRANSITIONS", "RankRecord", "RankState", "ReconcileAction",
           "ReconcileStep", "live_ranks", "next_step"]
