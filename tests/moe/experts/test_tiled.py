"""The mid-size expert kernels (``runners/tiled.py``): their band rule and start check (CPU, always), the kernels
against a float64 per-slot loop under Triton's CPU interpreter (``TRITON_INTERPRET=1``, else skipped: the README's
second pytest), and on a GPU compiled at every candidate config against grouped_mm, through a captured CUDA graph,
and as the grouped runner picks them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.env import triton_interpreted
from ray_moe.moe.experts.runners import tiled
from ray_moe.moe.experts.runners.grouped import GroupedRunner, grouped_mm_swiglu, mid_choice
from ray_moe.moe.experts.weights import ExpertWeights, SlotWeights, swiglu

pytestmark = pytest.mark.triton  # its Triton kernels also run under the CPU interpreter (TRITON_INTERPRET=1)

A, B, C = (tiled.TileConfig(64, 64, 64, 4, 4), tiled.TileConfig(64, 128, 64, 8, 3),
           tiled.TileConfig(128, 128, 64, 8, 3))
SMALL = tiled.TileConfig(16, 32, 32, 4, 2)  # the interpreter's tile: d, f multiples of 32


def naive(x: torch.Tensor, counts, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """float64 SwiGLU of each slot's segment of ``x`` [N, d] (slot q: wg[q] / wu[q] [f, d], wd[q] [d, f])."""
    out, start = [], 0
    for q, c in enumerate(counts):
        out.append(swiglu(x[start:start + c].double(), wg[q].double(), wu[q].double(), wd[q].double()))
        start += c
    return torch.cat(out)


def weights(q: int, d: int, f: int, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(q, *s, generator=g) / s[1] ** 0.5).to(device, dtype) for s in ((f, d), (f, d), (d, f))]


