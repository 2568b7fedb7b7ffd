"""Analytical precision payload and runner-alignment ledgers (spec 0x0AB, 0x0AD). Pure: no Ray, no
clocks. The scale count per row is the runtime quantizer's (``ray_moe.moe.dispatch.precision``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ray_moe.release.ledger import ANALYTICAL, LedgerRecord, dtype_width, positive_int
from ray_moe.moe.dispatch.precision import FP8_DTYPE, scales_per_row
from ray_moe.core.types import PayloadFormat


# ------------------------------------------------------------------------------------------------------
#  0x0AB precision payload, 0x0AD alignment
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionPayloadLedger(LedgerRecord):
    """Logical payload of ``remote_rows`` rows of width d in one payload format (spec 0x0AB).

    NATIVE:       R d b_16                       (b_16 = native_bytes, BF16 = 2)
    FP8_ROW:      R d b_8 + R * 1 * b_s          (b_8 = 1, b_s = 4)
    FP8_BLOCK128: R d b_8 + R ceil(d/128) b_s
    The scale count per row is the one the runtime quantizer uses (``precision.scales_per_row``).
    Excludes alignment, route metadata, headers, packetization and link transactions.
    """

    remote_rows: int
    hidden_size: int
    fmt: PayloadFormat
    native_bytes: int = 2
    scale_bytes: int = 4
    evidence: str = ANALYTICAL
    _DERIVED = ("element_bytes", "scales_per_row", "data_bytes", "scale_total_bytes", "total_bytes")

    def __post_init__(self) -> None:
        positive_int("remote_rows", self.remote_rows, allow_zero=True)
        positive_int("hidden_size", self.hidden_size)
        positive_int("native_bytes", self.native_bytes)
        positive_int("scale_bytes", self.scale_bytes)
        try:
            object.__setattr__(self, "fmt", PayloadFormat(self.fmt))
        except ValueError:
            raise ValueError(f"fmt: unknown payload format {self.fmt!r}") from None

    @property
    def element_bytes(self) -> int:
        return self.native_bytes if self.fmt is PayloadFormat.NATIVE else dtype_width(FP8_DTYPE)

    @property
    def scales_per_row(self) -> int:
        return scales_per_row(self.fmt, self.hidden_size)

    @property
    def data_bytes(self) -> int:
        return self.remote_rows * self.hidden_size * self.element_bytes

    @property
    def scale_total_bytes(self) -> int:
        return self.remote_rows * self.scales_per_row * self.scale_bytes

    @property
    def total_bytes(self) -> int:
        return self.data_bytes + self.scale_total_bytes


def precision_table(remote_rows: int, widths: Iterable[int],
                    formats: Iterable[PayloadFormat] = tuple(PayloadFormat),
                    native_bytes: int = 2) -> dict[int, dict[PayloadFormat, PrecisionPayloadLedger]]:
    """The 0x0AB table: ``table[d][fmt]`` for each width and format."""
    fmts = tuple(formats)
    return {int(d): {f: PrecisionPayloadLedger(remote_rows, int(d), f, native_bytes) for f in fmts}
            for d in widths}


@dataclass(frozen=True)
class AlignmentLedger(LedgerRecord):
    """Local executed rows when the runner needs row alignment ``a`` (spec 0x0AD).

    slot_counts: [Q] rows per physical slot;  n~_q = a ceil(n_q / a);  R_executed = sum_q n~_q.
    The fringe rows are LOCAL runner work: they add nothing to remote or staging payload.
    """

    slot_counts: tuple[int, ...]
    alignment: int
    evidence: str = ANALYTICAL
    _DERIVED = ("useful_rows", "executed_rows", "align_waste_rows")

    def __post_init__(self) -> None:
        counts = tuple(positive_int(f"slot_counts[{i}]", c, allow_zero=True)
                       for i, c in enumerate(self.slot_counts))
        object.__setattr__(self, "slot_counts", counts)
        positive_int("alignment", self.alignment)

    @property
    def executed_per_slot(self) -> tuple[int, ...]:
        a = self.alignment
        return tuple(a * -(-n // a) for n in self.slot_counts)

    @property
    def useful_rows(self) -> int:
        return sum(self.slot_counts)

    @property
    def executed_rows(self) -> int:
        return sum(self.executed_per_slot)

    @property
    def align_waste_rows(self) -> int:
        return self.executed_rows - self.useful_rows
