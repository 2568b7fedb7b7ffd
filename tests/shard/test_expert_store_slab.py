"""ExpertStore slot buffers: every held expert in exactly one buffer row, a generation is a slot map over the
buffers (views, never a copy), a migration writes into free rows, retirement frees them, more rows than are
free grow the buffer (counted), and the in-process deployment still serves exact outputs across a rebalance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_moe.model.config import RuntimeConfig
from ray_moe.core.types import Phase
from ray_moe.moe.experts.weights import SeededWeightSource
from ray_moe.placement.manifest import manifest_from_assignment
from ray_moe.placement.topology import Topology
from ray_moe.shard.expert_store import ExpertStore
from ray_moe_dev.testing.inprocess import InProcessDeployment, reference_output

D, F, E = 8, 12, 8
SRC = SeededWeightSource(num_layers=2, num_experts=E, hidden_size=D, ffn_size=F, seed=1, tagged=True)
EXPERT_BYTES = 3 * D * F * 4  # float32 w_gate + w_up + w_down of one expert


def manifest(generation: int, layers: list[list[int]], digests: dict) -> object:
    """Rank 0 hosts ``layers[l]`` in that local slot order; rank 1 hosts every other expert of the layer."""
    p2l, ranks = [], []
    for mine in layers:
        rest = [e for e in range(E) if e not in mine]
        p2l.append(list(mine) + rest)
        ranks.append([0] * len(mine) + [1] * len(rest))
    return manifest_from_assignment(generation=generation, phy2log=p2l, slot_rank=ranks, num_experts=E,
                                    topology=Topology.single_node(2), digests=digests)


def store(staging: int = 2) -> ExpertStore:
    return ExpertStore(0, torch.device("cpu"), torch.float32, staging_slots=staging)


def check_weights(w, layer: int) -> None:
    """Every local slot of ``w`` reads exactly its expert's source weights."""
    for i, e in enumerate(w.experts):
        got, want = w.expert_weights(i), SRC.expert(layer, e)
        assert torch.equal(got.w_gate, want.w_gate) and torch.equal(got.w_down, want.w_down)


def test_loading_allocates_needed_rows_plus_staging_and_nothing_else():
    st = store(staging=2)
    digs = st.load([(0, 3), (0, 1), (0, 4), (0, 0), (1, 5), (1, 2)], SRC)
    assert digs[(0, 3)] == SRC.expert(0, 3).digest()  # the digest of the bytes written, as before
    assert st.slab_info() == {0: {"capacity": 6, "used": 4, "free": 2}, 1: {"capacity": 4, "used": 2, "free": 2}}
    assert st.nbytes == (4 + 2 + 2 + 2) * EXPERT_BYTES and st.grows == 0 and len(st) == 6
    # held once: loading held keys again writes nothing
    assert st.load([(0, 3), (1, 5)], SRC) == {(0, 3): digs[(0, 3)], (1, 5): digs[(1, 5)]}
    assert st.slab_info()[0]["used"] == 4 and st.nbytes == 10 * EXPERT_BYTES


