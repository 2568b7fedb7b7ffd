"""Parallel layouts: attention and MoE rank coordinates (spec 0x0B, 0x0BA, 0x0BB). Pure: no Ray.

A ``ParallelLayout`` folds one list of global ranks two ways:

attention:  TP (fastest) x CP x DP x PP (slowest)        W_attention = TP*CP*DP*PP
MoE:        ETP (fastest) x EP x EDP x PP (slowest)      W_moe       = ETP*EP*EDP*PP

Both must equal the number of ranks. A rank's coordinates come from its *position* ``i`` in
``ranks`` (not from its global rank id), mixed-radix with the fastest axis first::

    etp = i % ETP
    ep  = (i // ETP) % EP
    edp = (i // (ETP*EP)) % EDP
    pp  = i // (ETP*EP*EDP)

An EP group is the ranks that share (etp, edp, pp), in ep order; an ETP group shares (ep, edp, pp), in
etp order. For ranks [0,1,2,3] with ETP=2, EP=2: r0=(ep 0, etp 0), r1=(0,1), r2=(1,0), r3=(1,1); EP
groups [0,2] [1,3]; ETP groups [0,1] [2,3] (spec 0x0BA).

Equal axis products prove only that two layouts cover the same ranks; they say nothing about
ownership. ETP decides the physical expert unit: ETP=1 keeps one complete copy on one rank, ETP>1
shards one copy over an ETP group. Changing ETP or EP changes what a physical slot id means, so it
needs a new placement generation (spec 0x0BB).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from math import prod

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["MoECoordinate", "AttentionCoordinate", "ParallelLayout", "PhysicalUnit"]


class PhysicalUnit(str, Enum):
    """What one physical expert slot stores under a layout (spec 0x0BA)."""

    COMPLETE_COPY = "complete copy on one rank"
    ETP_GROUP_COPY = "one copy spanning an ETP group"


@dataclass(frozen=True)
class MoECoordinate:
    """MoE coordinates of one global rank."""

    rank: int
    etp: int
    ep: int
    edp: int
    pp: int


@dataclass(frozen=True)
class AttentionCoordinate:
    """Attention coordinates of one global rank."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int


#: Fields that define expert ownership; a change in any of them needs a new generation (0x0BB).
MOE_OWNERSHIP_FIELDS: tuple[str, ...] = ("etp", "ep", "edp", "pp", "ranks")


