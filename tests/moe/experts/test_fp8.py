"""Block-scaled FP8 expert weights (``moe.experts.fp8``, ``runners/fp8.py``, the slot records and the store):
dequantization is exactly float32(code) x the scale of its block (partial edge blocks included, equal to
transformers' own dequantizer); a quantized expert's digest, wire form and copies carry its scales; the slot
buffers hold codes and scales row by row through loads, copies, grows and reorders; and every runner, dispatch
format and row mapping computes on FP8 slots exactly what it computes on the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from ray_moe.moe.dispatch.bucket import BucketDispatchOutput
from ray_moe.moe.dispatch.local import LocalDispatchOutput
from ray_moe.moe.dispatch.records import Handle, NormalDispatchOutput
from ray_moe.moe.experts.fp8 import FP8_DTYPE, FP8_MAX, Fp8Format, check_block, dequantize, quantize, scale_shape
from ray_moe.moe.experts.runners import make_runner
from ray_moe.moe.experts.runners.fp8 import Fp8Runner, dense_slots
from ray_moe.moe.experts.weights import (ExpertWeights, SeededWeightSource, SlotWeights, experts_from_wire,
                                         experts_to_wire)
from ray_moe.moe.layer import run_experts
from ray_moe.shard.expert_store import ExpertStore

D, F, E = 24, 40, 6
BLOCK = (16, 16)  # 24 x 40 weights: full and partial blocks in both directions
HANDLE = Handle(handle_id="h", generation=1, layer=0, pg_epoch=0, rank=0)


class Fp8Source(SeededWeightSource):
    """Seeded experts quantized per block: what an FP8 checkpoint's source returns (codes + scales)."""

    def __init__(self, block=BLOCK, **kw) -> None:
        super().__init__(num_layers=2, num_experts=E, hidden_size=D, ffn_size=F, seed=3, tagged=False, **kw)
        self.fp8_block = block

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        w = super().expert(layer, expert)
        q = [quantize(t, self.fp8_block) for t in (w.w_gate, w.w_up, w.w_down)]
        return ExpertWeights(layer, expert, *(c for c, _ in q), tuple(s for _, s in q), self.fp8_block)


SRC = Fp8Source()