def test_a_generation_is_views_of_the_buffer_and_a_second_one_copies_nothing():
    st = store(staging=2)
    digs = st.load([(0, e) for e in (3, 1, 4, 0)], SRC)
    g1 = manifest(1, [[3, 1, 4, 0]], digs)
    (w1,), keys1 = st.stack(g1)
    # the first generation of a fresh buffer sits in local slot order: plain views buf[:Q]
    assert not w1.row_mapped and w1.num_slots == 4 and w1.experts == (3, 1, 4, 0)
    buf_ptr = w1.w_gate.data_ptr()
    assert [st.row((0, e)) for e in (3, 1, 4, 0)] == [0, 1, 2, 3]
    check_weights(w1, 0)
    before = st.nbytes
    # generation 2 moves experts: 1 leaves, 6 arrives (a copy into a staging row), the order changes
    digs.update(st.put({(0, 6): SRC.expert(0, 6)}))
    assert st.row((0, 6)) == 4 and st.nbytes == before and st.grows == 0
    (w2,), keys2 = st.stack(manifest(2, [[0, 6, 3, 4]], digs))
    assert w2.row_mapped and w2.rows == (3, 4, 0, 2) and w2.num_slots == 4
    for t, name in ((w2.w_gate, "w_gate"), (w2.w_up, "w_up"), (w2.w_down, "w_down")):
        assert t.data_ptr() == getattr(w1, name).data_ptr()  # the same buffer, no copy
    assert w2.w_gate.data_ptr() == buf_ptr and st.nbytes == before
    check_weights(w2, 0)
    check_weights(w1, 0)  # the older generation still reads its own experts
    # retire generation 1: its expert 1 is freed; a later load reuses that row
    assert st.drop_unreferenced(set(keys2)) == 1 and st.row((0, 1)) is None
    assert st.slab_info()[0] == {"capacity": 6, "used": 4, "free": 2}
    st.load([(0, 7)], SRC)
    assert st.row((0, 7)) == 1 and st.nbytes == before and st.grows == 0
    check_weights(w2, 0)


def test_more_rows_than_free_grow_the_buffer_counted_and_keep_older_generations_intact():
    st = store(staging=1)
    digs = st.load([(0, 0), (0, 1)], SRC)
    (w1,), _ = st.stack(manifest(1, [[0, 1]], digs))
    old_ptr = w1.w_gate.data_ptr()
    digs.update(st.load([(0, 2), (0, 3), (0, 4)], SRC))  # 3 new rows, 1 free: grow to 2 + 3 + 1
    assert st.grows == 1
    assert st.slab_info()[0] == {"capacity": 6, "used": 5, "free": 1}
    assert st.nbytes == 6 * EXPERT_BYTES
    assert all(st.get((0, e)).digest() == digs[(0, e)] for e in range(5))  # held rows copied over
    check_weights(w1, 0)
    assert w1.w_gate.data_ptr() == old_ptr  # generation 1 keeps the old buffer alive until it retires
    # the grown buffer is new (no generation over it yet): the next generation is laid out plain again
    (w2,), _ = st.stack(manifest(2, [[4, 2, 0, 1, 3]], digs))
    assert not w2.row_mapped and w2.w_gate.data_ptr() != old_ptr
    check_weights(w2, 0)


def test_shared_rows_and_unplaced_rows_map_through_the_buffer():
    st = store(staging=0)
    digs = st.load([(0, e) for e in (2, 5, 1)], SRC)
    p2l = [[2, 5, 2] + [e for e in range(E) if e not in (1, 2, 5)] + [1]]
    ranks = [[0, 0, 0] + [1] * (E - 3) + [0]]
    m = manifest_from_assignment(generation=1, phy2log=p2l, slot_rank=ranks, num_experts=E,
                                 topology=Topology.single_node(2), digests=digs)
    (w,), keys = st.stack(m)
    assert w.row_mapped and w.experts == (2, 5, 2, 1) and w.rows == (0, 1, 0, 2)
    assert keys == {(0, 2), (0, 5), (0, 1)}
    check_weights(w, 0)


def test_refusals_change_nothing():
    st = store()
    digs = st.load([(0, 1), (0, 0)], SRC)
    rows = {k: st.row(k) for k in st.held()}
    with pytest.raises(ValueError, match="parameter_digest"):
        st.stack(manifest(1, [[0, 1]], {**digs, (0, 0): "other"}))
    with pytest.raises(ValueError, match="does not hold"):
        st.stack(manifest(1, [[0, 1, 2]], digs))
    assert {k: st.row(k) for k in st.held()} == rows  # nothing moved
    other = SRC.expert(0, 2)
    with pytest.raises(ValueError, match="already holds"):
        st.put({(0, 1): other})  # different bytes for a held key: a live generation may read that row
    assert st.get((0, 1)).digest() == digs[(0, 1)]
    assert st.put({(0, 1): SRC.expert(0, 1)}) == {(0, 1): digs[(0, 1)]}  # same bytes: held once, no write
    with pytest.raises(ValueError, match="w_gate"):
        st.put({(0, 5): SeededWeightSource(num_layers=1, num_experts=E, hidden_size=D, ffn_size=F + 4).expert(0, 5)})
    assert st.held() == [(0, 0), (0, 1)] and st.slab_info()[0]["used"] == 2
    with pytest.raises(ValueError, match="staging_slots"):
        ExpertStore(0, torch.device("cpu"), torch.float32, staging_slots=-1)


