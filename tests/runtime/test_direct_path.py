"""The runtime with ``dispatch_path=direct`` (dispatch/direct.py) on a local Ray instance (object-store
exchange between CPU shard actors): outputs equal the reference and the engine-path deployment, layer
statistics equal the engine path's, a scale event (new generation) keeps serving, injected faults keep
their outcomes (count: every rank aborts before payload; inverse: output rejected before publish)."""

from __future__ import annotations

import pytest
import torch

import ray_moe
from ray_moe.apps.release_client import ReleaseClient, ShardFault
from ray_moe.core.errors import CountAgreementError, RouteValidationError
from ray_moe.model.source import weight_source
from ray_moe_dev.testing.reference import reference_moe
from ray_moe.core.types import DispatchPath

CFG = dict(num_ranks=3, num_experts=6, hidden_size=32, ffn_size=48, top_k=2, slots_per_rank=3, seed=5,
           decode_buckets=False)


def _routes(t, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


def test_config_resolves_and_validates_the_path():
    cpu = ray_moe.RuntimeConfig(**CFG)
    assert cpu.resolved_dispatch_path is DispatchPath.ENGINE  # object store: engine unless asked
    assert ray_moe.RuntimeConfig(**CFG, device="cuda").resolved_dispatch_path is DispatchPath.DIRECT
    assert ray_moe.RuntimeConfig(**CFG, device="cuda", payload_format="fp8_row").resolved_dispatch_path \
        is DispatchPath.ENGINE
    assert ray_moe.RuntimeConfig(**CFG, dispatch_path="direct").resolved_dispatch_path is DispatchPath.DIRECT
    with pytest.raises(ValueError, match="dispatch_path=direct"):
        ray_moe.RuntimeConfig(**CFG, dispatch_path="direct", payload_format="fp8_row")
    with pytest.raises(ValueError, match="dispatch_path"):
        ray_moe.RuntimeConfig(**CFG, dispatch_path="fastest")


def test_direct_runtime_equals_reference_and_engine(ray_session):
    direct = ray_moe.Runtime.start(ray_moe.RuntimeConfig(**CFG, name="test-direct", dispatch_path="direct",
                                                         num_layers=2, residual=True))
    engine = ray_moe.Runtime.start(ray_moe.RuntimeConfig(**CFG, name="test-direct-engine", dispatch_path="engine",
                                                         num_layers=2, residual=True))
    try:
        src = weight_source(direct.cfg)
        for tokens in (1, 7, 50):
            h = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
            y_d, routes = direct.forward(h, return_routes=True)
            y_e, routes_e = engine.forward(h, return_routes=True)
            for (ids_d, w_d), (ids_e, w_e) in zip(routes, routes_e):
                assert torch.equal(torch.as_tensor(ids_d), torch.as_tensor(ids_e))
            torch.testing.assert_close(y_d, y_e, rtol=1e-5, atol=1e-6)
            # layer by layer against the semantic reference (residual stream, runtime's own routes)
            x = h.double()
            for layer, (ids, w) in enumerate(routes):
                x = x + reference_moe(x, torch.as_tensor(ids), torch.as_tensor(w), lambda e: src.expert(layer, e))
            torch.testing.assert_close(y_d.double(), x, rtol=1e-4, atol=1e-4)
        sd, se = direct.stats(), engine.stats()
        assert sd["rank_rows"] == se["rank_rows"]
        assert sd["ratios"] == se["ratios"] and sd["accepted_routes"] == se["accepted_routes"]
        # a new generation (replicas of expert 2) keeps serving through the direct path
        gen = direct.scale(expert=2, replicas=3)
        h = torch.randn(20, 32)
        ids, w = _routes(20, 6, 2, 1)
        y = direct.forward(h, torch.stack([ids, ids]), torch.stack([w, w]))
        x = h.double()
        for layer in range(2):
            x = x + reference_moe(x, ids, w, lambda e: src.expert(layer, e))
        torch.testing.assert_close(y.double(), x, rtol=1e-4, atol=1e-4)
        assert direct.placement().generation == gen
        # faults keep their outcomes on the direct path
        ReleaseClient.for_runtime(direct).inject_fault(ShardFault.COUNT, rank=1)
        with pytest.raises(Exception) as info:
            direct.forward(h, torch.stack([ids, ids]), torch.stack([w, w]))
        assert "CountAgreementError" in repr(info.value) or isinstance(info.value, CountAgreementError)
        ReleaseClient.for_runtime(direct).inject_fault(ShardFault.INVERSE, rank=2)
        with pytest.raises(Exception) as info:
            direct.forward(h, torch.stack([ids, ids]), torch.stack([w, w]))
        assert "output rejected before publish" in str(info.value)
        # and the deployment serves again afterwards
        torch.testing.assert_close(direct.forward(h, torch.stack([ids, ids]), torch.stack([w, w])).double(), x, rtol=1e-4, atol=1e-4)
    finally:
        direct.shutdown()
        engine.shutdown()
