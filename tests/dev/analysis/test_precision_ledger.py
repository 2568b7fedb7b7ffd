"""Precision payload and runner alignment ledgers (spec 0x0AB, 0x0AD)."""

from __future__ import annotations

import pytest

from ray_moe_dev.analysis.precision_ledger import AlignmentLedger, PrecisionPayloadLedger, precision_table
from ray_moe.core.types import PayloadFormat
from tests.dev.analysis.ledger_fixture import SLOT_COUNTS


def test_fp8_payload_table():
    table = precision_table(6, (3, 16, 7168))
    got = {d: tuple(table[d][f].total_bytes for f in PayloadFormat) for d in table}
    assert [f.value for f in PayloadFormat] == ["native", "fp8_row", "fp8_block128"]
    assert got == {3: (36, 42, 42), 16: (192, 120, 120), 7168: (86016, 43032, 44352)}
    row = table[7168][PayloadFormat.FP8_BLOCK128]
    assert (row.data_bytes, row.scales_per_row, row.scale_total_bytes) == (43008, 56, 1344)
    assert row.evidence == "analytical"


def test_fp8_is_not_smaller_for_tiny_rows():
    t = precision_table(6, (3,))[3]
    assert t[PayloadFormat.FP8_ROW].total_bytes > t[PayloadFormat.NATIVE].total_bytes
    assert t[PayloadFormat.FP8_ROW].data_bytes < t[PayloadFormat.NATIVE].data_bytes  # scales dominate


def test_precision_ledger_rejects_unknown_format():
    with pytest.raises(ValueError, match="fmt: unknown payload format 'fp4'"):
        PrecisionPayloadLedger(6, 3, "fp4")


def test_alignment_is_local_work_not_remote_rows():
    al = AlignmentLedger(SLOT_COUNTS, 4)
    assert al.evidence == "analytical"
    assert (al.useful_rows, al.executed_rows, al.align_waste_rows) == (8, 24, 16)
    assert al.executed_per_slot == (4, 4, 4, 4, 4, 4)
    assert AlignmentLedger((0, 5), 4).executed_per_slot == (0, 8)
    with pytest.raises(ValueError, match="alignment=0"):
        AlignmentLedger(SLOT_COUNTS, 0)