def slow_dequantize(codes: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    out = torch.empty(codes.shape, dtype=torch.float32)
    for i in range(codes.shape[0]):
        for j in range(codes.shape[1]):
            out[i, j] = codes[i, j].float() * scale[i // block[0], j // block[1]]
    return out


@pytest.mark.parametrize("shape,block", [((24, 40), (16, 16)), ((7, 5), (128, 128)), ((33, 17), (8, 32)),
                                         ((16, 16), (16, 16))])
def test_dequantize_is_code_times_its_block_scale_exactly(shape, block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g) * 3
    codes, scale = quantize(w, block)
    assert codes.dtype == FP8_DTYPE and scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape(shape, block)
    deq = dequantize(codes, scale, block)
    assert torch.equal(deq, slow_dequantize(codes, scale, block))
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    assert torch.equal(deq, _dequantize_fp8_weight(codes, scale, list(block), torch.float32))
    # each block's largest |w| maps to 448 (the e4m3 maximum): scale = amax / 448, codes within +-448
    assert codes.float().abs().max() <= FP8_MAX
    torch.testing.assert_close(deq, w, rtol=2 ** -3, atol=scale.max().item())  # e4m3: 3 mantissa bits
    assert torch.equal(dequantize(codes, scale, block, torch.bfloat16), deq.to(torch.bfloat16))
    # stacked [N, out, in] codes with [N, ...] scales dequantize per row
    two = dequantize(torch.stack([codes, codes]), torch.stack([scale, 2 * scale]), block)
    assert torch.equal(two[0], deq) and torch.equal(two[1], 2 * deq)


def test_quantize_zero_blocks_and_bad_blocks_and_shapes():
    codes, scale = quantize(torch.zeros(4, 20), (4, 16))
    assert scale.tolist() == [[1.0, 1.0]] and not codes.float().any()
    for bad in ([128], [0, 128], [1.5, 2], "128", [True, 2]):
        with pytest.raises(ValueError, match="weight_block_size"):
            check_block(bad)
    with pytest.raises(ValueError, match="scale_inv: shape"):
        dequantize(codes, torch.ones(2, 2), (4, 16))
    assert Fp8Format((16, 16)).shapes(F, D) == [((F, D), FP8_DTYPE), ((F, D), FP8_DTYPE), ((D, F), FP8_DTYPE),
                                                 ((3, 2), torch.float32), ((3, 2), torch.float32),
                                                 ((2, 3), torch.float32)]


def test_a_quantized_expert_digests_travels_and_converts_with_its_scales():
    w = SRC.expert(0, 1)
    assert w.quantized and w.block == BLOCK and w.nbytes == 3 * D * F + 4 * (6 + 6 + 6)
    d0 = w.digest()
    bumped = ExpertWeights.from_tensors(0, 1, [t.clone() for t in w.tensors()], BLOCK)
    bumped.scales[2][1, 0] *= 2  # one scale of w_down
    assert bumped.digest() != d0 and torch.equal(bumped.w_down.view(torch.uint8), w.w_down.view(torch.uint8))
    assert ExpertWeights(0, 1, w.w_gate, w.w_up, w.w_down).digest() != d0  # codes alone are not the expert
    back = experts_from_wire(experts_to_wire({(0, 1): w}))[(0, 1)]
    assert back.block == BLOCK and back.digest() == d0 and back.w_gate.dtype == FP8_DTYPE
    dense = w.dequantized()
    assert not dense.quantized and torch.equal(dense.w_down, dequantize(w.w_down, w.scales[2], BLOCK))
    assert w.to("cpu").quantized and w.to("cpu").digest() == d0  # a device move keeps codes and scales
    assert torch.equal(w.to("cpu", torch.float64).w_up, dense.w_up.double())  # values, never codes cast
    with pytest.raises(ValueError, match="w_gate.*expected float8_e4m3fn codes with scales \\[3, 2\\]"):
        ExpertWeights(0, 1, w.w_gate, w.w_up, w.w_down, (torch.ones(2, 2), w.scales[1], w.scales[2]), BLOCK)
    with pytest.raises(ValueError, match="scales and block go together"):
        ExpertWeights(0, 1, w.w_gate, w.w_up, w.w_down, w.scales, None)


# ------------------------------------------------------------------------------------------- runners
RUNNERS = [("loop", {}), ("grouped", {}), ("padded", {"alignment": 4}), ("block", {"block_size": 2, "column_block": 8})]


def fp8_and_dense(rows, c):
    """FP8 slot weights over a buffer of ``c`` experts (row-mapped unless rows is the identity) and the same
    slots over the dequantized buffer."""
    ws = [SRC.expert(0, e) for e in range(c)]
    codes = [torch.stack([w.tensors()[i] for w in ws]) for i in range(3)]
    scales = [torch.stack([w.scales[i] for w in ws]) for i in range(3)]
    q = len(rows)
    fp8 = SlotWeights.over_buffer(0, list(range(q)), list(rows), *codes, rows, scales=scales, block=BLOCK)
    dense = SlotWeights.over_buffer(0, list(range(q)), list(rows),
                                    *(dequantize(t, s, BLOCK) for t, s in zip(codes, scales)), rows)
    return fp8, dense


@pytest.mark.parametrize("kind,options", RUNNERS)
@pytest.mark.parametrize("rows", [(0, 1, 2), (4, 0, 2, 0)])
def test_fp8_slots_compute_exactly_what_their_dequantized_weights_compute(kind, options, rows):
    fp8, dense = fp8_and_dense(rows, 5)
    assert fp8.quantized and fp8.row_mapped == (rows != (0, 1, 2)) and fp8.scales[0].shape[0] == fp8.w_gate.shape[0]
    runner = make_runner(kind, **options)
    g = torch.Generator().manual_seed(1)
    counts = [3, 0, 2, 1][:len(rows)]
    x = torch.randn(sum(counts), D, generator=g)
    outs = [NormalDispatchOutput(rows=x, counts_list=tuple(counts), handle=HANDLE)]
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    outs.append(LocalDispatchOutput(rows=torch.cat([x, torch.zeros(2, D)]), counts_list=(), handle=HANDLE,
                                    offsets=offsets, valid=torch.tensor(counts)))
    cap = torch.zeros(len(rows), 3, D)
    for q, n in enumerate(counts):
        cap[q, :n] = torch.randn(n, D, generator=g)
    outs.append(BucketDispatchOutput(rows=cap, counts_list=(), handle=HANDLE, valid=torch.tensor(counts)))
    for out in outs:
        got, want = run_experts(runner, out, fp8, D), run_experts(runner, out, dense, D)
        n = sum(counts)
        if out.rows.dim() == 3:
            for q, c in enumerate(counts):
                assert torch.equal(got[q, :c], want[q, :c])
        else:
            assert torch.equal(got[:n], want[:n])
    plain = dense_slots(fp8, torch.float32)
    assert not plain.quantized and plain.rows == fp8.rows and torch.equal(plain.w_up, dense.w_up)
    assert not Fp8Runner(runner).takes_indexed(x, 6, fp8)


def test_bf16_activations_use_bf16_dequantized_weights():
    fp8, dense = fp8_and_dense((0, 1), 2)
    x = torch.randn(4, D).to(torch.bfloat16)
    runner = make_runner("loop")
    got = run_experts(runner, NormalDispatchOutput(rows=x, counts_list=(2, 2), handle=HANDLE), fp8, D)
    bf = SlotWeights.stack(0, [0, 1], [dense.expert_weights(i).to("cpu", torch.bfloat16) for i in range(2)])
    assert got.dtype == torch.bfloat16 and torch.equal(got, runner.run(x, [2, 2], bf))


# -------------------------------------------------------------------------------------------- store
def test_the_store_holds_codes_and_scales_row_by_row():
    from ray_moe.placement.manifest import manifest_from_assignment
    from ray_moe.placement.topology import Topology

    st = ExpertStore(0, torch.device("cpu"), torch.float32, staging_slots=1)
    digs = st.load([(0, 3), (0, 1)], SRC)
    assert digs[(0, 3)] == SRC.expert(0, 3).digest()
    info = st.slab_info()[0]
    assert info == {"capacity": 3, "used": 2, "free": 1}
    assert st.nbytes == 3 * SRC.expert(0, 0).nbytes  # FP8 rows: 1 byte a weight plus the scales
    digs.update(st.load([(0, 0), (0, 5)], SRC))  # a grow copies codes and scales
    assert st.grows == 1 and all(st.get((0, e)).digest() == SRC.expert(0, e).digest() for e in (3, 1, 0, 5))
    digs.update(st.put({(0, 2): SRC.expert(0, 2)}))
    exported = st.export([(0, 2)])[(0, 2)]
    assert exported.quantized and exported.digest() == digs[(0, 2)]
    # a generation in another order: the buffer is reordered in place, scales with their rows
    p2l = [[2, 5, 0, 1, 3, 4]]
    m = manifest_from_assignment(generation=1, phy2log=p2l, slot_rank=[[0, 0, 0, 0, 0, 1]], num_experts=E,
                                 topology=Topology.single_node(2), digests=digs)
    (w,), _ = st.stack(m)
    assert w.quantized and w.block == BLOCK and not w.row_mapped
    for i, e in enumerate(w.experts):
        assert w.expert_weights(i).digest() == SRC.expert(0, e).digest()
    # a dense expert is never cast into an FP8 layer (nor FP8 codes into a dense one)
    dense = SeededWeightSource(num_layers=2, num_experts=E, hidden_size=D, ffn_size=F, seed=3)
    with pytest.raises(ValueError, match="dense torch.float32 weights but layer 0's slot buffer holds FP8 rows"):
        st.put({(0, 4): dense.expert(0, 4)})
    st.load([(1, 0)], dense)
    with pytest.raises(ValueError, match="FP8 codes in blocks of \\[16, 16\\] but layer 1's slot buffer holds dense"):
        st.put({(1, 1): SRC.expert(1, 1)})
    with pytest.raises(ValueError, match="digest"):  # a held expert arriving with another scale
        bad = ExpertWeights.from_tensors(0, 2, [t.clone() for t in SRC.expert(0, 2).tensors()], BLOCK)
        bad.scales[0][0, 0] += 1
        st.put({(0, 2): bad})


@pytest.mark.parametrize("payload", ["native", "fp8_row"])
def test_fp8_weights_beside_the_fp8_dispatch_payload(payload):
    """Two in-process ranks with FP8 expert slots (seeded experts quantized at load, 128 x 128 blocks over
    d=256) and either payload: native rows give the dequantized model's output (fp32), FP8 activation rows
    (their own per-row scales) only the activation quantization's error on top; the weight scales never mix
    with the payload's."""
    from ray_moe.model.config import RuntimeConfig
    from ray_moe_dev.testing.inprocess import InProcessDeployment, reference_output

    cfg = RuntimeConfig(num_ranks=2, num_experts=8, hidden_size=256, ffn_size=128, top_k=2, slots_per_rank=5,
                        seed=2, quantization="fp8", payload_format=payload)
    dep = InProcessDeployment(cfg)
    held = dep.cores[0].store.get(dep.cores[0].store.held()[0])
    assert held.quantized and [tuple(s.shape) for s in held.scales] == [(1, 2), (1, 2), (2, 1)]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(32, 256, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(32)])
    w = torch.rand(32, 2, generator=g)
    y, results = dep.step(h, ids, w)
    assert not dep.errors(results)
    ref = reference_output(cfg, h, ids, w)  # float64 over the dequantized weights
    err = float((y.double() - ref).norm() / ref.norm())
    assert err < (1e-5 if payload == "native" else 5e-2) and (payload == "native" or err > 1e-4)
