"""Golden tests: every number of spec 0x02B1, 0x03A1-0x03C3, 0x07B (split vectors) and the 0x03E trace.

The fixture runs through the real data path (LocalExchangeGroup + engine.dispatch / combine with an
ExplicitSelector over Loop 2's frozen assignment, scalar experts E_e(x) = s_e x with s = [1, 2, 3, 4]).
The spec's numbers are pinned as literals; the naive loop reference (``ray_moe_dev.testing.reference``) is
checked against the same literals, and the mutation tests show the check is sensitive to each
coordinate (spec 0x03C3: "changing only a count, offset, stable order, split vector, local slot
offset, inverse route, or combined value causes the checked fixture to fail").
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from ray_moe.moe.dispatch.engine import combine, dispatch
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.moe.dispatch.plan import peer_split_vectors, semantic_from_send, source_major_from_expert
from ray_moe.core.routes import RouteBatch
from ray_moe.placement.manifest import manifest_from_assignment
from ray_moe.placement.selector import ExplicitSelector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe_dev.testing import fixtures as fx
from ray_moe_dev.testing.reference import (
    naive_plan,
    naive_round_trip,
    naive_scalar_experts_output,
    replay_plan_scalar,
    scalar_expert_rows,
)

# ------------------------------------------------------------------------------- golden numbers
ROUTE_IDS = [f"r0{i}" for i in range(8)]
COUNT_MATRIX = [[1, 2, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
ROW_SUMS = [4, 4, 0, 0]
COL_SUMS = [2, 3, 2, 1]
SEND_OFFSETS = {0: [0, 1, 3, 4, 4], 1: [0, 1, 2, 3, 4], 2: [0, 0, 0, 0, 0], 3: [0, 0, 0, 0, 0]}
SEND_SEGMENTS = {  # per destination rank 0..3 (flat group)
    0: [["r00"], ["r02", "r01"], ["r03"], []],
    1: [["r05"], ["r07"], ["r06"], ["r04"]],
    2: [[], [], [], []],
    3: [[], [], [], []],
}
RECV_SPLITS = {0: [1, 1, 0, 0], 1: [2, 1, 0, 0], 2: [1, 1, 0, 0], 3: [0, 1, 0, 0]}
RECV_ROUTES = {0: ["r00", "r05"], 1: ["r02", "r01", "r07"], 2: ["r03", "r06"], 3: ["r04"]}
LOCAL_REPACK = {  # rank -> [(slot, routes)] in local slot order
    0: [(0, ["r00", "r05"])],
    1: [(1, ["r02", "r07"]), (2, ["r01"])],
    2: [(3, ["r06"]), (4, ["r03"])],
    3: [(5, ["r04"])],
}
LOCAL_COUNTS = {0: [2], 1: [2, 1], 2: [1, 1], 3: [1]}
LOCAL_OFFSETS = {0: [0, 2], 1: [0, 2, 3], 2: [0, 1, 2], 3: [0, 1]}
GLOBAL_SLOT_COUNTS = [2, 2, 1, 1, 1, 1]
GLOBAL_SLOT_OFFSETS = [0, 2, 4, 5, 6, 7, 8]
LOGICAL_COUNTS = [4, 2, 1, 1]
SLOT_COUNTS_BY_NAME = {"q0": 2, "q1": 2, "q2": 1, "q3": 1, "q4": 1, "q5": 1}
RANK_COUNTS = {0: 2, 1: 3, 2: 2, 3: 1}
OUTPUT = {0: [[1.35, 13.5, 135.0], [3.20, 32.0, 320.0]], 1: [[8.22, 82.2, 822.0], [6.20, 62.0, 620.0]]}
# spec 0x07B: peer order [2, 0, 3, 1]
PERMUTED_SEND = {0: [1, 1, 0, 2], 1: [1, 1, 1, 1], 2: [0, 0, 0, 0], 3: [0, 0, 0, 0]}
PERMUTED_RECV_RANK1 = [0, 2, 0, 1]


def _code(name: str) -> float:
    return float(int(name[1:]))


def _names(origin: int, idx) -> list[str]:
    return [fx.route_name(origin, int(i)) for i in idx]


def _assert_rows(actual: torch.Tensor, expected, *, rtol=1e-6, atol=1e-5):
    torch.testing.assert_close(actual.to(torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------- the real path
def _fixture_step(snap, *, scales=fx.SCALES, gates=None, slots=None, route_codes=None):
    """One SPMD step over the fixture. ``gates``/``slots`` override per origin; ``route_codes`` maps a
    rank to the route names of its expert-major rows (identity-tagging experts for the round trip)."""
    sel = ExplicitSelector({p: (slots or {}).get(p, fx.route_tensors(p)[3]) for p in (0, 1)})
    phy2log = snap.phy2log.tolist()

    def step(ex):
        h, ids, w, _ = fx.route_tensors(ex.rank)
        if gates is not None and ex.rank in gates:
            w = torch.tensor(gates[ex.rank], dtype=torch.float32)
        out = dispatch(RouteBatch(ex.rank, h, ids, w), snap, ex, selector=sel, tag="fx")
        slot_ids = out.handle.receive.slot_ids.tolist()
        y_rows = scalar_expert_rows(out.rows, out.counts_list, slot_ids, phy2log, scales)
        res = {"out": out, "handle": out.handle, "rows_in": out.rows.clone(), "hidden": h}
        if route_codes is not None:
            # expert output row i = the code of the route the spec places at expert position i
            tag = torch.tensor([[_code(n), 10 * _code(n), 100 * _code(n)] for n in route_codes[ex.rank]],
                               dtype=h.dtype).reshape(-1, 3)
            back = source_major_from_expert(tag, out.handle.receive)
            got = ex.all_to_all_v("rt/return", {"y": back}, out.handle.receive.recv_counts.tolist(),
                                  out.handle.source.send_counts.tolist())
            res["semantic"] = semantic_from_send(got["y"], out.handle.source)
        res["y"] = combine(y_rows, out.handle, snap, ex, tag="fx", out_dtype=h.dtype)
        return res

    return step


@functools.lru_cache(maxsize=None)
def _run(group_name: str = "flat"):
    group = fx.flat_group() if group_name == "flat" else fx.permuted_group()
    snap = fx.snapshot(group)
    codes = {u: [n for _, names in LOCAL_REPACK[u] for n in names] for u in range(4)}
    return snap, LocalExchangeGroup(group).run(_fixture_step(snap, route_codes=codes))


def _fixture_naive(group=None) -> dict:
    snap = fx.snapshot(group)
    experts = {p: fx.route_tensors(p)[1].reshape(-1).tolist() for p in (0, 1)}
    slots = {p: fx.route_tensors(p)[3].tolist() for p in (0, 1)}
    return naive_plan(experts, slots, snap)


def _exact_gates() -> dict[int, list[float]]:
    """The spec's gates as Python floats, semantic order per origin (the route table is in that order)."""
    return {p: [r[5] for r in fx.EIGHT_ROUTES if r[1] == p] for p in (0, 1)}


