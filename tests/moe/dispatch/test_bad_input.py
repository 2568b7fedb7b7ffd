"""Bad input is rejected before any payload moves (spec 0x01D1, 0x03A1, 0x0E "abort before payload
exchange").

Every rank's endpoint is wrapped in a spy that records its collective calls. A bad batch on one rank
must raise an error naming the field and the value on that rank, every other rank must abort in the
same control round, and no rank may have called ``all_to_all_v``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from ray_moe.shard.fault_wrappers import FaultyExchange, ShardFault
from ray_moe.moe.dispatch.engine import dispatch
from ray_moe.moe.dispatch.protocol import ControlStatus
from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.exchange.local import LocalExchangeGroup
from ray_moe.core.routes import RouteBatch
from ray_moe.core.errors import CountAgreementError, RouteValidationError, StaleGenerationError
from ray_moe.placement.selector import ExplicitSelector
from ray_moe_dev.testing import fixtures as fx


class SpyExchange(Exchange):
    """Delegates to a real endpoint and records (rank, collective, tag) of every call."""

    def __init__(self, inner: Exchange, log: list) -> None:
        self._inner = inner
        self._log = log
        self.rank = inner.rank
        self.group = inner.group

    def all_gather(self, tag, vec):
        self._log.append((self.rank, "all_gather", tag))
        return self._inner.all_gather(tag, vec)

    def all_to_all_v(self, tag, tensors, send_splits, recv_splits):
        self._log.append((self.rank, "all_to_all_v", tag))
        return self._inner.all_to_all_v(tag, tensors, send_splits, recv_splits)


def _batch(rank: int) -> RouteBatch:
    h, ids, w, _ = fx.route_tensors(rank)
    return RouteBatch(rank, h, ids, w)


def _frozen_slots() -> dict[int, torch.Tensor]:
    return {p: fx.route_tensors(p)[3] for p in (0, 1)}


def _run_step(*, batches=None, slots=None, snapshots=None, status=None, count_fault=None, timeout_s=10.0):
    """Run one dispatch on the fixture's four ranks; each rank returns its output or the exception it
    raised. Returns (per-rank results, spy log)."""
    group = fx.flat_group()
    default_snap = fx.snapshot(group)
    sel = ExplicitSelector(slots if slots is not None else _frozen_slots())
    log: list = []

    def step(ex):
        r = ex.rank
        # the count fault is an exchange wrapper (as a shard installs it), under the spy
        inner = FaultyExchange(ex, frozenset({ShardFault.COUNT})) if (count_fault or {}).get(r) else ex
        spy = SpyExchange(inner, log)
        batch = (batches or {}).get(r) or _batch(r)
        snap = (snapshots or {}).get(r, default_snap)
        try:
            return dispatch(batch, snap, spy, selector=sel, tag="bad",
                            status=(status or {}).get(r, ControlStatus.OK))
        except Exception as exc:  # noqa: BLE001 - the test inspects every rank's error
            return exc

    return LocalExchangeGroup(group, timeout_s=timeout_s).run(step), log


def _assert_aborted_before_payload(results, log, *, bad_rank: int, error: type, pattern: str):
    """The bad rank raises ``error`` matching ``pattern``; every other rank raises a
    CountAgreementError; the control round ran on every rank; no payload exchange happened."""
    assert isinstance(results[bad_rank], error), f"rank {bad_rank}: {results[bad_rank]!r}"
    assert re.search(pattern, str(results[bad_rank])), str(results[bad_rank])
    for r, res in enumerate(results):
        if r != bad_rank:
            assert isinstance(res, CountAgreementError), f"rank {r}: {res!r}"
            assert f"[({bad_rank}, 'BAD_INPUT')]" in str(res)
    assert not [c for c in log if c[1] == "all_to_all_v"], log
    assert sorted(c[0] for c in log if c[1] == "all_gather") == [0, 1, 2, 3]


def test_good_step_uses_the_payload_exchange():
    """The spy sees the payload round when nothing is wrong (so its silence below means something)."""
    results, log = _run_step()
    assert all(not isinstance(r, Exception) for r in results), results
    assert sorted(c[0] for c in log if c[1] == "all_to_all_v") == [0, 1, 2, 3]


# ------------------------------------------------------------------------------- route batch fields
def _replace(rank: int, **fields) -> RouteBatch:
    return dataclasses.replace(_batch(rank), **fields)


@pytest.mark.parametrize("bad_id, shown", [(4, "expert id 4"), (7, "expert id 7"), (-2, "expert id -2")])
def test_out_of_range_expert_id(bad_id, shown):
    ids = fx.route_tensors(0)[1].clone()
    ids[1, 0] = bad_id
    results, log = _run_step(batches={0: _replace(0, topk_ids=ids)})
    _assert_aborted_before_payload(results, log, bad_rank=0, error=RouteValidationError,
                                   pattern=rf"topk_ids: {shown} is out of range \[0, 4\)")


def test_nan_gate():
    w = fx.route_tensors(1)[2].clone()
    w[0, 1] = float("nan")
    results, log = _run_step(batches={1: _replace(1, topk_weights=w)})
    _assert_aborted_before_payload(results, log, bad_rank=1, error=RouteValidationError,
                                   pattern=r"topk_weights: NaN")


def test_infinite_gate():
    w = fx.route_tensors(1)[2].clone()
    w[1, 1] = float("inf")
    results, log = _run_step(batches={1: _replace(1, topk_weights=w)})
    _assert_aborted_before_payload(results, log, bad_rank=1, error=RouteValidationError,
                                   pattern=r"topk_weights: .*infinite")


def test_negative_gate():
    w = fx.route_tensors(0)[2].clone()
    w[1, 1] = -0.30
    results, log = _run_step(batches={0: _replace(0, topk_weights=w)})
    _assert_aborted_before_payload(results, log, bad_rank=0, error=RouteValidationError,
                                   pattern=r"topk_weights: negative gate -0\.3")


def test_hidden_rows_disagree_with_topk_rows():
    h = torch.cat([fx.route_tensors(0)[0], torch.ones(1, 3, dtype=torch.float64)])  # [3, 3] vs [2, 2]
    results, log = _run_step(batches={0: _replace(0, hidden=h)})
    _assert_aborted_before_payload(results, log, bad_rank=0, error=RouteValidationError,
                                   pattern=r"topk_ids: expected \[T=3, k\], got shape \(2, 2\)")


def test_gate_shape_disagrees_with_ids():
    w = torch.full((2, 3), 0.3)
    results, log = _run_step(batches={1: _replace(1, topk_weights=w)})
    _assert_aborted_before_payload(results, log, bad_rank=1, error=RouteValidationError,
                                   pattern=r"topk_weights: shape \(2, 3\) != topk_ids shape \(2, 2\)")


def test_hidden_not_two_dimensional():
    h = fx.route_tensors(0)[0].reshape(-1)
    results, log = _run_step(batches={0: _replace(0, hidden=h)})
    _assert_aborted_before_payload(results, log, bad_rank=0, error=RouteValidationError,
                                   pattern=r"hidden: expected \[T, d\], got shape \(6,\)")


def test_float_topk_ids():
    ids = fx.route_tensors(1)[1].to(torch.float32)
    results, log = _run_step(batches={1: _replace(1, topk_ids=ids)})
    _assert_aborted_before_payload(results, log, bad_rank=1, error=RouteValidationError,
                                   pattern=r"topk_ids: expected int64, got torch\.float32")


def test_integer_gates():
    w = torch.ones(2, 2, dtype=torch.int64)
    results, log = _run_step(batches={0: _replace(0, topk_weights=w)})
    _assert_aborted_before_payload(results, log, bad_rank=0, error=RouteValidationError,
                                   pattern=r"topk_weights: expected float32, got torch\.int64")


def test_integer_hidden():
    h = torch.ones(2, 3, dtype=torch.int64)
    results, log = _run_step(batches={0: _replace(0, hidden=h)})
    _assert_aborted_before_payload(results, log, bad_rank=0, error=RouteValidationError,
                                   pattern=r"hidden: expected a floating dtype, got torch\.int64")


def test_nan_hidden():
    h = fx.route_tensors(0)[0].clone()
    h[1, 2] = float("nan")
    results, log = _run_step(batches={0: _replace(0, hidden=h)})
    _assert_aborted_before_payload(results, log, bad_rank=0, error=RouteValidationError,
                                   pattern=r"hidden: NaN")


# BUG (found by this test): ``dispatch`` builds ``SemanticRoutes.from_batch(batch)`` *before* the
# ``try: batch.validate(...)`` block (engine.py, step 1). ``from_batch`` unpacks ``t, k =
# batch.topk_ids.shape``, so a 1-D (or 3-D) ``topk_ids`` raises a bare ``ValueError("not enough values
# to unpack ...")`` that names no field, and the bad rank leaves without joining the control round: its
# peers block in ``all_gather`` until the exchange watchdog fires (ExchangeTimeoutError after
# ``timeout_s``, 30 s by default) instead of aborting together with CountAgreementError.
# Proposed fix: in engine.dispatch call ``batch.validate(snapshot.num_experts)`` first and build
# ``SemanticRoutes.from_batch`` inside the same ``try`` (on error use an empty SemanticRoutes), so the
# rank still reports BAD_INPUT in the control round.
def test_one_dimensional_topk_ids():
    ids = fx.route_tensors(0)[1].reshape(-1)
    w = fx.route_tensors(0)[2].reshape(-1)
    results, log = _run_step(batches={0: _replace(0, topk_ids=ids, topk_weights=w)}, timeout_s=1.0)
    _assert_aborted_before_payload(results, log, bad_rank=0, error=RouteValidationError,
                                   pattern=r"topk_ids: expected \[T=2, k\], got shape \(4,\)")


# ------------------------------------------------------------------------------- physical assignment
def test_log2phy_padding_used_as_a_slot():
    snap = fx.snapshot()
    pad = int(snap.log2phy[2, 1])  # expert 2 has one replica: its second log2phy column is padding
    assert pad == -1 and int(snap.logcnt[2]) == 1
    slots = _frozen_slots()
    slots[0] = torch.tensor([0, 2, 1, pad])  # r03 -> the padding entry
    results, log = _run_step(slots=slots)
    _assert_aborted_before_payload(results, log, bad_rank=0, error=RouteValidationError,
                                   pattern=r"physical_slot\[3\]=-1: log2phy padding -1 used as a slot")


def test_slot_out_of_range():
    slots = _frozen_slots()
    slots[1] = torch.tensor([5, 0, 3, 6])
    results, log = _run_step(slots=slots)
    _assert_aborted_before_payload(results, log, bad_rank=1, error=RouteValidationError,
                                   pattern=r"physical_slot\[3\]=6: out of range \[0, 6\)")


def test_slot_storing_another_expert():
    """r01 selects E1 but is assigned q4 (which stores E2): count-conserving, function-changing."""
    slots = _frozen_slots()
    slots[0] = torch.tensor([0, 4, 1, 4])
    results, log = _run_step(slots=slots)
    _assert_aborted_before_payload(
        results, log, bad_rank=0, error=RouteValidationError,
        pattern=r"physical_slot\[1\]=q4 stores logical expert 2, but the route selected logical expert 1")


def test_assignment_with_wrong_cardinality():
    slots = _frozen_slots()
    slots[1] = torch.tensor([5, 0, 3])  # three slots for four routes: one route would be lost
    results, log = _run_step(slots=slots)
    _assert_aborted_before_payload(results, log, bad_rank=1, error=RouteValidationError,
                                   pattern=r"physical_slot: expected shape \[4\], got \(3,\)")


# ------------------------------------------------------------------------------- control round faults
def test_count_fault_aborts_every_rank():
    results, log = _run_step(count_fault={1: 1})
    for r, res in enumerate(results):
        assert isinstance(res, CountAgreementError), f"rank {r}: {res!r}"
        assert "rank 1 declares split vector" in str(res) and "for 4 accepted routes" in str(res)
    assert not [c for c in log if c[1] == "all_to_all_v"]


def test_count_fault_on_an_empty_rank_aborts_every_rank():
    results, log = _run_step(count_fault={3: 2})
    for r, res in enumerate(results):
        assert isinstance(res, CountAgreementError), f"rank {r}: {res!r}"
        assert "rank 3 declares split vector" in str(res) and "for 0 accepted routes" in str(res)
    assert not [c for c in log if c[1] == "all_to_all_v"]


def test_stale_generation_aborts_every_rank():
    results, log = _run_step(status={2: ControlStatus.STALE_GENERATION})
    for r, res in enumerate(results):
        assert isinstance(res, StaleGenerationError), f"rank {r}: {res!r}"
        assert "rank(s) [2]" in str(res) and "[17]" in str(res)
        assert res.requested == 17
    assert not [c for c in log if c[1] == "all_to_all_v"]


def test_mismatched_map_digest_aborts_every_rank():
    """Rank 3 holds a snapshot of another generation-17 manifest (q4 and q5 swapped ranks)."""
    other = fx.six_slot_manifest()
    slots = list(other.slots)
    slots[4] = slots[4].model_copy(update={"destination_rank": 3})
    slots[5] = slots[5].model_copy(update={"destination_rank": 2})
    other = other.model_copy(update={"slots": tuple(slots)})
    from ray_moe.placement.snapshot import PlacementSnapshot

    snap3 = PlacementSnapshot.from_manifest(other, fx.topology(), fx.flat_group())
    assert snap3.generation == fx.snapshot().generation
    assert snap3.map_digest != fx.snapshot().map_digest
    results, log = _run_step(snapshots={3: snap3})
    for r, res in enumerate(results):
        assert isinstance(res, CountAgreementError), f"rank {r}: {res!r}"
        assert f"rank 3 reports map_digest={snap3.map_digest}" in str(res)
    assert not [c for c in log if c[1] == "all_to_all_v"]


def test_mismatched_generation_aborts_every_rank():
    results, log = _run_step(snapshots={2: fx.snapshot(generation=18)})
    for r, res in enumerate(results):
        assert isinstance(res, CountAgreementError), f"rank {r}: {res!r}"
        assert "rank 2 reports generation=18" in str(res)
    assert not [c for c in log if c[1] == "all_to_all_v"]


def test_mismatched_process_group_epoch_aborts_every_rank():
    snap = fx.snapshot(fx.flat_group(epoch=13))
    results, log = _run_step(snapshots={1: snap})
    for r, res in enumerate(results):
        assert isinstance(res, CountAgreementError), f"rank {r}: {res!r}"
        assert "rank 1 reports pg_epoch=13" in str(res)
    assert not [c for c in log if c[1] == "all_to_all_v"]


# BUG (found by this test): the control round compares generation, pg_epoch, layer and map_digest,
# but ``PlacementSnapshot.map_digest`` hashes (generation, layer, pg_epoch, process_group_id, phy2log,
# slot_rank, slot_local, peer_order) and not ``checkpoint_version``. Two ranks whose snapshots name
# different expert checkpoints for the same generation pass the control round and exchange payload,
# although spec 0x01D / 0x01D2 require the expert checkpoint version to agree before dispatch.
# Proposed fix: include ``checkpoint_version`` (and ``release_id``) in the map_digest hash in
# ``PlacementSnapshot.__post_init__`` (or send a checkpoint digest in the ControlRecord header).
def test_mismatched_checkpoint_aborts_every_rank():
    base = fx.snapshot()
    other = dataclasses.replace(base, checkpoint_version="checkpoint-0043", map_digest=0)
    results, log = _run_step(snapshots={3: other})
    for r, res in enumerate(results):
        assert isinstance(res, CountAgreementError), f"rank {r}: {res!r}"
    assert not [c for c in log if c[1] == "all_to_all_v"]


# BUG (found by this test): the control record carries (generation, pg_epoch, layer, status, num_routes,
# map_digest, split vector) but not the payload row shape or dtype. When one rank's hidden width
# disagrees with its peers' (d=4 on rank 1, d=3 elsewhere), every rank passes the control round, the
# payload all-to-all-v runs, and every rank then fails inside ``torch.cat`` with a bare RuntimeError
# ("Sizes of tensors must match ...") that names no field and no rank. (With the NCCL backend the
# receive buffers would be sized from the local width instead.)
# Proposed fix: add the hidden width and a dtype code to ``ControlRecord`` (engine.py) and compare them
# in ``agree()`` like ``generation``/``map_digest``, raising CountAgreementError("rank 1 reports
# hidden_size=4 but rank 0 reports 3") on every rank before payload.
def test_hidden_width_disagreeing_between_peers_aborts_before_payload():
    h = torch.ones(2, 4, dtype=torch.float64)
    results, log = _run_step(batches={1: _replace(1, hidden=h)}, timeout_s=2.0)
    for r, res in enumerate(results):
        assert isinstance(res, CountAgreementError), f"rank {r}: {res!r}"
        assert "hidden" in str(res) and "4" in str(res)
    assert not [c for c in log if c[1] == "all_to_all_v"]


# BUG (same root cause): one rank sends float32 rows while its peers send float64. The control round
# passes, the in-process exchange silently promotes the concatenated receive buffer to float64 (so rank 1
# receives rows in a dtype its own float32 experts cannot take), and a byte-level backend (NCCL) would
# reinterpret the bytes. Proposed fix: as above, a dtype code in ControlRecord compared in ``agree()``.
def test_hidden_dtype_disagreeing_between_peers_aborts_before_payload():
    h = fx.route_tensors(1)[0].to(torch.float32)
    results, log = _run_step(batches={1: _replace(1, hidden=h)}, timeout_s=2.0)
    for r, res in enumerate(results):
        assert isinstance(res, CountAgreementError), f"rank {r}: {res!r}"
        assert "dtype" in str(res)
    assert not [c for c in log if c[1] == "all_to_all_v"]


def test_bad_input_leaves_the_fixture_usable():
    """An aborted step changes no state: the same group runs the fixture right after."""
    ids = fx.route_tensors(0)[1].clone()
    ids[0, 0] = 9
    _run_step(batches={0: _replace(0, topk_ids=ids)})
    results, log = _run_step()
    assert all(not isinstance(r, Exception) for r in results)
    c = results[0].handle.count_matrix
    assert np.asarray(c).tolist() == [[1, 2, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
