"""The one step pipeline both fronts share (shard/pipeline.py StepPipeline), on CPU with EagerCapture: the
expert-only front's decode steps take the agreed bucket, are 'captured' once per (generation, shape) and
replayed after, with outputs equal to the float64 reference; an overflow reruns on the normal path."""

from __future__ import annotations

import dataclasses

import torch

import ray_moe
from ray_moe.core.types import Phase
from ray_moe_dev.testing.inprocess import InProcessDeployment, reference_output

CFG = dict(num_ranks=2, num_experts=6, hidden_size=16, ffn_size=32, top_k=2, slots_per_rank=4, seed=3,
           decode_token_capacity=8, residual=True)


def _batch(seed: int, t: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, 16, generator=g), torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(t)]),
            torch.rand(t, 2, generator=g))


def test_expert_only_decode_steps_replay_through_the_shared_pipeline(eager_capture):
    cfg = ray_moe.RuntimeConfig(**CFG)
    dep = InProcessDeployment(cfg)
    for core in dep.cores.values():
        core.paths = dataclasses.replace(core.paths, capture=True)
        assert core.executor.pipeline is core.pipeline  # one pipeline per shard, shared by both fronts
    paths_seen = []
    for i in range(6):
        h, ids, w = _batch(i, 6)  # the same bucket every step: captured at the first, replayed after
        y, res = dep.step(h, ids, w, phase=Phase.DECODE)
        assert not dep.errors(res), dep.errors(res)
        torch.testing.assert_close(y.double(), reference_output(cfg, h, ids, w), atol=1e-4, rtol=1e-4)
        paths_seen.append(dep.paths(res))
    assert paths_seen[0] == {"bucket"} and all(p == {"bucket-graph"} for p in paths_seen[2:]), paths_seen
    for core in dep.cores.values():
        c = core.pipeline.counters
        assert c["graphs_captured"] == 1 and c["graph_replays"] >= 4, c
        assert core.status()["graphs"] == 1 and core.status()["capture_error"] is None
        assert all(k[1][0] == "experts" for k in core.pipeline.graphs._graphs)  # keyed by the front's unit


def test_overflow_reruns_on_the_normal_path_and_is_counted():
    cfg = ray_moe.RuntimeConfig(**{**CFG, "decode_slot_capacity": 4})
    dep = InProcessDeployment(cfg)
    h = torch.randn(8, 16, generator=torch.Generator().manual_seed(9))
    ids = torch.tensor([[1, 2]] * 8)  # every row to experts 1 and 2: over a slot's capacity of 4
    w = torch.full((8, 2), 0.5)
    y, res = dep.step(h, ids, w, phase=Phase.DECODE)
    assert not dep.errors(res), dep.errors(res)
    torch.testing.assert_close(y.double(), reference_output(cfg, h, ids, w), atol=1e-4, rtol=1e-4)
    assert all(ls.fallback_reason == "expert_route_capacity_exceeded" for o in res.values() for ls in o.layers)
    for core in dep.cores.values():
        assert core.pipeline.counters["fallback_expert_route_capacity_exceeded"] == 1


def test_a_capture_never_records_into_a_pool_no_graph_holds():
    """``capture_pool``: the shard's pool while a captured graph holds it; after every graph is released, None (a
    new pool: capturing into a freed pool's handle fails PyTorch's allocator assert, and the lattice stays eager)."""
    from ray_moe.shard.pipeline import StepPipeline

    pipe = StepPipeline()
    assert pipe.capture_pool() is None  # the first capture makes the pool
    pipe.pool = ("pool", 1)
    pipe.graphs.put(3, ("decode", 8), object())
    pipe.graphs.put(4, ("decode", 8), object())
    assert pipe.capture_pool() == ("pool", 1)
    pipe.graphs.release(3)
    assert pipe.capture_pool() == ("pool", 1)  # generation 4's graph still holds it
    pipe.graphs.release(4)
    assert pipe.capture_pool() is None