def test_exports_and_gets_never_alias_a_row():
    st = store()
    st.load([(0, 3), (0, 5)], SRC)
    row = st.row((0, 3))
    exported, got = st.export([(0, 3)])[(0, 3)], st.get((0, 3))
    st.drop([(0, 3)], set())
    st.load([(0, 6)], SRC)
    assert st.row((0, 6)) == row  # the freed row, rewritten
    assert torch.equal(exported.w_gate, SRC.expert(0, 3).w_gate) and torch.equal(got.w_up, SRC.expert(0, 3).w_up)


def test_dropping_a_layers_last_row_releases_its_buffers():
    st = store()
    st.load([(0, 0), (1, 0)], SRC)
    assert st.nbytes == 2 * 3 * EXPERT_BYTES
    st.drop([(0, 0)], live={(1, 0)})
    assert st.slab_info() == {1: {"capacity": 3, "used": 1, "free": 2}} and st.nbytes == 3 * EXPERT_BYTES
    st.drop([(1, 0)], live={(1, 0)})  # live: kept
    assert st.held() == [(1, 0)]


BASE = dict(num_ranks=4, num_experts=8, hidden_size=16, ffn_size=24, top_k=2, slots_per_rank=3, num_layers=1,
            seed=3, tagged_weights=True, residual=True, decode_token_capacity=4)


def _err(y, cfg, h, ids, w) -> float:
    ref = reference_output(cfg, h, ids, w)
    return float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0))


def test_rebalance_serves_exactly_over_slot_maps_within_the_staging_rows():
    dep = InProcessDeployment(RuntimeConfig(**BASE))
    g = torch.Generator().manual_seed(4)
    h = torch.randn(16, 16, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(16)])
    w = torch.rand(16, 2, generator=g)
    before = {r: c.status() for r, c in dep.cores.items()}
    for s in before.values():
        assert s["slot_buffers"][0]["free"] == dep.cfg.staging_slots and s["slot_buffer_grows"] == 0
        assert s["weight_bytes"] == s["slot_buffers"][0]["capacity"] * 3 * 16 * 24 * 4
    dep.plane.record_load(np.array([[40, 1, 1, 1, 30, 1, 1, 1]]), phase="prefill", generation=dep.generation)
    rep = dep.plane.apply(dep.plane.propose_rebalance(), reason="rebalance")
    dep.generation = rep.new_generation
    mapped = [c._gens[rep.new_generation].view.weights[0] for c in dep.cores.values()]
    assert any(x is not None and x.row_mapped for x in mapped)  # the translation path serves this generation
    for phase in (Phase.PREFILL, Phase.DECODE):
        y, res = dep.step(h, ids, w, phase=phase)
        assert not dep.errors(res) and _err(y, dep.cfg, h, ids, w) < 1e-4
    for r, c in dep.cores.items():
        s = c.status()
        info = s["slot_buffers"][0]
        assert info["used"] == len(c.store) and info["used"] + info["free"] == info["capacity"]
        # no grow: the buffers are the ones allocated at deploy; a grow is counted and reported
        assert (s["weight_bytes"] == before[r]["weight_bytes"]) == (s["slot_buffer_grows"] == 0)


