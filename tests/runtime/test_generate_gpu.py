"""Generation in the shard on one GPU: the step lattice captured at start (whole-step decode graphs, piecewise
graphs of every token size), every step of a workload of many shapes replaying one of them, none captured while
serving; float32 tokens equal to transformers' greedy generate (float32 on the CPU), bf16 ones to the masked
backend's up to bf16 drift."""

from __future__ import annotations

import pytest
import torch

import ray_moe
from ray_moe_dev.testing.hf_models import tiny_model

pytestmark = pytest.mark.gpu


def _prompts(seed: int, lens) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_cuda_generation_replays_the_lattice_captured_at_start(ray_session, tmp_path, family):
    """float32 (the masked backend: decode steps take the piecewise token sizes): token-equal to transformers;
    DeepSeek's MLA attends on its latent (``model/mla.py``) in the holes like any other attention."""
    model, folder = tiny_model(family, tmp_path / family)
    model.eval()
    cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, device="cuda", dtype="float32",
                                                name=f"gpu-gen-{family}")
    rt = ray_moe.Runtime.start(cfg)
    try:
        prompts = _prompts(0, (5, 11, 3, 8, 6, 40, 1))
        got = rt.generate(prompts, max_new_tokens=12)
        want = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
        assert got == want
        status = rt.shard_status()[0]
        steps, counters = status["steps"], status["counters"]
        capture = steps["captures"][min(steps["captures"])]
        assert capture["piecewise_graphs"] == len(steps["lattice"]["token_sizes"]) and not capture["errors"], capture
        assert counters.get("piecewise_steps", 0) >= 8 and not counters.get("eager_steps"), counters
        assert not counters.get("graphs_captured_serving"), counters
        fused = status["fused_kernels"]
        assert fused["norm_layers"] >= 2 * model.config.num_hidden_layers and fused["rotary_modules"], fused
        if family == "qwen3_moe":
            assert fused["router_layers"] == model.config.num_hidden_layers and fused["skipped"] == {}, fused
        else:
            assert fused["router_layers"] == 0 and set(fused["skipped"]) == {"DeepseekV3TopkRouter"}, fused
        assert fused["qkv_modules"] == 0, fused
        # other prompts, other shapes: the same graphs, nothing captured
        more = _prompts(1, (17, 2, 33, 9))
        want2 = [model.generate(torch.tensor([p]), max_new_tokens=7, do_sample=False)[0, len(p):].tolist()
                 for p in more]
        assert rt.generate(more, max_new_tokens=7) == want2
        again = rt.shard_status()[0]["counters"]
        assert not again.get("graphs_captured_serving"), again
        assert again.get("multi_step_requests", 0) >= 2 and again.get("device_busy_us", 0) > 0, again
        assert again["gc_freezes"] == 1 and again["gc_frozen_objects"] > 10_000 and again["gc_collections"] > 0
        assert rt.serving().gc_counters()["gc_freezes"] == 1
        timings = rt.serving().timing_summary()
        assert timings["device"] > 0 and timings["device"] <= timings["shard"] + 1e-6, timings
    finally:
        rt.shutdown()


