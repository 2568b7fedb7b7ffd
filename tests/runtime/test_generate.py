"""Generation inside the shards, token-equal to transformers' greedy ``generate`` per prompt: in-process for
every family (prompts of different lengths, joining mid-stream), and on a local Ray deployment across a live
rebalance, a scale, a rank removal and a killed shard (no request lost or duplicated)."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch

import ray_moe
from ray_moe.model.kv import KVBudgetError
from ray_moe_dev.testing.hf_models import tiny_model
from ray_moe_dev.testing.inprocess import InProcessDeployment, generate_inprocess


def _prompts(seed: int, lens, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _reference(model, prompts, new: int) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe_dense0", "deepseek_v3", "qwen2_moe"])
def test_inprocess_generation_equals_transformers_greedy(tmp_path, family):
    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, decode_token_capacity=4)
    dep = InProcessDeployment(cfg)
    prompts = _prompts(0, (5, 13, 2, 9))
    late = _prompts(1, (6, 3))
    got = generate_inprocess(dep, prompts, 7, step_tokens=8, join_after={3: late})  # chunked prefill, joins
    assert got == _reference(model, prompts + late, 7)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_pipelined_generation_feeds_deferred_tokens_and_stays_token_equal(tmp_path, family):
    """Each step planned before the previous one is committed: decode inputs come from the ranks' own samples."""
    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, decode_token_capacity=4))
    prompts = _prompts(5, (5, 13, 2, 9))
    late = _prompts(6, (6, 3))
    got = generate_inprocess(dep, prompts, 7, step_tokens=8, join_after={3: late}, pipelined=True)
    assert got == _reference(model, prompts + late, 7)
    deferred = sum(c.generator.counters.get("deferred_tokens", 0) for c in dep.cores.values())
    assert deferred >= 6 * 5  # every decode input after the first of each request came from its rank


def test_a_deferred_token_never_sampled_is_refused_on_every_rank(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from ray_moe.shard.token_steps import DeferredTokenError

    from ray_moe.shard.records import GenerationInput, StepKind, StepRequest, WorkItem

    model, folder = tiny_model("mixtral", tmp_path / "m")
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, decode_token_capacity=4))
    for c in dep.cores.values():
        c.load_model(kv_tokens=256, block_size=8)
    bad = WorkItem("ghost", (), 5, None, True, deferred=True)
    reqs = {r: StepRequest("bad", dep.generation, StepKind.GENERATION, GenerationInput(items, (), (False, True)))
            for r, items in ((0, (bad,)), (1, ()))}

    def run(r):
        try:
            return dep.cores[r].step(reqs[r])
        except Exception as exc:  # noqa: BLE001
            return exc

    with ThreadPoolExecutor(2) as pool:
        out = list(pool.map(run, (0, 1)))
    assert isinstance(out[0], DeferredTokenError) and "'ghost'" in str(out[0]) and "position 5" in str(out[0])
    assert isinstance(out[1], Exception)  # the peer aborted with it, before any payload
    assert dep.cores[0].generator.host.kv.sequences() == []  # nothing reserved


@pytest.fixture(scope="module")
def served(ray_session, tmp_path_factory):
    model, folder = tiny_model("mixtral", tmp_path_factory.mktemp("gen") / "mixtral")
    model.eval()
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=4, slots_per_rank=4, decode_token_capacity=4,
                                                name="gen-elastic")
    rt = ray_moe.Runtime.start(cfg)
    # 12 blocks per rank: requests queue for blocks; multi-step decode (the CUDA default) on every elastic test
    rt.serving(kv_tokens=96, block_size=8, step_tokens=32, decode_steps=4)
    yield model, rt
    rt.shutdown()


