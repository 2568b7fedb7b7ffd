"""The whole step's analytical ledgers, from declared shapes and rebuilt from the real dispatch handles of
the eight-route fixture (spec 0x03C1, 0x03D1-0x03D6, 0x0AD)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_moe_dev.analysis.step_ledger import StepLedger, ledger_from_handles
from ray_moe.moe.dispatch.engine import combine, dispatch
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.core.routes import RouteBatch
from ray_moe.placement.selector import ExplicitSelector
from ray_moe_dev.testing import fixtures as fx
from tests.dev.analysis.ledger_fixture import SLOT_COUNTS, SLOTS_PER_RANK, TOKENS, C, D


# ---------------------------------------------------------------------------------------------- whole step


def _golden(step: StepLedger) -> None:
    assert step.evidence == "analytical"
    assert (step.rows.useful_rows, step.rows.padded_rows, step.rows.padding_rows) == (8, 32, 24)
    assert (step.payload.staging_dispatch_bytes, step.payload.staging_combine_bytes) == (48, 48)
    assert (step.payload.remote_dispatch_bytes, step.payload.remote_combine_bytes) == (36, 36)
    t = step.transport
    assert (t.dispatch_meta_bytes, t.combine_meta_bytes, t.route_handle_bytes) == (48, 24, 256)
    assert (t.count_matrix_bytes, t.send_offsets_bytes, t.recv_splits_bytes) == (128, 160, 128)
    assert (t.local_expert_offsets_bytes, t.remote_logical_bytes) == (80, 144)
    assert (step.padding.padded_dispatch_bytes, step.padding.padded_round_trip_bytes) == (192, 384)
    assert (step.buffers.total_bytes, step.buffers.peak) == (1136, (904, 4))
    assert step.slot_counts == SLOT_COUNTS
    assert step.slots_per_rank == SLOTS_PER_RANK
    assert step.alignment is not None
    assert (step.alignment.executed_rows, step.alignment.align_waste_rows) == (24, 16)


def test_step_ledger_from_declared_shapes():
    _golden(StepLedger(C, SLOT_COUNTS, SLOTS_PER_RANK, TOKENS, D, row_alignment=4))


def test_step_ledger_rejects_non_conserving_slot_counts():
    with pytest.raises(ValueError, match="slot_counts: sum 9 != routes in the count matrix 8"):
        StepLedger(C, (3, 2, 1, 1, 1, 1), SLOTS_PER_RANK, TOKENS, D)


def _run_fixture_step():
    """The eight-route fixture through the real SPMD data path (local exchange, four ranks)."""
    snap = fx.snapshot()
    sel = ExplicitSelector({o: fx.route_tensors(o)[3] for o in (0, 1)})
    grp = LocalExchangeGroup(fx.flat_group())

    def step(ex):
        h, ids, g, _ = fx.route_tensors(ex.rank)
        out = dispatch(RouteBatch(ex.rank, h, ids, g), snap, ex, selector=sel, tag="ledger")
        slots = out.handle.receive.slot_ids
        scale = torch.tensor([fx.SCALES[int(snap.phy2log[q])] for q in slots.tolist()], dtype=out.rows.dtype)
        y = out.rows * torch.repeat_interleave(scale, out.expert_counts)[:, None]
        res = combine(y, out.handle, snap, ex, tag="ledger", out_dtype=torch.float64)
        return out.handle, res

    return grp.run(step)


@pytest.fixture(scope="module")
def fixture_step():
    return _run_fixture_step()


def test_ledger_from_real_handles(fixture_step):
    handles = [h for h, _ in fixture_step]
    for rank, (_, out) in enumerate(fixture_step):  # the data path really ran
        if rank in fx.EXPECTED_OUTPUT:
            assert torch.allclose(out, torch.tensor(fx.EXPECTED_OUTPUT[rank], dtype=torch.float64), rtol=1e-6)
    step = ledger_from_handles(handles, hidden_size=D, row_alignment=4)
    _golden(step)
    assert step.num_tokens == TOKENS
    d = step.as_dict()
    assert d["evidence"] == "analytical" and d["transport"]["remote_logical_bytes"] == 144
    assert d["buffers"]["peak_bytes"] == 904


def test_ledger_from_handles_order_independent(fixture_step):
    handles = [h for h, _ in fixture_step]
    a = ledger_from_handles(handles[::-1], hidden_size=D)
    assert a.counts == tuple(tuple(r) for r in C) and a.slot_counts == SLOT_COUNTS


def test_ledger_from_handles_rejects_inconsistent_inputs(fixture_step):
    handles = [h for h, _ in fixture_step]
    with pytest.raises(ValueError, match="handles: empty"):
        ledger_from_handles([], hidden_size=D)
    with pytest.raises(ValueError, match=r"handles: ranks \[0, 1, 2\] do not cover the 4 ranks"):
        ledger_from_handles(handles[:3], hidden_size=D)
    with pytest.raises(ValueError, match=r"handles\[3\].rank=2: two handles for one rank"):
        ledger_from_handles(handles[:3] + [handles[2]], hidden_size=D)
    other = torch.tensor(C)
    other[1, 3] = 2
    bad = dataclasses.replace(handles[2], count_matrix=other)
    with pytest.raises(ValueError, match=r"handles\[2\].count_matrix=.*differs from rank 0"):
        ledger_from_handles(handles[:2] + [bad] + handles[3:], hidden_size=D)
    short = dataclasses.replace(handles[1].receive, expert_counts=torch.tensor([2, 0]))
    bad = dataclasses.replace(handles[1], receive=short)
    with pytest.raises(ValueError, match=r"handles\[rank 1\].receive.expert_counts=\[2, 0\]: sum 2 != column sum 3"):
        ledger_from_handles([handles[0], bad] + handles[2:], hidden_size=D)
