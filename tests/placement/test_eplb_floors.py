"""EPLB replica floors (``min_replicas``): met on every path, the public solver unchanged without them, and a
floor that cannot fit is a ValueError naming the expert and the floor."""

from __future__ import annotations

import numpy as np
import pytest

from ray_moe.placement.eplb import rebalance_experts, validate_result
from ray_moe.placement.eplb_solver import expert_counts, replicate_experts

SHAPES = [  # (L, E, Q, groups, nodes, gpus)
    (2, 8, 12, 1, 1, 4),
    (3, 8, 16, 4, 2, 4),  # hierarchical
    (2, 16, 24, 4, 2, 8),
]


def _w(shape, seed):
    L, E = shape[0], shape[1]
    return np.random.default_rng(seed).integers(0, 100, size=(L, E)).astype(np.float64)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_floor_is_the_public_solver(shape, seed):
    L, E, Q, g, n, p = shape
    w = _w(shape, seed)
    plain = rebalance_experts(w, Q, g, n, p)
    for floor in (np.ones((L, E), dtype=np.int64), np.zeros((L, E), dtype=np.int64)):
        same = rebalance_experts(w, Q, g, n, p, min_replicas=floor)
        assert all(np.array_equal(a, b) for a, b in zip(plain, same))
    a = replicate_experts(w.astype(np.float32), Q)
    b = replicate_experts(w.astype(np.float32), Q, np.ones((L, E), dtype=np.int64))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("migration", [False, True])
def test_floors_are_met(shape, seed, migration):
    L, E, Q, g, n, p = shape
    w = _w(shape, seed)
    rng = np.random.default_rng(100 + seed)
    floor = np.ones((L, E), dtype=np.int64)
    for l in range(L):
        cold = int(np.argmin(w[l]))
        floor[l, cold] = 2  # the coldest expert: the plain solve gives it one copy
        floor[l, rng.integers(E)] = 2
    kw = {}
    if migration:
        kw = dict(current_phy2log=rebalance_experts(w[:, ::-1].copy(), Q, g, n, p).phy2log, migration_tolerance=0.05,
                  avoid_same_gpu_duplicates=True)
    res = rebalance_experts(w, Q, g, n, p, min_replicas=floor, **kw)
    validate_result(res)
    assert (res.logcnt.numpy() >= floor).all()
    assert (expert_counts(res.phy2log.numpy(), E) == res.logcnt.numpy()).all()
    plain = rebalance_experts(w, Q, g, n, p, **kw)
    assert (plain.logcnt.numpy() < floor).any()  # the floors changed something


def test_greedy_continues_from_the_floors():
    w = np.array([[40, 1, 1, 0, 30, 1, 1, 1]], dtype=np.float32)
    _, _, plain = replicate_experts(w, 12)
    _, _, floored = replicate_experts(w, 12, np.array([[1, 1, 1, 2, 1, 1, 1, 1]]))
    assert plain.tolist() == [[3, 1, 1, 1, 3, 1, 1, 1]]
    assert floored.tolist() == [[3, 1, 1, 2, 2, 1, 1, 1]]  # the floor's slot comes out of the next-best share


def test_unmeetable_floor_names_the_expert_and_the_floor():
    w = np.ones((1, 8))
    floor = np.ones((1, 8), dtype=np.int64)
    floor[0, 3] = 6
    with pytest.raises(ValueError, match=r"expert 3 of layer 0 has a floor of 6"):
        rebalance_experts(w, 12, 1, 1, 4, min_replicas=floor)
    # hierarchical: the floor does not fit its node's slots
    w2 = np.ones((1, 8))
    f2 = np.ones((1, 8), dtype=np.int64)
    f2[0, 1] = 5
    with pytest.raises(ValueError, match=r"expert 1 >= 5"):
        rebalance_experts(w2, 12, 2, 2, 4, min_replicas=f2)
    with pytest.raises(ValueError, match="min_replicas has shape"):
        rebalance_experts(w, 12, 1, 1, 4, min_replicas=np.ones((2, 8), dtype=np.int64))
