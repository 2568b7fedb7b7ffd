# ======================================================================================================
#  THE DIRECT DATA PATH (one rank, one MoE layer, SPMD over the process group; the fast normal mode)
#
#   route batch ─> replica selection ─> send order + per-slot counts + value flags ── ONE host copy
#        │                     control round 1: engine header (generation, epoch, status, splits) ─ agree
#        │                     control round 2: per-physical-slot counts [Q] ─ every rank derives the
#        │                     expert-major layout of every destination on the host (no payload metadata)
#        ▼
#   own rows ──────── one fused gather/scatter straight into expert-major order (no network) ───────┐
#   peer rows ─ pack chunk c ─> [comm stream] all-to-all-v chunk c ─> place chunk c in expert-major ┤
#                                                                                                  ▼
#                                                              expert runner (expert-major rows)
#   own rows stay where they are ──────────────────────────────────────────────────────────────────┐
#   peer rows ─ gather chunk c ─> [comm stream] return all-to-all-v chunk c (into one buffer) ─────┤
#                                                                                                  ▼
#                               gated FP32 combine reading own rows and returned rows in one pass
#
#  Pure: no Ray. The exchange is any backend; NCCL (``device_async``) runs the rounds on a separate
#  stream so packs, placements and the own-rows copy overlap the transfers.
# ======================================================================================================
"""Direct dispatch and combine: the normal (prefill) mode with the fewest host waits and memory passes.

Same protocol guarantees as ``engine.dispatch`` / ``engine.combine`` (identical agreed count matrix,
expert-major rows in the same (slot, source, send position) order, the same combined output up to FP32
summation order), built for speed:

1. One device->host copy before the control round carries the validation flags and the per-slot route
   counts. On a flag the rank still takes part in both control rounds with ``BAD_INPUT`` (every peer
   aborts before payload) and raises the exact validation error.
2. Two control all-gathers: the engine's fixed-size header (checked by ``engine.agree``), then the
   per-physical-slot counts ``[Q]`` of every rank (only once the header agreed, so ranks on different
   generations never exchange vectors of different lengths). From the slot counts every rank knows where
   each received row lands in expert-major order, so no slot ids travel with the payload and no receive
   sort or host copy happens after the payload.
3. Rows for this rank's own experts never enter the network: one gather/scatter kernel moves them from
   ``hidden`` straight to their expert-major rows while the peer rows are in flight.
4. Peer rows travel in ``chunks`` rounds (each peer segment split into equal row ranges that both sides
   compute from the agreed counts); on NCCL, chunk c+1 is packed while chunk c is on the wire and chunk
   c is placed while c+1 is on the wire.
5. The combine reads every route's row once from wherever it lives (own expert-major rows, or the
   single buffer the return rounds fill) and writes each token once (FP32 accumulation).

Dense routes only (``T * k`` routes, the router's layout) and the native payload dtype; other inputs go
through ``engine.dispatch``.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, replace

import numpy as np
import torch

from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.dispatch.kernels import gated_combine, move_rows
from ray_moe.moe.dispatch.plan import check_assignment, count_by
from ray_moe.moe.dispatch.protocol import (
    DTYPE_CODES,
    ControlRecord,
    ControlStatus,
    DeferredChecks,
    Dispatcher,
    control_round,
    fence,
    global_counts,
)
from ray_moe.moe.dispatch.records import DispatchOutputFormat, DispatchOutput, Handle
from ray_moe.core.routes import RouteBatch, SemanticRoutes
from ray_moe.core.errors import CountAgreementError, RouteValidationError
from ray_moe.placement.selector import ReplicaSelector
from ray_moe.placement.snapshot import PlacementSnapshot
from ray_moe.core.types import DispatchMode
from ray_moe.moe.dispatch.direct_layout import _HostMaps, _Layout, _blocks_index, _to_device, build_layout, chunk_major_blocks

_NFLAGS = 3  # device flags of the plan: expert id out of range, gate not finite or negative, slot mismatch
_PLAN_GRAPHS = 16  # captured plans kept per dispatcher (one per layer x token count in a serving loop)


# ------------------------------------------------------------------------------------------------------
#  records
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DirectHandle(Handle):
    """The direct path's handle (generation coordinates from ``Handle``; combine resolves exactly these).

    gate:        [T, k] float32 combine gates
    route_src:   [T, k] int64   where route (t, j)'s expert output lives at combine time: s >= 0 is row s
                 of this rank's expert-major rows, s < 0 is row -1-s of the return buffer
    remote_em:   [N_remote] int64 expert-major row of each row received from a peer, in receive order
                 (chunk-major, then source peer, then the source's send order)
    send_chunks / recv_chunks: [C][G] host split vectors of every chunk round (own peer slot always 0)
    count_matrix: [P, P] int64 agreed route counts C[p, u] over global ranks
    """

    num_tokens: int
    top_k: int
    gate: torch.Tensor
    route_src: torch.Tensor
    remote_em: torch.Tensor
    send_chunks: tuple[tuple[int, ...], ...]
    recv_chunks: tuple[tuple[int, ...], ...]
    count_matrix: torch.Tensor
    num_rows: int
    sent_slot_counts: tuple[int, ...] = ()  # [Q] routes this rank sent to each physical slot (host)
    expert_counts: tuple[int, ...] = ()  # [Q_local] rows per local slot (host)

    @property
    def remote_sent(self) -> int:
        return sum(sum(c) for c in self.send_chunks)

    @property
    def remote_received(self) -> int:
        return sum(sum(c) for c in self.recv_chunks)


@dataclass(frozen=True, eq=False)
class DirectDispatchOutput(DispatchOutput):
    """Direct dispatch result on one rank (the normal mode's rows, expert-major).

    rows:          [N, d] received rows in expert-major order (hidden's dtype)
    counts_list:   rows per local slot on the host (what runners size their launches with)
    expert_counts: [Q_local] int64 the same counts as a host tensor
    handle:        the paired DirectHandle for ``DirectDispatcher.combine``
    """

    format = DispatchOutputFormat.EXPERT_MAJOR

    expert_counts: torch.Tensor | None = None


class DirectDispatcher(Dispatcher):
    """Direct dispatch/combine endpoint of one rank over one exchange.

    selector:      replica selection (graph-safe selectors let the plan be captured as a CUDA graph)
    chunks:        peer-row rounds per direction (1 = one round); every rank must use the same value
    wait_dispatch: NCCL only: wait (under the watchdog) at the end of dispatch; the end of combine always
                   waits, so a dead peer raises there and never hangs a later host sync
    capture_plans: capture graph-safe plans as CUDA graphs (the deployment's ``cuda_graphs``; off, every plan
                   launches its kernels: two ranks sharing one process and GPU cannot capture while the other
                   launches on the legacy stream, ``bench.rebalance_memory``)
    """

    mode = DispatchMode.DIRECT

    def __init__(self, exchange: Exchange, selector: ReplicaSelector, *, chunks: int = 1,
                 wait_dispatch: bool = True, capture_plans: bool = True) -> None:
        if chunks < 1:
            raise ValueError(f"chunks={chunks}: must be >= 1")
        self.exchange = exchange
        self.selector = selector
        self.chunks = int(chunks)
        self.wait_dispatch = wait_dispatch
        self.capture_plans = bool(capture_plans)
        self._async = bool(getattr(exchange, "device_async", False))
        self._comm: torch.cuda.Stream | None = None
        self._slots_cache: dict[tuple, _HostMaps] = {}
        self._graphs: dict[tuple, _PlanGraph] = {}
        # host timestamps of the step's stages, appended when a caller sets a list here (profiling)
        self.marks: list[tuple[str, float]] | None = None

    def _mark(self, label: str) -> None:
        if self.marks is not None:
            self.marks.append((label, time.perf_counter()))

    # ------------------------------------------------------------------ helpers
    def _comm_stream(self, device: torch.device) -> "torch.cuda.Stream":
        if self._comm is None:
            self._comm = torch.cuda.Stream(device=device)
        return self._comm

    def _slot_maps(self, snapshot: PlacementSnapshot) -> "_HostMaps":
        """Host maps of ``snapshot`` for this rank, cached by the snapshot's identity fields."""
        key = (snapshot.generation, snapshot.layer, snapshot.map_digest, snapshot.pg_epoch, self.exchange.rank)
        hit = self._slots_cache.get(key)
        if hit is None:
            hit = _HostMaps.build(snapshot, self.exchange.rank, self.exchange.size)
            if len(self._slots_cache) > 64:
                self._slots_cache.clear()
            self._slots_cache[key] = hit
        return hit

    def _round(self, tag: str, send: torch.Tensor, send_splits, recv_splits, out: torch.Tensor | None,
               stream) -> torch.Tensor:
        """One payload round of the peer rows; returns the receive buffer (``out`` when given)."""
        ex = self.exchange
        s, r = [int(x) for x in send_splits], [int(x) for x in recv_splits]
        if self._async:
            got = ex.post_all_to_all_v({"x": send}, s, r, stream=stream,  # type: ignore[attr-defined]
                                       out=None if out is None else {"x": out})["x"]
            return got
        got = ex.all_to_all_v(tag, {"x": send}, s, r)["x"]
        if out is not None:
            out.copy_(got)
            return out
        return got

    # ------------------------------------------------------------------ plan
    def _plan(self, batch: RouteBatch, snapshot: PlacementSnapshot) -> tuple[torch.Tensor, torch.Tensor]:
        """(send_order [R] int64, summary [3 + Q] int64: device flags then per-slot route counts).

        On CUDA with a ``graph_safe`` selector the ~50 small kernels of the plan are captured once per
        (generation, layer, map digest, T, k, dtypes, selector) and replayed: one launch instead of ~50
        host round trips through the dispatcher.
        """
        ids, w = batch.topk_ids, batch.topk_weights
        rank, selector = self.exchange.rank, self.selector
        if not (ids.is_cuda and selector.graph_safe and self.capture_plans):
            return _plan_tensors(ids, w, snapshot, selector, rank)
        key = (snapshot.generation, snapshot.layer, snapshot.map_digest, snapshot.pg_epoch, tuple(ids.shape),
               ids.dtype, w.dtype, type(selector), str(ids.device))
        graph = self._graphs.get(key)
        if graph is None:
            if len(self._graphs) >= _PLAN_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
            graph = _PlanGraph(ids, w, snapshot, selector, rank)
            self._graphs[key] = graph
        return graph.run(ids, w)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, batch: RouteBatch, snapshot: PlacementSnapshot, *, tag: str,
                 status: ControlStatus = ControlStatus.OK) -> DirectDispatchOutput:
        """Variable dispatch of one rank's routes (see the module docstring).

        batch.hidden [T, d] float, topk_ids [T, k] int64, topk_weights [T, k] float32.
        ``status`` lets the caller refuse the step while still taking part in the control rounds.
        """
        ex, selector = self.exchange, self.selector
        rank, g_count, me = ex.rank, ex.size, ex.peer
        h, ids, w = batch.hidden, batch.topk_ids, batch.topk_weights
        dev = h.device
        q_count, num_e = snapshot.num_slots, snapshot.num_experts
        self._mark("dispatch")
        # 1. host-only shape checks (no device work yet)
        error: Exception | None = None
        shape_ok = h.dim() == 2 and ids.dim() == 2 and ids.shape[0] == h.shape[0] and w.shape == ids.shape
        if not shape_ok or batch.origin_rank != rank or not h.is_floating_point():
            error = _first_error(batch, snapshot, rank)
        t_count = int(h.shape[0]) if h.dim() == 2 else 0
        k = int(ids.shape[1]) if ids.dim() == 2 else 0
        r_count = t_count * k
        slot_counts = np.zeros(q_count, dtype=np.int64)
        send_order = None
        if error is None and r_count:
            # 2-4. replica selection, send order, value flags and per-slot counts (a CUDA graph replay when
            #      the selector allows it), then ONE device->host copy
            send_order, summary = self._plan(batch, snapshot)
            # hidden finite <=> its max-abs is finite (NaN propagates; inf * 0 = NaN): one reduction pass
            hidden_bad = (torch.isnan(torch.linalg.vector_norm(h, float("inf")) * 0).view(1).to(torch.int64)
                          if h.numel() else torch.zeros(1, dtype=torch.int64, device=dev))
            self._mark("plan_enqueued")
            host = torch.cat([summary[:_NFLAGS], hidden_bad, summary[_NFLAGS:]]).cpu().numpy()
            self._mark("counts_on_host")
            if host[:_NFLAGS + 1].any():
                routes = SemanticRoutes.from_batch(batch)
                physical = selector.select(replace(routes, logical_expert=routes.logical_expert.clamp(0, num_e - 1)),
                                           snapshot).to(dev)
                error = _first_error(batch, snapshot, rank, routes=routes, physical=physical)
            else:
                slot_counts = host[_NFLAGS + 1:]
        if error is not None:
            status = ControlStatus.BAD_INPUT if status == ControlStatus.OK else status
            slot_counts = np.zeros(q_count, dtype=np.int64)
        maps_h = self._slot_maps(snapshot)
        declared = slot_counts @ maps_h.onehot
        # 5. control round 1: the engine's header, agreed exactly as engine.dispatch agrees it
        width = int(h.shape[1]) if h.dim() == 2 else -1
        record = ControlRecord(snapshot.generation, snapshot.pg_epoch, snapshot.layer, status,
                               int(slot_counts.sum()), snapshot.map_digest, width, DTYPE_CODES.get(h.dtype, 0),
                               0, tuple(declared.tolist()))
        c_peer = control_round(ex, record, tag, local_error=error)
        self._mark("control_1")
        # 6. control round 2: per-slot counts (same Q everywhere: the header agreed on the map digest)
        all_slots = ex.all_gather(f"{tag}/slots", slot_counts)
        self._mark("control_2")
        if not np.array_equal(all_slots @ maps_h.onehot, c_peer):
            raise CountAgreementError(f"{tag}: per-slot counts do not add up to the agreed split vectors "
                                      f"{c_peer.tolist()}; aborted before payload exchange")
        lay = build_layout(all_slots, maps_h, me, self.chunks)
        self._mark("layout")
        assert send_order is not None or r_count == 0
        return self._exchange_rows(batch, snapshot, lay, c_peer, send_order, t_count, k, tag)

    def _exchange_rows(self, batch: RouteBatch, snapshot: PlacementSnapshot, lay: _Layout, c_peer: np.ndarray,
                       send_order: torch.Tensor | None, t_count: int, k: int, tag: str) -> DirectDispatchOutput:
        ex, me, c = self.exchange, self.exchange.peer, self.chunks
        h = batch.hidden
        dev, d = h.device, int(h.shape[1])
        r_count = t_count * k
        n_rows = int(lay.recv_splits.sum())
        n_remote_recv = n_rows - int(lay.recv_splits[me])
        n_remote_send = r_count - int(lay.send_splits[me])
        # 7. index vectors on the device (one host table upload, no sync)
        if n_rows:
            table = _to_device(np.stack([lay.em_shift, lay.em_repeats]), dev)
            em_all = torch.arange(n_rows, device=dev) + torch.repeat_interleave(table[0], table[1], output_size=n_rows)
        else:
            em_all = torch.zeros(0, dtype=torch.int64, device=dev)
        own_lo = int(lay.recv_splits[:me].sum())
        own_hi = own_lo + int(lay.recv_splits[me])
        em_own = em_all[own_lo:own_hi]
        if send_order is None:
            send_order = torch.zeros(0, dtype=torch.int64, device=dev)
        send_tok = send_order // max(k, 1)
        send_lo = int(lay.send_splits[:me].sum())
        send_hi = send_lo + int(lay.send_splits[me])
        own_tok = send_tok[send_lo:send_hi]
        if c == 1:  # peer rows in peer order: everything but the own segment, two slices
            remote_em = torch.cat([em_all[:own_lo], em_all[own_hi:]])
            remote_tok = torch.cat([send_tok[:send_lo], send_tok[send_hi:]])
            # route_src in send order: own rows -> expert-major row; peer rows -> -1 - return-buffer row
            src_by_send = torch.cat([torch.arange(-1, -1 - send_lo, -1, device=dev), em_own,
                                     torch.arange(-1 - send_lo, -1 - n_remote_send, -1, device=dev)])
        else:
            rs, rl = chunk_major_blocks(lay.recv_splits, me, c)
            remote_em = em_all[_blocks_index(rs, rl, n_remote_recv, dev)]
            ss, sl = chunk_major_blocks(lay.send_splits, me, c)
            remote_send = _blocks_index(ss, sl, n_remote_send, dev)
            remote_tok = send_tok[remote_send]
            src_by_send = torch.empty(r_count, dtype=torch.int64, device=dev)
            src_by_send[send_lo:send_hi] = em_own
            src_by_send[remote_send] = torch.arange(-1, -1 - n_remote_send, -1, device=dev)
        route_src = torch.empty(r_count, dtype=torch.int64, device=dev)
        route_src[send_order] = src_by_send
        self._mark("indices_enqueued")
        # 8. payload: own rows straight to expert-major; peer rows in chunk rounds
        x = torch.empty(n_rows, d, dtype=h.dtype, device=dev)
        send_off = np.concatenate([[0], np.cumsum(lay.send_chunks.sum(axis=1))])
        recv_off = np.concatenate([[0], np.cumsum(lay.recv_chunks.sum(axis=1))])
        cur = torch.cuda.current_stream(dev) if self._async else None
        comm = self._comm_stream(dev) if self._async else None
        received = []
        for i in range(c):
            pack = h.index_select(0, remote_tok[send_off[i]:send_off[i + 1]])
            if comm is not None:
                comm.wait_stream(cur)
                pack.record_stream(comm)
            got = self._round(f"{tag}/dispatch{i}", pack, lay.send_chunks[i], lay.recv_chunks[i], None, comm)
            if comm is not None:
                got.record_stream(cur)
                ev = torch.cuda.Event()
                ev.record(comm)
                received.append((got, ev))
            else:
                received.append((got, None))
            if i == 0:
                move_rows(h, own_tok, x, em_own)  # overlaps the first round on NCCL
        for i, (got, ev) in enumerate(received):
            if ev is not None:
                cur.wait_event(ev)
            if got.shape[0]:
                move_rows(got, None, x, remote_em[recv_off[i]:recv_off[i + 1]])
        self._mark("payload_enqueued")
        if self._async and self.wait_dispatch:
            ex.wait(f"direct dispatch {tag!r}")  # type: ignore[attr-defined]
            self._mark("payload_done")
        counts_list = tuple(int(v) for v in lay.expert_counts.tolist())
        handle = DirectHandle(
            handle_id=f"direct-h{snapshot.generation}-r{ex.rank}-{uuid.uuid4().hex[:10]}",
            generation=snapshot.generation, layer=snapshot.layer, pg_epoch=snapshot.pg_epoch, rank=ex.rank,
            num_tokens=t_count, top_k=k,
            gate=batch.topk_weights.to(device=dev, dtype=torch.float32).reshape(t_count, k),
            route_src=route_src.view(t_count, k), remote_em=remote_em,
            send_chunks=tuple(tuple(int(v) for v in row) for row in lay.send_chunks),
            recv_chunks=tuple(tuple(int(v) for v in row) for row in lay.recv_chunks),
            count_matrix=global_counts(c_peer, ex.group.peer_order, snapshot.num_ranks), num_rows=n_rows,
            sent_slot_counts=tuple(int(v) for v in lay.sent_slot_counts.tolist()), expert_counts=counts_list,
        )
        return DirectDispatchOutput(rows=x, counts_list=counts_list, handle=handle,
                                    expert_counts=torch.from_numpy(lay.expert_counts))

    # ------------------------------------------------------------------ combine
    def combine(self, expert_rows: torch.Tensor, handle: DirectHandle, snapshot: PlacementSnapshot, *, tag: str,
                out_dtype: torch.dtype, checks: DeferredChecks | None = None) -> torch.Tensor:
        """Return path: peer rows go back in chunk rounds, own rows stay; one gated FP32 combine pass.

        expert_rows: [N, d] expert outputs in expert-major order (no gate applied)
        returns:     [T, d] ``out_dtype``
        checks: the handle check is deferred into it (read with the output before it is published); without
        it the handle is checked now (one host sync).
        """
        fence(handle, snapshot)
        if expert_rows.dim() != 2 or expert_rows.shape[0] != handle.num_rows:
            raise RouteValidationError(f"expert_rows: shape {tuple(expert_rows.shape)} but the handle received "
                                       f"{handle.num_rows} rows")
        self._check(handle, checks)
        self._mark("combine")
        y = expert_rows.contiguous()
        dev, d = y.device, int(y.shape[1])
        n_back = handle.remote_sent
        ret = torch.empty(n_back, d, dtype=y.dtype, device=dev)
        back_off = np.concatenate([[0], np.cumsum([sum(r) for r in handle.recv_chunks])])
        ret_off = np.concatenate([[0], np.cumsum([sum(s) for s in handle.send_chunks])])
        cur = torch.cuda.current_stream(dev) if self._async else None
        comm = self._comm_stream(dev) if self._async else None
        events = []
        for i in range(self.chunks):
            back = y.index_select(0, handle.remote_em[back_off[i]:back_off[i + 1]])
            if comm is not None:
                comm.wait_stream(cur)
                back.record_stream(comm)
            self._round(f"{tag}/combine{i}", back, handle.recv_chunks[i], handle.send_chunks[i],
                        ret[ret_off[i]:ret_off[i + 1]], comm)
            if comm is not None:
                ev = torch.cuda.Event()
                ev.record(comm)
                events.append(ev)
        for ev in events:
            cur.wait_event(ev)
        out = gated_combine(y, ret, handle.route_src, handle.gate, out_dtype)
        self._mark("combine_enqueued")
        if self._async:
            self.exchange.wait(f"direct combine {tag!r}")  # type: ignore[attr-defined]
            self._mark("combine_done")
        return out

    def handle_ok(self, handle: DirectHandle) -> torch.Tensor:
        return handle_ok(handle)

    def sent_slot_counts(self, handle: DirectHandle) -> np.ndarray:
        return np.asarray(handle.sent_slot_counts, dtype=np.int64)


def handle_ok(handle: DirectHandle) -> torch.Tensor:
    """Device-side check (no host sync) that ``route_src`` maps the routes one-to-one onto this rank's own
    expert-major rows and the return buffer's rows, every returned row used exactly once: a 0-d bool
    tensor, read with the output before it is published (fault 4 of spec 0x0E, direct-path form)."""
    rs = handle.route_src.reshape(-1)
    n_own_rows, n_back = handle.num_rows, handle.remote_sent
    if rs.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=rs.device)
    idx = torch.where(rs >= 0, rs, n_own_rows - 1 - rs)  # own rows, then the return buffer
    size = n_own_rows + n_back
    valid = ((idx >= 0) & (idx < size)).all()
    hits = torch.zeros(size, dtype=torch.int64, device=rs.device).scatter_add_(
        0, idx.clamp(0, max(size - 1, 0)), torch.ones_like(idx))
    return valid & (hits <= 1).all() & (hits[n_own_rows:] == 1).all()


def _plan_tensors(ids: torch.Tensor, w: torch.Tensor, snapshot: PlacementSnapshot, selector: ReplicaSelector,
                  rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan as device ops only (no host sync): ids [T, k] int64, w [T, k] float32 ->
    (send_order [R] int64, summary [3 + Q] int64). Out-of-range ids are clamped before any lookup and
    flagged, so a bad id is reported, never used as an index."""
    t, k = ids.shape
    dev = ids.device
    q_count, num_e = snapshot.num_slots, snapshot.num_experts
    maps = snapshot.on(dev)
    e = ids.reshape(-1).to(torch.int64)
    ec = e.clamp(0, num_e - 1)
    routes = SemanticRoutes(origin_rank=rank, num_tokens=t, top_k=k,
                            origin_token=torch.arange(t, device=dev).repeat_interleave(k),
                            route_slot=torch.arange(k, device=dev).repeat(t), logical_expert=ec,
                            gate=w.reshape(-1), dense=True)
    physical = selector.select(routes, snapshot)
    pc = physical.clamp(0, q_count - 1)
    dest_peer = maps.rank_to_peer[maps.slot_rank[pc]]
    # stable sort by (destination peer, slot); ties keep semantic order
    send_order = torch.sort(dest_peer * q_count + pc, stable=True).indices
    flags = torch.stack([
        (e != ec).any(),
        (~torch.isfinite(w)).any() | (w < 0).any(),
        ((physical != pc) | (maps.phy2log[pc] != e)).any(),
    ]).to(torch.int64)
    return send_order, torch.cat([flags, count_by(pc, q_count)])


class _PlanGraph:
    """One captured plan: static input copies, the graph, its output tensors (overwritten per replay;
    read before the next replay on the same stream) and the device maps it reads (kept alive).
    Captures in one process take turns (``CAPTURE_LOCK``): every capture registers with the process's one CUDA
    generator, which refuses a second capture in progress; two ranks of an in-process deployment sharing a GPU
    (tests, ``bench.rebalance_memory``) captured at once and one rank's first step failed (its peer then
    waited on the exchange: the run looked stalled)."""

    CAPTURE_LOCK = threading.Lock()  # process-wide, like the CUDA generator it guards

    def __init__(self, ids: torch.Tensor, w: torch.Tensor, snapshot: PlacementSnapshot, selector: ReplicaSelector,
                 rank: int) -> None:
        self.ids, self.w = ids.clone(), w.clone()
        self.maps = snapshot.on(ids.device)
        cur = torch.cuda.current_stream(ids.device)
        side = torch.cuda.Stream(device=ids.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):  # warm-up outside capture (lazy inits, allocator blocks)
            _plan_tensors(self.ids, self.w, snapshot, selector, rank)
        cur.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with _PlanGraph.CAPTURE_LOCK, torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = _plan_tensors(self.ids, self.w, snapshot, selector, rank)

    def run(self, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.ids.copy_(ids)
        self.w.copy_(w)
        self.graph.replay()
        return self.out


def _first_error(batch: RouteBatch, snapshot: PlacementSnapshot, rank: int, *, routes: SemanticRoutes | None = None,
                 physical: torch.Tensor | None = None) -> Exception:
    """The exact validation error ``engine.dispatch`` raises for this input (host syncs are fine here)."""
    try:
        batch.validate(snapshot.num_experts)
        if batch.origin_rank != rank:
            raise RouteValidationError(f"origin_rank={batch.origin_rank} but this endpoint is rank {rank}")
        if routes is not None and physical is not None:
            check_assignment(routes, physical, snapshot)
    except RouteValidationError as exc:
        return exc
    return RouteValidationError("route batch rejected by the direct path's value checks")