def test_generate_and_stream_equal_transformers(served):
    model, rt = served
    prompts = _prompts(2, (4, 11, 7))
    assert rt.generate(prompts, max_new_tokens=6) == _reference(model, prompts, 6)
    events = list(rt.generate_stream(prompts, max_new_tokens=4))
    by_prompt = {i: [t for j, t in events if j == i] for i in range(3)}
    assert [by_prompt[i] for i in range(3)] == _reference(model, prompts, 4)
    # sampling: seeded and reproducible, different seeds differ somewhere
    a = rt.generate(prompts, max_new_tokens=6, temperature=1.0, top_p=0.95, seed=11)
    assert a == rt.generate(prompts, max_new_tokens=6, temperature=1.0, top_p=0.95, seed=11)
    assert a != rt.generate(prompts, max_new_tokens=6, temperature=1.0, top_p=0.95, seed=12)
    # the same seeded tokens whether decode runs one token per call or several sub-steps per call
    sched = rt.serving().scheduler
    try:
        sched.decode_steps = 1
        assert rt.generate(prompts, max_new_tokens=6, temperature=1.0, top_p=0.95, seed=11) == a
    finally:
        sched.decode_steps = 4
    # one request too large for a rank's KV budget is refused by name; nothing else is affected
    with pytest.raises(KVBudgetError, match="need 15 KV blocks of 8; a rank's budget is 12 blocks"):
        rt.generate([[1] * 110], max_new_tokens=4)
    with pytest.raises(ValueError, match="context of 128 positions"):
        rt.generate([[1] * 120], max_new_tokens=10)
    assert rt.generate(prompts[:1], max_new_tokens=3) == _reference(model, prompts[:1], 3)
    # prefix caching through the Ray path: a prompt extending one served before is routed to its rank and
    # finds its two full blocks (16 tokens) there; the driver's books count them over the 18 prefilled tokens
    shared = _prompts(9, (17,))[0]
    rt.generate([shared], max_new_tokens=2)
    before = rt.stats()["ratios"]["prefix_cache_hit"]
    assert rt.generate([shared + [5]], max_new_tokens=3) == _reference(model, [shared + [5]], 3)
    after = rt.stats()["ratios"]["prefix_cache_hit"]
    assert (after["numerator"] - before["numerator"], after["denominator"] - before["denominator"]) == (16, 18)
    pools = [st["kv_blocks"] for st in rt.shard_status().values()]  # every block free, held or cached
    assert all(p["free"] + p["held"] + p["cached"] == 12 and p["cached"] >= 0 for p in pools), pools
    # the shared prompt's two full blocks stay findable (held until the driver's next step frees its sequences, then
    # cached)
    assert sum(p["hashed"] for p in pools) >= 2, pools
    s = rt.stats()
    assert s["phase_steps"].get("decode", 0) > 0 and s["bucket_layers"] > 0
    # the experts each step touched, from the same per-layer counts as the accepted routes
    use = s["expert_use"]
    assert use["routes"] == s["accepted_routes"] > 0 and use["experts"] == model.config.num_local_experts
    assert 1 <= use["touched_per_layer_step"] <= use["experts"] and use["peak_over_mean"] >= 1
    # the driver pipelined its steps: launched before the previous one was collected, decode inputs deferred
    assert rt.serving().overlapped > 0
    assert sum(st["counters"].get("deferred_tokens", 0) for st in rt.shard_status().values()) > 0
    assert all(st["counters"].get("multi_step_requests", 0) > 0 for st in rt.shard_status().values())
    # each shard process counts its collector's pauses (its heap is frozen on CUDA only)
    assert all(st["counters"]["gc_collections"] > 0 and st["counters"]["gc_freezes"] == 0
               for st in rt.shard_status().values())
    # on CPU the model keeps transformers' own norms and rotary (the fused kernels are CUDA-only)
    assert all(st["fused_kernels"] == {"norm_layers": 0, "rotary_modules": [], "router_layers": 0, "qkv_modules": 0,
                                       "skipped": {}, "fp8_dense_modules": [], "fp8_dense_dequantized": {},
                                       "fp8_qkv_modules": 0, "fp8_launch_table": None,
                                       "mla": {"absorbed_modules": 0, "decode_kernel": None, "decode_reason": None,
                                               "dequantized_bytes": 0}}
               for st in rt.shard_status().values())


def _generate_during(rt, prompts, new, op, wait_steps: int = 3):
    """Run ``rt.generate`` in a thread; once it made ``wait_steps`` steps, run ``op()``; return outputs."""
    out: dict = {}
    engine = rt.serving()
    start = engine.steps
    th = threading.Thread(target=lambda: out.setdefault("tokens", rt.generate(prompts, max_new_tokens=new,
                                                                                timeout_s=300)))
    th.start()
    deadline = time.time() + 120
    while engine.steps < start + wait_steps and time.time() < deadline and th.is_alive():
        time.sleep(0.01)
    assert th.is_alive(), "generation finished before the operation: make it longer"
    op()
    th.join(timeout=300)
    assert not th.is_alive()
    return out["tokens"]


