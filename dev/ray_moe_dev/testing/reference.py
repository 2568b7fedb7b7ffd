"""Naive references every fast path is compared against (spec 0x01A, 0x03B-0x03C3, 0x07B).

Everything here is written as plain Python loops over tokens, route slots, routes and ranks, with
Python ``sorted`` for every permutation. Nothing is vectorised on purpose: these functions are the
oracle, so they must be obviously correct by reading, not fast.

* ``reference_moe``: y_t = sum_j g_{t,j} * swiglu_{e_{t,j}}(h_t), one token and one route slot at a time.
* ``reference_multilayer``: ``reference_moe`` stacked over layers (optional residual).
* ``naive_plan``: every dispatch-plan coordinate of spec 0x03B-0x03C2 and 0x07B from per-origin routes
  and their physical slots: the count matrix C[p, u], split vectors in peer-slot order, send offsets,
  send orders, receive orders, the receive-side expert repack and the per-route positions.
* ``naive_round_trip``: follows every route through the plan and back (spec 0x03C3).
* ``replay_plan_scalar``: executes a plan dict with the scalar teaching expert E_e(x) = s_e x, using
  only the plan's counts, offsets, orders and gates (so a wrong coordinate changes the result).
* ``naive_scalar_experts_output``: the direct semantic output of the scalar teaching expert.
* ``naive_fp8_experts``: the block-FP8 experts (w8a8, 1 x b1 activation groups, b0 x b1 weight blocks) one
  slot, row, group and scale block at a time, in float64 (the FP8 expert kernels' oracle).

Conventions (shared with ``ray_moe.moe.dispatch.plan``):

* Semantic route order on an origin is r = t * k + j.
* Send order sorts an origin's routes by (destination peer slot, physical slot, semantic position):
  the send buffer must be contiguous per destination in *peer-slot* order, because split vectors are
  indexed by peer slot (0x07B). With the identity peer order this is spec 0x03B's
  (destination_rank, physical_slot_id, semantic_route_position).
* A destination receives source-major in peer-slot order (the wire order of all-to-all-v), and the
  expert repack sorts that receive buffer by (local slot index, receive position), i.e. by
  (physical slot in the manifest's local order, source, source send position) (spec 0x03C2).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from ray_moe.moe.experts.reference import reference_moe  # the oracle the drill uses too
from ray_moe.moe.experts.weights import ExpertWeights


# ------------------------------------------------------------------------------------------- experts


def reference_multilayer(
    hidden: torch.Tensor,
    num_layers: int,
    routing_fn: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    weight_fn: Callable[[int, int], ExpertWeights],
    *,
    residual: bool = True,
    acc_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Stack ``reference_moe`` over layers: ``routing_fn(layer, h) -> (topk_ids, topk_weights)`` and
    ``weight_fn(layer, e)``. With ``residual`` each layer computes h <- h + moe(h), else h <- moe(h)."""
    h = hidden.to(acc_dtype)
    for layer in range(num_layers):
        ids, w = routing_fn(layer, h)
        y = reference_moe(h, ids, w, lambda e, _l=layer: weight_fn(_l, e), acc_dtype=acc_dtype)
        h = h + y if residual else y
    return h


