"""What one rank saw in one MoE layer of one step (``LayerStats``): the typed record every step returns to the
driver's books, with a compact wire form. numpy only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ray_moe.core.wire import pack_ints, unpack_ints
from ray_moe.placement.snapshot import PlacementSnapshot


@dataclass(frozen=True)
class LayerStats:
    """What one rank saw in one layer of one step.

    expert_counts: [E] int64 accepted routes per logical expert from this origin (semantic ledger)
    rank_routes:   [P] int64 routes this origin sent to each global rank
    slot_rows:     {global slot id: rows executed here}
    path:          the dispatch mode that served the layer ("engine" | "direct" | "bucket" | "bucket-graph")
    """

    layer: int
    accepted: int
    remote: int
    inter_node: int
    expert_counts: np.ndarray
    rank_routes: np.ndarray
    slot_rows: dict[int, int]
    path: str = "engine"
    fallback_reason: str | None = None

    def __reduce__(self):
        """A compact wire form: one layer's ``pack_layers`` (a step result packs all of its layers at once);
        pickling numpy arrays one by one cost ~18 us each."""
        return (_one_layer, (pack_layers((self,)),))


def _one_layer(packed: tuple) -> LayerStats:
    return unpack_layers(packed)[0]


def pack_layers(layers: Sequence[LayerStats]) -> tuple:
    """A step's LayerStats (one per MoE layer) as one columnar wire form: every layer's arrays concatenated, each
    column in the narrowest integer type (``core.wire.pack_ints``). A 48-layer result took ~150 KB as LayerStats
    one by one, past Ray's 100 KB limit for values returned inline; ``unpack_layers`` inverts it exactly."""
    n = len(layers)
    scalars = np.array([(ls.layer, ls.accepted, ls.remote, ls.inter_node) for ls in layers],
                       dtype=np.int64).reshape(n, 4)
    counts = [np.asarray(ls.expert_counts, dtype=np.int64).reshape(-1) for ls in layers]
    routes = [np.asarray(ls.rank_routes, dtype=np.int64).reshape(-1) for ls in layers]
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
    ids = cat([np.fromiter(ls.slot_rows.keys(), dtype=np.int64, count=len(ls.slot_rows)) for ls in layers])
    rows = cat([np.fromiter(ls.slot_rows.values(), dtype=np.int64, count=len(ls.slot_rows)) for ls in layers])
    sizes = np.array([[c.size, r.size, len(ls.slot_rows)] for c, r, ls in zip(counts, routes, layers)],
                     dtype=np.int64).reshape(n, 3)
    return (pack_ints(scalars.reshape(-1)), pack_ints(sizes.reshape(-1)), pack_ints(cat(counts)),
            pack_ints(cat(routes)), pack_ints(ids), pack_ints(rows),
            [ls.path for ls in layers], [ls.fallback_reason for ls in layers])


def unpack_layers(packed: tuple) -> tuple[LayerStats, ...]:
    """``pack_layers``' inverse: the LayerStats, their arrays int64 and writable, as the sender's (views of one
    fresh array per column)."""
    scalars, sizes, counts, routes, ids, rows = (unpack_ints(c) for c in packed[:6])
    paths, reasons = packed[6], packed[7]
    n = len(paths)
    scalars, sizes = scalars.reshape(n, 4).tolist(), sizes.reshape(n, 3)
    cuts = [np.cumsum(sizes[:, j])[:-1] for j in range(3)]
    parts = (np.split(counts, cuts[0]), np.split(routes, cuts[1]), np.split(ids, cuts[2]), np.split(rows, cuts[2]))
    return tuple(LayerStats(s[0], s[1], s[2], s[3], c, r, dict(zip(i.tolist(), w.tolist())), p, why)
                 for s, c, r, i, w, p, why in zip(scalars, *parts, paths, reasons))


def merge_layer_stats(stats: Sequence[LayerStats]) -> tuple[LayerStats, ...]:
    """One LayerStats per layer (first-seen order): the counts of every entry of that layer summed (the
    sub-steps of a multi-step decode request); the path and fallback reason of its first entry."""
    by_layer: dict[int, list[LayerStats]] = {}
    for ls in stats:
        by_layer.setdefault(ls.layer, []).append(ls)
    out = []
    for layer, group in by_layer.items():
        if len(group) == 1:
            out.append(group[0])
            continue
        rows: dict[int, int] = {}
        for ls in group:
            for k, v in ls.slot_rows.items():
                rows[k] = rows.get(k, 0) + v
        first = group[0]
        out.append(LayerStats(layer, sum(ls.accepted for ls in group), sum(ls.remote for ls in group),
                              sum(ls.inter_node for ls in group), np.sum([ls.expert_counts for ls in group], axis=0),
                              np.sum([ls.rank_routes for ls in group], axis=0), rows, first.path,
                              first.fallback_reason))
    return tuple(out)


def layer_stats(layer: int, sent_slots: np.ndarray, slot_rows: Sequence[int], snapshot: PlacementSnapshot,
                rank: int, path: str, fallback_reason: str | None) -> LayerStats:
    """LayerStats from the routes this rank sent per physical slot ([Q] int64) and the rows it executed
    per local slot ([Q_local]): every other count is a sum over the snapshot's maps."""
    sent = np.asarray(sent_slots, dtype=np.int64)
    rank_routes = np.bincount(snapshot.slot_rank.numpy(), weights=sent, minlength=snapshot.num_ranks).astype(np.int64)
    node = snapshot.rank_node.numpy()
    counts = np.bincount(snapshot.phy2log.numpy(), weights=sent, minlength=snapshot.num_experts).astype(np.int64)
    local_ids = snapshot.on("cpu").rank_slots[rank].tolist()  # cached per snapshot
    return LayerStats(layer, int(sent.sum()), int(rank_routes.sum() - rank_routes[rank]),
                      int(rank_routes[node != node[rank]].sum()), counts, rank_routes,
                      dict(zip(local_ids, np.asarray(slot_rows, dtype=np.int64).tolist())), path, fallback_reason)
