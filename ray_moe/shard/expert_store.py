"""ExpertStore: the expert weights one rank holds, by (layer, logical expert), each held exactly once.

Per layer one preallocated slot buffer per weight (``w_gate`` [C, f, d], ``w_up`` [C, f, d], ``w_down``
[C, d, f] on the store's device and dtype); every held (layer, expert) occupies one buffer row. ``load`` /
``put`` write into a free row and compute the parameter digest there, once; ``drop`` / ``drop_unreferenced``
free rows (by liveness: whatever no prepared generation uses). C is sized by the first write of a layer: the
rows it needs plus ``staging_slots`` spare rows (what a migration copies into); a write needing more rows
than are free grows the buffer (reallocate, copy, counted in ``grows``).

FP8 experts (``ExpertWeights.scales``: a block-scaled checkpoint) get FP8 buffers: the codes in
float8_e4m3fn buffers of the same shapes and, beside them, scale buffers ``s_gate`` [C, ceil(f/b0),
ceil(d/b1)], ``s_up`` (same), ``s_down`` [C, ceil(d/b0), ceil(f/b1)] float32; the layer's format is set by its
first write (a dense expert is refused by an FP8 layer and the other way round, never cast). A row is always
the codes and their scales together: every write, grow, reorder, copy out and digest moves or covers both
(spec 0x0AC: the scales move with their rows).

A generation is a slot map over the buffers (``stack``): per layer a SlotWeights of views (rows in local slot
order) or a row-mapped one (``SlotWeights.rows``; ``moe.experts.slab`` translates at the runner boundary),
never a copy. A buffer no generation has been stacked over yet (fresh, or just grown) is first reordered so
the generation's slots sit in local slot order (the plain layout). A grown buffer is a new tensor: generations
stacked before keep the old one alive until they are retired.
No Ray, no locking: the owner (``ShardCore``) serialises control calls.
"""

from __future__ import annotations

import bisect
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from ray_moe.moe.experts.slab import slab_index
from ray_moe.moe.experts.weights import ExpertWeights, SlotWeights, WeightSource
from ray_moe.placement.manifest import PlacementManifest

Key = tuple[int, int]  # (layer, logical expert id)
_NAMES = ("w_gate", "w_up", "w_down")
_SCALE_NAMES = ("s_gate", "s_up", "s_down")
LOAD_THREADS = 8  # experts read (generated, or read from safetensors) at once from a source that allows it


def _key(k: Sequence[int]) -> Key:
    return (int(k[0]), int(k[1]))