def _prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of new tokens before the first divergence of each pair (greedy bf16 runs drift apart after one)."""
    same = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return same / max(1, sum(len(x) for x in a))


def test_bf16_graphs_on_the_varlen_backend_match_its_eager_steps(ray_session, tmp_path):
    """bf16 takes FlashAttention varlen and the in-place kernels: decode steps replay whole-step decode graphs,
    mixed steps (later prompts prefilled in chunks while earlier ones decode: short steps) whole-step token
    graphs whose attention reads every row in place (the paged varlen kernel). The same kernels run eagerly (``cuda_graphs=False``) give
    the same greedy tokens up to bf16 drift (the graphs' static context bound splits the decode kernel's key
    blocks differently); the masked backend on the same weights too, a little further (other kernels: 0.72 of
    the tokens agreed before a first divergence in the lease at a0f85fa); nothing captured after start."""
    _, folder = tiny_model("qwen3_moe", tmp_path / "m")
    prompts = _prompts(2, (9, 70, 33, 5, 110, 48, 17, 90))
    outs, infos = {}, {}
    for name, backend, graphs in (("graphs", "auto", True), ("eager", "auto", False), ("masked", "masked", True)):
        cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, device="cuda", dtype="bfloat16",
                                                    cuda_graphs=graphs, name=f"gpu-attn-{name}")
        rt = ray_moe.Runtime.start(cfg)
        try:
            eng = rt.serving(attention=backend, step_tokens=64)
            outs[name] = rt.generate(prompts, max_new_tokens=16)
            if name == "graphs":  # again (prefix hits now): the same graphs, tokens up to drift
                assert _prefix_agreement(rt.generate(prompts, max_new_tokens=16), outs[name]) >= 0.75
            st = rt.shard_status()[0]
            infos[name] = (eng.attention_backend, st["counters"], eng.kv_tokens, st["steps"], eng.warnings)
        finally:
            rt.shutdown()
    g, e, m = infos["graphs"], infos["eager"], infos["masked"]
    assert g[0] == e[0] == "varlen" and m[0] == "masked", (g[0], e[0], m[0])
    assert g[1].get("decode_graph_steps", 0) >= 5 and g[1].get("token_graph_steps", 0) >= 3, g[1]
    assert g[3]["captures"][min(g[3]["captures"])]["token_graphs"] == len(g[3]["lattice"]["token_sizes"]), g[3]
    assert m[1].get("decode_graph_steps", 0) == 0 and m[1].get("piecewise_steps", 0) >= 5, m[1]
    assert e[1].get("eager_steps", 0) >= 5 and not e[1].get("graph_replays"), e[1]
    assert e[4] and all("eager" in w for w in e[4]), e[4]  # graphs off: said at start
    for c in (g[1], m[1]):
        assert not c.get("graphs_captured_serving") and not c.get("eager_steps"), c
    assert g[2] > 100_000, g[2]  # kv_tokens=None: the cache sized from the GPU's memory
    assert g[3]["paths"]["decode"].startswith("decode graph"), g[3]
    agree = _prefix_agreement(outs["graphs"], outs["eager"])
    print("graphs vs eager greedy prefix agreement:", agree, "; varlen vs masked:",
          _prefix_agreement(outs["graphs"], outs["masked"]))
    assert agree >= 0.75, (agree, outs)
    assert _prefix_agreement(outs["graphs"], outs["masked"]) >= 0.6


def test_bf16_deepseek_decode_graphs_read_the_latent_in_place(ray_session, tmp_path):
    """bf16 DeepSeek-V3 on the varlen backend: its MLA modules attend on the latent (``model/mla.py``), decode
    steps read the latent cache in place through the Triton kernel and replay whole-step decode graphs captured
    at start; prefill and mixed steps replay piecewise graphs whose holes gather and expand only the prompt
    chunks' contexts. The same model with the kernels off (``fused_kernels=False``: transformers' expansion of
    every context in every step, eagerly) gives the same greedy tokens up to bf16 drift; nothing captured after
    start."""
    _, folder = tiny_model("deepseek_v3", tmp_path / "ds")
    prompts = _prompts(3, (9, 70, 33, 5, 48, 17))
    outs, infos = {}, {}
    for name, fused in (("absorbed", True), ("expanded", False)):
        cfg = ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1, device="cuda", dtype="bfloat16",
                                                    name=f"gpu-mla-{name}")
        rt = ray_moe.Runtime.start(cfg)
        try:
            rt.serving(step_tokens=64, fused_kernels=fused)
            outs[name] = rt.generate(prompts, max_new_tokens=16)
            st = rt.shard_status()[0]
            infos[name] = (st["counters"], st["steps"], st.get("fused_kernels"))
        finally:
            rt.shutdown()
    c, steps, fused = infos["absorbed"]
    assert fused["mla"]["absorbed_modules"] > 0 and fused["mla"]["decode_kernel"] == "mla_decode", fused
    assert steps["paths"]["decode"].startswith("decode graph"), steps["paths"]
    assert "piecewise graph" in steps["paths"]["prefill_mixed"], steps["paths"]
    assert c.get("decode_graph_steps", 0) >= 5 and c.get("piecewise_steps", 0) >= 3, c
    assert not c.get("graphs_captured_serving") and not c.get("eager_steps"), c
    ce = infos["expanded"][0]
    assert not ce.get("decode_graph_steps") and ce.get("eager_steps", 0) >= 5, ce
    assert "latent cache" in infos["expanded"][1]["paths"]["prefill_mixed"], infos["expanded"][1]["paths"]
    agree = _prefix_agreement(outs["absorbed"], outs["expanded"])
    print("absorbed (graphs) vs expanded (eager) greedy prefix agreement:", agree)
    assert agree >= 0.6, (agree, outs)
