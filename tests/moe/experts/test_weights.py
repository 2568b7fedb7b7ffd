"""Expert weights: seeded determinism, tagging, safetensors round trip, digests, stacking errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ray_moe.model.source import HFWeightSource

from ray_moe.moe.experts.weights import (
    MIXTRAL_EXPERT_KEY,
    SeededWeightSource,
    SlotWeights,
    parse_dtype,
    save_checkpoint,
    swiglu,
)


def source(**kw) -> SeededWeightSource:
    args = dict(num_layers=2, num_experts=4, hidden_size=8, ffn_size=16, seed=3)
    args.update(kw)
    return SeededWeightSource(**args)


def test_seeded_is_deterministic_per_seed_layer_expert():
    a, b = source(), source()
    for layer in range(2):
        for e in range(4):
            assert a.expert(layer, e).digest() == b.expert(layer, e).digest()
    digests = {source().expert(layer, e).digest() for layer in range(2) for e in range(4)}
    assert len(digests) == 8  # every (layer, expert) differs
    assert source(seed=4).expert(0, 0).digest() != a.expert(0, 0).digest()
    torch.testing.assert_close(a.router(1), b.router(1))
    assert not torch.equal(a.router(0), a.router(1))


def test_seeded_expert_independent_of_load_order():
    """Expert 2 is the same whether loaded alone, after others, or in a different order."""
    alone = source().expert(1, 2)
    s = source()
    for e in (3, 0, 1):
        s.expert(1, e)
    after = s.expert(1, 2)
    torch.testing.assert_close(alone.w_gate, after.w_gate, rtol=0, atol=0)
    torch.testing.assert_close(alone.w_down, after.w_down, rtol=0, atol=0)
    assert alone.digest() == after.digest()


def test_seeded_shapes_and_dtype():
    w = source(dtype=torch.bfloat16).expert(0, 1)
    assert w.w_gate.shape == (16, 8) and w.w_up.shape == (16, 8) and w.w_down.shape == (8, 16)
    assert w.w_gate.dtype == torch.bfloat16
    assert w.nbytes == 3 * 16 * 8 * 2


def test_seeded_range_errors():
    with pytest.raises(ValueError, match="expert=4"):
        source().expert(0, 4)
    with pytest.raises(ValueError, match="layer=2"):
        source().expert(2, 0)


def test_tagged_output_is_expert_id_times_base():
    s = source(tagged=True)
    x = torch.randn(5, 8)
    base = s.expert(0, 0)
    y0 = swiglu(x, base.w_gate, base.w_up, base.w_down)
    for e in range(4):
        w = s.expert(0, e)
        torch.testing.assert_close(swiglu(x, w.w_gate, w.w_up, w.w_down), (e + 1) * y0, atol=1e-5, rtol=1e-5)


def test_safetensors_round_trip(tmp_path):
    src = source()
    files = save_checkpoint(src, str(tmp_path), shards=2)
    assert len(files) == 2
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    loaded = HFWeightSource(str(tmp_path))
    assert (loaded.num_layers, loaded.num_experts, loaded.hidden_size, loaded.ffn_size) == (2, 4, 8, 16)
    for layer in range(2):
        torch.testing.assert_close(loaded.router(layer), src.router(layer), rtol=0, atol=0)
        for e in range(4):
            a, b = src.expert(layer, e), loaded.expert(layer, e)
            for name in ("w_gate", "w_up", "w_down"):
                torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)
            assert a.digest() == b.digest()


def test_safetensors_without_index_and_dtype_cast(tmp_path):
    save_checkpoint(source(num_layers=1, num_experts=2), str(tmp_path))
    os.remove(tmp_path / "model.safetensors.index.json")
    loaded = HFWeightSource(str(tmp_path), dtype=torch.bfloat16)
    assert loaded.expert(0, 1).w_up.dtype == torch.bfloat16
    assert loaded.router(0).dtype == torch.float32


def test_digest_sees_one_element():
    w = source().expert(0, 0)
    before = w.digest()
    changed = w.w_down.clone()
    changed[3, 5] += 1e-3
    other = type(w)(w.layer, w.expert, w.w_gate, w.w_up, changed)
    assert other.digest() != before
    assert type(w)(w.layer, w.expert + 1, w.w_gate, w.w_up, w.w_down).digest() != before  # identity is hashed
    assert w.digest() == before


def test_slot_weights_stack_and_errors():
    s = source()
    sw = SlotWeights.stack(1, [5, 9], [s.expert(1, 3), s.expert(1, 0)])
    assert sw.w_gate.shape == (2, 16, 8) and sw.w_down.shape == (2, 8, 16)
    assert (sw.num_slots, sw.hidden_size, sw.ffn_size) == (2, 8, 16)
    assert sw.slot_ids == (5, 9) and sw.experts == (3, 0)
    torch.testing.assert_close(sw.expert_weights(0).w_up, s.expert(1, 3).w_up, rtol=0, atol=0)
    with pytest.raises(ValueError, match="slot_ids"):
        SlotWeights.stack(1, [5], [s.expert(1, 3), s.expert(1, 0)])
    with pytest.raises(ValueError, match="experts"):
        SlotWeights.stack(1, [], [])


def test_safetensors_errors_name_folder_and_key(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty"):
        HFWeightSource(str(empty))
    save_checkpoint(source(num_layers=1, num_experts=2), str(tmp_path / "ck"))
    loaded = HFWeightSource(str(tmp_path / "ck"))
    missing = MIXTRAL_EXPERT_KEY.format(layer=0, expert=7, name="w1")
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        loaded.expert(0, 7)


def test_parse_dtype():
    assert parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype='int8'"):
        parse_dtype("int8")


def test_seeded_source_names_its_device_and_config_routes_it():
    """The default draw is the CPU's (unchanged values); a config's seeded_on_device hands the shard's device
    to the source, and a checkpoint with it is refused naming both fields."""
    from ray_moe.core.errors import ConfigError
    from ray_moe.model.config import RuntimeConfig
    from ray_moe.model.source import weight_source

    a, b = source(), source(device="cpu")
    assert a.device == b.device == "cpu" and a.describe()["device"] == "cpu"
    assert a.expert(1, 3).digest() == b.expert(1, 3).digest()
    base = dict(num_ranks=1, num_experts=4, hidden_size=8, ffn_size=16, top_k=2, slots_per_rank=4)
    assert weight_source(RuntimeConfig(**base)).device == "cpu"
    assert weight_source(RuntimeConfig(**base, device="cuda", seeded_on_device=True)).device == "cuda"
    assert weight_source(RuntimeConfig(**base, device="cuda")).device == "cpu"
    with pytest.raises((ConfigError, ValueError), match="seeded_on_device=True.*checkpoint="):
        RuntimeConfig(**base, seeded_on_device=True, checkpoint="/nowhere")


@pytest.mark.gpu
def test_seeded_on_cuda_draws_on_the_device_deterministically():
    """A CUDA draw returns device tensors, the same for two sources (any order), differs per expert and from
    the CPU draw, and digests as its own bytes do on the CPU; an ExpertStore on the GPU loads it unchanged."""
    from ray_moe.shard.expert_store import ExpertStore

    a, b = source(device="cuda", dtype=torch.bfloat16), source(device="cuda", dtype=torch.bfloat16)
    w = a.expert(1, 2)
    assert w.w_gate.is_cuda and w.w_down.dtype == torch.bfloat16 and w.w_down.shape == (8, 16)
    b.expert(0, 0)
    assert torch.equal(w.w_up, b.expert(1, 2).w_up)
    assert w.digest() == w.to("cpu").digest()
    assert w.digest() != a.expert(1, 3).digest()
    assert not torch.equal(w.w_gate.cpu(), source(dtype=torch.bfloat16).expert(1, 2).w_gate)
    st = ExpertStore(0, torch.device("cuda"), torch.bfloat16)
    digests = st.load([(1, 2), (0, 1)], a)
    assert digests[(1, 2)] == w.digest() and digests[(0, 1)] == a.expert(0, 1).digest()
