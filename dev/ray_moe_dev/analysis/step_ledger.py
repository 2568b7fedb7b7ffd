"""The whole step's analytical ledgers: the baseline step's fourteen buffers and eight completion events
(spec 0x03D3-0x03D5), and ``StepLedger`` built from declared shapes or from the real dispatch handles of
every rank (``ledger_from_handles``). Pure: no Ray, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ray_moe_dev.analysis.byte_ledgers import PaddingLedger, PayloadLedger, RowSlotLedger, TransportLedger
from ray_moe.release.ledger import (
    ANALYTICAL,
    BASELINE,
    CountMatrix,
    LedgerRecord,
    Representation,
    as_count_matrix,
    positive_int,
)
from ray_moe.release.lifetimes import Buffer, BufferRole, LifetimeLedger, Operation
from ray_moe_dev.analysis.precision_ledger import AlignmentLedger
from ray_moe.moe.dispatch.records import DispatchHandle


# ------------------------------------------------------------------------------------------------------
#  the baseline step's fourteen buffers and eight completion events (spec 0x03D3-0x03D5)
# ------------------------------------------------------------------------------------------------------

#: The spec's serialized-epoch lifetime table (0x03D3): name -> (start, end, last completion, role,
#: alias group). Byte sizes are NOT here; ``baseline_step_buffers`` derives them from shapes.
BASELINE_LIFETIMES: tuple[tuple[str, int, int, str, BufferRole, str | None], ...] = (
    ("input_hidden", 0, 9, "handle_released", BufferRole.INPUT, None),
    ("route_handle", 0, 9, "handle_released", BufferRole.HANDLE, None),
    ("count_matrix", 1, 7, "combine_complete", BufferRole.CONTROL, None),
    ("send_offsets", 1, 7, "combine_complete", BufferRole.CONTROL, None),
    ("receive_splits", 1, 7, "combine_complete", BufferRole.CONTROL, None),
    ("packed_send_payload", 1, 3, "dispatch_complete", BufferRole.SEND, None),
    ("send_metadata", 1, 3, "dispatch_complete", BufferRole.SEND, None),
    ("source_major_receive", 2, 4, "expert_input_ready", BufferRole.RECEIVE, None),
    ("local_expert_offsets", 3, 5, "expert_complete", BufferRole.CONTROL, None),
    ("local_expert_input", 3, 5, "expert_complete", BufferRole.EXPERT, None),
    ("expert_output_return_payload", 4, 7, "combine_complete", BufferRole.RETURN, "expert_output_return_payload"),
    ("return_metadata", 4, 7, "combine_complete", BufferRole.RETURN, None),
    ("returned_source_order_rows", 6, 8, "output_ready", BufferRole.RETURN, None),
    ("output_hidden", 7, 10, "downstream_consumer", BufferRole.OUTPUT, None),
)


def baseline_buffer_bytes(counts: Any, hidden_size: int, num_tokens: int, slots_per_rank: Sequence[int],
                          rep: Representation = BASELINE) -> dict[str, int]:
    """Byte size of each baseline buffer, derived from shapes (spec 0x03D2, 0x03D3).

    input/output hidden  [T, d]            T d b_a / T d b_o
    route handle         [R, 8] INT32      R * handle_fields * meta_bytes
    count matrix         [P, P] INT64;  send offsets [P, P+1] INT64;  receive splits [P, P] INT64
    packed send / source-major receive / local expert input   [R, d] b_a   (staging layout)
    send metadata        [R, 2] INT32      (every staged row, local ones included)
    local expert offsets sum_u (slots_u + 1) INT64
    expert output / return payload / returned rows            [R, d] b_o
    return metadata      [R, 1] INT32
    """
    tl = TransportLedger(counts, tuple(slots_per_rank), hidden_size, rep)
    pl = PayloadLedger.from_counts(counts, hidden_size, rep)
    r = pl.rows
    t = positive_int("num_tokens", num_tokens, allow_zero=True)
    return {
        "input_hidden": t * hidden_size * rep.activation_bytes,
        "route_handle": tl.route_handle_bytes,
        "count_matrix": tl.count_matrix_bytes,
        "send_offsets": tl.send_offsets_bytes,
        "receive_splits": tl.recv_splits_bytes,
        "packed_send_payload": pl.staging_dispatch_bytes,
        "send_metadata": r * rep.dispatch_meta_fields * rep.meta_bytes,
        "source_major_receive": pl.staging_dispatch_bytes,
        "local_expert_offsets": tl.local_expert_offsets_bytes,
        "local_expert_input": pl.staging_dispatch_bytes,
        "expert_output_return_payload": pl.staging_combine_bytes,
        "return_metadata": r * rep.combine_meta_fields * rep.meta_bytes,
        "returned_source_order_rows": pl.staging_combine_bytes,
        "output_hidden": t * hidden_size * rep.output_bytes,
    }


def baseline_step_buffers(counts: Any, hidden_size: int, num_tokens: int, slots_per_rank: Sequence[int],
                          rep: Representation = BASELINE) -> LifetimeLedger:
    """The fourteen baseline buffers with shape-derived bytes and the spec's epoch table (0x03D3)."""
    sizes = baseline_buffer_bytes(counts, hidden_size, num_tokens, slots_per_rank, rep)
    return LifetimeLedger(tuple(
        Buffer(name, sizes[name], start, end, alias_group=alias, last_completion=last, role=role)
        for name, start, end, last, role, alias in BASELINE_LIFETIMES
    ))