def _replay(plan: dict, gates=None) -> dict:
    hidden = {p: fx.HIDDEN.get(p, []) for p in range(4)}
    tokens = {p: [t for t in range(2) for _ in range(2)] for p in (0, 1)}
    g = gates or _exact_gates()
    snap = fx.snapshot()
    scale = [fx.SCALES[int(e)] for e in snap.phy2log.tolist()]
    return replay_plan_scalar(plan, hidden, tokens, g, scale)


# ------------------------------------------------------------------------------- 0x03A1
def test_eight_route_relation_0x03A1():
    """The columnar relation: route ids, origins, route slots, experts, gates, slots, destinations."""
    snap = fx.snapshot()
    table = []
    for p in (0, 1):
        h, ids, w, slots = fx.route_tensors(p)
        assert h.tolist() == fx.HIDDEN[p]
        for r in range(4):
            t, j = divmod(r, 2)
            q = int(slots[r])
            table.append((fx.route_name(p, r), p, t, j, int(ids[t, j]), round(float(w[t, j]), 2), q,
                          int(snap.slot_rank[q])))
    assert table == [
        ("r00", 0, 0, 0, 0, 0.65, 0, 0),
        ("r01", 0, 0, 1, 1, 0.35, 2, 1),
        ("r02", 0, 1, 0, 0, 0.70, 1, 1),
        ("r03", 0, 1, 1, 2, 0.30, 4, 2),
        ("r04", 1, 0, 0, 3, 0.58, 5, 3),
        ("r05", 1, 0, 1, 0, 0.42, 0, 0),
        ("r06", 1, 1, 0, 1, 0.55, 3, 2),
        ("r07", 1, 1, 1, 0, 0.45, 1, 1),
    ]
    assert fx.HIDDEN == {0: [[1, 10, 100], [2, 20, 200]], 1: [[3, 30, 300], [4, 40, 400]]}
    # every row checked against the immutable slot manifest (compatibility, 0x03A1 / 0x01D1)
    manifest = fx.six_slot_manifest()
    for name, p, _, _, e, _, q, u in table:
        slot = manifest.layer_slots()[q]
        assert slot.logical_expert_id == e and slot.destination_rank == u, name
    # ranks 2 and 3 own no input partition but stay members of the four-rank group
    for p in (2, 3):
        h, ids, w, slots = fx.route_tensors(p)
        assert h.shape == (0, 3) and ids.shape == (0, 2) and slots.numel() == 0
    assert fx.flat_group().size == 4