@dataclass(eq=False)
class _Slab:
    """One layer's slot buffers: w_gate [C, f, d], w_up [C, f, d], w_down [C, d, f]; FP8 layers also
    ``scales`` (s_gate, s_up, s_down) [C, ...] float32 in ``block`` blocks; ``free`` rows ascending;
    ``stacked``: a generation's SlotWeights reference these tensors (their rows may no longer move)."""

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    free: list[int] = field(default_factory=list)
    stacked: bool = False
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    block: tuple[int, int] | None = None

    @property
    def capacity(self) -> int:
        return int(self.w_gate.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every buffer a row lives in: the three weights, then (FP8) their three scale buffers."""
        return (self.w_gate, self.w_up, self.w_down, *(self.scales or ()))


class ExpertStore:
    """Weights by (layer, logical expert) on one device and dtype, one slot-buffer row each.

    staging_slots: spare rows a layer's buffer gets beyond the rows its first write needs (and keeps after
    a grow).
    """

    def __init__(self, rank: int, device: torch.device, dtype: torch.dtype, *, staging_slots: int = 2) -> None:
        if isinstance(staging_slots, bool) or int(staging_slots) != staging_slots or staging_slots < 0:
            raise ValueError(f"staging_slots={staging_slots!r} must be an integer >= 0")
        self.rank = rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.staging_slots = int(staging_slots)
        self.grows = 0
        self._slabs: dict[int, _Slab] = {}
        self._rows: dict[Key, int] = {}
        self._digests: dict[Key, str] = {}

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's slot buffers (held rows and free rows)."""
        return sum(s.nbytes for s in self._slabs.values())

    def held(self) -> list[Key]:
        return sorted(self._rows)

    def slab_info(self) -> dict[int, dict[str, int]]:
        """Per layer with a buffer: {"capacity": C, "used": held rows, "free": free rows}."""
        return {l: {"capacity": s.capacity, "used": s.capacity - len(s.free), "free": len(s.free)}
                for l, s in sorted(self._slabs.items())}

    @property
    def fp8_layers(self) -> int:
        """Layers whose slot buffers hold FP8 rows (codes and their block scales)."""
        return sum(s.scales is not None for s in self._slabs.values())

    @property
    def fp8_shapes(self) -> set[tuple[int, int, tuple[int, int] | None]]:
        """(d, f, block) of the layers whose slot buffers hold FP8 rows."""
        return {(int(s.w_gate.shape[2]), int(s.w_gate.shape[1]), s.block) for s in self._slabs.values()
                if s.scales is not None}

    def row(self, key: Sequence[int]) -> int | None:
        """The buffer row of a held (layer, expert), or None."""
        return self._rows.get(_key(key))

    def _views(self, key: Key) -> ExpertWeights:
        s, r = self._slabs[key[0]], self._rows[key]
        return ExpertWeights.from_tensors(key[0], key[1], [t[r] for t in s.tensors()], s.block)

    def get(self, key: Key) -> ExpertWeights | None:
        """A copy of a held expert's weights on the store's device (never aliasing a buffer row; an FP8
        expert's codes with their scales), or None."""
        key = _key(key)
        if key not in self._rows:
            return None
        w = self._views(key)
        return ExpertWeights.from_tensors(w.layer, w.expert, [t.clone() for t in w.tensors()], w.block)

    # ---------------------------------------------------------------- rows
    def _reserve(self, layer: int, n: int, like: ExpertWeights) -> None:
        """Make ``n`` rows free in ``layer``'s buffers: allocate them (n + staging rows, shapes of ``like``) or
        grow to used + n + staging rows (copy the held rows, count the grow)."""
        slab = self._slabs.get(layer)
        if slab is not None and len(slab.free) >= n:
            return
        used = 0 if slab is None else slab.capacity - len(slab.free)
        c = used + n + self.staging_slots
        if like.quantized:  # FP8 rows: codes as they are, their scales beside them
            bufs = [torch.zeros(c, *t.shape, device=self.device, dtype=t.dtype) for t in like.tensors()]
        else:
            bufs = [torch.zeros(c, *t.shape, device=self.device, dtype=self.dtype) for t in like.tensors()]
        scales = tuple(bufs[3:]) if like.quantized else None
        if slab is None:
            self._slabs[layer] = _Slab(*bufs[:3], free=list(range(c)), scales=scales, block=like.block)  # type: ignore[arg-type]
            return
        old = slab.capacity
        for new, cur in zip(bufs, slab.tensors()):
            new[:old].copy_(cur)
        # a fresh tensor: not stacked
        self._slabs[layer] = _Slab(*bufs[:3], free=slab.free + list(range(old, c)), scales=scales,  # type: ignore[arg-type]
                                   block=like.block)
        self.grows += 1

    def _check_shapes(self, key: Key, w: ExpertWeights) -> None:
        slab = self._slabs[key[0]]
        if w.block != slab.block:
            have = f"FP8 rows in blocks of {list(slab.block)}" if slab.block else f"dense {self.dtype} rows"
            got = f"FP8 codes in blocks of {list(w.block)}" if w.block else f"dense {w.w_gate.dtype} weights"
            raise ValueError(f"weights: expert {key} arrives as {got} but layer {key[0]}'s slot buffer holds {have}")
        for name, t, buf in zip(_NAMES + _SCALE_NAMES, w.tensors(), slab.tensors()):
            got = tuple(t.shape)
            if got != tuple(buf.shape[1:]):
                raise ValueError(f"{name}: expert {key} has shape {got} but layer {key[0]}'s slot buffer holds "
                                 f"{tuple(buf.shape[1:])} rows")

    def _write(self, key: Key, w: ExpertWeights) -> str:
        """Copy ``w`` into a free row of its layer (rows reserved) and digest the row, on the device."""
        self._check_shapes(key, w)
        slab = self._slabs[key[0]]
        r = slab.free.pop(0)
        for t, buf in zip(w.tensors(), slab.tensors()):
            buf[r].copy_(t)
        self._rows[key] = r
        self._digests[key] = self._views(key).digest()
        return self._digests[key]

    def _write_all(self, keys: Sequence[Key], items: Iterable[tuple[Key, Any]], resolve) -> None:
        """Write every (key, item) of ``items`` (keys not held, in the order of ``keys``), consumed as it is
        written: a reader's weights are released once copied into their row, so a load never holds more than
        the reader's read-ahead (materialised first, a 48-layer model's seeded experts were all held on the
        GPU beside their slot buffers: twice the experts' bytes at the peak). ``resolve(key, item)`` gives its
        ExpertWeights. The rows a layer needs are reserved at its first item (one grow at most per layer and
        call)."""
        need = Counter(k[0] for k in keys)
        for key, item in items:
            w = resolve(key, item)
            if need[key[0]]:
                if key[0] in self._slabs:
                    self._check_shapes(key, w)
                self._reserve(key[0], need[key[0]], w)
                need[key[0]] = 0
            self._write(key, w)

    def load(self, keys: Iterable[Sequence[int]], source: WeightSource) -> dict[Key, str]:
        """Read missing (layer, expert) weights from ``source`` into free rows; returns every key's digest."""
        keys = list(dict.fromkeys(_key(k) for k in keys))
        missing = [k for k in keys if k not in self._rows]
        threads = min(LOAD_THREADS, len(missing)) if getattr(source, "concurrent_reads", False) else 1
        if threads <= 1:
            self._write_all(missing, ((k, None) for k in missing), lambda k, _: source.expert(*k))
        else:
            self._write_all(missing, _prefetched(missing, source, threads), lambda _, w: w)
        return {k: self._digests[k] for k in keys}

    def put(self, weights: Mapping[Sequence[int], ExpertWeights]) -> dict[Key, str]:
        """Store copied weights in free rows; returns the digests computed from the bytes that arrived. A key
        already held keeps its row: the arriving copy must carry the same digest (ValueError otherwise,
        before anything is written: a live generation may be reading that row)."""
        items = {_key(k): w for k, w in weights.items()}
        shapes: dict[int, tuple] = {}
        for k, w in items.items():
            if k[0] in self._slabs:
                self._check_shapes(k, w)  # (an FP8 layer takes FP8 rows only, and the other way round)
            f, d = (tuple(w.w_gate.shape) + (0, 0))[:2]
            got_shapes = tuple(tuple(t.shape) for t in w.tensors())
            want = shapes.setdefault(k[0], tuple(tuple(t.shape[1:]) for t in self._slabs[k[0]].tensors())
                                     if k[0] in self._slabs else ((f, d), (f, d), (d, f)) + got_shapes[3:])
            if got_shapes != want:
                raise ValueError(f"weights: expert {k} has shapes {got_shapes}, expected {want} (w_gate [f, d], "
                                 f"w_up [f, d], w_down [d, f] of layer {k[0]}, then any FP8 scales)")
            if k in self._rows:
                got = (w.to(self.device) if w.quantized else w.to(self.device, self.dtype)).digest()
                if got != self._digests[k]:
                    raise ValueError(f"weights: rank {self.rank} already holds expert {k} with digest "
                                     f"{self._digests[k][:12]}; the arriving copy's is {got[:12]} (drop it first)")
        new = [(k, w) for k, w in items.items() if k not in self._rows]
        self._write_all([k for k, _ in new], new, lambda _, w: w)
        return {k: self._digests[k] for k in items}

    # ---------------------------------------------------------------- out
    def export(self, keys: Sequence[Sequence[int]], *, device: bool = False) -> dict[Key, ExpertWeights]:
        """Held weights for an actor-to-actor copy: CPU copies, or (``device``) views of the buffer rows for an
        NCCL send made before the next control call."""
        missing = [_key(k) for k in keys if _key(k) not in self._rows]
        if missing:
            raise ValueError(f"keys: rank {self.rank} holds no weights for (layer, expert) {missing[0]}")
        out = {}
        for k in keys:
            w = self._views(_key(k))
            if not device:  # (an FP8 expert's scales with its codes)
                w = ExpertWeights.from_tensors(w.layer, w.expert, [t.to("cpu", copy=True) for t in w.tensors()],
                                               w.block)
            out[_key(k)] = w
        return out

    def _settle(self, layer: int, order: Sequence[Key]) -> None:
        """Reorder an unstacked buffer so the distinct keys of ``order`` take rows 0, 1, ... (other held keys
        after them), moving rows in place along permutation cycles (one row of scratch per weight)."""
        slab = self._slabs[layer]
        first = list(dict.fromkeys(order))
        taken = set(first)
        rest = sorted(k for k in self._rows if k[0] == layer and k not in taken)
        want = first + rest
        if all(self._rows[k] == i for i, k in enumerate(want)):
            return
        c = slab.capacity
        src = [-1] * c  # new row i takes old row src[i]
        for i, k in enumerate(want):
            src[i] = self._rows[k]
        spare = iter(sorted(set(range(c)) - set(src)))
        src = [s if s >= 0 else next(spare) for s in src]
        done = [False] * c
        for start in range(c):
            if done[start] or src[start] == start:
                done[start] = True
                continue
            scratch = [t[start].clone() for t in slab.tensors()]
            i = start
            while True:
                done[i] = True
                j = src[i]
                if j == start:
                    for t, s in zip(slab.tensors(), scratch):
                        t[i].copy_(s)
                    break
                for t in slab.tensors():
                    t[i].copy_(t[j])
                i = j
        for i, k in enumerate(want):
            self._rows[k] = i
        slab.free = list(range(len(want), c))

    def stack(self, manifest: PlacementManifest) -> tuple[tuple[SlotWeights | None, ...], frozenset[Key]]:
        """This rank's slot weights per layer of ``manifest`` (None where it hosts no slot) and the keys they
        use: views of the slot buffers (no copy). Raises ``ValueError`` naming the slot when a weight is
        missing or its digest differs from the manifest's, before anything moves (nothing is published from
        a mismatch)."""
        plan: list[tuple[int, list, list[Key]] | None] = []
        keys: set[Key] = set()
        mismatches = []
        for layer in range(manifest.num_layers):
            slots = manifest.rank_slots(self.rank, layer)
            if not slots:
                plan.append(None)
                continue
            order = []
            for s in slots:
                key = (layer, s.logical_expert_id)
                if key not in self._rows:
                    raise ValueError(f"manifest: slot q{s.physical_slot_id} of layer {layer} needs expert "
                                     f"{s.logical_expert_id} which rank {self.rank} does not hold")
                if self._digests[key] != s.parameter_digest:
                    mismatches.append((layer, s.physical_slot_id, s.logical_expert_id))
                order.append(key)
            keys.update(order)
            plan.append((layer, slots, order))
        if mismatches:
            raise ValueError(f"parameter_digest: rank {self.rank} slots {mismatches} hold weights whose digest differs "
                             f"from the manifest of generation {manifest.generation}; not published")
        weights: list[SlotWeights | None] = []
        for item in plan:
            if item is None:
                weights.append(None)
                continue
            layer, slots, order = item
            slab = self._slabs[layer]
            if not slab.stacked:
                self._settle(layer, order)
            w = SlotWeights.over_buffer(layer, [s.physical_slot_id for s in slots], [k[1] for k in order],
                                        slab.w_gate, slab.w_up, slab.w_down, [self._rows[k] for k in order],
                                        [s.parameter_digest for s in slots], scales=slab.scales, block=slab.block)
            if w.row_mapped:
                slab_index(w)  # the device indices, now (never under a CUDA graph capture)
            slab.stacked = True
            weights.append(w)
        return tuple(weights), frozenset(keys)

    # ---------------------------------------------------------------- freeing
    def drop(self, keys: Iterable[Sequence[int]], live: set[Key]) -> None:
        """Free the rows of ``keys`` that no live generation uses (an aborted migration's staged copies); a
        layer left with no held row releases its buffers."""
        for k in keys:
            key = _key(k)
            if key in live or key not in self._rows:
                continue
            slab = self._slabs[key[0]]
            bisect.insort(slab.free, self._rows.pop(key))
            self._digests.pop(key, None)
            if len(slab.free) == slab.capacity:
                del self._slabs[key[0]]

    def drop_unreferenced(self, live: set[Key]) -> int:
        """Free every row outside ``live``; returns how many (layer, expert) weights were freed."""
        stale = [k for k in self._rows if k not in live]
        self.drop(stale, live)
        return len(stale)


def _prefetched(keys: list[Key], source: WeightSource, threads: int) -> Iterable[tuple[Key, ExpertWeights]]:
    """(key, weights) in ``keys`` order, read by ``threads`` threads at most ``2 * threads`` ahead of the
    consumer (the host memory in flight stays bounded; the rows are still written one at a time, in order)."""
    ahead = 2 * threads
    with ThreadPoolExecutor(threads, thread_name_prefix="expert-load") as pool:
        futs = [pool.submit(source.expert, *k) for k in keys[:ahead]]
        for i, k in enumerate(keys):
            w = futs[i].result()
            futs[i] = None  # type: ignore[call-overload]  # released as soon as it is written
            if i + ahead < len(keys):
                futs.append(pool.submit(source.expert, *keys[i + ahead]))
            yield k, w