def test_generation_survives_rebalance_scale_removal_and_a_killed_shard(served):
    model, rt = served
    prompts = _prompts(3, (5, 9, 3, 12, 6, 8))
    new = 14
    want = _reference(model, prompts, new)
    g0 = rt.placement().generation
    assert _generate_during(rt, prompts, new, rt.rebalance) == want
    assert _generate_during(rt, prompts, new, lambda: rt.scale(expert=3, replicas=2)) == want
    assert max(rt.placement().replica_counts(0)) >= 2 and rt.placement().generation > g0
    assert _generate_during(rt, prompts, new, lambda: rt.remove_rank(3)) == want
    assert list(rt.group.peer_order) == [0, 1, 2]
    victim = rt.shards[2]
    assert _generate_during(rt, prompts, new, lambda: ray.kill(victim)) == want
    assert list(rt.group.peer_order) == [0, 1] and 2 in rt.lost_ranks
    assert rt.serving().scheduler.moved > 0  # sequences of the removed / killed ranks were re-prefilled on survivors
    assert all(rc == 0 for rc in rt.refcounts().values())


def _counts(dep) -> list[dict[str, int]]:
    return [{**c.generator.counters, **c.pipeline.counters, **c.generator.graph_runner.counters}
            for c in dep.cores.values()]


def test_decode_graphs_of_an_expert_parallel_group_equal_greedy(tmp_path, eager_capture, paged_references):
    """Two ranks (the varlen backend, decode rows read in place: references as the kernels): the decode sizes
    captured at start (every rank at once: the warm-ups exchange), decode steps
    replay them (padded rows, masked padding routes, inputs copied into the captured buffers; on CPU the 'graph'
    replays its body eagerly), prefill and mixed steps run eagerly (their counts are agreed on the host), and
    the tokens equal transformers' greedy ones; nothing is captured once serving."""
    model, folder = tiny_model("qwen3_moe", tmp_path / "q3")
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2))
    prompts = _prompts(4, (5, 13, 2, 9, 7))
    assert generate_inprocess(dep, prompts, 9) == _reference(model, prompts, 9)
    for c in _counts(dep):
        assert c.get("graphs_captured_start", 0) == 13 and not c.get("graphs_captured_serving"), c  # 1..128
        assert c.get("decode_graph_steps", 0) >= 4 and c.get("eager_steps", 0) >= 1, c
    paths = dep.cores[0].generator.graph_runner.paths()
    assert paths["decode"].startswith("decode graph") and paths["prefill_mixed"].startswith("eager (an expert-parallel")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_one_rank_steps_replay_the_lattice_captured_at_start_equal_greedy(tmp_path, eager_capture, family):
    """A group of one: every size is captured at start; every step of prompts of many lengths (lone prompts,
    chunked prefill, requests joining mid-stream, mixed steps) replays one of them, padded to its size, its
    attention from the step's own plan (the piecewise graph's holes); tokens equal transformers' greedy ones and
    no graph is captured after start. DeepSeek's MLA attends on its latent (absorbed) in the holes like any other."""
    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1))
    core = dep.cores[0]
    for p in _prompts(8, (9, 20)):  # lone prompts: padded to 16 / 32 rows
        assert generate_inprocess(dep, [p], 5, step_tokens=64) == _reference(model, [p], 5)
    prompts, late = _prompts(9, (5, 13, 2)), _prompts(10, (6, 3))
    got = generate_inprocess(dep, prompts, 6, step_tokens=8, join_after={2: late}, pipelined=True)
    assert got == _reference(model, prompts + late, 6)
    c = _counts(dep)[0]
    assert not c.get("graphs_captured_serving"), c
    if family == "deepseek_v3":  # every MLA layer attends its latent (model/mla.py): its holes gather what they need
        assert c.get("absorbed_mla_modules") == model.config.num_hidden_layers, c
        assert core.generator.fused_kernels()["mla"]["absorbed_modules"] == model.config.num_hidden_layers
    assert c.get("graphs_captured_start", 0) > 0 and c.get("piecewise_steps", 0) >= 8, c
    assert c.get("eager_steps", 0) == 0, c
    # pipelined: steps done while the next one launched were read between its pieces (how many: the threads decide)
    assert c.get("completions_between_pieces", 0) >= 1, c
    kinds = {k[0] for _, k in core.generator.graphs._graphs if isinstance(k, tuple)}
    assert kinds == {"tokens"}  # (the masked backend on CPU: decode steps take the token sizes)


