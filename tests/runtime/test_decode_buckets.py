"""Decode buckets on local Ray: admission agreed by every rank, fixed-capacity path equal to the reference,
oversize fallback without clipping, generation change invalidating the bucket key, injected key mismatch."""

from __future__ import annotations

import pytest
import torch

import ray_moe
from ray_moe.apps.release_client import ReleaseClient, ShardFault
from ray_moe.model.source import weight_source
from ray_moe_dev.testing.reference import reference_moe

CFG = dict(num_ranks=4, num_experts=8, hidden_size=16, ffn_size=32, top_k=2, slots_per_rank=3, seed=5,
           decode_token_capacity=4, tagged_weights=True, name="decode-buckets")


@pytest.fixture(scope="module")
def rt(ray_session):
    runtime = ray_moe.Runtime.start(ray_moe.RuntimeConfig(**CFG))
    yield runtime
    runtime.shutdown()


def _step(rt, tokens, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, rt.cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(rt.cfg.num_experts, generator=g)[:2] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=g)
    y = rt.forward(h, ids, w, phase="decode", **kw)
    ref = reference_moe(h.double(), ids, w, lambda e: weight_source(rt.cfg).expert(0, e))
    return float((y.double() - ref).abs().max())


@pytest.mark.parametrize("tokens", [1, 5, 9, 16])
def test_admitted_bucket_equals_reference(rt, tokens):
    before = rt.stats()
    assert _step(rt, tokens, tokens) < 1e-4
    after = rt.stats()
    assert after["bucket_layers"] == before["bucket_layers"] + 1
    assert after["fallbacks"] == before["fallbacks"]


def test_oversize_decode_falls_back_unchanged(rt):
    """17 tokens over 4 ranks puts 5 on rank 0 > C_T = 4: rank_token_capacity_exceeded; nothing clipped."""
    before = rt.stats()
    assert _step(rt, 17, 99) < 1e-4
    after = rt.stats()
    assert after["bucket_layers"] == before["bucket_layers"]
    assert after["fallbacks"].get("rank_token_capacity_exceeded", 0) == \
        before["fallbacks"].get("rank_token_capacity_exceeded", 0) + 1
    assert after["accepted_routes"] - before["accepted_routes"] == 17 * 2


def test_slot_capacity_fallback(rt):
    """Every route to experts 0 and 4 exceeds some slot's route capacity: expert_route_capacity_exceeded."""
    t = 16
    h = torch.randn(t, rt.cfg.hidden_size)
    ids = torch.tensor([[0, 4]] * t)
    w = torch.rand(t, 2)
    before = rt.stats()["fallbacks"].get("expert_route_capacity_exceeded", 0)
    y = rt.forward(h, ids, w, phase="decode")
    ref = reference_moe(h.double(), ids, w, lambda e: weight_source(rt.cfg).expert(0, e))
    assert float((y.double() - ref).abs().max()) < 1e-4
    assert rt.stats()["fallbacks"]["expert_route_capacity_exceeded"] == before + 1


def test_injected_graph_key_mismatch_falls_back_on_every_rank(rt):
    g = rt.placement().generation
    ReleaseClient.for_runtime(rt).inject_fault(ShardFault.GRAPH_KEY, rank=2, generation=g)
    before = rt.stats()["fallbacks"].get("graph_key_mismatch", 0)
    assert _step(rt, 6, 7) < 1e-4
    assert rt.stats()["fallbacks"]["graph_key_mismatch"] == before + 1
    assert _step(rt, 6, 8) < 1e-4  # one-shot fault: the next step replays again


def test_generation_change_invalidates_bucket_key(rt):
    import ray

    g0 = rt.placement().generation
    assert _step(rt, 4, 1) < 1e-4
    buckets = ray.get([h.status.remote() for h in rt.shards.values()])
    g1 = rt.scale(expert=3, replicas=3)
    assert g1 != g0
    replays = rt.stats()["bucket_layers"]
    assert _step(rt, 4, 2) < 1e-4  # a new bucket keyed to g1 is built; the g0 one was freed at retirement
    assert rt.stats()["bucket_layers"] == replays + 1
    assert rt.generations()[g0] == "RETIRED"
    assert buckets


def test_mixed_batch_is_split_by_phase(rt):
    """12 prefill rows and 3 decode rows (spec 0x05E): two execution units, outputs back in row order."""
    g = torch.Generator().manual_seed(42)
    t = 15
    h = torch.randn(t, rt.cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(rt.cfg.num_experts, generator=g)[:2] for _ in range(t)])
    w = torch.rand(t, 2, generator=g)
    mask = torch.zeros(t, dtype=torch.bool)
    mask[[2, 7, 11]] = True
    before = rt.stats()
    y = rt.forward_mixed(h, mask, ids, w)
    ref = reference_moe(h.double(), ids, w, lambda e: weight_source(rt.cfg).expert(0, e))
    assert float((y.double() - ref).abs().max()) < 1e-4
    after = rt.stats()
    assert after["phase_steps"]["prefill"] == before["phase_steps"].get("prefill", 0) + 1
    assert after["phase_steps"]["decode"] == before["phase_steps"].get("decode", 0) + 1
    assert after["bucket_layers"] == before["bucket_layers"] + 1  # the decode unit took the bucket
    assert after["accepted_routes"] - before["accepted_routes"] == 2 * t


def test_route_class_fractions_add_up(rt):
    s = rt.stats()["ratios"]
    den = s["same_gpu"]["denominator"]
    assert den > 0
    assert s["same_gpu"]["numerator"] + s["same_node_remote_gpu"]["numerator"] + s["different_node"]["numerator"] == den