def test_handle_keeps_semantic_columns():
    snap, res = _run()
    h0 = res[0]["handle"]
    assert h0.routes.origin_token.tolist() == [0, 0, 1, 1]
    assert h0.routes.route_slot.tolist() == [0, 1, 0, 1]
    assert h0.routes.logical_expert.tolist() == [0, 1, 0, 2]
    torch.testing.assert_close(h0.routes.gate, torch.tensor([0.65, 0.35, 0.70, 0.30]))
    assert res[1]["handle"].routes.logical_expert.tolist() == [3, 0, 1, 0]
    assert res[1]["handle"].source.physical_slot.tolist() == [5, 0, 3, 1]
    assert h0.source.physical_slot.tolist() == [0, 2, 1, 4]
    assert h0.generation == 17 and h0.placement_version == "placement-v17"
    assert h0.checkpoint_version == "checkpoint-0042" and h0.process_group_id == "ep-group-0"


# ------------------------------------------------------------------------------- 0x03B
def test_count_matrix_0x03B():
    _, res = _run()
    for u in range(4):
        c = res[u]["handle"].count_matrix
        assert c.tolist() == COUNT_MATRIX, f"rank {u}"
        assert c.sum(1).tolist() == ROW_SUMS
        assert c.sum(0).tolist() == COL_SUMS
        assert int(c.sum()) == 8
    for p in range(4):
        assert res[p]["handle"].source.counts_by_rank.tolist() == COUNT_MATRIX[p]


def test_send_offsets_0x03B():
    _, res = _run()
    for p in range(4):
        src = res[p]["handle"].source
        assert src.send_offsets.tolist() == SEND_OFFSETS[p], f"rank {p}"
        assert src.send_counts.tolist() == COUNT_MATRIX[p]
        assert int(src.send_offsets[-1]) == ROW_SUMS[p]  # the sentinel is R_p


def test_send_orders_0x03B():
    _, res = _run()
    for p in range(4):
        src = res[p]["handle"].source
        offs = src.send_offsets.tolist()
        segs = [_names(p, src.send_order[offs[u]:offs[u + 1]]) if p in (0, 1) else [] for u in range(4)]
        assert segs == SEND_SEGMENTS[p], f"rank {p}"
    # send slots follow (destination, slot, semantic position)
    assert res[0]["handle"].source.send_slot.tolist() == [0, 1, 2, 4]
    assert res[1]["handle"].source.send_slot.tolist() == [0, 1, 3, 5]
    assert res[0]["handle"].source.inverse_send.tolist() == [0, 2, 1, 3]
    assert res[1]["handle"].source.inverse_send.tolist() == [3, 0, 2, 1]


# ------------------------------------------------------------------------------- 0x03C1
def _receive_names(res, u):
    """Receive order of rank u composed from every source's real send plan (source-major, peer order)."""
    handles = [r["handle"] for r in res]
    group = handles[0].count_matrix.shape[0]
    names = []
    peer_u = fx.flat_group().peer_of(u)
    for src in range(group):
        sp = handles[src].source
        a, b = int(sp.send_offsets[peer_u]), int(sp.send_offsets[peer_u + 1])
        names += _names(src, sp.send_order[a:b])
    return names