def test_a_start_capture_out_of_memory_refits_the_cache_and_captures_again(tmp_path, eager_capture, monkeypatch):
    """A cache sized from memory whose start capture runs out of device memory (here: the largest piecewise
    size, once, as the DeepSeek slice's did on an H100) is made smaller with twice the graphs' memory kept beside
    it, the lattice captured again, and the driver plans the smaller cache and says so; every step then replays
    a graph, tokens equal to greedy. (CPU: the cache's sizing and the error stand in for the GPU's.)"""
    from ray_moe.driver.loop import GenerationLoop
    from ray_moe.model.host import ModelHost
    from ray_moe.model.kv import PagedKVCache
    from ray_moe.model.sampling import SamplingParams
    from ray_moe.shard import token_steps
    from ray_moe.shard.graph_runner import StepGraphRunner
    from ray_moe_dev.testing.inprocess import LocalTransport

    load, capture_tokens = token_steps.TokenStepExecutor.load.__func__, StepGraphRunner._capture_tokens
    sized: list[int] = []

    def load_sized(cls, *a, **k):  # a cache "sized from memory" with a 1 MiB workspace
        ex = load(cls, *a, **k)
        ex.kv_sizing = (0.9, 1 << 20)
        return ex

    def size_kv(self, fraction, workspace):  # the GPU's sizing, on CPU: half the blocks
        sized.append(workspace)
        self.kv = PagedKVCache(self.kv.num_blocks // 2, self.kv.block_size, device=self.device, dtype=self.dtype)
        return self.kv.capacity_tokens

    failed: list[int] = []

    def capture_once(self, generation, rows, *a):
        if not failed:
            failed.append(rows)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 384.00 MiB")
        return capture_tokens(self, generation, rows, *a)

    monkeypatch.setattr(token_steps.TokenStepExecutor, "load", classmethod(load_sized))
    monkeypatch.setattr(ModelHost, "size_kv", size_kv)
    monkeypatch.setattr(StepGraphRunner, "_capture_tokens", capture_once)
    model, folder = tiny_model("qwen3_moe", tmp_path / "m")
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1))
    transport = LocalTransport(dep)
    loop = GenerationLoop(transport, device="cpu", kv_tokens=1024, block_size=8, step_tokens=64)
    try:
        rep = loop.steps_report[0]["capture"]
        assert failed == [max(loop.steps_report[0]["lattice"]["token_sizes"])]  # the largest size first
        assert rep["kv_refit"]["from_tokens"] == 1024 and rep["kv_refit"]["to_tokens"] == 512
        assert list(rep["kv_refit"]["errors"]) == ["tokens"] and not rep["errors"]
        assert sized == [(1 << 20) + token_steps.REFIT_MIN_BYTES] and rep["piecewise_graphs"] > 0
        assert loop.scheduler.kv_blocks == 512 // 8 and loop.rank_kv_tokens == 512
        assert loop.capacity.kv_tokens == 512 and loop.capacity.rank_running == loop.rank_running  # the refit's
        assert any("1024 -> 512 tokens" in w for w in loop.warnings), loop.warnings
        prompts = _prompts(11, (9, 20, 4))
        handles = [loop.submit(p, SamplingParams(max_new_tokens=5)) for p in prompts]
        assert [h.result(120) for h in handles] == _reference(model, prompts, 5)
    finally:
        loop.close()
        transport.close()
    c = _counts(dep)[0]
    assert c.get("kv_refits") == 1 and c.get("eager_steps", 0) == 0 and not c.get("graphs_captured_serving"), c


@pytest.mark.parametrize("family,whole_rows", [("qwen3_moe", None), ("qwen3_moe", 0), ("qwen3_moe", 16),
                                               ("deepseek_v3", None)])
