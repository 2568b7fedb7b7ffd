"""The FP8 kernels' tuned launch tables (``runners/fp8_configs.py``): the format round-trips, a row count takes the
entry of the nearest tuned count at or above it, malformed tables are refused naming the file and the field, a
table drives only the GPU model it is named for, and the tables shipped with the package parse."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.moe.experts.runners import fp8_configs, fp8_kernels
from ray_moe.moe.experts.runners.fp8_configs import (
    LaunchConfig,
    LinearBackend,
    LinearChoice,
    RowTable,
    SwigluChoice,
    TunedTable,
    dump_table,
    parse_table,
)

launch = st.builds(LaunchConfig, st.sampled_from(fp8_configs.BLOCK_MS), st.sampled_from(fp8_configs.BLOCK_NS),
                   st.sampled_from(fp8_configs.WARPS), st.sampled_from(fp8_configs.STAGES))
split = st.builds(LaunchConfig, st.sampled_from(fp8_configs.BLOCK_MS), st.sampled_from(fp8_configs.BLOCK_NS),
                  st.sampled_from(fp8_configs.WARPS), st.sampled_from(fp8_configs.STAGES),
                  st.sampled_from(fp8_configs.SPLIT_KS))
linear = st.one_of(st.builds(LinearChoice, st.just(LinearBackend.TRITON), split),
                   st.just(LinearChoice(LinearBackend.SCALED_MM)))


def rows_of(choice):
    return st.dictionaries(st.integers(1, 1 << 16), choice, min_size=1, max_size=6).map(
        lambda d: RowTable(tuple(sorted(d)), tuple(d[k] for k in sorted(d))))


tables = st.builds(TunedTable, st.just("NVIDIA H100 80GB HBM3"),
                   st.dictionaries(st.sampled_from(["d=2048,f=768,block=128x128", "d=7168,f=2048,block=128x128"]),
                                   rows_of(st.builds(SwigluChoice, launch, launch)), max_size=2),
                   st.dictionaries(st.sampled_from(["out=4096,in=2048,block=128x128", "out=512,in=2048,block=128x128"]),
                                   rows_of(linear), max_size=2),
                   st.just({"qwen3-30b-a3b": {"iters": 20}}))


@settings(max_examples=60, deadline=None)
@given(tables)
def test_a_table_round_trips_through_json(table):
    again = parse_table(json.loads(json.dumps(dump_table(table))))
    assert again == table or dump_table(again) == dump_table(table)


@settings(max_examples=60, deadline=None)
@given(rows_of(st.integers()), st.integers(1, 1 << 17))
def test_a_row_count_takes_the_nearest_tuned_count_at_or_above(table, rows):
    got = table.at(rows)
    above = [r for r in table.rows if r >= rows]
    want_rows = min(above) if above else max(table.rows)
    assert got == table.choices[table.rows.index(want_rows)]


def _table(**over):
    base = {"device": "GPU X", "swiglu": {"d=8,f=4,block=128x128": {"16": {
        "gate_up": {"block_m": 16, "block_n": 128, "warps": 4, "stages": 4},
        "down": {"block_m": 16, "block_n": 64, "warps": 4, "stages": 3}}}},
        "linear": {"out=256,in=128,block=128x128": {"16": {"backend": "triton", "config": {
            "block_m": 16, "block_n": 32, "warps": 4, "stages": 5}}, "1024": {"backend": "scaled_mm"}}}}
    base.update(over)
    return base


def test_lookups_by_shape_and_rows():
    t = parse_table(_table())
    assert t.swiglu(8, 4, (128, 128), 3).down == LaunchConfig(16, 64, 4, 3)
    assert t.swiglu(8, 4, (64, 128), 3) is None  # another block: not tuned
    assert t.linear(256, 128, (128, 128), 16).config == LaunchConfig(16, 32, 4, 5)
    assert t.linear(256, 128, (128, 128), 17).backend is LinearBackend.SCALED_MM
    assert t.linear(256, 128, (128, 128), 1 << 20).backend is LinearBackend.SCALED_MM  # past the largest: the largest
    assert t.linear(512, 128, (128, 128), 16) is None


@pytest.mark.parametrize("patch, field", [
    (lambda t: t["swiglu"]["d=8,f=4,block=128x128"]["16"]["down"].update(block_n=48), "block_n=48"),
    (lambda t: t["swiglu"]["d=8,f=4,block=128x128"]["16"]["gate_up"].update(warps=3), "warps=3"),
    (lambda t: t["swiglu"]["d=8,f=4,block=128x128"]["16"].pop("down"), "expected {gate_up, down}"),
    (lambda t: t["linear"]["out=256,in=128,block=128x128"]["1024"].update(backend="cutlass"), "backend='cutlass'"),
    (lambda t: t["linear"]["out=256,in=128,block=128x128"]["16"].pop("config"), "carries its launch config"),
    (lambda t: t["linear"]["out=256,in=128,block=128x128"].update({"many": {"backend": "scaled_mm"}}), "'many'"),
    (lambda t: t.pop("device"), "'device'"),
    (lambda t: t["linear"]["out=256,in=128,block=128x128"]["16"]["config"].update(split_k=3), "split_k=3"),
    (lambda t: t["swiglu"]["d=8,f=4,block=128x128"]["16"]["down"].update(split_k=2), "take no split"),
])
def test_a_malformed_table_is_refused_naming_the_field(patch, field):
    t = _table()
    patch(t)
    with pytest.raises(ValueError, match="tab.json") as err:
        parse_table(t, "tab.json")
    assert field in str(err.value)


def test_tables_are_read_by_the_gpu_name_they_are_measured_on(tmp_path):
    name = "NVIDIA H100 80GB HBM3"
    assert fp8_configs.device_slug(name) == "nvidia-h100-80gb-hbm3"
    assert fp8_configs.table_for(name, tmp_path) is None  # none measured: the heuristics
    fp8_configs.table_path(name, tmp_path).write_text(json.dumps(_table(device=name)))
    fp8_configs.table_for.cache_clear()
    assert fp8_configs.table_for(name, tmp_path).device == name
    other = "NVIDIA H100 80GB HBM3 (copied)"
    fp8_configs.table_path(other, tmp_path).write_text(json.dumps(_table(device=name)))
    with pytest.raises(ValueError, match="not the GPU it is named for"):
        fp8_configs.table_for(other, tmp_path)
    fp8_configs.table_path("bad", tmp_path).write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        fp8_configs.table_for("bad", tmp_path)
    fp8_configs.table_for.cache_clear()


def test_without_a_cuda_device_the_kernels_take_their_heuristics():
    x = torch.zeros(300, 2048)
    assert fp8_configs.table_for_device(x.device) is None
    assert fp8_kernels.swiglu_choice(x, 2048, 768, (128, 128), 300, 128) == fp8_kernels.launch_config(
        fp8_kernels.row_block(300, 128))
    assert fp8_kernels.linear_choice(x, 4096, 2048, (128, 128)) == fp8_kernels.default_linear(300)
    assert "CUDA bf16" in fp8_kernels.scaled_mm_reason(x, 4096, 2048, (128, 128))


def test_the_shipped_tables_parse_and_are_named_for_their_gpu():
    files = sorted(fp8_configs.CONFIG_DIR.glob("fp8-*.json"))
    for f in files:
        t = parse_table(json.loads(f.read_text()), str(f))
        assert f == fp8_configs.table_path(t.device), f
        for rows in t.swiglu_rows.values():
            assert list(rows.rows) == sorted(set(rows.rows))


def test_shapes_without_a_tuned_entry_are_named(monkeypatch):
    """``untuned_reason``: the GPU without a table, a table missing some shapes (named), a table covering all."""
    assert fp8_configs.untuned_reason(torch.device("cpu"), [(8, 4, (128, 128))]) is None  # no CUDA GPU: none
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU X")
    cuda = torch.device("cuda", 0)
    tables = {}
    monkeypatch.setattr(fp8_configs, "table_for", lambda name: tables.get(name))
    assert fp8_configs.untuned_reason(cuda) is None  # nothing in FP8
    why = fp8_configs.untuned_reason(cuda, [(8, 4, (128, 128))])
    assert "no tuned FP8 launch table for this GPU (GPU X; fp8-gpu-x.json)" in why
    tables["GPU X"] = parse_table(_table())
    assert fp8_configs.untuned_reason(cuda, [(8, 4, (128, 128))], [(256, 128, (128, 128)), (64, 64, None)]) is None
    why = fp8_configs.untuned_reason(cuda, [(8, 4, (128, 128)), (16, 4, (128, 128))], [(512, 128, (128, 128))])
    assert why.endswith("no entry for d=16,f=4,block=128x128, out=512,in=128,block=128x128"), why


def test_the_table_in_use_is_named_by_its_file(monkeypatch):
    assert fp8_configs.table_file(torch.device("cpu")) is None
    monkeypatch.setattr(fp8_configs, "table_for_device", lambda device: parse_table(_table(device="NVIDIA H200")))
    assert fp8_configs.table_file(torch.device("cuda", 0)) == "fp8-nvidia-h200.json"
    monkeypatch.setattr(fp8_configs, "table_for_device", lambda device: None)
    assert fp8_configs.table_file(torch.device("cuda", 0)) is None
