"""Analytical row-slot and byte ledgers of one dispatch/combine step (spec 0x03C1, 0x03D1, 0x03D2,
0x03D6). Pure: no Ray, no clocks. Computed from a count matrix and declared widths, never measured
(``ray_moe.release.ledger``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from numbers import Real
from typing import Any

from ray_moe.release.ledger import (
    ANALYTICAL,
    BASELINE,
    CountMatrix,
    LedgerRecord,
    Representation,
    as_count_matrix,
    positive_int,
)


# ------------------------------------------------------------------------------------------------------
#  0x03C1 row slots
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSlotLedger(LedgerRecord):
    """Useful all-to-all-v row slots vs uniform padded all-to-all row slots (spec 0x03C1).

    counts: [P, P] count matrix over global ranks.
    padded = P^2 * max C (every source-destination cell padded to the hottest split).
    A row-slot comparison only: no bytes, no latency.
    """

    counts: CountMatrix
    evidence: str = ANALYTICAL
    _DERIVED = ("num_ranks", "useful_rows", "local_rows", "remote_rows", "max_split", "padded_rows",
                "padding_rows")

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", as_count_matrix(self.counts))

    @property
    def num_ranks(self) -> int:
        return len(self.counts)

    @property
    def useful_rows(self) -> int:
        return sum(sum(r) for r in self.counts)

    @property
    def local_rows(self) -> int:
        return sum(self.counts[p][p] for p in range(self.num_ranks))

    @property
    def remote_rows(self) -> int:
        return self.useful_rows - self.local_rows

    @property
    def max_split(self) -> int:
        return max(max(r) for r in self.counts)

    @property
    def padded_rows(self) -> int:
        return self.num_ranks**2 * self.max_split

    @property
    def padding_rows(self) -> int:
        return self.padded_rows - self.useful_rows

    @property
    def send_rows(self) -> tuple[int, ...]:
        """Row sums R_p (routed rows of each source)."""
        return tuple(sum(r) for r in self.counts)

    @property
    def recv_rows(self) -> tuple[int, ...]:
        """Column sums (rows each destination receives)."""
        return tuple(sum(self.counts[p][u] for p in range(self.num_ranks)) for u in range(self.num_ranks))


# ------------------------------------------------------------------------------------------------------
#  0x03D1 / 0x03D6 payload bytes
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PayloadLedger(LedgerRecord):
    """Collective staging payload vs representation-level remote row payload (spec 0x03D1, 0x03D6).

    B_stage,dispatch = R d b_a;  B_stage,combine = R d b_o;  B_remote,payload = R_remote d (b_a + b_o).
    Local routes stay in the staging layout but cross no link (local-bypass policy). Excludes metadata,
    control tables, scales, padding, protocol and physical transactions.
    """

    rows: int  # R: all useful route rows
    remote_rows: int  # R_remote: rows whose destination differs from the source
    hidden_size: int  # d
    activation_bytes: int = 2  # b_a
    output_bytes: int = 2  # b_o
    evidence: str = ANALYTICAL
    _DERIVED = ("staging_dispatch_bytes", "staging_combine_bytes", "staging_round_trip_bytes",
                "remote_dispatch_bytes", "remote_combine_bytes", "remote_payload_bytes")

    def __post_init__(self) -> None:
        positive_int("rows", self.rows, allow_zero=True)
        positive_int("remote_rows", self.remote_rows, allow_zero=True)
        positive_int("hidden_size", self.hidden_size)
        positive_int("activation_bytes", self.activation_bytes)
        positive_int("output_bytes", self.output_bytes)
        if self.remote_rows > self.rows:
            raise ValueError(f"remote_rows={self.remote_rows}: exceeds rows={self.rows}")

    @staticmethod
    def from_counts(counts: Any, hidden_size: int, rep: Representation = BASELINE) -> "PayloadLedger":
        """R = sum C, R_remote = sum of the off-diagonal of C."""
        rs = RowSlotLedger(counts)
        return PayloadLedger(rs.useful_rows, rs.remote_rows, hidden_size, rep.activation_bytes, rep.output_bytes)

    @staticmethod
    def from_shape(num_tokens: int, top_k: int, hidden_size: int, remote_fraction: float,
                   rep: Representation = BASELINE) -> "PayloadLedger":
        """R = T k; R_remote = f_remote R (must be a whole number of rows)."""
        t = positive_int("num_tokens", num_tokens, allow_zero=True)
        k = positive_int("top_k", top_k)
        if not isinstance(remote_fraction, Real) or not 0.0 <= float(remote_fraction) <= 1.0:
            raise ValueError(f"remote_fraction={remote_fraction!r}: must be a number in [0, 1]")
        r = t * k
        remote = Fraction(remote_fraction).limit_denominator(1 << 20) * r
        if remote.denominator != 1:
            raise ValueError(f"remote_fraction={remote_fraction!r}: gives {float(remote)} remote rows of {r}, "
                             f"not a whole number")
        return PayloadLedger(r, int(remote), hidden_size, rep.activation_bytes, rep.output_bytes)

    @property
    def staging_dispatch_bytes(self) -> int:
        return self.rows * self.hidden_size * self.activation_bytes

    @property
    def staging_combine_bytes(self) -> int:
        return self.rows * self.hidden_size * self.output_bytes

    @property
    def staging_round_trip_bytes(self) -> int:
        return self.staging_dispatch_bytes + self.staging_combine_bytes

    @property
    def remote_dispatch_bytes(self) -> int:
        return self.remote_rows * self.hidden_size * self.activation_bytes

    @property
    def remote_combine_bytes(self) -> int:
        return self.remote_rows * self.hidden_size * self.output_bytes

    @property
    def remote_payload_bytes(self) -> int:
        return self.remote_dispatch_bytes + self.remote_combine_bytes


@dataclass(frozen=True)
class PaddingLedger(LedgerRecord):
    """Uniform padded all-to-all reservation vs useful staging payload (spec 0x03D6).

    padded rows = P^2 max C per direction; bytes = rows * d * width. A reservation ratio, not a slowdown.
    """

    counts: CountMatrix
    hidden_size: int
    activation_bytes: int = 2
    output_bytes: int = 2
    evidence: str = ANALYTICAL
    _DERIVED = ("padded_rows", "useful_rows", "padded_dispatch_bytes", "padded_combine_bytes",
                "padded_round_trip_bytes", "useful_dispatch_bytes", "useful_round_trip_bytes",
                "reservation_ratio")

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", as_count_matrix(self.counts))
        positive_int("hidden_size", self.hidden_size)
        positive_int("activation_bytes", self.activation_bytes)
        positive_int("output_bytes", self.output_bytes)

    @staticmethod
    def from_counts(counts: Any, hidden_size: int, rep: Representation = BASELINE) -> "PaddingLedger":
        return PaddingLedger(counts, hidden_size, rep.activation_bytes, rep.output_bytes)

    @property
    def _rows(self) -> RowSlotLedger:
        return RowSlotLedger(self.counts)

    @property
    def padded_rows(self) -> int:
        return self._rows.padded_rows

    @property
    def useful_rows(self) -> int:
        return self._rows.useful_rows

    @property
    def padded_dispatch_bytes(self) -> int:
        return self.padded_rows * self.hidden_size * self.activation_bytes

    @property
    def padded_combine_bytes(self) -> int:
        return self.padded_rows * self.hidden_size * self.output_bytes

    @property
    def padded_round_trip_bytes(self) -> int:
        return self.padded_dispatch_bytes + self.padded_combine_bytes

    @property
    def useful_dispatch_bytes(self) -> int:
        return self.useful_rows * self.hidden_size * self.activation_bytes

    @property
    def useful_round_trip_bytes(self) -> int:
        return self.useful_dispatch_bytes + self.useful_rows * self.hidden_size * self.output_bytes

    @property
    def reservation_ratio(self) -> float:
        """padded / useful row slots (inf when nothing is useful)."""
        return self.padded_rows / self.useful_rows if self.useful_rows else math.inf


# ------------------------------------------------------------------------------------------------------
#  0x03D2 transport metadata, handle state, control tables
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransportLedger(LedgerRecord):
    """Transport metadata, origin handle state and count/split tables (spec 0x03D2).

    counts:         [P, P] count matrix
    slots_per_rank: [P] physical slots hosted on each destination (local expert offsets have
                    slots + 1 entries per destination, sentinel included)

    remote_logical_bytes = remote payload (dispatch + combine) + remote dispatch/combine metadata:
    logical remote bytes excluding protocol, scales, alignment and physical transactions. Table storage
    (count matrix, offsets, splits, local expert offsets) is storage, not a network claim.
    """

    counts: CountMatrix
    slots_per_rank: tuple[int, ...]
    hidden_size: int
    rep: Representation = BASELINE
    evidence: str = ANALYTICAL
    _DERIVED = ("dispatch_meta_bytes", "combine_meta_bytes", "route_handle_bytes", "count_matrix_bytes",
                "send_offsets_bytes", "recv_splits_bytes", "local_expert_offset_entries",
                "local_expert_offsets_bytes", "control_table_bytes", "remote_payload_bytes",
                "remote_logical_bytes")

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", as_count_matrix(self.counts))
        spr = tuple(positive_int(f"slots_per_rank[{i}]", s, allow_zero=True)
                    for i, s in enumerate(self.slots_per_rank))
        if len(spr) != len(self.counts):
            raise ValueError(f"slots_per_rank: {len(spr)} entries for a {len(self.counts)}-rank count matrix")
        object.__setattr__(self, "slots_per_rank", spr)
        positive_int("hidden_size", self.hidden_size)

    @property
    def _rows(self) -> RowSlotLedger:
        return RowSlotLedger(self.counts)

    @property
    def dispatch_meta_bytes(self) -> int:
        return self._rows.remote_rows * self.rep.dispatch_meta_fields * self.rep.meta_bytes

    @property
    def combine_meta_bytes(self) -> int:
        return self._rows.remote_rows * self.rep.combine_meta_fields * self.rep.meta_bytes

    @property
    def route_handle_bytes(self) -> int:
        return self._rows.useful_rows * self.rep.handle_fields * self.rep.meta_bytes

    @property
    def count_matrix_bytes(self) -> int:
        p = self._rows.num_ranks
        return p * p * self.rep.coord_bytes

    @property
    def send_offsets_bytes(self) -> int:
        p = self._rows.num_ranks
        return p * (p + 1) * self.rep.coord_bytes

    @property
    def recv_splits_bytes(self) -> int:
        p = self._rows.num_ranks
        return p * p * self.rep.coord_bytes

    @property
    def local_expert_offset_entries(self) -> int:
        return sum(s + 1 for s in self.slots_per_rank)

    @property
    def local_expert_offsets_bytes(self) -> int:
        return self.local_expert_offset_entries * self.rep.coord_bytes

    @property
    def control_table_bytes(self) -> int:
        return (self.count_matrix_bytes + self.send_offsets_bytes + self.recv_splits_bytes
                + self.local_expert_offsets_bytes)

    @property
    def remote_payload_bytes(self) -> int:
        return PayloadLedger.from_counts(self.counts, self.hidden_size, self.rep).remote_payload_bytes

    @property
    def remote_logical_bytes(self) -> int:
        return self.remote_payload_bytes + self.dispatch_meta_bytes + self.combine_meta_bytes