def test_the_h200_paths_on_cpu_stay_token_equal(tmp_path, eager_capture, paged_references, monkeypatch, family,
                                                whole_rows):
    """The H200's paths with references as the kernels (varlen attention, decode rows read in place): decode
    steps replay whole-step decode graphs over the shared slot vector (a prefix of it copied per step); mixed
    steps replay the whole-step token graphs (every row read in place through the step's work tables) up to
    the lattice's ``whole_rows``, the piecewise graphs above (their holes run the decode rows in place and the
    chunks over their gathered contexts); every token equals transformers' greedy one."""
    import ray_moe.shard.lattice as lattice

    if whole_rows is not None:
        monkeypatch.setattr(lattice, "WHOLE_ROWS", whole_rows)
    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1))
    core = dep.cores[0]
    prompts, late = _prompts(11, (5, 13, 2)), _prompts(12, (9, 4, 7))
    got = generate_inprocess(dep, prompts, 6, step_tokens=8 if whole_rows != 16 else 24,
                             join_after={2: late, 4: prompts[:1]})
    assert core.generator.host.varlen
    assert got == _reference(model, prompts + late + prompts[:1], 6)
    c = _counts(dep)[0]
    if family == "deepseek_v3":
        assert not core.generator.host.paged_decode and c.get("decode_graph_steps", 0) == 0
        return
    whole, piecewise = c.get("token_graph_steps", 0), c.get("piecewise_steps", 0)
    assert c.get("decode_graph_steps", 0) >= 3, c
    if whole_rows is None:  # every token size whole-step (the tiny lattice's sizes are all below WHOLE_ROWS)
        assert whole >= 3 and piecewise == 0, c
    elif whole_rows == 0:
        assert whole == 0 and piecewise >= 3, c
    else:  # the 16-row size whole-step, the larger ones piecewise
        assert whole >= 1 and piecewise >= 1, c
    assert not c.get("graphs_captured_serving") and not c.get("eager_steps"), c
    graphs = core.generator.graph_runner.status()
    assert graphs["captures"][0]["token_graphs"] == (len(graphs["lattice"]["token_sizes"]) if whole_rows is None
                                                     else 1 if whole_rows == 16 else 0)


def test_padding_never_changes_a_token_against_eager_steps(tmp_path, eager_capture, paged_references):
    """The same requests through the captured sizes (padded rows) and with graphs off (every step eager and
    exact): the same tokens, whatever sizes the steps padded to."""
    import dataclasses

    model, folder = tiny_model("qwen3_moe", tmp_path / "q3")
    model.eval()
    prompts = _prompts(21, (3, 17, 8, 30, 1, 12))
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1))
    padded = generate_inprocess(dep, prompts, 8, step_tokens=16, decode_steps=3)
    # (a named decode capacity: the paths are not re-picked at load, so the fixture's capture flag stays withdrawn)
    eager = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, decode_token_capacity=256))
    for core in eager.cores.values():
        core.paths = dataclasses.replace(core.paths, capture=False)
    exact = generate_inprocess(eager, prompts, 8, step_tokens=16, decode_steps=3)
    assert padded == exact == _reference(model, prompts, 8)
    assert _counts(dep)[0].get("eager_steps", 0) == 0 and _counts(eager)[0].get("eager_steps", 0) > 0


@pytest.mark.parametrize("family,ranks,pipelined,capture", [("mixtral", 2, False, False), ("qwen3_moe", 2, True, True),
                                                             ("qwen3_moe", 1, True, True), ("qwen2_moe", 1, False, False)])
def test_multi_step_decode_stays_token_equal(tmp_path, eager_capture, request, family, ranks, pipelined, capture):
    """Multi-step decode: one request per rank runs several decode sub-steps, each fed the tokens the rank
    sampled in the one before (on the device while they run, or from the host); requests joining mid-stream
    get single steps meanwhile; every rank runs the same sub-steps; outputs stay token-equal. Captured: the
    decode graphs of sizes up to the named capacity (8), the varlen path's references as the kernels."""
    import dataclasses

    if capture:
        request.getfixturevalue("paged_references")
    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=ranks, decode_token_capacity=8))
    for core in dep.cores.values():
        core.paths = dataclasses.replace(core.paths, capture=capture)
    prompts, late = _prompts(13, (5, 13, 2, 9)), _prompts(14, (6, 3))
    got = generate_inprocess(dep, prompts, 11, step_tokens=8, join_after={3: late}, pipelined=pipelined,
                             decode_steps=4)
    assert got == _reference(model, prompts + late, 11)
    counters = [{**c.generator.counters, **c.pipeline.counters} for c in dep.cores.values()]
    assert all(c.get("multi_step_requests", 0) >= 1 for c in counters), counters
    if capture:
        assert all(c.get("graph_replays", 0) >= 8 for c in counters), counters


