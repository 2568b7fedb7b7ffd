"""ShardCore and ControlPlane in-process (no Ray): steps on every path equal the reference, the generation
fence, retirement at refcount 0, rebalance / scale / rank loss, faults installed as wrappers, honest stats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_moe.model.config import RuntimeConfig
from ray_moe.core.errors import CountAgreementError, RouteValidationError, StaleGenerationError
from ray_moe_dev.testing.inprocess import InProcessDeployment, reference_output
from ray_moe.core.types import GenerationState, Phase

BASE = dict(num_ranks=4, num_experts=8, hidden_size=16, ffn_size=24, top_k=2, slots_per_rank=3, num_layers=2,
            seed=3, tagged_weights=True, residual=True, decode_token_capacity=4)


def _routes(t: int, seed: int, cfg: RuntimeConfig):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k] for _ in range(t)]) if t else \
        torch.zeros(0, cfg.top_k, dtype=torch.int64)
    w = torch.rand(t, cfg.top_k, generator=g)
    return h, ids, w


def _err(y, cfg, h, ids, w) -> float:
    ref = reference_output(cfg, h, ids, w)
    assert y.shape == ref.shape
    # relative to the output's scale (tagged weights make expert e's output (e + 1) x larger)
    return float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)) if ref.numel() else 0.0


@pytest.fixture(scope="module")
def dep() -> InProcessDeployment:
    return InProcessDeployment(RuntimeConfig(**BASE))


@pytest.mark.parametrize("tokens", [0, 3, 13])
def test_prefill_step_equals_reference(dep, tokens):
    h, ids, w = _routes(tokens, tokens, dep.cfg)
    y, res = dep.step(h, ids, w)
    assert not dep.errors(res)
    assert y.shape == (tokens, dep.cfg.hidden_size)
    assert _err(y, dep.cfg, h, ids, w) < 1e-4
    assert dep.paths(res) == {"engine"}
    # statistics: every accepted route counted once, per layer, on its origin
    assert sum(ls.accepted for o in res.values() for ls in o.layers) == tokens * 2 * dep.cfg.num_layers


@pytest.mark.parametrize("tokens", [1, 7, 16])
def test_decode_bucket_step_equals_reference(dep, tokens):
    h, ids, w = _routes(tokens, 100 + tokens, dep.cfg)
    y, res = dep.step(h, ids, w, phase=Phase.DECODE)
    assert not dep.errors(res)
    assert _err(y, dep.cfg, h, ids, w) < 1e-4
    assert dep.paths(res) == {"bucket"}  # 16 tokens over 4 ranks: 4 per rank = C_T
    rows = {q: n for o in res.values() for ls in o.layers if ls.layer == 0 for q, n in ls.slot_rows.items()}
    assert sum(rows.values()) == tokens * 2


def test_decode_over_token_capacity_takes_the_variable_path_with_its_reason(dep):
    h, ids, w = _routes(17, 5, dep.cfg)  # 5 tokens on rank 0 > C_T = 4
    y, res = dep.step(h, ids, w, phase=Phase.DECODE)
    assert _err(y, dep.cfg, h, ids, w) < 1e-4
    assert dep.paths(res) == {"engine"}
    assert {ls.fallback_reason for o in res.values() for ls in o.layers} == {"rank_token_capacity_exceeded"}


def test_decode_slot_overflow_reruns_unclipped(dep):
    """Every route to experts 0 and 4: a slot's capacity overflows on the device; the step reruns."""
    t = 16
    h = torch.randn(t, dep.cfg.hidden_size)
    ids = torch.tensor([[0, 4]] * t)
    w = torch.rand(t, 2)
    y, res = dep.step(h, ids, w, phase=Phase.DECODE)
    assert _err(y, dep.cfg, h, ids, w) < 1e-4
    assert {ls.fallback_reason for o in res.values() for ls in o.layers} == {"expert_route_capacity_exceeded"}


