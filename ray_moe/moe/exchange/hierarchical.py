"""Hierarchical all-to-all-v through node relays (spec 0x07E) over any flat ``Exchange``. Pure: no Ray.

``HierarchicalExchange`` wraps one rank's flat endpoint and the ``Topology``. Its ``all_to_all_v`` has the
flat contract exactly (same rows, same source-major peer order on every rank) but moves different-node
rows in three rounds, each an ``all_to_all_v`` on the flat endpoint with sparse splits (zero-count peers
kept in every vector):

    round 1  same-GPU / same-node rows -> final rank; different-node rows -> source-node relay
    round 2  source relay -> destination-node relay
    round 3  destination relay -> final rank

Every row travels with routing metadata (final global rank, source peer slot, position in the source's
send buffer), so the final rank restores the flat order by sorting on (source peer, position). Staging
never changes a row's final rank.

Counts are agreed before any payload moves: one ``all_gather`` of every rank's (send, recv) split vectors
gives every rank the same global count matrix, from which all three rounds' split matrices follow. A
(send, recv) disagreement aborts every rank before round 1.

``all_gather`` delegates to the flat endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from ray_moe.moe.exchange.base import Exchange, check_splits
from ray_moe.moe.dispatch.hierarchy import RelayRounds, RelayStageLedger, relay_ranks, relay_rounds
from ray_moe.core.errors import CountAgreementError
from ray_moe.placement.topology import Topology
from ray_moe.core.types import ExchangeSchedule

META_PREFIX = "__hier."
_FINAL = META_PREFIX + "final"  # [N] int64 final global rank
_SRC = META_PREFIX + "src"  # [N] int64 source peer slot
_POS = META_PREFIX + "pos"  # [N] int64 position in the source's send buffer


@dataclass(frozen=True)
class LocalStageRows:
    """Rows *this rank* sent to another rank in each stage of one call (measured from its own rows)."""

    source_to_source_relay: int
    relay_to_relay: int
    relay_to_final: int
    direct_same_node: int


@dataclass(frozen=True)
class HierarchicalCallRecord:
    """What one hierarchical ``all_to_all_v`` did.

    global_ledger: rows per stage over all ranks (from the agreed count matrix; identical on every rank)
    local_rows:    rows this rank moved off-rank per stage (counted from the rows it actually sent)
    count_matrix:  [P, P] global-rank counts C[s, t] of the call
    """

    tag: str
    global_ledger: RelayStageLedger
    local_rows: LocalStageRows
    count_matrix: tuple[tuple[int, ...], ...]


class HierarchicalExchange(Exchange):
    """A flat endpoint plus the topology: three-round relay ``all_to_all_v``, delegated ``all_gather``."""

    schedule = ExchangeSchedule.HIERARCHICAL

    def __init__(self, inner: Exchange, topology: Topology) -> None:
        members = set(inner.group.peer_order)
        ranks = {r.rank for r in topology.ranks}
        if members != ranks:
            raise ValueError(
                f"inner.group.peer_order={list(inner.group.peer_order)}: a hierarchical exchange needs the group to "
                f"hold exactly the topology ranks {sorted(ranks)}"
            )
        self.inner = inner
        self.topology = topology
        self.rank = inner.rank
        self.group = inner.group
        self._relay = relay_ranks(topology)  # [P] relay of each global rank (validates one relay per node)
        self._node = torch.tensor(topology.node_index(), dtype=torch.int64)
        self._peer_order = torch.tensor(self.group.peer_order, dtype=torch.int64)
        self._rank_to_peer = torch.empty_like(self._peer_order)
        self._rank_to_peer[self._peer_order] = torch.arange(self.group.size, dtype=torch.int64)
        self.last_call: HierarchicalCallRecord | None = None

    def all_gather(self, tag: str, vec: np.ndarray) -> np.ndarray:
        return self.inner.all_gather(tag, vec)

    def close(self) -> None:
        self.inner.close()

    # ------------------------------------------------------------------------------------------------
    def _agree(self, tag: str, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
        """All-gather (send, recv) of every rank; check recv[v] == column v of the sends on every rank alike.

        Returns C over global ranks: [P, P] int64.
        """
        p = self.size
        vec = np.asarray([int(x) for x in send_splits] + [int(x) for x in recv_splits], dtype=np.int64)
        got = self.inner.all_gather(f"{tag}/hier-ctl", vec)
        send_peer = torch.from_numpy(np.ascontiguousarray(got[:, :p]))
        recv_peer = torch.from_numpy(np.ascontiguousarray(got[:, p:]))
        negative = (send_peer < 0).any(dim=1)
        if bool(negative.any()):
            i = int(torch.nonzero(negative)[0])
            raise CountAgreementError(
                f"{tag}: rank {self.group.peer_order[i]} declares a negative split {send_peer[i].tolist()}; "
                f"aborted before payload exchange"
            )
        expected_recv = send_peer.T
        bad = (recv_peer != expected_recv).any(dim=1)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise CountAgreementError(
                f"{tag}: rank {self.group.peer_order[i]} expects recv_splits {recv_peer[i].tolist()} but its peers "
                f"send {expected_recv[i].tolist()}; aborted on every rank before payload exchange"
            )
        c = torch.zeros(p, p, dtype=torch.int64)
        c[self._peer_order[:, None], self._peer_order[None, :]] = send_peer
        return c

    def _round(
        self, tag: str, held: dict[str, torch.Tensor], hop: torch.Tensor, matrix: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """One flat all-to-all-v: rows sorted by next-hop peer, splits from the agreed round matrix."""
        me = self.rank
        hop_peer = self._rank_to_peer.to(hop.device)[hop]
        order = torch.sort(hop_peer, stable=True).indices
        send = torch.bincount(hop_peer.cpu(), minlength=self.size)
        expected = matrix[me, self._peer_order]
        if not bool(torch.equal(send, expected)):
            raise CountAgreementError(
                f"{tag}: rank {me} holds rows for peers {send.tolist()} but the agreed plan sends {expected.tolist()}"
            )
        recv = matrix[self._peer_order, me]
        out = {k: v.index_select(0, order) for k, v in held.items()}
        return self.inner.all_to_all_v(tag, out, send.tolist(), recv.tolist())

    def all_to_all_v(
        self,
        tag: str,
        tensors: Mapping[str, torch.Tensor],
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
    ) -> dict[str, torch.Tensor]:
        """Flat contract, relay schedule. ``tensors`` share their row axis; names may not start with
        ``__hier.``.

        1. validate, agree on counts (one all-gather), derive the three round matrices
        2. attach metadata: final global rank, source peer slot, send position
        3. round 1: same-node rows to their final rank, different-node rows to this node's relay
        4. round 2: pending rows (at a source relay) to the destination relay
        5. round 3: pending rows (at a destination relay) to their final rank
        6. restore flat order: sort delivered rows by (source peer, send position); strip metadata
        """
        # 1.
        check_splits("send_splits", tensors, send_splits, self.size)
        if len(recv_splits) != self.size:
            raise ValueError(f"recv_splits: {len(recv_splits)} entries for a group of {self.size} peers")
        for k in tensors:
            if k.startswith(META_PREFIX):
                raise ValueError(f"tensors: name {k!r} uses the reserved prefix {META_PREFIX!r}")
        c = self._agree(tag, send_splits, recv_splits)
        rounds: RelayRounds = relay_rounds(c, self.topology)
        me = self.rank
        n = int(sum(int(s) for s in send_splits))
        dev = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        # 2.
        dest_peer = torch.repeat_interleave(
            torch.arange(self.size, device=dev), torch.as_tensor([int(s) for s in send_splits], device=dev)
        )
        held = dict(tensors)
        held[_FINAL] = self._peer_order.to(dev)[dest_peer]
        held[_SRC] = torch.full((n,), self.peer, dtype=torch.int64, device=dev)
        held[_POS] = torch.arange(n, dtype=torch.int64, device=dev)
        relay, node = self._relay.to(dev), self._node.to(dev)
        # 3.
        final = held[_FINAL]
        same_node = node[final] == node[me]
        hop1 = torch.where(same_node, final, relay[me])
        local_direct = int((same_node & (final != me)).sum())
        local_stage1 = int((~same_node).sum()) if int(relay[me]) != me else 0
        got = self._round(f"{tag}/hier-1", held, hop1, rounds.round_matrix(1))
        delivered, pending = _split_done(got, me)
        # 4.
        local_stage2 = int(pending[_FINAL].numel())
        got = self._round(f"{tag}/hier-2", pending, relay[pending[_FINAL]], rounds.round_matrix(2))
        done2, pending = _split_done(got, me)
        # 5.
        local_stage3 = int(pending[_FINAL].numel())
        got = self._round(f"{tag}/hier-3", pending, pending[_FINAL], rounds.round_matrix(3))
        done3, pending = _split_done(got, me)
        if pending[_FINAL].numel():
            raise CountAgreementError(f"{tag}: {pending[_FINAL].numel()} rows still in flight at rank {me} after round 3")
        # 6.
        parts = [delivered, done2, done3]
        merged = {k: torch.cat([p[k] for p in parts], 0) for k in delivered}
        m = int(merged[_POS].numel())
        if m != int(sum(int(r) for r in recv_splits)):
            raise CountAgreementError(f"{tag}: rank {me} received {m} rows, expected {sum(int(r) for r in recv_splits)}")
        width = int(merged[_POS].max()) + 1 if m else 1
        order = torch.sort(merged[_SRC] * width + merged[_POS], stable=True).indices
        self.last_call = HierarchicalCallRecord(
            tag=tag,
            global_ledger=rounds.ledger(),
            local_rows=LocalStageRows(local_stage1, local_stage2, local_stage3, local_direct),
            count_matrix=tuple(tuple(int(x) for x in row) for row in c.tolist()),
        )
        return {k: merged[k].index_select(0, order) for k in tensors}


def _split_done(got: dict[str, torch.Tensor], me: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Partition received rows into those whose final rank is ``me`` and those still in flight."""
    done = got[_FINAL] == me
    idx_done = torch.nonzero(done, as_tuple=False).flatten()
    idx_pend = torch.nonzero(~done, as_tuple=False).flatten()
    return ({k: v.index_select(0, idx_done) for k, v in got.items()},
            {k: v.index_select(0, idx_pend) for k, v in got.items()})