@pytest.mark.parametrize("family,pipelined", [("qwen3_moe", True), ("qwen2_moe", False)])
def test_multi_step_sub_steps_on_arrays_stay_token_equal(tmp_path, eager_capture, paged_references, family, pipelined):
    """The H200's path (static shapes, varlen attention, decode reading the cache in place; references as the
    kernels): a group of one plans every sub-step of a multi-step request at its first one and launches the
    later ones on arrays, each fed the one before's samples on the device; requests joining mid-stream get
    single steps meanwhile; outputs stay token-equal and every fed token is counted."""
    import dataclasses

    from ray_moe.shard.core import ShardCore

    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, decode_token_capacity=8))
    core = dep.cores[0]
    core.paths = dataclasses.replace(core.paths, capture=True)
    results = []
    complete = ShardCore._complete_held  # (every completion's: on return, queued, or between a launch's pieces)

    def recorded(self, pending, stack):
        results.append(complete(self, pending, stack))
        return results[-1]

    prompts, late = _prompts(15, (5, 13, 2, 9)), _prompts(16, (6, 3))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ShardCore, "_complete_held", recorded)
        got = generate_inprocess(dep, prompts, 11, step_tokens=8, join_after={3: late}, pipelined=pipelined,
                                 decode_steps=4)
    assert got == _reference(model, prompts + late, 11)
    # the layer statistics count every row of every sub-step once (multi-step results sum their sub-steps'
    # device summaries): each fed token (the prompts, and each request's generated tokens but its last) was
    # routed to top-k experts in every MoE layer
    rows = sum(map(len, prompts + late)) + 10 * len(prompts + late)
    top_k = model.config.num_experts_per_tok
    per_layer: dict[int, int] = {}
    for res in results:
        for ls in res.layers:
            per_layer[ls.layer] = per_layer.get(ls.layer, 0) + ls.accepted
            assert ls.expert_counts.sum() == ls.accepted
    # ... and a sequence one token from its end may run the step's last sub-steps anyway (Scheduler._overshoot_fits:
    # its rows routed and counted, its samples dropped): at most 3 of 4 sub-steps a request
    (routed,) = set(per_layer.values())
    assert rows * top_k <= routed <= (rows + 3 * len(prompts + late)) * top_k and routed % top_k == 0, (per_layer,
                                                                                                        rows * top_k)
    c = {**core.generator.counters, **core.pipeline.counters}
    assert core.generator.host.paged_decode and c.get("multi_step_requests", 0) >= 2, c
    assert c.get("array_substeps", 0) == c["multi_step_substeps"] >= c["multi_step_requests"], c  # each after the first
    assert c["deferred_on_device"] >= c["array_substeps"], c  # each fed its sequences' tokens on the device


@pytest.mark.parametrize("family,decode_steps", [("qwen3_moe", 1), ("qwen2_moe", 1), ("qwen3_moe", 4)])
def test_a_step_launched_before_the_previous_completes_takes_its_tokens_on_the_device(tmp_path, eager_capture, family,
                                                                                      decode_steps):
    """A group of one launches step n+1 while step n is still running (launch n+1, then complete n): n+1's
    deferred tokens are copied from n's sampled-token tensor on the device; outputs stay token-equal. With
    multi-step decode each sub-step also feeds the next from the device."""
    import dataclasses

    from ray_moe.shard.records import GenerationInput, StepKind, StepRequest
    from ray_moe.model.sampling import SamplingParams
    from ray_moe.driver.scheduler import Scheduler

    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, decode_token_capacity=8))
    core = dep.cores[0]
    info = core.load_model(kv_tokens=1024, block_size=8, rank_running=8, step_tokens=64)
    core.prepare_steps()  # the lattice captured (the CPU emulation)
    sched = Scheduler([0], kv_blocks=info["kv_blocks"], block_size=8, max_context=info["max_context"], step_tokens=64,
                      decode_steps=decode_steps)
    prompts = _prompts(12, (5, 13, 2, 9))
    rids = [sched.submit(p, SamplingParams(max_new_tokens=7)) for p in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}

    def launch(plan, n):
        req = StepRequest(f"o{n}", dep.generation, StepKind.GENERATION, GenerationInput(
            plan.items[0], plan.free[0], (plan.has_prefill or not plan.has_decode, plan.has_decode), plan.steps))
        with core._pinned(req.generation, req.step_id) as (status, view, paths):
            return core.generator.launch(req, view, paths, status, core._decode_key(view) if paths.bucket else 0)

    flying, n = None, 0
    while True:
        plan = sched.plan(ahead=None if flying is None else flying[0])
        nxt = None if plan.empty else (plan, launch(plan, n))  # launched before the previous one completes
        n += 1
        if flying is not None:
            res = flying[1].complete()
            for ev in sched.commit(flying[0], res.output.tokens):
                got[ev.request_id].append(ev.token)
        flying = nxt
        if flying is None and not sched.pending():
            break
    assert [got[r] for r in rids] == _reference(model, prompts, 7)
    assert core.generator.counters.get("deferred_on_device", 0) >= 4 * 5, core.generator.counters


