"""The runtime on CUDA: one ExpertShardActor per GPU, NCCL (CuPy) exchange, decode buckets as CUDA graphs.

Skipped without CUDA (``gpu``) / without two GPUs (``multi_gpu``) by ``tests/conftest.py``. Checked:
  * prefill and decode outputs equal the naive reference (``reference_moe`` / ``reference_forward`` on CPU in
    float64 from ``weight_source(cfg)``): bf16 within 3e-2 of the output scale, float32 on CUDA within 1e-4;
  * replicas are exercised (routes of a replicated expert reach both of its ranks);
  * every step's generation pin is released (refcounts 0 after each step);
  * decode steps take the bucket path, the whole step replayed as one CUDA graph (``graph_replays`` +=
    layers per step, every layer's path ``bucket-graph`` on every rank, one captured step per (rank,
    generation, bucket) freed by ``release_graphs``); an oversize step takes the variable path
    (``rank_token_capacity_exceeded``), unclipped;
  * a live scale under traffic copies the expert GPU to GPU over NCCL (copies, no checkpoint loads; the new
    replica's bytes equal the source), the outputs stay equal to the reference throughout (tagged weights),
    the old generation retires with refcount 0 and decode replays graphs again on the new generation;
  * shutdown kills every actor, frees the placement group's GPUs and the coordinator name.

Deployments are class-scoped (one alive at a time: each holds one GPU per rank).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ray_moe
from ray_moe.apps.release_client import ReleaseClient
from ray_moe.model.source import weight_source
from ray_moe.runtime import Runtime
from ray_moe_dev.testing.reference import reference_moe
from ray_moe_dev.testing.reference_model import reference_forward
from ray_moe.core.types import ExchangeKind

pytestmark = pytest.mark.gpu

# C_T = 8 tokens per rank; C_q = 32 = C_T * k * 2 ranks, so no admitted step can exceed a slot's capacity
# (random routes stay on the graph path; only the deliberate oversize test falls back)
BASE = dict(num_experts=8, hidden_size=256, ffn_size=512, top_k=2, seed=7, device="cuda",
            decode_token_capacity=8, decode_slot_capacity=32, exchange_timeout_s=60.0)
BF16_TOL = 3e-2
F32_TOL = 1e-4


class _Recording(Runtime):
    """Keeps the last step's per-rank StepResults (path taken per layer, shard elapsed)."""

    last = None

    def _account(self, results, *args, **kwargs):
        self.last = results
        return super()._account(results, *args, **kwargs)


def _start(**kw) -> _Recording:
    return _Recording.start(ray_moe.RuntimeConfig(**{**BASE, **kw}))