@pytest.mark.parametrize("kind,error", [("count", CountAgreementError), ("scale", CountAgreementError),
                                        ("inverse", RouteValidationError)])
def test_faults_fire_once_as_wrappers_and_leave_the_next_step_clean(dep, kind, error):
    h, ids, w = _routes(8, 9, dep.cfg)
    dep.cores[1].inject_fault(kind, count=1, generation=dep.generation)
    _, res = dep.step(h, ids, w)
    errs = dep.errors(res)
    assert isinstance(errs[1], error)
    if kind != "inverse":  # a control-round fault aborts every rank before payload
        assert set(errs) == set(dep.group.peer_order)
    y, res = dep.step(h, ids, w)
    assert not dep.errors(res) and _err(y, dep.cfg, h, ids, w) < 1e-4
    assert dep.cores[1].faults.fired.get(f"fault_{kind}", 0) >= 1


def test_crash_fault_raises_on_its_rank_for_its_count_of_steps():
    one = InProcessDeployment(RuntimeConfig(**{**BASE, "num_ranks": 1, "slots_per_rank": 8}))
    h, ids, w = _routes(4, 3, one.cfg)
    one.cores[0].inject_fault("crash", count=2, generation=one.generation)
    for _ in range(2):
        _, res = one.step(h, ids, w)
        assert "injected fault" in str(one.errors(res)[0])
    y, res = one.step(h, ids, w)
    assert _err(y, one.cfg, h, ids, w) < 1e-4
    assert one.cores[0].counters["aborted_steps"] == 2


def test_a_staged_output_is_published_under_the_step_lock(monkeypatch):
    """On CUDA an expert-only output is a view of the reused pinned staging buffer: ``publish`` (the actor:
    ``ray.put``) gets the array while the step lock is held and the output carries what it returned; without
    ``publish`` the view is copied. (On CPU nothing is staged: the buffer is pretended here.)"""
    from ray_moe.core.wire import tensor_to_wire
    from ray_moe.shard.records import ExpertOnlyInput, StepKind, StepRequest

    one = InProcessDeployment(RuntimeConfig(**{**BASE, "num_ranks": 1, "slots_per_rank": 8}))
    core = one.cores[0]
    h, ids, w = _routes(5, 4, one.cfg)
    monkeypatch.setattr(type(core._staging), "holds", lambda self, arr: True)
    seen = []

    def publish(arr):
        seen.append((arr.shape, core._step_lock.locked()))
        return "ref"

    def req(step_id):
        routes = ids.unsqueeze(0).expand(2, -1, -1).numpy(), w.unsqueeze(0).expand(2, -1, -1).numpy()
        return StepRequest(step_id, one.generation, StepKind.EXPERT_ONLY, ExpertOnlyInput(tensor_to_wire(h), *routes))

    res = core.step(req("p0"), publish=publish)
    assert res.output.hidden == "ref" and seen == [((5, one.cfg.hidden_size), True)]
    assert res.kind is StepKind.EXPERT_ONLY and res.active_generation == one.generation and res.actor_s >= res.elapsed_s
    again = core.step(req("p1"))
    assert isinstance(again.output.hidden, np.ndarray) and again.output.hidden.shape == (5, one.cfg.hidden_size)


def test_parity_fault_changes_the_output_only_while_armed(dep):
    h, ids, w = _routes(6, 11, dep.cfg)
    dep.cores[0].inject_fault("parity", count=1)
    y_bad, _ = dep.step(h, ids, w)
    y_ok, _ = dep.step(h, ids, w)
    assert _err(y_ok, dep.cfg, h, ids, w) < 1e-4
    assert float((y_bad - y_ok).abs().max()) > 1e-3  # rank 0's experts drifted by 1%


def test_graph_key_fault_takes_the_explicit_eager_path(dep):
    h, ids, w = _routes(6, 12, dep.cfg)
    dep.cores[2].inject_fault("graph_key", count=1)
    y, res = dep.step(h, ids, w, phase=Phase.DECODE)
    assert _err(y, dep.cfg, h, ids, w) < 1e-4
    assert {ls.fallback_reason for o in res.values() for ls in o.layers} == {"graph_key_mismatch"}