def test_a_generation_published_later_is_captured_at_its_first_step_and_counted(tmp_path, eager_capture):
    """The lattice is captured at start for the active generation; a rebalance publishes another one: a step
    pinned to the retired generation is refused (nothing captured for it), the new generation's lattice is
    captured at its first step (counted apart: ``graphs_captured_serving``, what a user watches for) and the
    retired one's graphs are gone."""
    import numpy as np

    from ray_moe.core.errors import StaleGenerationError
    from ray_moe.shard.records import GenerationInput, StepKind, StepRequest, WorkItem
    from ray_moe.model.sampling import SampleSpec

    model, folder = tiny_model("qwen3_moe", tmp_path / "q3")
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1))
    core = dep.cores[0]
    core.load_model(kv_tokens=256, block_size=8, rank_running=4, step_tokens=16)
    start = core.prepare_steps()
    sizes = len(start["lattice"]["token_sizes"])
    assert start["capture"]["piecewise_graphs"] == sizes and start["paths"]["prefill_mixed"].startswith("piecewise")
    g0 = dep.generation
    counts = np.ones((dep.cfg.num_layers, dep.cfg.num_experts), dtype=np.int64)
    dep.plane.record_load(counts, phase="prefill", generation=g0)
    g1 = dep.plane.apply(dep.plane.propose_rebalance(), reason="rebalance").new_generation
    assert g1 != g0
    item = WorkItem("s", (3, 4, 5), 0, SampleSpec(0.0, 1.0, 1, 3), False)
    work = GenerationInput((item,), (), (True, False))
    with pytest.raises(StaleGenerationError):
        core.step(StepRequest("stale", g0, StepKind.GENERATION, work))
    assert all(g != g0 for g, _ in core.generator.graphs._graphs)  # (released with the retired generation)
    res = core.step(StepRequest("fresh", g1, StepKind.GENERATION, work))
    assert set(res.output.tokens) == {"s"}
    c = core.generator.graph_runner.counters
    assert c["graphs_captured_start"] == c["graphs_captured_serving"] == sizes, c
    assert core.status()["steps"]["captures"][g1]["at_start"] is False


def test_shards_serve_a_pipelined_driver_from_concurrent_calls(tmp_path):
    """As the Ray driver does: step n+1 (deferred tokens, ``after`` = n) is sent to every rank while step n is
    still running there, each call on its own thread; the shards launch in order and stay token-equal."""
    from concurrent.futures import ThreadPoolExecutor

    from ray_moe.shard.records import GenerationInput, StepKind, StepRequest
    from ray_moe.model.sampling import SamplingParams
    from ray_moe.driver.scheduler import Scheduler

    model, folder = tiny_model("mixtral", tmp_path / "m")
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, decode_token_capacity=4))
    infos = [c.load_model(kv_tokens=512, block_size=8) for c in dep.cores.values()]
    sched = Scheduler([0, 1], kv_blocks=infos[0]["kv_blocks"], block_size=8, max_context=infos[0]["max_context"],
                      step_tokens=8)
    prompts = _prompts(13, (5, 13, 2, 9, 4))
    rids = [sched.submit(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}
    pool = ThreadPoolExecutor(8)

    def send(plan, n, after):
        units = (plan.has_prefill or not plan.has_decode, plan.has_decode)
        reqs = {r: StepRequest(f"c{n}", dep.generation, StepKind.GENERATION,
                               GenerationInput(plan.items[r], plan.free[r], units), after) for r in (0, 1)}
        return f"c{n}", {r: pool.submit(dep.cores[r].step, reqs[r]) for r in (0, 1)}

    flying, n = None, 0
    while True:
        plan = sched.plan(ahead=None if flying is None else flying[0])
        nxt = None if plan.empty else (plan, *send(plan, n, None if flying is None else flying[1]))
        n += 1
        if flying is not None:
            results = {r: f.result(timeout=60) for r, f in flying[2].items()}
            for ev in sched.commit(flying[0], {k: v for x in results.values() for k, v in x.output.tokens.items()}):
                got[ev.request_id].append(ev.token)
        flying = nxt
        if flying is None and not sched.pending():
            break
    pool.shutdown()
    assert [got[r] for r in rids] == _reference(model, prompts, 6)
    assert sum(c.generator.counters.get("deferred_tokens", 0) for c in dep.cores.values()) >= 5 * 4


def test_single_prompts_take_the_plain_causal_prefill(tmp_path):
    """One sequence from position 0 leaves the mask to transformers (SDPA's causal kernel); same tokens."""
    model, folder = tiny_model("mixtral", tmp_path / "m")
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, decode_token_capacity=4))
    for p in _prompts(7, (9, 1, 17)):
        assert generate_inprocess(dep, [p], 6) == _reference(model, [p], 6)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_other_families_stay_token_equal_across_rebalance_and_scale(ray_session, tmp_path, family):
    """Softmax top-k with renormalisation (Qwen3-MoE) and sigmoid + correction bias + grouped top-k + shared
    experts + a dense first layer (DeepSeek-V3): live placement changes while generating change no token."""
    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, decode_token_capacity=4, name=f"gen-{family}")
    rt = ray_moe.Runtime.start(cfg)
    try:
        rt.serving(kv_tokens=256, block_size=8, step_tokens=16)
        prompts = _prompts(5, (7, 4, 10, 6))
        new = 12
        want = _reference(model, prompts, new)
        g0 = rt.placement().generation
        assert _generate_during(rt, prompts, new, rt.rebalance, wait_steps=2) == want
        assert _generate_during(rt, prompts, new, lambda: rt.scale(expert=1, replicas=2), wait_steps=2) == want
        assert rt.placement().generation > g0 and rt.placement().replica_counts(0)[1] == 2
        assert all(rc == 0 for rc in rt.refcounts().values())
    finally:
        rt.shutdown()


