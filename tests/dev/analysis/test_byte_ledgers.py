"""Analytical row-slot and byte ledgers (spec 0x03C1, 0x03D1, 0x03D2, 0x03D6): computed from inputs and
pinned to the spec's golden numbers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe_dev.analysis.byte_ledgers import PaddingLedger, PayloadLedger, RowSlotLedger, TransportLedger
from ray_moe.release.ledger import MIB, Representation
from tests.dev.analysis.ledger_fixture import SLOTS_PER_RANK, C, D, fixture_count_matrix


def test_fixture_count_matrix_matches_spec():
    assert fixture_count_matrix() == C


# ---------------------------------------------------------------------------------------------- 0x03C1


def test_row_slots_padded_vs_all_to_all_v():
    rs = RowSlotLedger(fixture_count_matrix())
    assert rs.evidence == "analytical"
    assert (rs.useful_rows, rs.padded_rows, rs.padding_rows) == (8, 32, 24)
    assert (rs.local_rows, rs.remote_rows, rs.max_split, rs.num_ranks) == (2, 6, 2, 4)
    assert rs.send_rows == (4, 4, 0, 0)
    assert rs.recv_rows == (2, 3, 2, 1)


def test_row_slots_accept_tensor_and_follow_the_input():
    rs = RowSlotLedger(torch.tensor(C, dtype=torch.int64))
    assert rs.counts == tuple(tuple(r) for r in C)
    hotter = [row[:] for row in C]
    hotter[1][3] = 5  # one hot pair raises every cell's padded capacity
    h = RowSlotLedger(hotter)
    assert (h.useful_rows, h.padded_rows, h.padding_rows) == (12, 80, 68)


@pytest.mark.parametrize(
    "bad, needle",
    [
        ([[1, 2], [3]], "counts: row 1"),
        ([[1, -1], [0, 0]], "counts[0][1]=-1"),
        ([[1, 0.5], [0, 0]], "counts[0][1]=0.5"),
        ([], "counts: empty"),
    ],
)
def test_row_slots_reject_bad_matrices(bad, needle):
    with pytest.raises(ValueError) as ei:
        RowSlotLedger(bad)
    assert needle in str(ei.value)


def test_row_slots_reject_float_tensor():
    with pytest.raises(ValueError, match="counts: expected an integer count matrix"):
        RowSlotLedger(torch.tensor(C, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------- 0x03D1


def test_staging_payload_is_not_remote_payload():
    pl = PayloadLedger.from_counts(fixture_count_matrix(), D)
    assert pl.evidence == "analytical"
    assert (pl.rows, pl.remote_rows) == (8, 6)
    assert (pl.staging_dispatch_bytes, pl.staging_combine_bytes) == (48, 48)
    assert (pl.remote_dispatch_bytes, pl.remote_combine_bytes) == (36, 36)
    assert pl.remote_payload_bytes == 72


def test_payload_widths_come_from_dtypes():
    rep = Representation.from_dtypes(activation=torch.float8_e4m3fn, output=torch.float32)
    pl = PayloadLedger.from_counts(C, D, rep)
    assert (pl.staging_dispatch_bytes, pl.staging_combine_bytes) == (8 * 3 * 1, 8 * 3 * 4)
    assert (pl.remote_dispatch_bytes, pl.remote_combine_bytes) == (18, 72)


def test_payload_rejects_bad_fields():
    with pytest.raises(ValueError, match="remote_rows=7: exceeds rows=6"):
        PayloadLedger(6, 7, 3)
    with pytest.raises(ValueError, match="hidden_size=0"):
        PayloadLedger(6, 1, 0)
    with pytest.raises(ValueError, match="activation_bytes"):
        Representation(activation_bytes=0)


# ---------------------------------------------------------------------------------------------- 0x03D2


def test_transport_metadata_handle_and_control_tables():
    tl = TransportLedger(fixture_count_matrix(), SLOTS_PER_RANK, D)
    assert tl.evidence == "analytical"
    assert tl.dispatch_meta_bytes == 48  # 6 remote rows * 2 INT32
    assert tl.combine_meta_bytes == 24  # 6 remote rows * 1 INT32
    assert tl.route_handle_bytes == 256  # 8 routes * 8 INT32
    assert tl.count_matrix_bytes == 128
    assert tl.send_offsets_bytes == 160  # P (P + 1) INT64
    assert tl.recv_splits_bytes == 128
    assert tl.local_expert_offset_entries == 10
    assert tl.local_expert_offsets_bytes == 80
    assert tl.remote_logical_bytes == 144  # 36 + 36 + 48 + 24


def test_transport_slots_per_rank_must_match_ranks():
    with pytest.raises(ValueError, match="slots_per_rank: 3 entries for a 4-rank"):
        TransportLedger(C, (1, 2, 2), D)
    with pytest.raises(ValueError, match=r"slots_per_rank\[1\]"):
        TransportLedger(C, (1, -2, 2, 1), D)


# ---------------------------------------------------------------------------------------------- 0x03D6


def test_regular_padding_fixture():
    pd = PaddingLedger.from_counts(fixture_count_matrix(), D)
    assert pd.evidence == "analytical"
    assert pd.padded_dispatch_bytes == 192
    assert pd.padded_round_trip_bytes == 384
    assert pd.useful_dispatch_bytes == 48
    assert pd.useful_round_trip_bytes == 96
    assert pd.reservation_ratio == 4.0


def test_regular_padding_large_shape():
    pl = PayloadLedger.from_shape(num_tokens=4096, top_k=2, hidden_size=4096, remote_fraction=0.75)
    assert pl.staging_dispatch_bytes == 64 * MIB
    assert pl.staging_round_trip_bytes == 128 * MIB
    assert pl.remote_payload_bytes == 96 * MIB
    assert pl.remote_rows == 6144


def test_remote_fraction_must_give_whole_rows():
    with pytest.raises(ValueError, match="remote_fraction=0.3"):
        PayloadLedger.from_shape(num_tokens=1, top_k=2, hidden_size=8, remote_fraction=0.3)
    with pytest.raises(ValueError, match="remote_fraction=1.5"):
        PayloadLedger.from_shape(num_tokens=1, top_k=2, hidden_size=8, remote_fraction=1.5)


# ---------------------------------------------------------------------------------------------- properties


square = st.integers(min_value=1, max_value=5).flatmap(
    lambda p: st.lists(st.lists(st.integers(0, 9), min_size=p, max_size=p), min_size=p, max_size=p)
)


@settings(max_examples=40, deadline=None)
@given(counts=square, d=st.integers(1, 64))
def test_ledger_identities(counts, d):
    rs = RowSlotLedger(counts)
    p = len(counts)
    assert rs.local_rows + rs.remote_rows == rs.useful_rows == sum(map(sum, counts))
    assert rs.padded_rows >= rs.useful_rows
    assert sum(rs.send_rows) == sum(rs.recv_rows) == rs.useful_rows
    pl = PayloadLedger.from_counts(counts, d)
    assert pl.remote_payload_bytes <= pl.staging_round_trip_bytes
    tl = TransportLedger(counts, (1,) * p, d)
    assert tl.remote_logical_bytes == rs.remote_rows * (d * 4 + 2 * 4 + 1 * 4)
    assert tl.send_offsets_bytes - tl.count_matrix_bytes == p * 8