class ParallelLayout(BaseModel):
    """Attention axes (tp, cp, dp, pp) and MoE axes (etp, ep, edp, pp) over ``ranks``.

    ``ranks`` lists global ranks in coordinate order (position 0 is coordinate 0 on every axis).
    Validation names the field and value: axes must be >= 1, ranks unique and >= 0,
    ``tp*cp*dp*pp == len(ranks)`` and ``etp*ep*edp*pp == len(ranks)``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int = Field(default=1, ge=1, description="attention tensor parallel")
    cp: int = Field(default=1, ge=1, description="attention context parallel")
    dp: int = Field(default=1, ge=1, description="attention data parallel")
    pp: int = Field(default=1, ge=1, description="pipeline parallel (shared by attention and MoE)")
    etp: int = Field(default=1, ge=1, description="expert tensor parallel: shards of one physical expert copy")
    ep: int = Field(default=1, ge=1, description="expert parallel: ranks that split the expert set")
    edp: int = Field(default=1, ge=1, description="expert data parallel: replicas of the whole EP group")
    ranks: tuple[int, ...] = Field(min_length=1, description="global ranks in coordinate order")

    @model_validator(mode="after")
    def _check(self) -> "ParallelLayout":
        seen: set[int] = set()
        for i, r in enumerate(self.ranks):
            if r < 0:
                raise ValueError(f"ranks[{i}]={r} is negative")
            if r in seen:
                raise ValueError(f"ranks[{i}]={r} appears twice")
            seen.add(r)
        n = len(self.ranks)
        if self.w_attention != n:
            raise ValueError(
                f"tp*cp*dp*pp = {self.tp}*{self.cp}*{self.dp}*{self.pp} = {self.w_attention} != len(ranks)={n}"
            )
        if self.w_moe != n:
            raise ValueError(
                f"etp*ep*edp*pp = {self.etp}*{self.ep}*{self.edp}*{self.pp} = {self.w_moe} != len(ranks)={n}"
            )
        return self

    # ------------------------------------------------------------------ products
    @property
    def w_attention(self) -> int:
        """TP*CP*DP*PP."""
        return prod((self.tp, self.cp, self.dp, self.pp))

    @property
    def w_moe(self) -> int:
        """ETP*EP*EDP*PP."""
        return prod((self.etp, self.ep, self.edp, self.pp))

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    # ------------------------------------------------------------------ coordinates
    def moe_coordinates(self) -> tuple[MoECoordinate, ...]:
        """(etp, ep, edp, pp) of each rank, in ``ranks`` order."""
        out = []
        for i, r in enumerate(self.ranks):
            out.append(
                MoECoordinate(
                    rank=r,
                    etp=i % self.etp,
                    ep=(i // self.etp) % self.ep,
                    edp=(i // (self.etp * self.ep)) % self.edp,
                    pp=i // (self.etp * self.ep * self.edp),
                )
            )
        return tuple(out)

    def attention_coordinates(self) -> tuple[AttentionCoordinate, ...]:
        """(tp, cp, dp, pp) of each rank, in ``ranks`` order."""
        out = []
        for i, r in enumerate(self.ranks):
            out.append(
                AttentionCoordinate(
                    rank=r,
                    tp=i % self.tp,
                    cp=(i // self.tp) % self.cp,
                    dp=(i // (self.tp * self.cp)) % self.dp,
                    pp=i // (self.tp * self.cp * self.dp),
                )
            )
        return tuple(out)

    def moe_coordinate(self, rank: int) -> MoECoordinate:
        for c in self.moe_coordinates():
            if c.rank == rank:
                return c
        raise ValueError(f"rank={rank} is not in layout ranks {list(self.ranks)}")

    @staticmethod
    def _groups(coords: tuple, key: tuple[str, ...], order: str) -> tuple[tuple[int, ...], ...]:
        """Group ranks sharing the ``key`` axes; order members by ``order``; order groups by first
        member's position."""
        buckets: dict[tuple[int, ...], list] = {}
        for c in coords:
            buckets.setdefault(tuple(getattr(c, k) for k in key), []).append(c)
        return tuple(tuple(c.rank for c in sorted(b, key=lambda c: getattr(c, order))) for b in buckets.values())

    def ep_groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks sharing (etp, edp, pp), each in ep order."""
        return self._groups(self.moe_coordinates(), ("etp", "edp", "pp"), "ep")

    def etp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks sharing (ep, edp, pp), each in etp order: the shards of one physical expert copy."""
        return self._groups(self.moe_coordinates(), ("ep", "edp", "pp"), "etp")

    def edp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks sharing (etp, ep, pp), each in edp order."""
        return self._groups(self.moe_coordinates(), ("etp", "ep", "pp"), "edp")

    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Attention tensor-parallel groups: ranks sharing (cp, dp, pp), each in tp order."""
        return self._groups(self.attention_coordinates(), ("cp", "dp", "pp"), "tp")

    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Attention data-parallel groups: ranks sharing (tp, cp, pp), each in dp order."""
        return self._groups(self.attention_coordinates(), ("tp", "cp", "pp"), "dp")

    def physical_unit(self) -> PhysicalUnit:
        """ETP=1: a complete copy on one rank; ETP>1: one copy spanning an ETP group."""
        return PhysicalUnit.COMPLETE_COPY if self.etp == 1 else PhysicalUnit.ETP_GROUP_COPY

    def moe_ownership_changes(self, other: "ParallelLayout") -> tuple[str, ...]:
        """Names of the MoE ownership fields (etp, ep, edp, pp, ranks) that differ from ``other``."""
        return tuple(f for f in MOE_OWNERSHIP_FIELDS if getattr(self, f) != getattr(other, f))