def _routes(t: int, e: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()
    w = torch.rand(t, k, generator=g) + 0.05
    return ids, w / w.sum(1, keepdim=True)


def _inputs(cfg, t: int, seed: int):
    """hidden [T, d] already in the deployment's dtype (the reference starts from the same values) and
    per-layer routes [L, T, k]."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, cfg.hidden_size, generator=g).to(getattr(torch, cfg.dtype))
    rs = [_routes(t, cfg.num_experts, cfg.top_k, g) for _ in range(cfg.num_layers)]
    return h, torch.stack([r[0] for r in rs]), torch.stack([r[1] for r in rs])


def _check(rt, t: int, seed: int, phase: str, tol: float) -> float:
    """One step against the float64 reference; returns the error relative to the output scale."""
    cfg = rt.cfg
    h, ids, w = _inputs(cfg, t, seed)
    y = rt.forward(h, ids, w, phase=phase)
    assert y.shape == h.shape and y.dtype == h.dtype
    ref = reference_forward(cfg, weight_source(cfg), h.double(),
                            routes=[(ids[l], w[l]) for l in range(cfg.num_layers)]).out
    scale = float(ref.abs().max()) or 1.0
    torch.testing.assert_close(y.double(), ref, atol=tol * scale, rtol=tol)
    return float((y.double() - ref).abs().max()) / scale


def _refcounts_zero(rt) -> None:
    rc = rt.refcounts()
    assert all(v == 0 for v in rc.values()), rc


def _paths(rt) -> set[str]:
    return {ls.path for res in rt.last.values() for ls in res.layers}


def _check_graph(rt, t: int, seed: int, tol: float) -> None:
    """A decode step replayed from a captured graph: the first step of a (generation, bucket) runs the
    bucket eagerly on every rank and captures the whole step; the next ones replay it."""
    before = rt.stats()
    _check(rt, t, seed, "decode", tol)
    if _paths(rt) == {"bucket"}:  # captured just now
        assert rt.stats()["graph_replays"] == before["graph_replays"]
        before = rt.stats()
        _check(rt, t, seed + 1, "decode", tol)
    assert _paths(rt) == {"bucket-graph"}, _paths(rt)
    after = rt.stats()
    assert after["graph_replays"] == before["graph_replays"] + rt.cfg.num_layers
    assert after["fallbacks"] == before["fallbacks"]


# ==================================================================================== two GPUs, bf16
@pytest.fixture(scope="class")
def rt_bf16(ray_session):
    runtime = _start(num_ranks=2, slots_per_rank=5, num_layers=2, residual=True, dtype="bfloat16",
                     tagged_weights=True, name="gpu-bf16")
    yield runtime
    runtime.shutdown()


@pytest.mark.multi_gpu
class TestTwoGpusBf16:
    """2 ranks x 5 slots for 8 experts (experts 0 and 1 replicated on both ranks), 2 layers with residual,
    tagged weights (expert e's output is (e+1) x a shared function: a wrong expert shows in the output)."""

    def test_deployed_on_two_gpus_with_nccl(self, rt_bf16):
        import ray

        infos = ray.get([h.node_info.remote() for h in rt_bf16.shards.values()])
        gpu_ids = [tuple(i["gpu_ids"]) for i in infos]
        assert all(len(g) == 1 for g in gpu_ids) and len(set(gpu_ids)) == 2, gpu_ids
        assert rt_bf16.cfg.exchange_kind is ExchangeKind.NCCL
        kinds = ray.get([h.__ray_call__.remote(lambda a: type(a.core.exchange).__name__)
                         for h in rt_bf16.shards.values()])
        assert kinds == ["NcclExchange", "NcclExchange"]
        modes = ray.get([h.__ray_call__.remote(lambda a: (a.core.paths.normal.mode.value, a.core.paths.capture))
                         for h in rt_bf16.shards.values()])
        assert modes == [("direct", True), ("direct", True)]

    @pytest.mark.parametrize("tokens", [1, 64, 301])
    def test_prefill_equals_reference(self, rt_bf16, tokens):
        _check(rt_bf16, tokens, tokens, "prefill", BF16_TOL)
        assert _paths(rt_bf16) == {"direct"}
        _refcounts_zero(rt_bf16)

    @pytest.mark.parametrize("tokens", [1, 5, 16])
    def test_decode_replays_cuda_graphs(self, rt_bf16, tokens):
        """<= C_T = 8 tokens per rank: admitted; every layer of every rank replays its captured graph."""
        for rep in range(3):  # the first step may capture, the next ones replay the same graph
            _check_graph(rt_bf16, tokens, 100 * tokens + 10 * rep, BF16_TOL)
            _refcounts_zero(rt_bf16)

    def test_oversize_decode_falls_back_unclipped(self, rt_bf16):
        """17 tokens: rank 0 gets 9 > C_T = 8 -> rank_token_capacity_exceeded on every layer; nothing clipped."""
        before = rt_bf16.stats()
        _check(rt_bf16, 17, 5, "decode", BF16_TOL)
        after = rt_bf16.stats()
        assert after["graph_replays"] == before["graph_replays"]
        key = "rank_token_capacity_exceeded"
        assert after["fallbacks"].get(key, 0) == before["fallbacks"].get(key, 0) + rt_bf16.cfg.num_layers
        assert after["accepted_routes"] - before["accepted_routes"] == 17 * 2 * rt_bf16.cfg.num_layers
        assert _paths(rt_bf16) == {"direct"}
        _refcounts_zero(rt_bf16)

    def test_replicas_are_exercised(self, rt_bf16):
        man = rt_bf16.placement()
        assert man.replica_counts(0)[:2] == [2, 2]
        hosts = sorted(s.destination_rank for s in man.replicas(0, 0))
        assert hosts == [0, 1]
        t = 64
        h = torch.randn(t, rt_bf16.cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        ids = torch.zeros(t, 2, dtype=torch.int64)
        ids[:, 1] = 5
        w = torch.full((t, 2), 0.5)
        before = dict(rt_bf16.stats()["rank_rows"])
        y = rt_bf16.forward(h, ids, w)
        cfg = rt_bf16.cfg
        ref = reference_forward(cfg, weight_source(cfg), h.double(), routes=[(ids, w)] * cfg.num_layers).out
        scale = float(ref.abs().max())
        torch.testing.assert_close(y.double(), ref, atol=BF16_TOL * scale, rtol=BF16_TOL)
        after = rt_bf16.stats()["rank_rows"]
        delta = {u: after.get(u, 0) - before.get(u, 0) for u in (0, 1)}
        # expert 0's routes were split over both replicas; expert 5 lives on rank 1 only
        assert delta[0] > 0 and delta[1] > t * rt_bf16.cfg.num_layers, delta
        assert sum(delta.values()) == 2 * t * rt_bf16.cfg.num_layers
        _refcounts_zero(rt_bf16)

    def test_captured_graphs_are_released(self, rt_bf16):
        import ray

        _check_graph(rt_bf16, 4, 1, BF16_TOL)
        g = rt_bf16.placement().generation
        freed = ReleaseClient.for_runtime(rt_bf16).release_graphs(g)
        assert freed == 2  # one captured decode step per rank
        _check(rt_bf16, 4, 2, "decode", BF16_TOL)  # recaptured on demand: eager this step
        assert _paths(rt_bf16) == {"bucket"}
        _check_graph(rt_bf16, 4, 3, BF16_TOL)

    def test_live_scale_copies_over_nccl_under_traffic(self, rt_bf16):
        import ray

        from ray_moe.moe.experts.weights import experts_from_wire

        cfg = rt_bf16.cfg
        expert = 3  # one copy, on rank 0 (slots 0..4 = experts 0..4 on rank 0; 5, 6, 7, 0, 1 on rank 1)
        man0 = rt_bf16.placement()
        assert [s.destination_rank for s in man0.replicas(expert, 0)] == [0]
        stop = threading.Event()
        errors: list[BaseException] = []
        served = {"steps": 0, "worst": 0.0}

        def stream():
            i = 0
            while not stop.is_set():
                try:
                    phase = "prefill" if i % 3 == 2 else "decode"
                    t = 40 if phase == "prefill" else 1 + i % 16
                    err = _check(rt_bf16, t, 5000 + i, phase, BF16_TOL)
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
                    return
                served["steps"] += 1
                served["worst"] = max(served["worst"], err)
                i += 1

        th = threading.Thread(target=stream, daemon=True)
        th.start()
        try:
            time.sleep(2.0)
            steps_before = served["steps"]
            rep = ray.get(rt_bf16.coordinator.scale.remote(expert, 2, None))
            time.sleep(2.0)
        finally:
            stop.set()
            th.join(timeout=120)
        assert not errors, errors
        assert served["steps"] > steps_before > 0
        # copied GPU to GPU (RayFleet in NCCL mode: send_experts / recv_experts), never reloaded
        assert rep["copies"] == cfg.num_layers and rep["loads"] == 0, rep
        assert rep["timings_s"]["materialize"] > 0
        assert rep["ledger"]["network_bytes"] == cfg.num_layers * 3 * cfg.hidden_size * cfg.ffn_size * 2
        g_new = rep["new_generation"]
        man = rt_bf16.placement()
        assert man.generation == g_new
        for layer in range(cfg.num_layers):
            assert sorted(s.destination_rank for s in man.replicas(expert, layer)) == [0, 1]
            payload = ray.get(rt_bf16.shards[1].expert_weights.remote(layer, expert))
            w = experts_from_wire(payload)[(layer, expert)]
            src = weight_source(cfg).expert(layer, expert)
            assert torch.equal(w.w_gate, src.w_gate) and torch.equal(w.w_up, src.w_up)
            assert torch.equal(w.w_down, src.w_down)
        assert rt_bf16.generations()[rep["old_generation"]] == "RETIRED"
        retired = ray.get(rt_bf16.coordinator.retired_with_refcount.remote())
        assert all(rc == 0 for _, rc in retired)
        _refcounts_zero(rt_bf16)
        # the new generation serves decode through freshly captured graphs; routes to the scaled expert
        # reach its new replica on rank 1
        _check_graph(rt_bf16, 8, 77, BF16_TOL)
        t = 32
        h = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
        ids = torch.tensor([[expert, 2]] * t)
        w = torch.full((t, 2), 0.5)
        rows0 = dict(rt_bf16.stats()["rank_rows"])
        y = rt_bf16.forward(h, ids, w)
        ref = reference_forward(cfg, weight_source(cfg), h.double(), routes=[(ids, w)] * cfg.num_layers).out
        torch.testing.assert_close(y.double(), ref, atol=BF16_TOL * float(ref.abs().max()), rtol=BF16_TOL)
        rows1 = rt_bf16.stats()["rank_rows"]
        assert rows1.get(1, 0) > rows0.get(1, 0)  # expert 2 lives on rank 0 only: rank 1 rows are expert 3's


# ==================================================================================== two GPUs, float32
@pytest.fixture(scope="class")
def rt_fp32(ray_session):
    runtime = _start(num_ranks=2, slots_per_rank=5, num_layers=1, dtype="float32", name="gpu-fp32")
    yield runtime
    runtime.shutdown()


@pytest.mark.multi_gpu
class TestTwoGpusFloat32:
    """The same data path in float32 on CUDA: tight tolerance (no TF32: torch's default for matmul)."""

    @pytest.mark.parametrize("tokens", [3, 64, 257])
    def test_prefill_equals_reference_tightly(self, rt_fp32, tokens):
        _check(rt_fp32, tokens, tokens, "prefill", F32_TOL)
        _refcounts_zero(rt_fp32)

    @pytest.mark.parametrize("tokens", [1, 7, 16])
    def test_decode_graph_equals_reference_tightly(self, rt_fp32, tokens):
        _check_graph(rt_fp32, tokens, 31 * tokens, F32_TOL)
        _refcounts_zero(rt_fp32)

    def test_reference_moe_directly(self, rt_fp32):
        """Single layer: the plain per-token reference (not the model wrapper) agrees too."""
        cfg = rt_fp32.cfg
        h, ids, w = _inputs(cfg, 50, 9)
        y = rt_fp32.forward(h, ids[0], w[0])
        src = weight_source(cfg)
        ref = reference_moe(h.double(), ids[0], w[0], lambda e: src.expert(0, e))
        torch.testing.assert_close(y.double(), ref, atol=F32_TOL * float(ref.abs().max()), rtol=F32_TOL)


# ==================================================================================== one GPU
@pytest.fixture(scope="class")
def rt_one(ray_session):
    runtime = _start(num_ranks=1, slots_per_rank=8, num_layers=2, residual=True, dtype="bfloat16",
                     name="gpu-one")
    yield runtime
    runtime.shutdown()


class TestOneGpu:
    """num_ranks=1: a one-rank NCCL communicator, all experts local; prefill and graph decode still exact."""

    def test_prefill_and_decode_equal_reference(self, rt_one):
        _check(rt_one, 200, 1, "prefill", BF16_TOL)
        _refcounts_zero(rt_one)
        for rep in range(2):
            _check_graph(rt_one, 6, 2 + 10 * rep, BF16_TOL)
            _refcounts_zero(rt_one)


# ==================================================================================== teardown
def test_shutdown_frees_actors_gpus_and_name(ray_session):
    import ray
    from ray.util import placement_group_table

    n = min(2, torch.cuda.device_count())
    rt = _start(num_ranks=n, slots_per_rank=8, num_layers=1, dtype="bfloat16", name="gpu-teardown")
    handles = list(rt.shards.values())
    pg_id = rt.members()["members"]["0"]["bundle"][0]  # the start's placement group (rank 0 in its bundle 0)
    assert ray.get([h.ping.remote() for h in handles]) == list(range(n))
    _check(rt, 4, 1, "decode", BF16_TOL)
    rt.shutdown()
    for h in handles:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(h.ping.remote(), timeout=60)
    assert placement_group_table()[pg_id]["state"] == "REMOVED"
    deadline = time.time() + 60
    while time.time() < deadline and ray.available_resources().get("GPU", 0) < ray.cluster_resources().get("GPU", 0):
        time.sleep(0.5)
    assert ray.available_resources().get("GPU", 0) == ray.cluster_resources().get("GPU", 0)
    with pytest.raises(ValueError, match="gpu-teardown"):
        ray_moe.Runtime.connect("gpu-teardown")