def test_a_multi_step_request_agrees_its_decode_path_once(tmp_path, monkeypatch):
    """Every rank agrees the generation, the path and the token bucket once per request: the sub-steps after
    the first take no control round of their own (one round per call, however many sub-steps)."""
    import ray_moe.shard.token_steps as engine
    import ray_moe.shard.pipeline as pipeline

    model, folder = tiny_model("mixtral", tmp_path / "m")
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=2, decode_token_capacity=8))
    rounds, calls = [], []
    real_round, real_launch = pipeline.decode_round, engine.TokenStepExecutor.launch
    monkeypatch.setattr(pipeline, "decode_round", lambda *a, **k: rounds.append(1) or real_round(*a, **k))

    def launch(self, req, *a, **k):
        calls.append((req.input.units[1], req.input.steps))
        return real_launch(self, req, *a, **k)

    monkeypatch.setattr(engine.TokenStepExecutor, "launch", launch)
    prompts = _prompts(15, (5, 9, 3, 7))
    assert generate_inprocess(dep, prompts, 10, decode_steps=4) == _reference(model, prompts, 10)
    decode_calls = [steps for want_decode, steps in calls if want_decode]
    assert max(decode_calls) == 4 and len(rounds) == len(decode_calls)  # one round per call, on each rank
    assert sum(decode_calls) > len(rounds)


def test_a_thousand_sequence_running_limit_decodes_hundreds_at_once_equal_greedy(tmp_path, eager_capture,
                                                                                  paged_references):
    """The CUDA default running limit (1,024, ``driver/defaults.py``) on one rank, on CPU with the H200's attention
    path standing in: the lattice holds 29 decode sizes up to 1,024; 300 requests submitted at once decode in steps
    of more than 256 rows (decode sizes the 256 default never had), every step replays a size captured at start,
    and every request's tokens equal transformers' greedy ones."""
    from ray_moe.driver.loop import GenerationLoop
    from ray_moe.model.sampling import SamplingParams
    from ray_moe_dev.testing.inprocess import LocalTransport

    model, folder = tiny_model("qwen3_moe", tmp_path / "m")
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1))
    transport = LocalTransport(dep)
    loop = GenerationLoop(transport, device="cpu", kv_tokens=8192, block_size=8, step_tokens=2048, max_running=1024)
    try:
        lattice = loop.steps_report[0]["lattice"]
        assert lattice["rank_running"] == 1024 and len(lattice["decode_sizes"]) == 29
        assert lattice["decode_sizes"][-1] == 1024 and loop.capacity.tokens_per_sequence == 8
        prompts = _prompts(21, [2 + i % 7 for i in range(300)])
        handles = [loop.submit(p, SamplingParams(max_new_tokens=6)) for p in prompts]
        got = [h.result(600) for h in handles]
        widest = max(rows for _, rows, _ in loop.step_shapes)
    finally:
        loop.close()
        transport.close()
    assert widest == 300, widest  # every request decoding in one step: beyond the old 256 limit
    assert got == _reference(model, prompts, 6)
    c = _counts(dep)[0]
    assert c.get("decode_graph_steps", 0) >= 1 and not c.get("graphs_captured_serving"), c
    assert c.get("eager_steps", 0) == 0, c