def test_receive_splits_0x03C1():
    snap, res = _run()
    for u in range(4):
        rec = res[u]["handle"].receive
        assert rec.recv_counts.tolist() == RECV_SPLITS[u], f"rank {u}"
        assert rec.recv_offsets.tolist()[-1] == COL_SUMS[u]
        names = _receive_names(res, u)
        assert names == RECV_ROUTES[u]
        # the slots that actually arrived, source-major, are those routes' slots
        slot_of = {fx.route_name(p, r): int(fx.route_tensors(p)[3][r]) for p in (0, 1) for r in range(4)}
        assert rec.recv_slot.tolist() == [slot_of[n] for n in names]
    # S^recv_{u,p} = C_{p,u}: the split vectors are the transpose of the count matrix
    c = torch.tensor(COUNT_MATRIX)
    send, recv = peer_split_vectors(c, snap.peer_order)
    assert send.tolist() == COUNT_MATRIX
    assert recv.tolist() == [RECV_SPLITS[u] for u in range(4)]


def test_padded_row_slots_0x03C1():
    """Uniform padding of all P^2 cells to the max split: 32 row slots, 8 useful, 24 padding."""
    _, res = _run()
    c = res[0]["handle"].count_matrix
    p = c.shape[0]
    padded = p * p * int(c.max())
    assert (p, int(c.max()), padded, int(c.sum()), padded - int(c.sum())) == (4, 2, 32, 8, 24)


