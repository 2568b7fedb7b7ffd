"""Ratios that keep their numerator and denominator (spec 0x0D). Pure: no Ray.

A ratio without its denominator is unreproducible, and the five ratios of 0x0D are not
interchangeable: dividing remote routes by *attempted* routes answers a different question than
dividing them by *accepted* routes. Every ratio here is therefore a record of two integer counts and a
name; its value is derived, and a zero denominator gives ``None`` ("no observations"), never a silent 0.

The five definitions (0x0D), each over a set of workload cells:

=========================  ==========================  ==================================
ratio (metric name)        numerator                   denominator
=========================  ==========================  ==================================
moe_route_drop_ratio       dropped routes              attempted routes
moe_remote_route_ratio     remote routes               accepted routes
moe_inter_node_route_ratio inter-node routes           accepted routes
moe_graph_replay_ratio     graph-replay steps          graph-replay + eager-fallback steps
moe_fallback_step_ratio    eager-fallback steps        all steps
=========================  ==========================  ==================================

"Remote" is every route whose destination rank differs from its origin rank (same-node-remote-gpu and
different-node, 0x07C); "inter-node" is the different-node subset, so ``inter_node <= remote``. The
replay/fallback columns count *steps* (a decode step either replays its graph or falls back to eager),
which is why the fallback count is both a term of the graph-replay denominator and the numerator of the
fallback step ratio; prefill steps are eager by design and count in neither replay nor fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from types import MappingProxyType
from typing import Callable, Iterable, Iterator, Mapping

from ray_moe.core.types import Phase

MIXED_PHASE = "mixed"
"""Phase label of a cell whose steps mix prefill and decode units (0x05E keeps per-unit provenance)."""

CELL_PHASES: frozenset[str] = frozenset({Phase.PREFILL.value, Phase.DECODE.value, MIXED_PHASE})


def _check_count(owner: str, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{field}={value!r} must be an int count")
    if value < 0:
        raise ValueError(f"{owner}.{field}={value} must be >= 0")
    return value


class RatioKind(str, Enum):
    """The five non-interchangeable ratios of 0x0D; the value is the 0x0DB metric name."""

    DROP = "moe_route_drop_ratio"
    REMOTE = "moe_remote_route_ratio"
    INTER_NODE = "moe_inter_node_route_ratio"
    GRAPH_REPLAY = "moe_graph_replay_ratio"
    FALLBACK = "moe_fallback_step_ratio"


@dataclass(frozen=True)
class Ratio:
    """``numerator / denominator`` with both counts kept (a proportion: ``0 <= numerator <= denominator``).

    ``value`` is ``None`` when the denominator is 0: no observations is not a ratio of 0.
    """

    name: str
    numerator: int
    denominator: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Ratio.name={self.name!r} must be a non-empty string")
        _check_count(f"Ratio[{self.name}]", "numerator", self.numerator)
        _check_count(f"Ratio[{self.name}]", "denominator", self.denominator)
        if self.numerator > self.denominator:
            raise ValueError(
                f"Ratio[{self.name}].numerator={self.numerator} exceeds denominator={self.denominator}"
            )

    @property
    def fraction(self) -> Fraction | None:
        """The exact value, or ``None`` when the denominator is 0."""
        if self.denominator == 0:
            return None
        return Fraction(self.numerator, self.denominator)

    @property
    def value(self) -> float | None:
        """The value as a float, or ``None`` when the denominator is 0 (never a silent 0)."""
        f = self.fraction
        return None if f is None else float(f)

    def __add__(self, other: "Ratio") -> "Ratio":
        """Pool two observations of the same ratio: numerators and denominators add (never values)."""
        if not isinstance(other, Ratio):
            return NotImplemented
        if other.name != self.name:
            raise ValueError(f"Ratio.name={other.name!r} cannot be pooled with {self.name!r}")
        return Ratio(self.name, self.numerator + other.numerator, self.denominator + other.denominator)

    def render(self) -> str:
        """``570/798 = 0.714286`` or ``0/0 = n/a``."""
        v = self.value
        return f"{self.numerator}/{self.denominator} = " + ("n/a" if v is None else f"{v:.6f}")


@dataclass(frozen=True)
class WorkloadCell:
    """One evaluation cell's counts (0x0D): one release, one phase label, one observation window.

    Conservation (0x0CD): ``accepted + dropped == attempted``. Route classes: ``inter_node <= remote <=
    accepted``. Step accounting: ``replay + fallback <= steps``.
    """

    release: str
    phase: str
    steps: int
    attempted: int
    accepted: int
    dropped: int
    remote: int
    inter_node: int
    replay: int
    fallback: int
    name: str = ""

    def __post_init__(self) -> None:
        owner = f"WorkloadCell[{self.name or self.phase}]"
        if not isinstance(self.release, str) or not self.release:
            raise ValueError(f"{owner}.release={self.release!r} must be a non-empty release id")
        phase = self.phase.value if isinstance(self.phase, Phase) else self.phase
        if phase not in CELL_PHASES:
            raise ValueError(f"{owner}.phase={self.phase!r} is not one of {sorted(CELL_PHASES)}")
        object.__setattr__(self, "phase", phase)
        for f in ("steps", "attempted", "accepted", "dropped", "remote", "inter_node", "replay", "fallback"):
            _check_count(owner, f, getattr(self, f))
        if self.accepted + self.dropped != self.attempted:
            raise ValueError(
                f"{owner}.attempted={self.attempted} != accepted={self.accepted} + dropped={self.dropped}"
            )
        if self.remote > self.accepted:
            raise ValueError(f"{owner}.remote={self.remote} exceeds accepted={self.accepted}")
        if self.inter_node > self.remote:
            raise ValueError(f"{owner}.inter_node={self.inter_node} exceeds remote={self.remote}")
        if self.replay + self.fallback > self.steps:
            raise ValueError(
                f"{owner}.replay={self.replay} + fallback={self.fallback} exceeds steps={self.steps}"
            )


@dataclass(frozen=True)
class RatioDefinition:
    """How one ratio reads a cell: the numerator and denominator terms, named for reports."""

    kind: RatioKind
    numerator_label: str
    denominator_label: str
    numerator: Callable[[WorkloadCell], int]
    denominator: Callable[[WorkloadCell], int]


RATIO_DEFINITIONS: Mapping[RatioKind, RatioDefinition] = MappingProxyType(
    {
        RatioKind.DROP: RatioDefinition(
            RatioKind.DROP, "dropped routes", "attempted routes", lambda c: c.dropped, lambda c: c.attempted
        ),
        RatioKind.REMOTE: RatioDefinition(
            RatioKind.REMOTE, "remote routes", "accepted routes", lambda c: c.remote, lambda c: c.accepted
        ),
        RatioKind.INTER_NODE: RatioDefinition(
            RatioKind.INTER_NODE,
            "inter-node routes",
            "accepted routes",
            lambda c: c.inter_node,
            lambda c: c.accepted,
        ),
        RatioKind.GRAPH_REPLAY: RatioDefinition(
            RatioKind.GRAPH_REPLAY,
            "graph replays",
            "replay + fallback",
            lambda c: c.replay,
            lambda c: c.replay + c.fallback,
        ),
        RatioKind.FALLBACK: RatioDefinition(
            RatioKind.FALLBACK, "fallback steps", "all steps", lambda c: c.fallback, lambda c: c.steps
        ),
    }
)


def cell_ratio(kind: RatioKind, cell: WorkloadCell) -> Ratio:
    """One ratio of one cell, by its 0x0D definition."""
    d = RATIO_DEFINITIONS[RatioKind(kind)]
    return Ratio(d.kind.value, d.numerator(cell), d.denominator(cell))


@dataclass(frozen=True)
class RatioSet:
    """The five ratios of 0x0D over one set of cells, with the pooled totals they came from."""

    drop: Ratio
    remote: Ratio
    inter_node: Ratio
    graph_replay: Ratio
    fallback: Ratio
    steps: int
    attempted: int
    accepted: int
    dropped: int

    def __iter__(self) -> Iterator[Ratio]:
        return iter((self.drop, self.remote, self.inter_node, self.graph_replay, self.fallback))

    def by_kind(self) -> dict[RatioKind, Ratio]:
        return {RatioKind(r.name): r for r in self}


def aggregate(cells: Iterable[WorkloadCell]) -> RatioSet:
    """Pool cells into the five ratios (0x0D).

    1. Require one release across the cells (a result names one release id).
    2. Sum every numerator and every denominator over the cells; never average per-cell values.
    3. Build each ratio from its definition; an empty set gives five ratios with value ``None``.
    """
    cells = tuple(cells)
    for i, c in enumerate(cells):
        if not isinstance(c, WorkloadCell):
            raise ValueError(f"cells[{i}]={c!r} is not a WorkloadCell")
        if c.release != cells[0].release:
            raise ValueError(
                f"cells[{i}].release={c.release!r} differs from cells[0].release={cells[0].release!r}"
            )
    pooled: dict[RatioKind, Ratio] = {}
    for kind, d in RATIO_DEFINITIONS.items():
        pooled[kind] = Ratio(
            kind.value, sum(d.numerator(c) for c in cells), sum(d.denominator(c) for c in cells)
        )
    return RatioSet(
        drop=pooled[RatioKind.DROP],
        remote=pooled[RatioKind.REMOTE],
        inter_node=pooled[RatioKind.INTER_NODE],
        graph_replay=pooled[RatioKind.GRAPH_REPLAY],
        fallback=pooled[RatioKind.FALLBACK],
        steps=sum(c.steps for c in cells),
        attempted=sum(c.attempted for c in cells),
        accepted=sum(c.accepted for c in cells),
        dropped=sum(c.dropped for c in cells),
    )