def test_one_rank_replicas_share_a_row_on_the_device_offsets_path():
    """One rank, 10 slots over 8 experts: the replicas share their expert's row (held once), so the generation
    is row-mapped from the start; the local path (device-side offsets) and the bucket serve it exactly."""
    cfg = RuntimeConfig(**{**BASE, "num_ranks": 1, "slots_per_rank": 10, "decode_token_capacity": 16})
    dep = InProcessDeployment(cfg)
    core = dep.cores[0]
    w = core._gens[dep.generation].view.weights[0]
    assert w.row_mapped and w.num_slots == 10 and len(core.store) == 8
    assert core.status()["slot_buffers"] == {0: {"capacity": 8 + cfg.staging_slots, "used": 8,
                                                 "free": cfg.staging_slots}}
    g = torch.Generator().manual_seed(5)
    h = torch.randn(12, 16, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(12)])
    wt = torch.rand(12, 2, generator=g)
    for phase, path in ((Phase.PREFILL, "local"), (Phase.DECODE, "bucket")):
        y, res = dep.step(h, ids, wt, phase=phase)
        assert dep.paths(res) == {path} and not dep.errors(res)
        assert _err(y, cfg, h, ids, wt) < 1e-4


def test_parallel_load_equals_one_at_a_time(tmp_path):
    """A source that allows concurrent reads is read by several threads: the same rows and digests as one
    thread, in key order; bounded prefetch (the test source counts reads in flight)."""
    import threading

    from ray_moe.moe.experts.weights import SeededWeightSource
    from ray_moe.shard import expert_store as es

    class Counting(SeededWeightSource):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.lock, self.now, self.peak = threading.Lock(), 0, 0

        def expert(self, layer, expert):
            with self.lock:
                self.now += 1
                self.peak = max(self.peak, self.now)
            try:
                return super().expert(layer, expert)
            finally:
                with self.lock:
                    self.now -= 1

    kw = dict(num_layers=2, num_experts=24, hidden_size=16, ffn_size=8, seed=3)
    keys = [(layer, e) for layer in range(2) for e in range(24)]
    par_src = Counting(**kw)
    assert par_src.concurrent_reads
    par = es.ExpertStore(0, torch.device("cpu"), torch.float32)
    got = par.load(keys, par_src)
    seq_src = SeededWeightSource(**kw)
    seq_src.concurrent_reads = False
    seq = es.ExpertStore(0, torch.device("cpu"), torch.float32)
    want = seq.load(keys, seq_src)
    assert got == want and list(got) == keys
    for k in keys:
        a, b = par.get(k), seq.get(k)
        assert torch.equal(a.w_gate, b.w_gate) and torch.equal(a.w_down, b.w_down)
    assert 1 <= par_src.peak <= es.LOAD_THREADS


@pytest.mark.parametrize("concurrent", [True, False])
def test_a_load_holds_no_more_than_the_read_ahead(concurrent):
    """Weights read from a source are released once written into their rows: a load of many experts never
    holds more than the readers' read-ahead (the source counts its weights still alive at each read; a load
    that gathered every expert before writing held all 96 here, on the GPU twice the experts' bytes)."""
    import threading
    import weakref

    from ray_moe.shard import expert_store as es

    class Tracking(SeededWeightSource):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.lock, self.alive, self.peak = threading.Lock(), 0, 0

        def _gone(self):
            with self.lock:
                self.alive -= 1

        def expert(self, layer, expert):
            w = super().expert(layer, expert)
            with self.lock:
                self.alive += 1
                self.peak = max(self.peak, self.alive)
            weakref.finalize(w.w_gate, self._gone)
            return w

    src = Tracking(num_layers=4, num_experts=24, hidden_size=16, ffn_size=8, seed=5)
    src.concurrent_reads = concurrent
    keys = [(layer, e) for layer in range(4) for e in range(24)]
    st = es.ExpertStore(0, torch.device("cpu"), torch.float32)
    digests = st.load(keys, src)
    assert list(digests) == keys and st.get((3, 23)).w_gate.shape == (8, 16)
    bound = 2 * es.LOAD_THREADS + 2 if concurrent else 2
    assert 1 <= src.peak <= bound, f"{src.peak} experts' weights alive at once (read-ahead bound {bound})"
