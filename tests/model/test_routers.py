"""Routeless steps of a checkpoint deployment route with the model's own router (ray_moe.model.routers)."""

from __future__ import annotations

import itertools
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from ray_moe_dev.testing.inprocess import InProcessDeployment

from ray_moe.core.errors import ConfigError
from ray_moe.core.wire import tensor_to_wire, wire_to_tensor
from ray_moe.model.checkpoint import CheckpointIndex
from ray_moe.model.config import config_from_pretrained
from ray_moe.model.routers import CheckpointRouter, checkpoint_router
from ray_moe.model.source import weight_source
from ray_moe.moe.router import Router
from ray_moe.shard.records import ExpertOnlyInput, StepKind, StepRequest

T = 37


def _router(folder: str, **kw) -> CheckpointRouter:
    index = CheckpointIndex(folder)
    args = {"num_layers": index.spec.num_moe_layers, "top_k": index.spec.top_k,
            "hidden_size": index.spec.hidden_size, "dtype": torch.float32, "device": torch.device("cpu")}
    return CheckpointRouter(index, **{**args, **kw})


def _block_inputs(model, index: CheckpointIndex) -> dict[int, torch.Tensor]:
    """[T, d] hidden each MoE block of the live model sees in a forward over T tokens."""
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for layer, path in enumerate(index.spec.experts_paths):
        block = model.get_submodule(path.rpartition(".")[0])
        hooks.append(block.register_forward_pre_hook(
            lambda m, args, layer=layer: seen.__setitem__(layer, args[0].detach().reshape(-1, args[0].shape[-1]))))
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _hf_routes(model, index: CheckpointIndex, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) the live model's MoE block hands its experts for ``hidden`` [T, d], and check that its
    gate module alone returns the same."""
    path = index.spec.experts_paths[layer]
    block_path, _, _ = path.rpartition(".")
    got = {}
    hook = model.get_submodule(path).register_forward_pre_hook(
        lambda m, args: got.update(ids=args[1].clone(), w=args[2].clone()))
    try:
        with torch.no_grad():
            model.get_submodule(block_path)(hidden.unsqueeze(0))
            _, w, ids = model.get_submodule(index.spec.router_paths[layer])(hidden)
    finally:
        hook.remove()
    assert torch.equal(got["ids"], ids) and torch.equal(got["w"], w)
    return got["ids"].to(torch.int64), got["w"].to(torch.float32)


@pytest.mark.parametrize("family,layout,sharded", [("deepseek_v3", "per_expert", False),
                                                    ("deepseek_v3", "fused", True),
                                                    ("qwen3_moe", "per_expert", False),
                                                    ("qwen3_moe_dense0", "fused", False),
                                                    ("mixtral", "per_expert", True)])
def test_routes_equal_transformers_own_on_every_moe_layer(hf_checkpoint, family, layout, sharded):
    model, folder = hf_checkpoint(family, layout, sharded)
    router = _router(folder)
    index = router.index
    layers = router.prepare()
    assert [r.path for r in layers] == list(index.spec.router_paths)
    for r in layers:  # every parameter / buffer (correction bias included) is the model's
        live = dict(model.get_submodule(r.path).state_dict())
        assert live and live.keys() == r.module.state_dict().keys()
        for name, t in r.module.state_dict().items():
            assert torch.equal(t, live[name]), (r.path, name)
    inputs = _block_inputs(model, index)
    rand = torch.randn(T, index.spec.hidden_size, generator=torch.Generator().manual_seed(4))
    for layer in range(index.spec.num_moe_layers):
        for hidden in (inputs[layer], rand):
            want_ids, want_w = _hf_routes(model, index, layer, hidden)
            ids, gates = router(layer, hidden)
            assert ids.dtype == torch.int64 and gates.dtype == torch.float32
            assert ids.shape == gates.shape == (T, index.spec.top_k)
            assert torch.equal(ids, want_ids)
            torch.testing.assert_close(gates, want_w, atol=1e-6, rtol=1e-6)


def test_deepseek_routes_are_sigmoid_grouped_and_scaled_not_the_synthetic_softmax(hf_checkpoint):
    """The synthetic softmax router gives other experts and gates that sum to 1; the model's gates are
    sigmoid scores renormalised and scaled by routed_scaling_factor (2.5)."""
    model, folder = hf_checkpoint("deepseek_v3")
    router = _router(folder)
    index = router.index
    synthetic = Router([index.read_router(l) for l in range(2)], num_experts=8, top_k=2, norm_topk=True, skew=0.0,
                       seed=0, device=torch.device("cpu"))
    hidden = _block_inputs(model, index)[0]
    ids, gates = router(0, hidden)
    torch.testing.assert_close(gates.sum(-1), torch.full((T,), 2.5), atol=1e-5, rtol=1e-5)
    s_ids, _ = synthetic(0, hidden)
    assert not torch.equal(ids.sort(-1).values, s_ids.sort(-1).values)


# ------------------------------------------------------------------------------------ the shard path
def _steps(dep: InProcessDeployment, hidden: torch.Tensor, *, layers: tuple[int, ...] | None = None,
           routes: tuple[torch.Tensor, torch.Tensor] | None = None, return_routes: bool = False):
    """One step over every rank (tokens split in order, as ``InProcessDeployment.step``), optionally of some
    layers only; routes [L, T, k]. Returns (output [T, d], per-layer (ids, gates) when asked, whole T)."""
    ranks = list(dep.group.peer_order)
    parts = torch.tensor_split(torch.arange(hidden.shape[0]), len(ranks))
    step_id = f"r{next(_IDS)}"
    reqs = {}
    for r, idx in zip(ranks, parts):
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        reqs[r] = StepRequest(step_id, dep.generation, StepKind.EXPERT_ONLY, ExpertOnlyInput(
            hidden=tensor_to_wire(hidden[lo:hi]),
            topk_ids=None if routes is None else routes[0][:, lo:hi].contiguous().numpy(),
            topk_weights=None if routes is None else routes[1][:, lo:hi].contiguous().numpy(),
            layers=layers, return_routes=return_routes))
    with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
        outs = [res.output for res in pool.map(lambda r: dep.cores[r].step(reqs[r]), ranks)]
    y = torch.cat([wire_to_tensor(o.hidden, o.hidden_dtype) for o in outs], 0)
    if not return_routes:
        return y, None
    per_layer = [(torch.cat([torch.as_tensor(o.routes[i][0]) for o in outs]),
                  torch.cat([torch.as_tensor(o.routes[i][1]) for o in outs])) for i in range(len(outs[0].routes))]
    return y, per_layer


_IDS = itertools.count()


@pytest.mark.parametrize("family,residual", [("deepseek_v3", True), ("qwen3_moe", False)])
def test_routeless_step_equals_the_step_with_the_models_routes(hf_checkpoint, family, residual):
    model, folder = hf_checkpoint(family)
    dep = InProcessDeployment(config_from_pretrained(folder, num_ranks=2, residual=residual))
    index = CheckpointIndex(folder)
    hidden = torch.randn(T, index.spec.hidden_size, generator=torch.Generator().manual_seed(5))
    y_free, used = _steps(dep, hidden, return_routes=True)
    # the same step with the model's routes given explicitly, layer by layer (routes of layer l need the
    # hidden that enters layer l)
    h = hidden
    for layer in range(index.spec.num_moe_layers):
        ids, w = _hf_routes(model, index, layer, h)
        assert torch.equal(used[layer][0], ids)
        torch.testing.assert_close(used[layer][1], w, atol=1e-6, rtol=1e-6)
        h, _ = _steps(dep, h, layers=(layer,), routes=(ids[None], w[None]))
    torch.testing.assert_close(y_free, h, atol=1e-5, rtol=1e-5)
    y_again, _ = dep.step(hidden)  # the plain routeless step of the test deployment
    torch.testing.assert_close(y_again, y_free, atol=0, rtol=0)


def test_synthetic_deployment_keeps_the_synthetic_router(hf_checkpoint):
    _, folder = hf_checkpoint("qwen3_moe")
    cfg = config_from_pretrained(folder, num_ranks=1)
    synthetic = cfg.model_copy(update={"checkpoint": None})
    core_router = InProcessDeployment(synthetic).cores[0].executor.router
    assert isinstance(core_router, Router)
    assert isinstance(checkpoint_router(cfg, weight_source(cfg), device=torch.device("cpu"), dtype=torch.float32),
                      CheckpointRouter)


# ------------------------------------------------------------------------------------ refusals
def test_block_that_changes_its_routers_output_is_refused(hf_checkpoint, monkeypatch):
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    _, folder = hf_checkpoint("qwen3_moe")

    def forward(self, hidden_states):  # a block that rescales its router's weights before its experts
        flat = hidden_states.view(-1, hidden_states.shape[-1])
        _, w, ids = self.gate(flat)
        return self.experts(flat, ids, 2 * w).view_as(hidden_states)

    monkeypatch.setattr(m.Qwen3MoeSparseMoeBlock, "forward", forward)
    with pytest.raises(ConfigError, match=r"family qwen3_moe .*MoE layer 0: the MoE block model\.layers\.0\.mlp "
                                          r"\(Qwen3MoeSparseMoeBlock\) does not hand its experts"):
        _router(folder).prepare()


def test_router_returning_logits_only_is_refused(hf_checkpoint, monkeypatch):
    from transformers.models.mixtral import modeling_mixtral as m

    _, folder = hf_checkpoint("mixtral")
    monkeypatch.setattr(m.MixtralTopKRouter, "forward",
                        lambda self, h: torch.nn.functional.linear(h.reshape(-1, self.hidden_dim), self.weight))
    with pytest.raises(ConfigError, match=r"family mixtral .*MixtralTopKRouter\) returns Tensor rather than "
                                          r"\(router_logits, top_k_weights, top_k_index\)"):
        _router(folder).prepare()


def test_refusals_name_what_cannot_be_reproduced(hf_checkpoint, tmp_path):
    _, folder = hf_checkpoint("deepseek_v3")
    with pytest.raises(ConfigError, match=r"picks 2 experts per token but top_k=1"):
        _router(folder, top_k=1).prepare()
    with pytest.raises(ConfigError, match=r"router_skew=1\.0 biases the synthetic router only"):
        _router(folder, router_skew=1.0).prepare()
    # a checkpoint without its router's correction bias cannot be routed as the model routes
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nobias"
    shutil.copytree(folder, bad)
    for f in bad.glob("*.safetensors"):
        state = load_file(str(f))
        save_file({k: v for k, v in state.items() if "e_score_correction_bias" not in k}, str(f),
                  metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"no tensor for the router's 'model\.layers\.1\.mlp\.gate\."
                                          r"e_score_correction_bias'"):
        _router(str(bad)).prepare()
    # a folder without config.json: no transformers model to route with
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    (legacy / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        _router(str(legacy), top_k=2).prepare()


def test_routeless_step_of_an_unroutable_checkpoint_fails_with_the_reason(hf_checkpoint):
    """The refusal reaches the caller of the first routeless step (explicit routes keep working)."""
    _, folder = hf_checkpoint("deepseek_v3")
    dep = InProcessDeployment(config_from_pretrained(folder, num_ranks=2, top_k=1))
    h = torch.randn(5, 32, generator=torch.Generator().manual_seed(6))
    _, results = dep.step(h)
    errs = dep.errors(results)
    assert sorted(errs) == [0, 1]
    assert all(isinstance(e, ConfigError) and "top_k=1" in str(e) for e in errs.values())
    ids = torch.zeros(5, 1, dtype=torch.int64)
    y, results = dep.step(h, ids, torch.ones(5, 1))
    assert not dep.errors(results) and y.shape == (5, 32)