def baseline_step_operations() -> tuple[Operation, ...]:
    """The correctness DAG of spec 0x03D4 with completion epochs consistent with 0x03D3's table.

    route_ready -> dispatch_packed -> dispatch_complete -> expert_input_ready -> expert_complete
    -> combine_complete -> output_ready -> handle_released;  output_ready -> downstream_consumer.
    """
    return (
        Operation("route_ready", 1, (), ("input_hidden",), ("route_handle",)),
        Operation("dispatch_packed", 2, ("route_ready",), ("input_hidden", "route_handle"),
                  ("count_matrix", "send_offsets", "receive_splits", "packed_send_payload", "send_metadata")),
        Operation("dispatch_complete", 3, ("dispatch_packed",),
                  ("packed_send_payload", "send_metadata", "count_matrix", "send_offsets", "receive_splits"),
                  ("source_major_receive",)),
        Operation("expert_input_ready", 4, ("dispatch_complete",), ("source_major_receive", "receive_splits"),
                  ("local_expert_offsets", "local_expert_input")),
        Operation("expert_complete", 5, ("expert_input_ready",), ("local_expert_input", "local_expert_offsets"),
                  ("expert_output_return_payload", "return_metadata")),
        Operation("combine_complete", 7, ("expert_complete",),
                  ("expert_output_return_payload", "return_metadata", "count_matrix", "send_offsets",
                   "receive_splits"),
                  ("returned_source_order_rows",)),
        Operation("output_ready", 8, ("combine_complete",), ("returned_source_order_rows", "route_handle"),
                  ("output_hidden",)),
        Operation("handle_released", 9, ("output_ready",), ("route_handle",)),
        Operation("downstream_consumer", 10, ("output_ready",), ("output_hidden",)),
    )