def test_unknown_fault_kind_is_refused(dep):
    with pytest.raises(ValueError, match="kind='bogus'"):
        dep.cores[0].inject_fault("bogus")


@pytest.mark.parametrize("kind", ["bogus", "generation"])
def test_a_step_of_a_forged_kind_is_refused_before_anything_changes(dep, kind):
    """The rank follows the kind a request declares: one it does not know, or one its input's class does not
    declare (a generation kind over hidden states, refused before "no model loaded"), is refused by name with
    no wait, no pin, no counter and no launch recorded; the rank serves the next step as before."""
    from ray_moe.core.errors import RequestError
    from ray_moe.core.wire import tensor_to_wire
    from ray_moe.shard.records import ExpertOnlyInput, StepKind, StepRequest

    h, ids, w = _routes(4, 8, dep.cfg)
    core = dep.cores[0]
    req = StepRequest("forged", dep.generation, StepKind.EXPERT_ONLY, ExpertOnlyInput(tensor_to_wire(h)), after="x")
    object.__setattr__(req, "kind", kind)  # as if it were built or edited past the constructor
    before = (dict(core.counters), core.refcount(dep.generation), list(core._order._done))
    with pytest.raises(RequestError, match=f"step 'forged': kind='{kind}'"):
        core.step(req)
    assert (dict(core.counters), core.refcount(dep.generation), list(core._order._done)) == before
    y, _ = dep.step(h, ids, w)
    assert _err(y, dep.cfg, h, ids, w) < 1e-4


def test_generation_fence_retire_and_rebalance():
    dep = InProcessDeployment(RuntimeConfig(**{**BASE, "num_layers": 1}))
    g0 = dep.generation
    h, ids, w = _routes(12, 1, dep.cfg)
    dep.step(h, ids, w)
    dep.plane.record_load(np.array([[40, 1, 1, 1, 30, 1, 1, 1]]), phase="prefill", generation=g0)
    rep = dep.plane.apply(dep.plane.propose_rebalance(), reason="rebalance")
    g1 = rep.new_generation
    assert rep.retired and dep.plane.registry.state(g0) == GenerationState.RETIRED
    assert all(c.refcount(g0) == 0 for c in dep.cores.values())
    # a step pinned to the retired generation is refused on every rank before any payload
    _, res = dep.step(h, ids, w, generation=g0)
    errs = dep.errors(res)
    assert set(errs) == set(dep.group.peer_order)
    assert all(isinstance(e, StaleGenerationError) for e in errs.values())
    dep.generation = g1
    y, res = dep.step(h, ids, w)
    assert not dep.errors(res) and _err(y, dep.cfg, h, ids, w) < 1e-4
    # scale: expert 3 to three replicas, live
    g2 = dep.plane.apply(dep.plane.propose_scale(3, 3), reason="scale").new_generation
    dep.generation = g2
    assert len(dep.plane.manifest().replicas(3, 0)) == 3
    y, res = dep.step(h, ids, w)
    assert _err(y, dep.cfg, h, ids, w) < 1e-4


def test_rank_loss_regroups_the_survivors():
    dep = InProcessDeployment(RuntimeConfig(**{**BASE, "num_layers": 1, "slots_per_rank": 4}))
    h, ids, w = _routes(10, 2, dep.cfg)
    survivors = [0, 1, 3]
    group = dep.regroup(survivors)
    rep = dep.plane.remove_ranks([2], group)
    dep.generation = rep.new_generation
    assert 2 not in {s.destination_rank for s in dep.plane.manifest().slots}
    y, res = dep.step(h, ids, w)
    assert set(res) == set(survivors)
    assert not dep.errors(res) and _err(y, dep.cfg, h, ids, w) < 1e-4