def stacked(wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> SlotWeights:
    """Slot weights of layer 0 holding slot q's stacks (expert q)."""
    return SlotWeights.stack(0, list(range(wg.shape[0])), [ExpertWeights(0, q, wg[q], wu[q], wd[q])
                                                           for q in range(wg.shape[0])])


# ---------------------------------------------------------------- the band rule and the check (CPU)
def test_bands_walk_up_the_sizes_while_the_fastest_config_wins():
    """Each size's fastest config serves its band while it beats grouped_mm by MIN_SPEEDUP; the walk stops at the
    first size where none does (a later win does not reopen it)."""
    times = {32: {None: 1.0, A: 0.70, B: 0.80}, 64: {None: 1.0, A: 0.90, B: 0.60},
             128: {None: 1.0, A: 0.99, B: 0.97}, 256: {None: 1.0, C: 0.5}}
    assert tiled.bands(times) == ((32, A), (64, B))
    assert tiled.bands({32: {None: 1.0, A: 0.96}}) == ()  # 1.04x: under MIN_SPEEDUP
    assert tiled.bands({32: {None: 1.0, A: 0.96}}, min_speedup=1.0) == ((32, A),)
    assert tiled.bands({32: {None: 1.0}}) == () and tiled.bands({}) == ()


def test_a_choice_runs_the_first_band_holding_the_rows_a_slot():
    choice = tiled.TiledChoice(((32, A), (128, C)), "measured")
    assert choice.config(32 * 128, 128) is A and choice.config(32 * 128 + 1, 128) is C
    assert choice.config(128 * 128, 128) is C and choice.config(128 * 128 + 1, 128) is None
    assert tiled.OFF.config(1, 1) is None and choice.config(5, 0) is A  # no slots: counted as one


def test_configs_fit_only_widths_their_tiles_divide():
    assert A.fits(2048, 768) and B.fits(2048, 768) and C.fits(7168, 2048)
    assert not B.fits(2048, 96) and not A.fits(2048, 32)


def test_the_check_keeps_grouped_mm_off_cuda_and_says_why():
    """On a CPU the start check chooses no band (and the grouped runner says so in ``status``'s words)."""
    choice = mid_choice(torch.device("cpu"), torch.bfloat16, 2048, 768, 128, 8)
    assert choice.bands == () and "device cpu" in choice.reason
    assert "grouped_mm does not take" in mid_choice(torch.device("cpu"), torch.int8, 64, 64, 4, 2).reason
    text = GroupedRunner(mid=choice).kernels()
    assert "no tiled kernels (device cpu" in text and "grouped_mm above" in text
    text = GroupedRunner(mid=tiled.TiledChoice(((64, A),), "why")).kernels()
    assert "the tiled Triton kernels to 64 rows a slot (why)" in text


def test_the_runner_keeps_its_paths_where_the_kernels_do_not_serve():
    """A measured band does not send CPU rows (no interpreter) or forced backends to the kernels."""
    q, d, f = 4, 64, 32
    wg, wu, wd = weights(q, d, f)
    w = stacked(wg, wu, wd)
    x = torch.randn(200, d)
    offsets = torch.tensor([50, 100, 150, 200], dtype=torch.int32)
    choice = tiled.TiledChoice(((256, SMALL),), "test")
    if not triton_interpreted():
        assert not GroupedRunner(mid=choice).takes_indexed(x, 200, w)
    assert not GroupedRunner(use_grouped_mm=True, mid=choice).takes_indexed(x, 200, w)
    want = naive(x, [50] * 4, wg, wu, wd)
    torch.testing.assert_close(GroupedRunner(use_grouped_mm=True, mid=choice).run_offsets(x, offsets, w).double(),
                               want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- the kernels under Triton's interpreter (CPU)
interpreted = pytest.mark.skipif(not triton_interpreted(), reason="the tiled kernels run on CPU under Triton's "
                                 "interpreter: set TRITON_INTERPRET=1 for pytest")


@interpreted
@settings(max_examples=8, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=6), block_m=st.sampled_from([16, 32]),
       pad=st.integers(0, 3))
def test_interpreted_kernels_match_the_float64_loop(counts, block_m, pad):
    """Any rows a slot (empty slots, slots over several row blocks), padding rows past offsets[-1] left alone."""
    pytest.importorskip("triton")
    q, d, f = len(counts), 64, 32
    wg, wu, wd = weights(q, d, f, seed=len(counts))
    n = sum(counts)
    x = torch.randn(n + pad, d)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    cfg = tiled.TileConfig(block_m, 32, 32, 4, 2)
    y = tiled.tiled_swiglu(x, offsets, wg, wu, wd, config=cfg)
    torch.testing.assert_close(y[:n].double(), naive(x[:n], counts, wg, wu, wd), atol=1e-5, rtol=1e-5)


@interpreted
def test_interpreted_kernels_read_routes_and_buffer_rows():
    """Token-major rows read through a route order (top-2), and slot weights over a larger buffer (weight_rows)."""
    pytest.importorskip("triton")
    counts, d, f = [5, 0, 40, 17, 1, 33], 64, 32
    q, n = len(counts), sum(counts)
    wg, wu, wd = weights(q, d, f, seed=3)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    tokens = torch.randn(60, d)
    order = torch.randperm(120, generator=torch.Generator().manual_seed(1))[:n].to(torch.int32)
    y = tiled.tiled_swiglu(tokens, offsets, wg, wu, wd, config=SMALL, order=order, top_k=2)
    torch.testing.assert_close(y.double(), naive(tokens[order.long() // 2], counts, wg, wu, wd), atol=1e-5, rtol=1e-5)
    rows = torch.tensor([7, 2, 9, 0, 4, 11])  # slot q's weights at buffer row rows[q]
    buf = [torch.randn(12, *w.shape[1:]) for w in (wg, wu, wd)]
    for b, w in zip(buf, (wg, wu, wd)):
        b[rows] = w
    x = torch.randn(n, d)
    y = tiled.tiled_swiglu(x, offsets, *buf, config=SMALL, weight_rows=rows)
    torch.testing.assert_close(y.double(), naive(x, counts, wg, wu, wd), atol=1e-5, rtol=1e-5)


@interpreted
def test_interpreted_runner_takes_the_kernels_in_their_band():
    """The grouped runner with a measured band: device-offset and route-order calls of mid-size steps go to the
    kernels (equal to grouped_mm's result), decode sizes and steps above the band keep their paths."""
    pytest.importorskip("triton")
    q, d, f = 4, 64, 32
    wg, wu, wd = weights(q, d, f, seed=5)
    w = stacked(wg, wu, wd)
    runner = GroupedRunner(mid=tiled.TiledChoice(((40, SMALL),), "test"))
    counts = [30, 45, 20, 40]  # 135 rows over 4 slots: 33.75 a slot, inside the band
    x = torch.randn(sum(counts), d)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    assert runner.takes_indexed(x, sum(counts), w)
    torch.testing.assert_close(runner.run_offsets(x, offsets, w).double(), naive(x, counts, wg, wu, wd),
                               atol=1e-5, rtol=1e-5)
    order = torch.arange(sum(counts), dtype=torch.int32)
    torch.testing.assert_close(runner.run_indexed(x, order, 1, offsets, w).double(), naive(x, counts, wg, wu, wd),
                               atol=1e-5, rtol=1e-5)
    assert not runner.takes_indexed(x, 40 * q + 1, w) and not runner.takes_indexed(x, 16 * q, w)


@interpreted
def test_interpreted_start_check_error_covers_every_variant():
    """The check's error over its three variants (expert-major, route order, buffer rows) is small against the
    float64 loop, and large against a reference that is wrong (so the check can refuse)."""
    pytest.importorskip("triton")
    wg, wu, wd = weights(5, 64, 32, seed=11)

    def loop(x, offsets, a, b, c):
        ends = offsets.tolist()
        return naive(x, [e - s for s, e in zip([0] + ends[:-1], ends)], a, b, c).float()

    g = torch.Generator().manual_seed(4)
    for top_k in (2, 8):  # the route order of the deployment's routes a token (serving reuses these compiles)
        assert tiled.check_error(SMALL, (wg, wu, wd), torch.device("cpu"), torch.float32, g, loop, top_k) < 1e-5
        assert tiled.check_error(SMALL, (wg, wu, wd), torch.device("cpu"), torch.float32, g,
                                 lambda *a: 2 * loop(*a), top_k) > 0.4


# ---------------------------------------------------------------- compiled on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("per_slot", [24, 64, 130, 260])
def test_cuda_kernels_match_grouped_mm_at_every_candidate(per_slot):
    """Qwen3-30B-A3B's expert shape (d 2,048, f 768, 128 slots), bf16, routes drawn uniformly: every candidate
    config against grouped_mm over expert-major rows, route-order rows and buffer rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, d, f = 128, 2048, 768
    wg, wu, wd = weights(q, d, f, torch.bfloat16, "cuda", seed=per_slot)
    g = torch.Generator().manual_seed(per_slot)
    x, offsets = tiled.routed_rows(per_slot * q, q, d, torch.device("cuda"), torch.bfloat16, g)
    want = grouped_mm_swiglu(x, offsets, wg, wu, wd).float()
    scale = want.abs().max()
    for cfg in tiled.CANDIDATES:
        got = tiled.tiled_swiglu(x, offsets, wg, wu, wd, config=cfg).float()
        assert float((got - want).abs().max() / scale) < 1e-2, cfg
        err = tiled.check_error(cfg, (wg, wu, wd), torch.device("cuda"), torch.bfloat16, g, grouped_mm_swiglu, 8)
        assert err < tiled.CHECK_TOLERANCE, cfg
        rows = torch.randperm(q, device="cuda")  # the same slots scattered over a buffer of 2q rows
        buf = [torch.zeros(2 * q, *w.shape[1:], device="cuda", dtype=w.dtype) for w in (wg, wu, wd)]
        for b, w in zip(buf, (wg, wu, wd)):
            b[rows] = w
        got = tiled.tiled_swiglu(x, offsets, *buf, config=cfg, weight_rows=rows).float()
        assert float((got - want).abs().max() / scale) < 1e-2, cfg


@pytest.mark.gpu
def test_cuda_kernels_replay_in_a_graph_with_new_offsets():
    """One capture at a fixed row count replays other routings of those rows exactly (the grid is fixed by the
    row count; the slot of each row block is found on the device)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, d, f, n = 128, 2048, 768, 64 * 128
    wg, wu, wd = weights(q, d, f, torch.bfloat16, "cuda", seed=1)
    g = torch.Generator().manual_seed(2)
    x, offsets = tiled.routed_rows(n, q, d, torch.device("cuda"), torch.bfloat16, g)
    cfg = tiled.CANDIDATES[1]
    tiled.tiled_swiglu(x, offsets, wg, wu, wd, config=cfg)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tiled.tiled_swiglu(x, offsets, wg, wu, wd, config=cfg)
    for seed in (3, 4):
        x2, o2 = tiled.routed_rows(n, q, d, torch.device("cuda"), torch.bfloat16, torch.Generator().manual_seed(seed))
        o2[:5] = 0  # some empty slots, a hot one
        o2[5:] = torch.clamp(o2[5:], min=300)
        o2[-1] = n
        x.copy_(x2)
        offsets.copy_(o2)
        graph.replay()
        torch.testing.assert_close(y, tiled.tiled_swiglu(x, offsets, wg, wu, wd, config=cfg), atol=0, rtol=0)


@pytest.mark.gpu
def test_cuda_start_check_decides_and_the_runner_follows():
    """The start check on this GPU either serves bands (each config reproducing grouped_mm; the runner's results
    in a band then equal the kernels') or keeps grouped_mm, saying why with its timings."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, d, f = 128, 2048, 768
    choice = mid_choice(torch.device("cuda"), torch.bfloat16, d, f, q, 8)
    assert "grouped_mm" in choice.reason or choice.bands == (), choice.reason
    if not choice.bands:
        return
    wg, wu, wd = weights(q, d, f, torch.bfloat16, "cuda", seed=7)
    w = stacked(wg, wu, wd)
    top, cfg = choice.bands[0]
    x, offsets = tiled.routed_rows(top * q, q, d, torch.device("cuda"), torch.bfloat16, torch.Generator().manual_seed(8))
    runner = GroupedRunner(mid=choice)
    torch.testing.assert_close(runner.run_offsets(x, offsets, w),
                               tiled.tiled_swiglu(x, offsets, wg, wu, wd, config=cfg), atol=0, rtol=0)


@interpreted
def test_interpreted_check_times_both_variants_and_the_reference_pays_its_gather(monkeypatch):
    """Step 2 of the check times expert-major rows and route-order rows; the reference's route-order call gets the
    rows gathered (as serving gathers before grouped_mm); a config serves a size only where it beats the reference
    in BOTH variants (its worse ratio)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(tiled, "CHECK_ROWS_PER_SLOT", (2, 4, 8))
    wg, wu, wd = weights(5, 64, 32, seed=12)
    seen: list[int] = []

    def loop(x, offsets, a, b, c):
        ends = offsets.tolist()
        seen.append(int(x.shape[0]))
        return naive(x, [e - s for s, e in zip([0] + ends[:-1], ends)], a, b, c).float().to(x.dtype)

    slow = {8: 1}  # the route-order variant of the 8-rows size: the kernel loses there
    calls: list[tuple[int, bool]] = []

    def timer(fn):
        seen.clear()
        fn()
        ref = bool(seen)  # the reference ran (with the rows it was handed)
        rows = seen[0] if ref else None
        calls.append((rows, ref))
        n = len(calls)
        if ref:
            return 1.0
        kernel_variant = (n - 1) % 4  # per size: ref, ref, kernel expert-major, kernel route order
        per_slot = tiled.CHECK_ROWS_PER_SLOT[(n - 1) // 4]
        return 2.0 if slow.get(per_slot) == kernel_variant - 2 else 0.5

    choice = tiled.measure_choice(torch.device("cpu"), torch.float32, 64, 32, 5, [SMALL], loop, 3, timer=timer)
    refs = [r for r, is_ref in calls if is_ref]
    assert refs == [10, 10, 20, 20, 40, 40]  # both reference calls of each size get all per_slot x slots rows
    assert choice.bands == ((2, SMALL), (4, SMALL)), choice.reason
    assert "expert-major / route order" in choice.reason and "8 rows a slot" in choice.reason
