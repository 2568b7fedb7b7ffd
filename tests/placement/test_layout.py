"""ParallelLayout: the two 0x0BA four-rank manifests, world-size checks, group derivation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ray_moe.placement.layout import MoECoordinate, ParallelLayout, PhysicalUnit

RANKS = (0, 1, 2, 3)


def active() -> ParallelLayout:
    return ParallelLayout(tp=2, cp=1, dp=2, pp=1, etp=1, ep=4, edp=1, ranks=RANKS)


def candidate() -> ParallelLayout:
    return ParallelLayout(tp=2, cp=1, dp=2, pp=1, etp=2, ep=2, edp=1, ranks=RANKS)


def test_spec_0x0BA_products_are_four_four_four():
    assert (active().w_attention, active().w_moe, candidate().w_moe) == (4, 4, 4)
    assert candidate().w_attention == 4


def test_spec_0x0BA_active_layout_groups():
    lay = active()
    assert lay.ep_groups() == ((0, 1, 2, 3),)
    assert lay.etp_groups() == ((0,), (1,), (2,), (3,))
    assert lay.physical_unit() is PhysicalUnit.COMPLETE_COPY
    assert lay.physical_unit().value == "complete copy on one rank"


def test_spec_0x0BA_candidate_layout_coordinates_and_groups():
    lay = candidate()
    assert [(c.rank, c.ep, c.etp) for c in lay.moe_coordinates()] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert lay.ep_groups() == ((0, 2), (1, 3))
    assert lay.etp_groups() == ((0, 1), (2, 3))
    assert lay.physical_unit() is PhysicalUnit.ETP_GROUP_COPY
    assert lay.physical_unit().value == "one copy spanning an ETP group"
    assert lay.moe_coordinate(3) == MoECoordinate(rank=3, etp=1, ep=1, edp=0, pp=0)
    # attention: TP=2 DP=2 -> TP groups [0,1] [2,3], DP groups [0,2] [1,3]
    assert lay.tp_groups() == ((0, 1), (2, 3))
    assert lay.dp_groups() == ((0, 2), (1, 3))
    # equal products, different ownership (0x0BB)
    assert active().moe_ownership_changes(lay) == ("etp", "ep")
    assert active().moe_ownership_changes(active()) == ()


def test_non_contiguous_global_ranks_use_positions():
    lay = ParallelLayout(tp=4, etp=2, ep=2, ranks=(7, 3, 5, 1))
    assert lay.ep_groups() == ((7, 5), (3, 1))
    assert lay.etp_groups() == ((7, 3), (5, 1))


def test_pp_and_edp_groups():
    lay = ParallelLayout(tp=2, dp=2, pp=2, etp=1, ep=2, edp=2, ranks=tuple(range(8)))
    assert lay.ep_groups() == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert lay.edp_groups() == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert {c.pp for c in lay.moe_coordinates()[:4]} == {0} and {c.pp for c in lay.moe_coordinates()[4:]} == {1}
    # pp coordinate agrees between the attention and MoE foldings
    assert [a.pp for a in lay.attention_coordinates()] == [m.pp for m in lay.moe_coordinates()]


def test_world_size_checks_name_the_fields():
    with pytest.raises(ValidationError, match=r"tp\*cp\*dp\*pp = 2\*1\*1\*1 = 2 != len\(ranks\)=4"):
        ParallelLayout(tp=2, etp=1, ep=4, ranks=RANKS)
    with pytest.raises(ValidationError, match=r"etp\*ep\*edp\*pp = 2\*1\*1\*1 = 2 != len\(ranks\)=4"):
        ParallelLayout(tp=4, etp=2, ranks=RANKS)
    with pytest.raises(ValidationError, match=r"ranks\[2\]=1 appears twice"):
        ParallelLayout(tp=3, ep=3, ranks=(0, 1, 1))
    with pytest.raises(ValidationError, match=r"ranks\[0\]=-1 is negative"):
        ParallelLayout(ranks=(-1,))
    with pytest.raises(ValidationError, match="etp"):
        ParallelLayout(etp=0, ranks=(0,))
    with pytest.raises(ValueError, match="rank=9 is not in layout"):
        active().moe_coordinate(9)
    assert "etp" in ParallelLayout.model_json_schema()["properties"]


@st.composite
def layouts(draw):
    pp = draw(st.integers(1, 2))
    etp, ep, edp = (draw(st.integers(1, 3)) for _ in range(3))
    n = etp * ep * edp * pp
    ranks = tuple(draw(st.permutations(list(range(n)))))
    per = n // pp
    tp = draw(st.sampled_from([d for d in range(1, per + 1) if per % d == 0]))
    return ParallelLayout(tp=tp, dp=per // tp, pp=pp, etp=etp, ep=ep, edp=edp, ranks=ranks)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_property_groups_partition_the_ranks(lay):
    for groups, size in ((lay.ep_groups(), lay.ep), (lay.etp_groups(), lay.etp), (lay.edp_groups(), lay.edp),
                         (lay.tp_groups(), lay.tp), (lay.dp_groups(), lay.dp)):
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == sorted(lay.ranks)
    # one EP group and one ETP group intersect in at most one rank (independent axes)
    for eg in lay.ep_groups():
        for tg in lay.etp_groups():
            assert len(set(eg) & set(tg)) <= 1
    coords = {c.rank: c for c in lay.moe_coordinates()}
    assert len({(c.etp, c.ep, c.edp, c.pp) for c in coords.values()}) == lay.world_size