def naive_scalar_experts_output(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    scales: Sequence[float],
) -> list[list[float]]:
    """The scalar teaching expert E_e(x) = s_e x (spec 0x03C3): y_t = sum_j g_{t,j} s_{e_{t,j}} h_t.

    Pure Python floats, one token, one route slot and one coordinate at a time. Returns [T][d].
    """
    out: list[list[float]] = []
    for t in range(int(hidden.shape[0])):
        row = [0.0] * int(hidden.shape[1])
        for j in range(int(topk_ids.shape[1])):
            e = int(topk_ids[t, j])
            g = float(topk_weights[t, j])
            for c in range(len(row)):
                row[c] += g * float(scales[e]) * float(hidden[t, c])
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------- plan
def _exclusive(counts: Sequence[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def naive_plan(
    experts_by_origin: Mapping[int, Sequence[int]],
    slots_by_origin: Mapping[int, Sequence[int]],
    snapshot,
) -> dict:
    """Every dispatch-plan coordinate, by explicit loops (spec 0x03B, 0x03C1, 0x03C2, 0x07B).

    experts_by_origin[p]: logical expert of each route of origin p, semantic order (missing origin: none).
    slots_by_origin[p]:   physical slot chosen for each of those routes.
    snapshot:             a ``PlacementSnapshot`` (only its maps are read, as Python lists).

    Raises ``ValueError`` if a slot is out of range or stores another logical expert (0x01D1).

    Keys of the result (ranks are global ranks; "peer order" vectors are indexed by peer slot; the
    per-rank send/receive entries exist for the process group's members only):
      count_matrix   [P][P] C[p][u] over global ranks
      row_sums       [P]    routes sent by each origin;  col_sums [P] rows received by each rank
      send_counts    {p: [G]}   split vector of origin p in peer order, s_p[i] = C[p][pi(i)] (G members)
      send_offsets   {p: [G+1]} exclusive prefix of send_counts with the sentinel
      send_order     {p: [R_p]} semantic route at each send position
      inverse_send   {p: [R_p]} send position of each semantic route
      send_slot      {p: [R_p]} physical slot at each send position
      recv_counts    {u: [G]}   source split vector in peer order, r_u[i] = C[pi(i)][u]
      recv_offsets   {u: [G+1]}
      recv_routes    {u: [(origin, semantic route)]} source-major receive order
      recv_slot      {u: [N_u]} physical slot of each received row
      slot_ids       {u: [Q_u]} slots hosted on u in the manifest's local slot order
      expert_order   {u: [N_u]} receive position at each expert position
      expert_routes  {u: [(origin, semantic route)]} expert-major order
      expert_counts  {u: [Q_u]} rows per local slot (zero-row slots kept)
      expert_offsets {u: [Q_u+1]}
      slot_counts    [Q] rows per physical slot;  slot_offsets [Q+1]
      logical_counts [E] rows per logical expert
      rank_counts    [P] rows received per rank (= col_sums)
      positions      {p: [(send_pos, dest_rank, recv_pos, expert_pos)]} per semantic route
    """
    num_ranks = int(snapshot.num_ranks)
    num_experts = int(snapshot.num_experts)
    phy2log = [int(x) for x in snapshot.phy2log.tolist()]
    slot_rank = [int(x) for x in snapshot.slot_rank.tolist()]
    slot_local = [int(x) for x in snapshot.slot_local.tolist()]
    peer_order = [int(x) for x in snapshot.peer_order.tolist()]
    num_slots = len(phy2log)
    peer_of: dict[int, int] = {}
    for i, r in enumerate(peer_order):
        peer_of[r] = i

    experts: dict[int, list[int]] = {}
    slots: dict[int, list[int]] = {}
    for p in range(num_ranks):
        experts[p] = [int(e) for e in experts_by_origin.get(p, [])]
        slots[p] = [int(q) for q in slots_by_origin.get(p, [])]
        if len(experts[p]) != len(slots[p]):
            raise ValueError(f"slots_by_origin[{p}]: {len(slots[p])} slots for {len(experts[p])} routes")
        for r in range(len(slots[p])):
            q = slots[p][r]
            if q < 0 or q >= num_slots:
                raise ValueError(f"slots_by_origin[{p}][{r}]={q} is not a physical slot of [0, {num_slots})")
            if phy2log[q] != experts[p][r]:
                raise ValueError(
                    f"slots_by_origin[{p}][{r}]=q{q} stores logical expert {phy2log[q]}, "
                    f"route selected {experts[p][r]}"
                )

    # count matrix over global ranks (0x03B)
    count_matrix = [[0] * num_ranks for _ in range(num_ranks)]
    for p in range(num_ranks):
        for q in slots[p]:
            count_matrix[p][slot_rank[q]] += 1
    row_sums = [sum(count_matrix[p]) for p in range(num_ranks)]
    col_sums = [sum(count_matrix[p][u] for p in range(num_ranks)) for u in range(num_ranks)]

    # source side: split vectors in peer order (0x07B), offsets, stable send order
    num_peers = len(peer_order)
    send_counts: dict[int, list[int]] = {}
    send_offsets: dict[int, list[int]] = {}
    send_order: dict[int, list[int]] = {}
    inverse_send: dict[int, list[int]] = {}
    send_slot: dict[int, list[int]] = {}
    for p in range(num_ranks):
        if p not in peer_of:
            if slots[p]:
                raise ValueError(f"slots_by_origin[{p}]: origin rank {p} is not a member of the process group")
            continue
        send_counts[p] = [count_matrix[p][peer_order[i]] for i in range(num_peers)]
        send_offsets[p] = _exclusive(send_counts[p])
        routes = list(range(len(slots[p])))
        for r in routes:
            if slot_rank[slots[p][r]] not in peer_of:
                raise ValueError(f"slots_by_origin[{p}][{r}]=q{slots[p][r]} lives on a rank outside the group")
        send_order[p] = sorted(routes, key=lambda r, _s=slots[p]: (peer_of[slot_rank[_s[r]]], _s[r], r))
        inv = [0] * len(routes)
        for pos, r in enumerate(send_order[p]):
            inv[r] = pos
        inverse_send[p] = inv
        send_slot[p] = [slots[p][r] for r in send_order[p]]

    # destination side: source-major receive (0x03C1), expert repack (0x03C2)
    recv_counts: dict[int, list[int]] = {}
    recv_offsets: dict[int, list[int]] = {}
    recv_routes: dict[int, list[tuple[int, int]]] = {}
    recv_slot: dict[int, list[int]] = {}
    slot_ids: dict[int, list[int]] = {}
    expert_order: dict[int, list[int]] = {}
    expert_routes: dict[int, list[tuple[int, int]]] = {}
    expert_counts: dict[int, list[int]] = {}
    expert_offsets: dict[int, list[int]] = {}
    for u in peer_order:
        me = peer_of[u]
        recv_counts[u] = [count_matrix[peer_order[i]][u] for i in range(num_peers)]
        recv_offsets[u] = _exclusive(recv_counts[u])
        got: list[tuple[int, int]] = []
        for i in range(num_peers):
            src = peer_order[i]
            for pos in range(send_offsets[src][me], send_offsets[src][me + 1]):
                got.append((src, send_order[src][pos]))
        recv_routes[u] = got
        recv_slot[u] = [slots[src][r] for src, r in got]
        slot_ids[u] = sorted([q for q in range(num_slots) if slot_rank[q] == u], key=lambda q: slot_local[q])
        expert_order[u] = sorted(range(len(got)), key=lambda i, _rs=recv_slot[u]: (slot_local[_rs[i]], i))
        expert_routes[u] = [got[i] for i in expert_order[u]]
        counts = []
        for q in slot_ids[u]:
            n = 0
            for s in recv_slot[u]:
                if s == q:
                    n += 1
            counts.append(n)
        expert_counts[u] = counts
        expert_offsets[u] = _exclusive(counts)

    slot_counts = [0] * num_slots
    logical_counts = [0] * num_experts
    for p in range(num_ranks):
        for r in range(len(slots[p])):
            slot_counts[slots[p][r]] += 1
            logical_counts[experts[p][r]] += 1

    positions: dict[int, list[tuple[int, int, int, int]]] = {}
    for p in peer_order:
        rows = []
        for r in range(len(slots[p])):
            u = slot_rank[slots[p][r]]
            recv_pos = recv_routes[u].index((p, r))
            expert_pos = expert_order[u].index(recv_pos)
            rows.append((inverse_send[p][r], u, recv_pos, expert_pos))
        positions[p] = rows

    return {
        "num_ranks": num_ranks,
        "peer_order": peer_order,
        "count_matrix": count_matrix,
        "row_sums": row_sums,
        "col_sums": col_sums,
        "send_counts": send_counts,
        "send_offsets": send_offsets,
        "send_order": send_order,
        "inverse_send": inverse_send,
        "send_slot": send_slot,
        "recv_counts": recv_counts,
        "recv_offsets": recv_offsets,
        "recv_routes": recv_routes,
        "recv_slot": recv_slot,
        "slot_ids": slot_ids,
        "expert_order": expert_order,
        "expert_routes": expert_routes,
        "expert_counts": expert_counts,
        "expert_offsets": expert_offsets,
        "slot_counts": slot_counts,
        "slot_offsets": _exclusive(slot_counts),
        "logical_counts": logical_counts,
        "rank_counts": list(col_sums),
        "positions": positions,
    }


def naive_round_trip(plan: dict) -> dict[int, list[int]]:
    """Follow each route r of each origin forward (send -> receive -> expert buffer) and back through
    the inverse composition pi_s^-1 . pi_x^-1 . pi_e^-1 (spec 0x03C3), using only the plan's orders and
    offsets. Returns, per origin, the semantic route recovered at each semantic position: the identity
    ``[0, 1, ..., R_p - 1]`` for a correct plan."""
    peer_order = plan["peer_order"]
    num_peers = len(peer_order)
    peer_of = {r: i for i, r in enumerate(peer_order)}
    restored: dict[int, list[int]] = {}
    for p in peer_order:
        out = []
        for r in range(len(plan["send_order"][p])):
            # forward
            send_pos = plan["inverse_send"][p][r]
            dest_peer = None
            for i in range(num_peers):
                if plan["send_offsets"][p][i] <= send_pos < plan["send_offsets"][p][i + 1]:
                    dest_peer = i
            u = peer_order[dest_peer]
            within = send_pos - plan["send_offsets"][p][dest_peer]
            recv_pos = plan["recv_offsets"][u][peer_of[p]] + within
            expert_pos = plan["expert_order"][u].index(recv_pos)
            # backward: expert position -> receive position -> source segment -> send position -> route
            back_recv = plan["expert_order"][u][expert_pos]
            src_peer = None
            for i in range(num_peers):
                if plan["recv_offsets"][u][i] <= back_recv < plan["recv_offsets"][u][i + 1]:
                    src_peer = i
            src = peer_order[src_peer]
            back_send = plan["send_offsets"][src][peer_of[u]] + (back_recv - plan["recv_offsets"][u][src_peer])
            out.append(plan["send_order"][src][back_send])
        restored[p] = out
    return restored


def replay_plan_scalar(
    plan: dict,
    hidden_by_origin: Mapping[int, Sequence[Sequence[float]]],
    tokens_by_origin: Mapping[int, Sequence[int]],
    gates_by_origin: Mapping[int, Sequence[float]],
    slot_scale: Sequence[float],
) -> dict[int, list[list[float]]]:
    """Execute a plan dict by loops with the scalar teaching expert (spec 0x03C3).

    Uses only the plan's send orders, send offsets, receive splits, expert orders, local slot ids,
    expert offsets and inverse send orders, plus the given gates, so changing any one of them changes
    the output (or raises ``ValueError`` when segments no longer fit). ``slot_scale[q]`` is the scale
    of the expert stored in physical slot q. Returns y[p] as [T_p][d] Python floats.
    """
    peer_order = plan["peer_order"]
    num_peers = len(peer_order)
    peer_of = {r: i for i, r in enumerate(peer_order)}
    # 1. pack: send buffer in send order
    send_buf: dict[int, list[list[float]]] = {}
    for p in peer_order:
        tokens = tokens_by_origin.get(p, [])
        send_buf[p] = [list(map(float, hidden_by_origin[p][tokens[r]])) for r in plan["send_order"][p]]
        if plan["send_offsets"][p][-1] != len(send_buf[p]):
            raise ValueError(f"send_offsets[{p}] sentinel {plan['send_offsets'][p][-1]} != {len(send_buf[p])} rows")
    # 2. exchange: destination u takes segment [O_src[me], O_src[me+1]) of every source, in peer order
    recv_buf: dict[int, list[list[float]]] = {}
    for u in peer_order:
        me = peer_of[u]
        rows: list[list[float]] = []
        for i in range(num_peers):
            src = peer_order[i]
            seg = send_buf[src][plan["send_offsets"][src][me]:plan["send_offsets"][src][me + 1]]
            if len(seg) != plan["recv_counts"][u][i]:
                raise ValueError(f"rank {u}: peer {i} sent {len(seg)} rows, split says {plan['recv_counts'][u][i]}")
            rows.extend(seg)
        recv_buf[u] = rows
    # 3. repack to expert-major, 4. scalar experts on local slot segments, 5. inverse repack
    back_buf: dict[int, list[list[float]]] = {}
    for u in peer_order:
        order = plan["expert_order"][u]
        if sorted(order) != list(range(len(recv_buf[u]))):
            raise ValueError(f"expert_order[{u}] is not a permutation of {len(recv_buf[u])} rows")
        expert_buf = [list(recv_buf[u][i]) for i in order]
        offs = plan["expert_offsets"][u]
        if offs[-1] != len(expert_buf):
            raise ValueError(f"expert_offsets[{u}] sentinel {offs[-1]} != {len(expert_buf)} rows")
        for a, q in enumerate(plan["slot_ids"][u]):
            for pos in range(offs[a], offs[a + 1]):
                expert_buf[pos] = [slot_scale[q] * v for v in expert_buf[pos]]
        back = [None] * len(expert_buf)
        for pos, i in enumerate(order):
            back[i] = expert_buf[pos]
        back_buf[u] = back
    # 6. return exchange: origin p takes, from every destination, that destination's p-segment
    returned: dict[int, list[list[float]]] = {}
    for p in peer_order:
        rows = []
        for i in range(num_peers):
            u = peer_order[i]
            offs = plan["recv_offsets"][u]
            rows.extend(back_buf[u][offs[peer_of[p]]:offs[peer_of[p] + 1]])
        returned[p] = rows
    # 7. inverse send, 8. gated combine keyed by (origin, token)
    out: dict[int, list[list[float]]] = {}
    for p in peer_order:
        tokens = tokens_by_origin.get(p, [])
        gates = gates_by_origin.get(p, [])
        num_tokens = len(hidden_by_origin.get(p, []))
        width = len(hidden_by_origin[p][0]) if num_tokens else 0
        y = [[0.0] * width for _ in range(num_tokens)]
        for r in range(len(tokens)):
            row = returned[p][plan["inverse_send"][p][r]]
            for c in range(width):
                y[tokens[r]][c] += float(gates[r]) * row[c]
        out[p] = y
    return out


def scalar_expert_rows(
    rows: torch.Tensor,
    counts: Sequence[int],
    slot_ids: Sequence[int],
    phy2log: Sequence[int],
    scales: Sequence[float],
) -> torch.Tensor:
    """The scalar teaching expert as a runner: expert-major ``rows`` [N, d] with ``counts`` rows per
    local slot (``slot_ids`` in local slot order) -> each row times s_e of the logical expert its slot
    stores. One local slot and one row at a time; the gate is not applied."""
    out = rows.clone()
    start = 0
    for a in range(len(counts)):
        e = int(phy2log[int(slot_ids[a])])
        for i in range(start, start + int(counts[a])):
            out[i] = rows[i] * float(scales[e])
        start += int(counts[a])
    if start != int(rows.shape[0]):
        raise ValueError(f"counts: sum {start} != rows {int(rows.shape[0])}")
    return out


# ------------------------------------------------------------------------------------------- norms
def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm one row at a time, with the layer's roundings (``models.norms``' oracle):
    y = (x / sqrt(mean(x^2) + eps)) in FP32, rounded to x's dtype, then weight * y rounded to x's dtype.

    x: [..., H], weight: [H] of x's dtype -> [..., H] of x's dtype."""
    h = x.shape[-1]
    rows = x.reshape(-1, h)
    out = torch.empty_like(rows)
    w = weight.float().cpu()
    for i in range(rows.shape[0]):
        r = rows[i].float().cpu()
        ms = sum(float(v) * float(v) for v in r) / h
        y = (r * (1.0 / (ms + eps) ** 0.5)).to(x.dtype)
        out[i] = (w * y.float()).to(x.dtype).to(out.device)
    return out.view(x.shape)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding one (batch, head, position) row at a time, with transformers' roundings
    (``models.rotary``' oracle): y = round(x * cos) + round(rotate_half(x) * sin), rounded, where
    rotate_half([x1 | x2]) = [-x2 | x1].

    x: [B, H, T, D], cos / sin: [B or 1, T, D] of x's dtype -> [B, H, T, D] contiguous."""
    b, h, t, d = x.shape
    half = d // 2
    out = torch.empty(b, h, t, d, dtype=x.dtype)
    for i in range(b):
        for j in range(h):
            for p in range(t):
                row = x[i, j, p].cpu()
                c, s = cos[min(i, cos.shape[0] - 1), p].cpu(), sin[min(i, sin.shape[0] - 1), p].cpu()
                rot = torch.cat([-row[half:], row[:half]])
                out[i, j, p] = (row * c) + (rot * s)  # each product rounded to x's dtype, then the sum
    return out


# ------------------------------------------------------------------------------------------- FP8 experts
def _naive_group_quant(row: torch.Tensor, b1: int) -> torch.Tensor:
    """One activation row [n] -> its FP8 value [n] float64: per group of ``b1`` columns, in float32 as the
    kernels round, scale = max(amax / 448, 1e-12), code = e4m3(clamp(x / scale, +-448)); value = code x scale."""
    out = torch.empty(row.shape[0], dtype=torch.float64)
    for j in range(0, row.shape[0], b1):
        grp = row[j:j + b1].to(torch.float32).cpu()
        scale = torch.clamp_min(grp.abs().max() / torch.tensor(448.0), 1e-12)
        code = torch.clamp(grp / scale, -448.0, 448.0).to(torch.float8_e4m3fn)
        out[j:j + b1] = code.to(torch.float64) * float(scale)
    return out


def _naive_block_weight(codes: torch.Tensor, scale: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    """One weight's codes [out, in] e4m3 and block scales -> float64 values, scale block by scale block."""
    w = codes.cpu().to(torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] *= float(scale[i, j])
    return w


def naive_fp8_experts(x: torch.Tensor, counts: Sequence[int], codes: Sequence[torch.Tensor],
                      scales: Sequence[torch.Tensor], block: Sequence[int],
                      rows: Sequence[int] | None = None) -> torch.Tensor:
    """Block-FP8 SwiGLU experts, naively: x [N, d] expert-major rows, counts rows per slot, codes (w_gate
    [C, f, d], w_up [C, f, d], w_down [C, d, f]) e4m3 with scales [C, ceil(out / b0), ceil(in / b1)], rows: the
    buffer row of each slot (None: slot q is row q) -> [N, d] float64 (CPU). For each row of slot q:
      1. x quantized per 1 x b1 group (float32 rounding), taken back to float64
      2. g = x Wg^T, u = x Wu^T with W = code x block scale (float64)
      3. h = silu(g) * u (float64), quantized per 1 x b1 group from its float32 value
      4. y = h Wd^T"""
    b0, b1 = (int(b) for b in block)
    y = torch.zeros(x.shape, dtype=torch.float64)
    start = 0
    for q, c in enumerate(counts):
        r = q if rows is None else int(rows[q])
        if int(c):
            wg, wu, wd = (_naive_block_weight(t[r], s[r], b0, b1) for t, s in zip(codes, scales))
            for i in range(start, start + int(c)):
                xi = _naive_group_quant(x[i], b1)
                g, u = wg @ xi, wu @ xi
                h = _naive_group_quant(g / (1.0 + torch.exp(-g)) * u, b1)
                y[i] = wd @ h
        start += int(c)
    return y