# ------------------------------------------------------------------------------- 0x03C2
def test_local_repack_0x03C2():
    _, res = _run()
    route_token = {fx.route_name(p, r): (p, r // 2) for p in (0, 1) for r in range(4)}
    for u in range(4):
        rec = res[u]["handle"].receive
        assert rec.slot_ids.tolist() == [q for q, _ in LOCAL_REPACK[u]], f"rank {u}"
        assert rec.expert_counts.tolist() == LOCAL_COUNTS[u]
        assert res[u]["out"].counts_list == tuple(LOCAL_COUNTS[u])
        assert res[u]["out"].expert_counts.tolist() == LOCAL_COUNTS[u]
        assert rec.expert_offsets.tolist() == LOCAL_OFFSETS[u]
        recv_names = _receive_names(res, u)
        expert_names = [recv_names[i] for i in rec.expert_order.tolist()]
        assert expert_names == [n for _, names in LOCAL_REPACK[u] for n in names]
        # the payload rows the runner sees, expert-major, are those routes' hidden rows
        want = [fx.HIDDEN[route_token[n][0]][route_token[n][1]] for n in expert_names]
        if want:
            _assert_rows(res[u]["rows_in"], want, rtol=0, atol=0)
        else:
            assert res[u]["rows_in"].shape == (0, 3)


def test_global_slot_counts_and_ledgers_0x02B1():
    snap, res = _run()
    counts = [c for u in range(4) for c in res[u]["handle"].receive.expert_counts.tolist()]
    slots = [q for u in range(4) for q in res[u]["handle"].receive.slot_ids.tolist()]
    assert slots == [0, 1, 2, 3, 4, 5]
    assert counts == GLOBAL_SLOT_COUNTS
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    assert offs == GLOBAL_SLOT_OFFSETS
    # the three ledgers: logical experts, physical slots, destination ranks
    logical = [0, 0, 0, 0]
    by_slot = {}
    for u in range(4):
        for q in res[u]["handle"].receive.recv_slot.tolist():
            logical[int(snap.phy2log[q])] += 1
            by_slot[f"q{q}"] = by_slot.get(f"q{q}", 0) + 1
    assert logical == LOGICAL_COUNTS
    assert by_slot == SLOT_COUNTS_BY_NAME
    assert {u: res[u]["handle"].receive.num_rows for u in range(4)} == RANK_COUNTS
    # router-side logical counts (before placement) are the same [4, 2, 1, 1]
    router = [0, 0, 0, 0]
    for p in (0, 1):
        for e in fx.route_tensors(p)[1].reshape(-1).tolist():
            router[e] += 1
    assert router == LOGICAL_COUNTS
    # conservation (0x01B): sum n_e = sum n_q = T k = 8
    assert sum(logical) == sum(counts) == sum(RANK_COUNTS.values()) == 2 * 2 * 2


# ------------------------------------------------------------------------------- 0x03C3
def test_round_trip_identity_0x03C3():
    """Expert rows are tagged with the route the spec places at each expert position; after the real
    inverse repack, return exchange and inverse send, the tags arrive in semantic order r00..r07."""
    _, res = _run()
    restored = []
    for p in (0, 1):
        sem = res[p]["semantic"]
        restored += [f"r0{int(round(float(v)))}" for v in sem[:, 0].tolist()]
        _assert_rows(sem, [[_code(n), 10 * _code(n), 100 * _code(n)] for n in ROUTE_IDS[4 * p:4 * p + 4]],
                     rtol=0, atol=0)
    assert restored == ROUTE_IDS
    for p in (2, 3):
        assert res[p]["semantic"].shape == (0, 3)


def test_combined_output_0x03C3():
    _, res = _run()
    for p in (0, 1):
        y = res[p]["y"]
        assert y.dtype == torch.float64 and y.shape == (2, 3)
        _assert_rows(y, OUTPUT[p])
    for p in (2, 3):
        assert res[p]["y"].shape == (0, 3)
    # direct semantic execution (the naive oracle) produces the same numbers
    for p in (0, 1):
        h, ids, w, _ = fx.route_tensors(p)
        direct = naive_scalar_experts_output(h, ids, w, fx.SCALES)
        _assert_rows(torch.tensor(direct), OUTPUT[p], rtol=1e-7, atol=1e-6)
    assert fx.EXPECTED_OUTPUT == OUTPUT


def test_replica_choice_does_not_change_output():
    """r01 may use either replica of E1 (q2 on rank 1 or q3 on rank 2): the function is unchanged."""
    snap = fx.snapshot()
    slots = {0: torch.tensor([0, 3, 1, 4]), 1: fx.route_tensors(1)[3]}
    res = LocalExchangeGroup(fx.flat_group()).run(_fixture_step(snap, slots=slots))
    assert res[0]["handle"].count_matrix.tolist() == [[1, 1, 2, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    for p in (0, 1):
        _assert_rows(res[p]["y"], OUTPUT[p])


def test_real_path_is_sensitive_to_gate_and_expert():
    snap = fx.snapshot()
    # one gate changed (r00: 0.65 -> 0.60): p0.t0 changes, nothing else does
    res = LocalExchangeGroup(fx.flat_group()).run(
        _fixture_step(snap, gates={0: [[0.60, 0.35], [0.70, 0.30]]}))
    _assert_rows(res[0]["y"][0:1], [[1.30, 13.0, 130.0]])
    _assert_rows(res[0]["y"][1:], OUTPUT[0][1:])
    _assert_rows(res[1]["y"], OUTPUT[1])
    # wrong expert scales (E0 and E1 swapped): the checked output no longer matches
    res = LocalExchangeGroup(fx.flat_group()).run(_fixture_step(snap, scales=(2.0, 1.0, 3.0, 4.0)))
    assert not torch.allclose(res[0]["y"], torch.tensor(OUTPUT[0], dtype=torch.float64))


# ------------------------------------------------------------------------------- naive reference
def test_naive_plan_pins_the_fixture():
    plan = _fixture_naive()
    assert plan["count_matrix"] == COUNT_MATRIX
    assert plan["row_sums"] == ROW_SUMS and plan["col_sums"] == COL_SUMS
    assert plan["send_offsets"] == SEND_OFFSETS
    for p in (0, 1):
        offs = plan["send_offsets"][p]
        segs = [_names(p, plan["send_order"][p][offs[u]:offs[u + 1]]) for u in range(4)]
        assert segs == SEND_SEGMENTS[p]
    assert plan["recv_counts"] == RECV_SPLITS
    assert {u: [fx.route_name(p, r) for p, r in plan["recv_routes"][u]] for u in range(4)} == RECV_ROUTES
    for u in range(4):
        assert plan["slot_ids"][u] == [q for q, _ in LOCAL_REPACK[u]]
        assert [fx.route_name(p, r) for p, r in plan["expert_routes"][u]] == \
            [n for _, names in LOCAL_REPACK[u] for n in names]
    assert plan["expert_counts"] == LOCAL_COUNTS and plan["expert_offsets"] == LOCAL_OFFSETS
    assert plan["slot_counts"] == GLOBAL_SLOT_COUNTS and plan["slot_offsets"] == GLOBAL_SLOT_OFFSETS
    assert plan["logical_counts"] == LOGICAL_COUNTS
    assert plan["rank_counts"] == [RANK_COUNTS[u] for u in range(4)]
    restored = naive_round_trip(plan)
    assert [fx.route_name(p, r) for p in (0, 1) for r in restored[p]] == ROUTE_IDS
    y = _replay(plan)
    for p in (0, 1):
        _assert_rows(torch.tensor(y[p], dtype=torch.float64), OUTPUT[p], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("group_name", ["flat", "permuted"])
def test_real_plan_equals_naive_plan(group_name):
    group = fx.flat_group() if group_name == "flat" else fx.permuted_group()
    snap, res = _run(group_name)
    plan = _fixture_naive(group)
    for u in range(4):
        h = res[u]["handle"]
        assert h.count_matrix.tolist() == plan["count_matrix"]
        assert h.source.send_counts.tolist() == plan["send_counts"][u]
        assert h.source.send_offsets.tolist() == plan["send_offsets"][u]
        assert h.source.send_order.tolist() == plan["send_order"][u]
        assert h.source.inverse_send.tolist() == plan["inverse_send"][u]
        assert h.source.send_slot.tolist() == plan["send_slot"][u]
        assert h.receive.recv_counts.tolist() == plan["recv_counts"][u]
        assert h.receive.recv_offsets.tolist() == plan["recv_offsets"][u]
        assert h.receive.recv_slot.tolist() == plan["recv_slot"][u]
        assert h.receive.slot_ids.tolist() == plan["slot_ids"][u]
        assert h.receive.expert_order.tolist() == plan["expert_order"][u]
        assert h.receive.expert_counts.tolist() == plan["expert_counts"][u]
        assert h.receive.expert_offsets.tolist() == plan["expert_offsets"][u]


# ------------------------------------------------------------------------------- 0x07B
def test_peer_order_split_vectors_0x07B():
    snap, res = _run("permuted")
    assert snap.peer_order.tolist() == [2, 0, 3, 1]
    for p in range(4):
        h = res[p]["handle"]
        assert h.source.send_counts.tolist() == PERMUTED_SEND[p], f"rank {p}"
        assert h.count_matrix.tolist() == COUNT_MATRIX  # the global-rank matrix is unchanged
    assert res[1]["handle"].receive.recv_counts.tolist() == PERMUTED_RECV_RANK1
    assert res[1]["handle"].receive.recv_counts.tolist() != [2, 1, 0, 0]
    # source 0's vector in global destination order vs peer order
    assert COUNT_MATRIX[0] == [1, 2, 1, 0] and res[0]["handle"].source.send_counts.tolist() == [1, 1, 0, 2]
    send, recv = peer_split_vectors(torch.tensor(COUNT_MATRIX), snap.peer_order)
    assert send.tolist() == [PERMUTED_SEND[u] for u in range(4)]
    assert recv[1].tolist() == PERMUTED_RECV_RANK1
    # zero-count peers stay in every vector
    assert all(len(res[p]["handle"].source.send_counts) == 4 for p in range(4))
    # outputs are unchanged, and so is the round trip
    for p in (0, 1):
        _assert_rows(res[p]["y"], OUTPUT[p])
    restored = [f"r0{int(round(float(v)))}" for p in (0, 1) for v in res[p]["semantic"][:, 0].tolist()]
    assert restored == ROUTE_IDS
    plan = _fixture_naive(fx.permuted_group())
    assert plan["send_counts"] == PERMUTED_SEND and plan["recv_counts"][1] == PERMUTED_RECV_RANK1


def test_peer_order_confusion_is_caught():
    """Sending the global-order vector [1,2,1,0] on a [2,0,3,1] group conserves the row count but the
    checked fixture fails."""
    plan = _fixture_naive(fx.permuted_group())
    bad = copy.deepcopy(plan)
    bad["send_counts"][0] = [1, 2, 1, 0]
    bad["send_offsets"][0] = [0, 1, 3, 4, 4]
    assert sum(bad["send_counts"][0]) == 4
    assert _fixture_failures(bad)


# ------------------------------------------------------------------------------- mutation tests
def _fixture_failures(plan: dict, gates=None, expected=None) -> list[str]:
    """The checked fixture: internal consistency of the plan + the replayed output vs the golden one."""
    fails: list[str] = []
    n = plan["num_ranks"]
    po = plan["peer_order"]
    c = plan["count_matrix"]
    slot_rank = fx.snapshot().slot_rank.tolist()
    for p in range(n):
        r_p = len(plan["send_order"][p])
        if sum(c[p]) != r_p:
            fails.append(f"row sum C[{p}] != R_{p}")
        if plan["send_counts"][p] != [c[p][po[i]] for i in range(n)]:
            fails.append(f"send_counts[{p}] is not C[{p}] in peer order")
        offs = [0]
        for x in plan["send_counts"][p]:
            offs.append(offs[-1] + x)
        if plan["send_offsets"][p] != offs:
            fails.append(f"send_offsets[{p}] is not the exclusive prefix")
        if sorted(plan["send_order"][p]) != list(range(r_p)):
            fails.append(f"send_order[{p}] is not a permutation")
        elif [plan["send_order"][p][i] for i in plan["inverse_send"][p]] != list(range(r_p)):
            fails.append(f"inverse_send[{p}] is not the inverse")
        slots = fx.route_tensors(p)[3].tolist() if p in (0, 1) else []
        key = [(po.index(slot_rank[slots[r]]), slots[r], r) for r in plan["send_order"][p]]
        if key != sorted(key):
            fails.append(f"send_order[{p}] is not stable by (destination, slot, position)")
    for u in range(n):
        if plan["recv_counts"][u] != [c[po[i]][u] for i in range(n)]:
            fails.append(f"recv_counts[{u}] is not column {u} of C in peer order")
        offs = [0]
        for x in plan["expert_counts"][u]:
            offs.append(offs[-1] + x)
        if plan["expert_offsets"][u] != offs:
            fails.append(f"expert_offsets[{u}] is not the prefix of expert_counts")
    try:
        restored = naive_round_trip(plan)
        if any(restored[p] != list(range(len(plan["send_order"][p]))) for p in range(n)):
            fails.append("round trip is not the identity")
    except (ValueError, TypeError, IndexError) as exc:
        fails.append(f"round trip failed: {exc}")
    try:
        y = _replay(plan, gates)
        want = expected or OUTPUT
        for p in (0, 1):
            if not torch.allclose(torch.tensor(y[p], dtype=torch.float64),
                                  torch.tensor(want[p], dtype=torch.float64), rtol=1e-9, atol=1e-9):
                fails.append(f"output of p{p} differs")
    except (ValueError, TypeError, IndexError) as exc:
        fails.append(f"replay failed: {exc}")
    return fails


def _swap(lst, i, j):
    lst[i], lst[j] = lst[j], lst[i]


MUTATIONS = {
    "count": lambda pl: pl["count_matrix"][0].__setitem__(1, 3),
    "send_offset": lambda pl: pl["send_offsets"][0].__setitem__(2, 2),
    "send_order": lambda pl: (_swap(pl["send_order"][0], 1, 2), _swap(pl["inverse_send"][0], 1, 2)),
    "split_vector": lambda pl: pl["recv_counts"].__setitem__(1, [1, 2, 0, 0]),
    "send_split_vector": lambda pl: pl["send_counts"].__setitem__(1, [1, 1, 2, 0]),
    "expert_order": lambda pl: _swap(pl["expert_order"][1], 1, 2),
    "local_slot_offset": lambda pl: pl["expert_offsets"][1].__setitem__(1, 1),
    "local_slot_count": lambda pl: pl["expert_counts"][2].__setitem__(0, 2),
    "inverse_route": lambda pl: _swap(pl["inverse_send"][0], 0, 1),
    "local_slot_ids": lambda pl: _swap(pl["slot_ids"][2], 0, 1),
}


def test_unmutated_fixture_passes_the_check():
    assert _fixture_failures(_fixture_naive()) == []
    assert _fixture_failures(_fixture_naive(fx.permuted_group())) == []


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_one_mutation_fails_the_check(name):
    plan = _fixture_naive()
    bad = copy.deepcopy(plan)
    MUTATIONS[name](bad)
    assert bad != plan
    assert _fixture_failures(bad), f"mutation {name!r} went unnoticed"
    assert _fixture_failures(plan) == []  # the copy was mutated, not the original


def test_gate_mutation_fails_the_check():
    plan = _fixture_naive()
    gates = _exact_gates()
    gates[1][2] += 0.01  # r06
    assert _fixture_failures(plan, gates=gates)


def test_combined_value_mutation_fails_the_check():
    plan = _fixture_naive()
    want = copy.deepcopy(OUTPUT)
    want[1][0][1] = 82.3
    assert _fixture_failures(plan, expected=want)


def test_output_mutations_change_replayed_values():
    """Not only a raised error: the orders and offsets that still fit produce different numbers."""
    plan = _fixture_naive()
    base = _replay(plan)
    for name in ("send_order", "expert_order", "local_slot_offset", "inverse_route", "local_slot_ids"):
        bad = copy.deepcopy(plan)
        MUTATIONS[name](bad)
        y = _replay(bad)
        assert y != base, name


# ------------------------------------------------------------------------------- 0x03E
def _two_rank_trace():
    topo = Topology.single_node(2)
    manifest = manifest_from_assignment(generation=3, phy2log=[[0, 1]], slot_rank=[[0, 1]], num_experts=2,
                                        topology=topo, process_group_id="ep-group-0")
    group = ProcessGroupSpec.identity(2)
    snap = PlacementSnapshot.from_manifest(manifest, topo, group)
    ids = {0: [[0, 1], [1, 0]], 1: [[1, 0], [1, 0]]}
    gates = {0: [[0.6, 0.4], [0.7, 0.3]], 1: [[0.8, 0.2], [0.9, 0.1]]}
    hidden = {0: [[1.0, 10.0], [2.0, 20.0]], 1: [[3.0, 30.0], [4.0, 40.0]]}
    scales = (1.0, 2.0)
    sel = ExplicitSelector({p: torch.tensor(ids[p]).reshape(-1) for p in (0, 1)})  # slot q == expert e

    def step(ex):
        p = ex.rank
        h = torch.tensor(hidden[p], dtype=torch.float32)
        out = dispatch(RouteBatch(p, h, torch.tensor(ids[p]), torch.tensor(gates[p])), snap, ex,
                       selector=sel, tag="trace")
        rows = scalar_expert_rows(out.rows, out.counts_list, out.handle.receive.slot_ids.tolist(),
                                  snap.phy2log.tolist(), scales)
        back = source_major_from_expert(rows, out.handle.receive)
        got = ex.all_to_all_v("trace-rt/return", {"y": back}, out.handle.receive.recv_counts.tolist(),
                              out.handle.source.send_counts.tolist())
        semantic = semantic_from_send(got["y"], out.handle.source)
        y = combine(rows, out.handle, snap, ex, tag="trace", out_dtype=h.dtype)
        return out.handle, semantic, y

    return LocalExchangeGroup(group).run(step), hidden, gates, ids, scales


def test_two_rank_trace_0x03E():
    res, hidden, gates, ids, scales = _two_rank_trace()
    h0, h1 = res[0][0], res[1][0]
    # each rank has four routed rows; keeps two, sends two
    assert h0.count_matrix.tolist() == [[2, 2], [2, 2]]
    assert h0.source.send_counts.tolist() == [2, 2] and h1.source.send_counts.tolist() == [2, 2]
    assert h0.receive.recv_counts.tolist() == [2, 2] and h1.receive.recv_counts.tolist() == [2, 2]
    assert h0.source.send_order.tolist() == [0, 3, 1, 2]  # t0/e0, t1/e0 | t0/e1, t1/e1
    assert h1.source.send_order.tolist() == [1, 3, 0, 2]
    # each returned row recovers origin rank, origin token, route slot and gate
    for p, (h, semantic, _) in enumerate(res):
        assert h.rank == p
        assert h.routes.origin_token.tolist() == [0, 0, 1, 1]
        assert h.routes.route_slot.tolist() == [0, 1, 0, 1]
        torch.testing.assert_close(h.routes.gate, torch.tensor(gates[p]).reshape(-1))
        want = [[scales[ids[p][t][j]] * v for v in hidden[p][t]] for t in range(2) for j in range(2)]
        _assert_rows(semantic, want)
    # combined outputs: y = sum_j g_j s_{e_j} h_t
    _assert_rows(res[0][2], [[1.4, 14.0], [3.4, 34.0]])
    _assert_rows(res[1][2], [[5.4, 54.0], [7.6, 76.0]])
    # combining only by token id collides p0.t0 with p1.t0; dropping the route slot loses a route
    by_token = [[0.0, 0.0], [0.0, 0.0]]
    by_rank_token: dict[tuple[int, int], list[float]] = {}
    for p, (h, semantic, _) in enumerate(res):
        for r in range(4):
            t = int(h.routes.origin_token[r])
            g = float(h.routes.gate[r])
            row = [g * float(v) for v in semantic[r]]
            by_token[t] = [a + b for a, b in zip(by_token[t], row)]
            by_rank_token[(p, t)] = row  # keyed without the route slot: the second route overwrites
    y0, y1 = res[0][2].double(), res[1][2].double()
    assert not torch.allclose(torch.tensor(by_token, dtype=torch.float64), y0)
    assert not torch.allclose(torch.tensor(by_token, dtype=torch.float64), y1)
    assert not torch.allclose(torch.tensor(by_rank_token[(0, 0)], dtype=torch.float64), y0[0])