# ------------------------------------------------------------------------------------------------------
#  the whole step, from declared shapes or from real dispatch handles
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepLedger(LedgerRecord):
    """Every analytical ledger of one MoE layer step, built from one count matrix.

    counts:         [P, P] C over global ranks
    slot_counts:    [Q] rows received per physical slot, global slot-id order
    slots_per_rank: [P] physical slots hosted per rank
    """

    counts: CountMatrix
    slot_counts: tuple[int, ...]
    slots_per_rank: tuple[int, ...]
    num_tokens: int
    hidden_size: int
    rep: Representation = BASELINE
    row_alignment: int | None = None
    evidence: str = ANALYTICAL
    rows: RowSlotLedger = field(init=False)
    payload: PayloadLedger = field(init=False)
    transport: TransportLedger = field(init=False)
    padding: PaddingLedger = field(init=False)
    buffers: LifetimeLedger = field(init=False)
    alignment: AlignmentLedger | None = field(init=False)

    def __post_init__(self) -> None:
        c = as_count_matrix(self.counts)
        object.__setattr__(self, "counts", c)
        object.__setattr__(self, "slot_counts", tuple(int(x) for x in self.slot_counts))
        object.__setattr__(self, "slots_per_rank", tuple(int(x) for x in self.slots_per_rank))
        rows = RowSlotLedger(c)
        if sum(self.slot_counts) != rows.useful_rows:
            raise ValueError(f"slot_counts: sum {sum(self.slot_counts)} != routes in the count matrix "
                             f"{rows.useful_rows} (conservation)")
        if sum(self.slots_per_rank) != len(self.slot_counts):
            raise ValueError(f"slots_per_rank: {list(self.slots_per_rank)} hosts {sum(self.slots_per_rank)} "
                             f"slots but slot_counts has {len(self.slot_counts)}")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "payload", PayloadLedger.from_counts(c, self.hidden_size, self.rep))
        object.__setattr__(self, "transport", TransportLedger(c, self.slots_per_rank, self.hidden_size, self.rep))
        object.__setattr__(self, "padding", PaddingLedger.from_counts(c, self.hidden_size, self.rep))
        object.__setattr__(self, "buffers", baseline_step_buffers(c, self.hidden_size, self.num_tokens,
                                                                  self.slots_per_rank, self.rep))
        object.__setattr__(self, "alignment", None if self.row_alignment is None
                           else AlignmentLedger(self.slot_counts, self.row_alignment))


def ledger_from_handles(handles: Sequence[DispatchHandle], *, hidden_size: int,
                        rep: Representation = BASELINE, row_alignment: int | None = None) -> StepLedger:
    """Build the step's analytical ledgers from the dispatch handles of ALL ranks of one step.

    Steps:
      1. one handle per global rank 0..P-1 (P from the count matrix)
      2. every handle carries the same count matrix C [P, P]
      3. each rank's source row agrees with C[rank, :]; its received expert counts sum to C[:, rank]
      4. slot counts in global slot-id order from (receive.slot_ids, receive.expert_counts);
         slots per rank from the local expert count vectors; tokens from the semantic routes
    ``hidden_size`` and ``rep`` declare the representation: a handle carries rows, not widths.
    """
    hs = list(handles)
    if not hs:
        raise ValueError("handles: empty; pass the dispatch handles of every rank of the step")
    # 1.-2.
    c = as_count_matrix(hs[0].count_matrix, "handles[0].count_matrix")
    p = len(c)
    by_rank: dict[int, DispatchHandle] = {}
    for i, h in enumerate(hs):
        if h.rank in by_rank:
            raise ValueError(f"handles[{i}].rank={h.rank}: two handles for one rank")
        by_rank[h.rank] = h
        ci = as_count_matrix(h.count_matrix, f"handles[{i}].count_matrix")
        if ci != c:
            raise ValueError(f"handles[{i}].count_matrix={[list(r) for r in ci]}: differs from rank "
                             f"{hs[0].rank}'s {[list(r) for r in c]}")
    if sorted(by_rank) != list(range(p)):
        raise ValueError(f"handles: ranks {sorted(by_rank)} do not cover the {p} ranks of the count matrix")
    if len({(h.generation, h.layer) for h in hs}) != 1:
        raise ValueError(f"handles: mixed (generation, layer) {sorted({(h.generation, h.layer) for h in hs})}")
    # 3.-4.
    slot_rows: dict[int, int] = {}
    slots_per_rank: list[int] = []
    tokens = 0
    for u in range(p):
        h = by_rank[u]
        sent = [int(x) for x in h.source.counts_by_rank.tolist()]
        if sent != list(c[u]):
            raise ValueError(f"handles[rank {u}].source.counts_by_rank={sent}: != count matrix row {list(c[u])}")
        got = [int(x) for x in h.receive.expert_counts.tolist()]
        want = sum(c[s][u] for s in range(p))
        if sum(got) != want:
            raise ValueError(f"handles[rank {u}].receive.expert_counts={got}: sum {sum(got)} != column sum {want}")
        for q, n in zip(h.receive.slot_ids.tolist(), got):
            slot_rows[int(q)] = n
        slots_per_rank.append(len(got))
        tokens += h.routes.num_tokens
    slot_counts = tuple(slot_rows[q] for q in sorted(slot_rows))
    return StepLedger(c, slot_counts, tuple(slots_per_rank), tokens, hidden_size, rep, row_alignment)
