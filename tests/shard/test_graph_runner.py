"""The step graph runner's shared buffers across lattices (``shard/graph_runner.py``; the CUDA-graph paths on CPU
through ``eager_capture``): once a generation's captures are released, the next lattice's capture makes its own
slot vector and attention-output arena, so a larger step budget (the step profile's variants) captures and serves
every size; while captures are held, a larger lattice is refused with the sizes named."""

from __future__ import annotations

import pytest
import torch

import ray_moe
from ray_moe.driver.loop import GenerationLoop
from ray_moe.model.sampling import SamplingParams
from ray_moe.shard.lattice import StepLattice
from ray_moe_dev.testing.hf_models import tiny_model
from ray_moe_dev.testing.inprocess import InProcessDeployment, LocalTransport


def _prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]


def test_a_larger_lattice_after_a_release_gets_buffers_of_its_sizes_and_serves_token_equal(tmp_path, eager_capture):
    model, folder = tiny_model("qwen3_moe", tmp_path / "m")
    model.eval()
    dep = InProcessDeployment(ray_moe.RuntimeConfig.from_pretrained(folder, num_ranks=1))
    transport = LocalTransport(dep)
    loop = GenerationLoop(transport, device="cpu", kv_tokens=1024, block_size=8, step_tokens=8)
    core = dep.cores[0]
    runner = core.generator.graph_runner
    try:
        small = runner.lattice.max_tokens
        assert runner.arena is not None and runner.arena.rows == small
        larger = StepLattice.build(loop.rank_running, 64)
        assert larger.max_tokens > small
        with pytest.raises(ValueError, match=f"max_tokens={larger.max_tokens}.*{small} rows"):
            core.generator.configure(larger, core.paths)  # captures still held: refused before anything changes
        assert runner.lattice.max_tokens == small and runner.arena.rows == small
        core.release_graphs(dep.generation)
        assert runner.arena is None and runner.slots is None  # no capture left: the buffers go with them
        core.generator.configure(larger, core.paths)
        rep = core.prepare_steps()["capture"]
        assert not rep["errors"] and rep["piecewise_graphs"] == len(larger.token_sizes), rep
        assert runner.arena.rows == larger.max_tokens
        loop.scheduler.step_tokens = 64  # (the step profile's variant: steps up to the new budget)
        prompts = _prompts(3, (60, 7, 33))
        handles = [loop.submit(p, SamplingParams(max_new_tokens=4)) for p in prompts]
        got = [h.result(120) for h in handles]
    finally:
        loop.close()
        transport.close()
    assert got == [model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0, len(p):].tolist()
                   for p in prompts]
