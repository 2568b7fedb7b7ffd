"""The one-rank path (``dispatch/local.py``): equal to the reference protocol on random routes with replicas
and padding routes, the runner on device-side offsets, the fence, faults and bad input; a one-rank deployment
serves prefill and decode (its decode bucket is this path) equal to the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.shard.fault_wrappers import corrupt_handle
from ray_moe.model.config import RuntimeConfig
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.moe.dispatch.local import LocalDispatcher
from ray_moe.moe.dispatch.protocol import ControlStatus, DeferredChecks
from ray_moe.core.routes import RouteBatch
from ray_moe.core.errors import RouteValidationError, StaleGenerationError
from ray_moe.moe.experts.runners import make_runner
from ray_moe.moe.experts.weights import SeededWeightSource, SlotWeights
from ray_moe.placement.manifest import manifest_from_assignment
from ray_moe.placement.selector import make_selector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe_dev.testing.inprocess import InProcessDeployment, reference_output
from ray_moe_dev.testing.reference import reference_moe
from ray_moe.core.types import Phase

E, D, F = 6, 16, 24


def _setup(replicas: int = 2):
    """One rank holding every expert, expert 0 and 1 replicated."""
    phy2log = [list(range(E)) + list(range(replicas))]
    slot_rank = [[0] * len(phy2log[0])]
    topo = Topology.single_node(1)
    group = ProcessGroupSpec(group_id="ep-group-0", peer_order=(0,), epoch=0)
    man = manifest_from_assignment(generation=3, phy2log=phy2log, slot_rank=slot_rank, num_experts=E, topology=topo,
                                   process_group_id=group.group_id, checkpoint_version="ck", digests={})
    snap = PlacementSnapshot.from_manifest(man, topo, group, layer=0)
    src = SeededWeightSource(num_layers=1, num_experts=E, hidden_size=D, ffn_size=F, seed=2)
    weights = SlotWeights.stack(0, list(range(len(phy2log[0]))), [src.expert(0, e) for e in phy2log[0]])
    ex = LocalExchangeGroup(group).endpoint(0)
    return snap, src, weights, ex


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 24), st.integers(1, 3), st.integers(0, 4), st.sampled_from(["round_robin", "hash"]))
def test_local_path_equals_the_reference(t, k, pad, policy):
    snap, src, weights, ex = _setup()
    g = torch.Generator().manual_seed(t * 31 + k * 7 + pad)
    h = torch.randn(t + pad, D, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t + pad)]) if t + pad else \
        torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(t + pad, k, generator=g)
    ids_padded = ids.clone()
    ids_padded[t:] = -1  # padding routes: no expert identity, no output
    d = LocalDispatcher(ex, make_selector(policy), validate=False)
    out = d.dispatch(RouteBatch(0, h, ids_padded, w), snap, tag="p")
    y_rows = make_runner("grouped").run_offsets(out.rows, out.offsets, SlotWeights(
        weights.layer, weights.slot_ids, weights.experts, weights.w_gate.double(), weights.w_up.double(),
        weights.w_down.double()))
    checks = DeferredChecks()
    y = d.combine(y_rows, out.handle, snap, tag="p", out_dtype=torch.float64, checks=checks)
    checks.verify()
    ref = reference_moe(h[:t], ids[:t], w[:t], lambda e: src.expert(0, e))
    assert y.shape == (t + pad, D)
    torch.testing.assert_close(y[:t], ref, atol=1e-6, rtol=1e-6)  # the combine accumulates in FP32
    assert float(y[t:].abs().sum()) == 0.0
    assert int(out.valid.sum()) == t * k and int(out.handle.sent_slots.sum()) == t * k


def test_fence_status_faults_and_bad_input():
    snap, _, weights, ex = _setup()
    d = LocalDispatcher(ex, make_selector("round_robin"), validate=True)
    h = torch.randn(4, D)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 0]])
    w = torch.rand(4, 2)
    with pytest.raises(StaleGenerationError, match="refused generation 3"):
        d.dispatch(RouteBatch(0, h, ids, w), snap, tag="s", status=ControlStatus.STALE_GENERATION)
    with pytest.raises(RouteValidationError, match="expert id 9"):
        d.dispatch(RouteBatch(0, h, torch.tensor([[0, 9]] * 4), w), snap, tag="b")
    out = d.dispatch(RouteBatch(0, h, ids, w), snap, tag="f")
    y_rows = make_runner("grouped").run_offsets(out.rows, out.offsets, weights)
    with pytest.raises(RouteValidationError, match="output rejected before publish"):
        d.combine(y_rows, corrupt_handle(out.handle), snap, tag="f", out_dtype=torch.float32)
    other = PlacementSnapshot(**{**snap.__dict__, "generation": 4, "map_digest": 0, "_device_cache": {}})
    with pytest.raises(StaleGenerationError, match="handle generation 3"):
        d.combine(y_rows, out.handle, other, tag="f", out_dtype=torch.float32)


@pytest.mark.parametrize("phase", [Phase.PREFILL, Phase.DECODE])
def test_one_rank_deployment_serves_on_the_local_path(phase):
    cfg = RuntimeConfig(num_ranks=1, num_experts=8, hidden_size=16, ffn_size=24, top_k=2, slots_per_rank=10,
                        num_layers=2, residual=True, tagged_weights=True, decode_token_capacity=8)
    dep = InProcessDeployment(cfg)
    assert dep.cores[0].paths.normal.mode.value == "local" and dep.cores[0].paths.bucket.mode.value == "local"
    for t in (1, 5, 8):
        g = torch.Generator().manual_seed(t)
        h = torch.randn(t, 16, generator=g)
        ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)])
        w = torch.rand(t, 2, generator=g)
        y, res = dep.step(h, ids, w, phase=phase)
        ref = reference_output(cfg, h, ids, w)
        assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5
        assert dep.paths(res) == {"local" if phase is Phase.PREFILL else "bucket"}


@pytest.mark.gpu
def test_cuda_counting_order_matches_the_sort_and_captures():
    """On CUDA the one-rank dispatcher's order is the counting sort at decode sizes: equal to the stable sort,
    and it records into a CUDA graph (no host sync) whose replay gives the same order for new inputs."""
    from ray_moe.moe.dispatch.plan import expert_major_order

    g = torch.Generator().manual_seed(2)
    index = torch.randint(0, 129, (2048,), generator=g).cuda()
    order, dest, counts = expert_major_order(index, 129)
    assert torch.equal(order, torch.sort(index, stable=True).indices)
    assert torch.equal(counts, torch.bincount(index, minlength=129))
    static = index.clone()
    expert_major_order(static, 129)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = expert_major_order(static, 129)
    fresh = torch.randint(0, 129, (2048,), generator=g).cuda()
    static.copy_(fresh)
    graph.replay()
    assert torch.equal(out[0], torch.sort(fresh, stable=True).indices)
    assert torch.equal(out[1][out[0]], torch.arange(2048, device="cuda"))
