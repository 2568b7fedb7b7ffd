"""ShardCore: everything one expert-shard rank does, with no Ray in it.

The Ray actor (``expert_shard.py``) is a thin shell that owns one ShardCore, its mailbox and its
exchange endpoint. Tests drive ShardCores directly over the in-process exchange.

State owned here:
* expert weights by (layer, logical expert), content-addressed by digest and shared by every
  generation that places that expert on this rank (retained copies are never duplicated);
* per generation: the manifest, one PlacementSnapshot per layer and the stacked SlotWeights per layer;
* a local GenerationRegistry mirror: a step pins its generation here (exact per-step refcounts), the
  coordinator publishes / drains / retires through it and reads the refcounts back.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ray_moe.config import RuntimeConfig
from ray_moe.dispatch.engine import ControlStatus, combine, dispatch, reject_corrupt
from ray_moe.dispatch.exchange.base import Exchange
from ray_moe.dispatch.precision import dequantize
from ray_moe.dispatch.records import RouteBatch
from ray_moe.errors import GenerationError, RouteValidationError, StaleGenerationError
from ray_moe.experts.runners import make_runner
from ray_moe.experts.weights import ExpertWeights, SlotWeights, WeightSource, parse_dtype
from ray_moe.model import route, zipf_bias
from ray_moe.placement.manifest import PlacementManifest
from ray_moe.placement.registry import GenerationRegistry
from ray_moe.placement.selector import make_selector
from ray_moe.placement.snapshot import PlacementSnapshot, snapshots_for
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.types import GenerationState, Phase


@dataclass(frozen=True)
class StepRequest:
    """One rank's share of one model step (all layers).

    hidden:       [T, d] float (NumPy on the wire, any float dtype)
    topk_ids:     [L, T, k] int64 or None (None: the rank routes with its own router)
    topk_weights: [L, T, k] float32 or None
    """

    step_id: str
    generation: int
    hidden: Any
    topk_ids: Any = None
    topk_weights: Any = None
    phase: Phase = Phase.PREFILL
    return_routes: bool = False
    marks: bool = False  # record host timestamps of the step's stages (StepResult.marks)


@dataclass(frozen=True)
class LayerStats:
    """What one rank saw in one layer of one step.

    expert_counts: [E] int64 accepted routes per logical expert from this origin (semantic ledger)
    rank_routes:   [P] int64 routes this origin sent to each global rank
    slot_rows:     {global slot id: rows executed here}
    """

    layer: int
    accepted: int
    remote: int
    inter_node: int
    expert_counts: np.ndarray
    rank_routes: np.ndarray
    slot_rows: dict[int, int]
    path: str = "variable"  # variable | bucket | bucket-graph
    fallback_reason: str | None = None


@dataclass(frozen=True)
class StepResult:
    """One rank's output of one step. ``hidden``: [T, d] NumPy in the configured dtype's wire form."""

    rank: int
    step_id: str
    generation: int
    hidden: Any
    hidden_dtype: str
    layers: tuple[LayerStats, ...]
    routes: tuple[tuple[np.ndarray, np.ndarray], ...] | None
    active_generation: int | None
    elapsed_s: float
    # (stage, host seconds, device seconds) since the step started, when the request asked for marks: the
    # host clock where the host got to; on CUDA the device clock (events) where the device got to (-1 on CPU)
    marks: tuple[tuple[str, float, float], ...] = ()


@dataclass
class _Generation:
    manifest: PlacementManifest
    snapshots: tuple[PlacementSnapshot, ...]
    weights: tuple[SlotWeights | None, ...]
    keys: frozenset[tuple[int, int]] = field(default_factory=frozenset)


class ShardCore:
    """One expert-parallel rank."""

    def __init__(self, rank: int, cfg: RuntimeConfig, source: WeightSource, *, device: str | torch.device = "cpu",
                 topology: Topology | None = None) -> None:
        self.rank = rank
        self.cfg = cfg
        self.source = source
        self.device = torch.device(device)
        self.dtype = parse_dtype(cfg.dtype)
        self.topology = topology or Topology.single_node(cfg.num_ranks)
        self.registry = GenerationRegistry(record_leases=False)
        self.runner = make_runner(cfg.runner)
        self.selector = make_selector(cfg.replica_policy)
        self.exchange: Exchange | None = None
        self._experts: dict[tuple[int, int], ExpertWeights] = {}
        self._digests: dict[tuple[int, int], str] = {}
        self._gens: dict[int, _Generation] = {}
        self._lock = threading.RLock()
        self._step_lock = threading.Lock()
        self.routers = [source.router(l).to(self.device, torch.float32) for l in range(cfg.num_layers)]
        self.biases = [zipf_bias(cfg.num_experts, cfg.router_skew, cfg.seed, l).to(self.device)
                       for l in range(cfg.num_layers)]
        self.counters: dict[str, int] = {"steps": 0, "stale_rejects": 0, "aborted_steps": 0}
        # candidate generations (a release in SHADOW / CANARY) serve pinned steps while still PENDING
        self._candidates: set[int] = set()
        self._candidate_pins: dict[int, int] = {}
        # fault injection (spec 0x0E): kind -> (remaining count, generation filter or None)
        self._faults: dict[str, tuple[int, int | None]] = {}
        self._buckets: dict[tuple[int, int], _DecodeBucket] = {}
        self._last_fallback: str | None = None
        self._direct = None  # DirectDispatcher when the deployment runs the direct path (set_exchange)
        self._pinned: torch.Tensor | None = None  # grow-only pinned staging buffer of step outputs (CUDA)

    # ================================================================ control path
    def set_exchange(self, exchange: Exchange) -> None:
        from ray_moe.dispatch.direct import DirectDispatcher
        from ray_moe.types import DispatchPath

        self.exchange = exchange
        # the normal-mode path is a deployment-wide choice (every rank must speak the same control protocol)
        direct = self.cfg.resolved_dispatch_path is DispatchPath.DIRECT
        self._direct = DirectDispatcher(exchange, chunks=1) if direct else None

    def load_experts(self, keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], str]:
        """Load (layer, expert) weights from the weight source; returns their parameter digests."""
        out = {}
        for layer, expert in keys:
            key = (int(layer), int(expert))
            if key not in self._experts:
                w = self.source.expert(*key).to(self.device, self.dtype)
                self._experts[key] = w
                self._digests[key] = w.digest()
            out[key] = self._digests[key]
        return out

    def export_experts(self, keys: Sequence[tuple[int, int]], *, device: bool = False) -> dict[tuple[int, int], ExpertWeights]:
        """Weights this rank holds, for an actor-to-actor copy (CPU tensors, or device tensors for NCCL)."""
        missing = [k for k in keys if tuple(k) not in self._experts]
        if missing:
            raise ValueError(f"keys: rank {self.rank} holds no weights for (layer, expert) {missing[0]}")
        return {tuple(k): (self._experts[tuple(k)] if device else self._experts[tuple(k)].to("cpu")) for k in keys}

    def import_experts(self, weights: Mapping[tuple[int, int], ExpertWeights]) -> dict[tuple[int, int], str]:
        """Store copied weights; returns the digests computed from the bytes that arrived."""
        out = {}
        for key, w in weights.items():
            key = (int(key[0]), int(key[1]))
            w = w.to(self.device, self.dtype)
            self._experts[key] = w
            self._digests[key] = w.digest()
            out[key] = self._digests[key]
        return out

    def held_experts(self) -> list[tuple[int, int]]:
        return sorted(self._experts)

    def prepare_generation(self, manifest: PlacementManifest, group: ProcessGroupSpec) -> dict[str, Any]:
        """Materialise this rank's slots of a new generation (weights must already be held) and verify every
        slot's parameter digest. Registers the generation PENDING in the local mirror."""
        with self._lock:
            snaps = snapshots_for(manifest, self.topology, group)
            weights: list[SlotWeights | None] = []
            keys: set[tuple[int, int]] = set()
            mismatches = []
            for layer in range(manifest.num_layers):
                slots = manifest.rank_slots(self.rank, layer)
                if not slots:
                    weights.append(None)
                    continue
                experts = []
                for s in slots:
                    key = (layer, s.logical_expert_id)
                    if key not in self._experts:
                        raise ValueError(
                            f"manifest: slot q{s.physical_slot_id} of layer {layer} needs expert "
                            f"{s.logical_expert_id} which rank {self.rank} does not hold"
                        )
                    if self._digests[key] != s.parameter_digest:
                        mismatches.append((layer, s.physical_slot_id, s.logical_expert_id))
                    experts.append(self._experts[key])
                    keys.add(key)
                weights.append(SlotWeights.stack(layer, [s.physical_slot_id for s in slots], experts,
                                                 [s.parameter_digest for s in slots]))
            if mismatches:
                raise ValueError(
                    f"parameter_digest: rank {self.rank} slots {mismatches} hold weights whose digest differs from "
                    f"the manifest of generation {manifest.generation}; not published"
                )
            if manifest.generation not in self._gens:
                self.registry.register(manifest)
            self._gens[manifest.generation] = _Generation(manifest, snaps, tuple(weights), frozenset(keys))
            return {"rank": self.rank, "generation": manifest.generation, "slots": sum(
                w.num_slots for w in weights if w is not None), "verified": True}

    def publish(self, generation: int) -> None:
        with self._lock:
            if generation not in self._gens:
                raise GenerationError(f"generation={generation} was never prepared on rank {self.rank}")
            state = self.registry.state(generation)
            if state == GenerationState.PENDING:
                self.registry.publish(generation)
            elif state == GenerationState.DRAINING:
                self.registry.reactivate(generation)

    def refcount(self, generation: int) -> int:
        """In-flight handles pinning ``generation`` here (registry leases + candidate pins)."""
        with self._lock:
            pins = self._candidate_pins.get(generation, 0)
        try:
            return self.registry.refcount(generation) + pins
        except Exception:  # noqa: BLE001 - unknown generation holds nothing
            return pins

    # ---------------------------------------------------------------- candidates and faults
    def allow_candidate(self, generation: int) -> None:
        """A prepared PENDING generation may serve steps that name it explicitly (shadow, canary)."""
        with self._lock:
            if generation not in self._gens or self.registry.state(generation) != GenerationState.PENDING:
                raise GenerationError(f"generation={generation} is not a prepared PENDING candidate on rank {self.rank}")
            self._candidates.add(generation)

    def stop_dispatch(self, generation: int) -> None:
        """The stop fence: no new step may pin ``generation`` (candidate revoked, or ACTIVE -> DRAINING)."""
        with self._lock:
            self._candidates.discard(generation)
            if generation in self._gens and self.registry.state(generation) == GenerationState.ACTIVE:
                self.registry.mark_draining(generation)

    def release_graphs(self, generation: int) -> int:
        """Free captured decode graphs keyed to ``generation``; returns how many were freed."""
        return self._free_graphs(generation)

    def _free_graphs(self, generation: int) -> int:
        return 0

    def inject_fault(self, kind: str, count: int = 1, generation: int | None = None) -> None:
        """Arm a fault for the next ``count`` steps (of ``generation`` only, if given)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind={kind!r} is not one of {sorted(FAULT_KINDS)}")
        with self._lock:
            self._faults[kind] = (int(count), generation)

    def _take_fault(self, kind: str, generation: int) -> bool:
        with self._lock:
            left, gen = self._faults.get(kind, (0, None))
            if left <= 0 or (gen is not None and gen != generation):
                return False
            self._faults[kind] = (left - 1, gen)
            self.counters[f"fault_{kind}"] = self.counters.get(f"fault_{kind}", 0) + 1
            return True

    def retire(self, generation: int) -> bool:
        """Retire a drained generation and free weights no live generation uses. False if still pinned."""
        with self._lock:
            if generation not in self._gens:
                return True
            if self.refcount(generation) > 0:
                return False
            state = self.registry.state(generation)
            if state == GenerationState.ACTIVE:
                raise GenerationError(f"generation={generation} is ACTIVE on rank {self.rank}; publish a successor first")
            self._candidates.discard(generation)
            self._free_graphs(generation)
            if state == GenerationState.PENDING:
                self.registry.abandon(generation)
            else:
                self.registry.retire(generation)
            del self._gens[generation]
            live = set().union(*(g.keys for g in self._gens.values())) if self._gens else set()
            for key in [k for k in self._experts if k not in live]:
                del self._experts[key]
                del self._digests[key]
            return True

    def drop_experts(self, keys: Sequence[tuple[int, int]]) -> None:
        """Free staged weights that no generation uses (an aborted migration)."""
        with self._lock:
            live = set().union(*(g.keys for g in self._gens.values())) if self._gens else set()
            for key in keys:
                key = (int(key[0]), int(key[1]))
                if key not in live:
                    self._experts.pop(key, None)
                    self._digests.pop(key, None)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "rank": self.rank,
                "active": self.registry.active(),
                "generations": {g: {"state": self.registry.state(g).value, "refcount": self.registry.refcount(g)}
                                for g in self._gens},
                "experts_held": len(self._experts),
                "weight_bytes": sum(w.nbytes for w in self._experts.values()),
                "counters": dict(self.counters),
            }

    def expert_weights(self, layer: int, expert: int) -> ExpertWeights | None:
        w = self._experts.get((layer, expert))
        return None if w is None else w.to("cpu")

    # ================================================================ data path
    def step(self, req: StepRequest, publish: Callable[[StepResult], StepResult] | None = None) -> StepResult:
        """Run every layer of one step SPMD with the other ranks (one call per step, not per layer).

        On CUDA the output reaches the host through a reused pinned buffer (a DMA, not a pageable copy); the
        result's ``hidden`` is a view of it only until the step lock is released. ``publish`` (called under
        the lock) moves it somewhere durable (the actor shell: the Ray object store); without it the view is
        copied here.
        """
        if self.exchange is None:
            raise RuntimeError(f"rank {self.rank}: no exchange endpoint set")
        t0 = time.perf_counter()
        with self._step_lock:
            res = self._step(req, t0)
            if not self._staged(res):
                return res
            if publish is not None:
                return publish(res)
            return dataclasses.replace(res, hidden=np.array(res.hidden))

    def _staged(self, res: StepResult) -> bool:
        """Whether ``res.hidden`` is a view of this core's pinned staging buffer."""
        buf = self._pinned
        return (buf is not None and isinstance(res.hidden, np.ndarray) and res.hidden.size > 0
                and np.may_share_memory(res.hidden, buf.numpy()))  # bounds only: O(1)

    def _host_out(self, h: torch.Tensor) -> tuple[np.ndarray, str]:
        """[T, d] output -> (NumPy wire array, dtype name); CUDA tensors through the pinned staging buffer."""
        if h.device.type != "cuda" or h.numel() == 0:
            return _to_wire(h)
        h = h.contiguous()
        nbytes = h.numel() * h.element_size()
        if self._pinned is None or self._pinned.numel() < nbytes:
            self._pinned = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        host = self._pinned[:nbytes].view(h.dtype).view(h.shape)
        host.copy_(h)  # pinned D2H: a DMA at link speed, no page faults on a fresh pageable buffer
        return _to_wire(host)

    def _step(self, req: StepRequest, t0: float) -> StepResult:
        cfg = self.cfg
        status = ControlStatus.OK
        lease = None
        candidate_pin = False
        try:
            lease = self.registry.acquire_generation(req.generation, holder=req.step_id)
        except (StaleGenerationError, GenerationError, KeyError, ValueError):
            with self._lock:
                if req.generation in self._candidates:
                    self._candidate_pins[req.generation] = self._candidate_pins.get(req.generation, 0) + 1
                    candidate_pin = True
            if not candidate_pin:
                status = ControlStatus.STALE_GENERATION
                self.counters["stale_rejects"] += 1
        g = req.generation
        gen = self._gens.get(req.generation) if status == ControlStatus.OK else self._any_generation()
        if gen is None:
            raise StaleGenerationError(f"rank {self.rank} holds no generation at all", requested=req.generation)
        marks: list[tuple[str, float, Any]] | None = [] if req.marks else None
        cuda = self.device.type == "cuda"
        origin = None
        if marks is not None and cuda:
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()

        def mark(label: str) -> None:
            if marks is not None:
                ev = None
                if cuda:
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                marks.append((label, time.perf_counter() - t0, ev))

        h = _to_tensor(req.hidden, self.device).to(self.dtype)
        mark("hidden_in")
        routes_out = []
        stats = []
        checks: list = []  # (handle id, device flag): read with the output, before it is published
        try:
            for layer in range(cfg.num_layers):
                snap = gen.snapshots[layer]
                if req.topk_ids is not None:
                    ids = _to_tensor(req.topk_ids[layer], self.device).to(torch.int64)
                    gates = _to_tensor(req.topk_weights[layer], self.device).to(torch.float32)
                else:
                    ids, gates = route(h, self.routers[layer], self.biases[layer], cfg.top_k, cfg.norm_topk)
                if req.return_routes:
                    routes_out.append((ids.cpu().numpy(), gates.cpu().numpy()))
                tag = f"{req.step_id}/L{layer}"
                if self._take_fault("crash", g):
                    raise RuntimeError(f"injected fault: rank {self.rank} failed serving generation {g}")
                if req.phase == Phase.DECODE and cfg.decode_buckets and status == ControlStatus.OK:
                    done = self._decode_layer(layer, gen, snap, h, ids, gates, tag)
                    if done is not None:
                        y, ls = done
                        h = h + y if cfg.residual else y
                        stats.append(ls)
                        continue
                    reason = self._last_fallback
                else:
                    reason = None
                mark(f"L{layer}/routes")
                if self._direct is not None:
                    y, ls = self._direct_layer(layer, gen, snap, h, ids, gates, tag, status, g, checks, reason,
                                               mark)
                    h = h + y if cfg.residual else y
                    stats.append(ls)
                    mark(f"L{layer}/direct_layer")
                    continue
                out = dispatch(RouteBatch(self.rank, h, ids, gates), snap, self.exchange, selector=self.selector,
                               tag=tag, payload_format=cfg.payload_format,
                               status=status if layer == 0 else ControlStatus.OK,
                               count_fault=1 if layer == 0 and self._take_fault("count", g) else 0,
                               scale_fault=layer == 0 and self._take_fault("scale", g))
                x = dequantize(out.rows, out.scales, cfg.payload_format, self.dtype)
                w = gen.weights[layer]
                if x.shape[0]:
                    y_rows = self.runner.run(x, out.counts_list, w)
                else:
                    y_rows = x.new_zeros((0, cfg.hidden_size))
                if self._take_fault("parity", g):
                    y_rows = y_rows * 1.01  # a runner whose output drifted from its reference
                handle = out.handle
                if self._take_fault("inverse", g):
                    handle = _corrupt_inverse(handle)
                y = combine(y_rows, handle, snap, self.exchange, tag=tag, out_dtype=self.dtype,
                            deferred_check=checks)
                h = h + y if cfg.residual else y
                stats.append(_layer_stats(layer, out, snap, self.rank, cfg.num_experts, reason))
                mark(f"L{layer}/engine_layer")
            if checks:
                flags = torch.stack([f for _, f in checks]).tolist()
                for (hid, _), ok in zip(checks, flags):
                    reject_corrupt(hid, ok)
            mark("checks")
            self.counters["steps"] += 1
        except StaleGenerationError as exc:
            self.counters["aborted_steps"] += 1
            if status == ControlStatus.STALE_GENERATION:
                raise StaleGenerationError(
                    f"{exc} (rank {self.rank}: step pinned generation {req.generation}, active "
                    f"{self.registry.active()})", requested=req.generation, active=self.registry.active()) from None
            raise
        except BaseException:
            self.counters["aborted_steps"] += 1
            raise
        finally:
            if lease is not None:
                self.registry.release(lease)
            if candidate_pin:
                with self._lock:
                    self._candidate_pins[g] -= 1
        arr, dt = self._host_out(h)
        mark("hidden_out")
        done = tuple((label, host, -1.0 if ev is None else float(origin.elapsed_time(ev)) * 1e-3)
                     for label, host, ev in (marks or ()))  # the D2H above waited for every event
        return StepResult(self.rank, req.step_id, req.generation, arr, dt, tuple(stats),
                          tuple(routes_out) if req.return_routes else None, self.registry.active(),
                          time.perf_counter() - t0, done)

    def _direct_layer(self, layer: int, gen: "_Generation", snap: PlacementSnapshot, h: torch.Tensor,
                      ids: torch.Tensor, gates: torch.Tensor, tag: str, status: ControlStatus, g: int, checks: list,
                      reason: str | None, mark=lambda label: None):
        """One layer through ``dispatch/direct.py`` (same faults, checks and stats as the engine path)."""
        from ray_moe.dispatch.direct import corrupt_route_src

        cfg = self.cfg
        out = self._direct.dispatch(RouteBatch(self.rank, h, ids, gates), snap, selector=self.selector, tag=tag,
                                    status=status if layer == 0 else ControlStatus.OK,
                                    count_fault=1 if layer == 0 and self._take_fault("count", g) else 0,
                                    scale_fault=layer == 0 and self._take_fault("scale", g))
        mark(f"L{layer}/dispatch")
        w = gen.weights[layer]
        y_rows = self.runner.run(out.rows, out.counts_list, w) if out.rows.shape[0] else out.rows.new_zeros(
            (0, cfg.hidden_size))
        mark(f"L{layer}/experts")
        if self._take_fault("parity", g):
            y_rows = y_rows * 1.01
        handle = corrupt_route_src(out.handle) if self._take_fault("inverse", g) else out.handle
        y = self._direct.combine(y_rows, handle, snap, tag=tag, out_dtype=self.dtype, deferred_check=checks)
        return y, _direct_stats(layer, out.handle, snap, self.rank, cfg.num_experts, reason)

    # ================================================================ decode buckets
    def _bucket(self, gen: _Generation, layer: int) -> "_DecodeBucket":
        """The decode bucket of (generation, layer): key, static geometry, device maps (built once)."""
        key = (gen.manifest.generation, layer)
        b = self._buckets.get(key)
        if b is None:
            b = _DecodeBucket.build(self, gen, layer)
            self._buckets[key] = b
        return b

    def _free_graphs(self, generation: int) -> int:
        freed = 0
        for key in [k for k in self._buckets if k[0] == generation]:
            freed += int(self._buckets.pop(key).graph is not None)
        return freed

    def _decode_layer(self, layer: int, gen: _Generation, snap: PlacementSnapshot, h: torch.Tensor,
                      ids: torch.Tensor, gates: torch.Tensor, tag: str):
        """Admission (spec 0x05D) agreed by every rank, then the bucket path (replaying a captured CUDA graph
        on GPUs). Returns (y [T, d], stats) or None for the eager variable fallback (reason kept)."""
        from ray_moe.dispatch.plan import check_assignment
        from ray_moe.dispatch.records import SemanticRoutes
        from ray_moe.phases.admission import AdmissionStep, Fallback, FallbackReason, admit_decode_graph

        cfg = self.cfg
        bucket = self._bucket(gen, layer)
        batch = RouteBatch(self.rank, h, ids, gates)
        # 1. select replicas for the valid routes (padding never gets a slot)
        ok = True
        try:
            batch.validate(snap.num_experts, cfg.hidden_size)
            routes = SemanticRoutes.from_batch(batch)
            phys = self.selector.select(routes, snap).to(h.device)
            check_assignment(routes, phys, snap)
        except RouteValidationError:
            ok = False
            phys = torch.zeros(0, dtype=torch.int64, device=h.device)
        t = int(h.shape[0]) if ok else -1
        slot_counts = torch.bincount(phys, minlength=snap.num_slots).cpu().numpy() if ok else np.zeros(snap.num_slots)
        # 2. decode control round: every rank reports its bucket key digest, readiness, tokens and slot counts
        digest = bucket.key_digest ^ (1 if self._take_fault("graph_key", gen.manifest.generation) else 0)
        vec = np.concatenate([[gen.manifest.generation, snap.pg_epoch, layer, snap.map_digest, digest,
                               int(bucket.ready), t], slot_counts.astype(np.int64)])
        rows = self.exchange.all_gather(f"{tag}/ctl-decode", vec.astype(np.int64))
        peers = self.exchange.group.peer_order
        if any(int(r[6]) < 0 for r in rows):
            return self._fallback("bad_input", "a rank rejected its decode input")
        for i, r in enumerate(rows):
            if int(r[0]) != gen.manifest.generation or int(r[3]) != snap.map_digest:
                from ray_moe.errors import CountAgreementError

                raise CountAgreementError(f"{tag}: rank {peers[i]} planned decode under another generation or map; "
                                          f"aborted before payload exchange")
        # 3. the admission predicate, evaluated identically on every rank
        if any(int(r[4]) != bucket.key_digest for r in rows):
            bad = [peers[i] for i, r in enumerate(rows) if int(r[4]) != bucket.key_digest]
            return self._fallback(FallbackReason.GRAPH_KEY_MISMATCH.value, f"ranks {bad} hold a graph of another key")
        rank_tokens = [0] * snap.num_ranks
        for i, r in enumerate(rows):
            rank_tokens[peers[i]] = int(r[6])
        slot_routes = tuple(int(x) for x in np.sum(np.stack([r[7:] for r in rows]), 0))
        step = AdmissionStep(Phase.DECODE, bucket.key, tuple(rank_tokens), slot_routes)
        ready = _Readiness(all(int(r[5]) == 1 for r in rows))
        outcome = admit_decode_graph(step, bucket.desc, ready)
        if isinstance(outcome, Fallback):
            return self._fallback(outcome.reason.value, outcome.detail)
        # 4. replay: stage this step's valid state into the stable buffers, run the fixed-shape layer
        y, path = bucket.run(self, h, phys, gates.reshape(-1), tag)
        slot_rows = bucket.slot_rows(slot_routes)
        dest = snap.slot_rank.to(phys.device)[phys]
        self.counters["bucket_replays"] = self.counters.get("bucket_replays", 0) + 1
        return y, _route_stats(layer, routes.logical_expert, dest, snap, self.rank, cfg.num_experts, slot_rows,
                               path, None)

    def _fallback(self, reason: str, detail: str):
        self._last_fallback = reason
        key = f"fallback_{reason}"
        self.counters[key] = self.counters.get(key, 0) + 1
        return None

    def _any_generation(self) -> _Generation | None:
        active = self.registry.active()
        if active is not None and active in self._gens:
            return self._gens[active]
        return next(iter(self._gens.values()), None)


FAULT_KINDS = frozenset({"count", "scale", "inverse", "parity", "crash", "graph_key"})
"""Faults a shard can inject into its own data path (the ten of spec 0x0E are composed from these and from
control-path faults injected at the coordinator)."""


class _Readiness:
    """Duck-typed stable-buffer check for ``admit_decode_graph``: every rank's buffers at their addresses."""

    def __init__(self, ok: bool) -> None:
        self._ok = ok

    def ready(self, bucket) -> bool:  # noqa: ARG002 - the bucket is this rank's own
        return self._ok


class _DecodeBucket:
    """One rank's decode bucket for one (generation, layer): the immutable graph key, the static geometry,
    device copies of the maps, stable input/output buffers and (on CUDA) the captured graph."""

    def __init__(self) -> None:
        self.graph = None
        self.ready = True

    @staticmethod
    def build(core: "ShardCore", gen: "_Generation", layer: int) -> "_DecodeBucket":
        from ray_moe.dispatch.bucket import BucketShape, default_slot_capacity, pair_capacity
        from ray_moe.phases.buckets import DecodeBucket, GraphKey

        cfg = core.cfg
        snap = gen.snapshots[layer]
        group = core.exchange.group
        c_t = cfg.decode_token_capacity
        c_q = cfg.decode_slot_capacity or default_slot_capacity(c_t, cfg.top_k, group.size, snap.num_slots)
        caps_by_rank = [c_q * int(snap.rank_num_slots[r]) for r in group.peer_order]
        b = _DecodeBucket()
        b.key = GraphKey.for_snapshot(
            snap, hidden_size=cfg.hidden_size, top_k=cfg.top_k, activation_dtype=core.dtype, gate_dtype=torch.float32,
            dispatch_backend=cfg.exchange_kind, runner_backend="padded",
            rank_token_capacities=[c_t] * snap.num_ranks, slot_route_capacities=[c_q] * snap.num_slots,
        )
        b.desc = DecodeBucket.build(b.key)
        import hashlib

        b.key_digest = int.from_bytes(hashlib.sha256(repr(b.key).encode()).digest()[:7], "little")
        q_local = int(snap.rank_num_slots[core.rank])
        b.shape = BucketShape(group.size, c_t, cfg.top_k, pair_capacity(c_t, cfg.top_k, caps_by_rank), q_local, c_q,
                              cfg.hidden_size)
        dev = core.device
        b.maps = (snap.slot_rank.to(dev), snap.rank_to_peer.to(dev), snap.slot_local.to(dev))
        b.local_ids = snap.rank_slot_ids(core.rank).tolist()
        w = gen.weights[layer]
        b.weights = None if w is None else (w.w_gate, w.w_up, w.w_down)
        b.capture = core.device.type == "cuda" and cfg.cuda_graphs and type(core.exchange).__name__ == "NcclExchange"
        # stable buffers: their addresses are what a captured graph reads and writes
        b.h = torch.zeros(c_t, cfg.hidden_size, dtype=core.dtype, device=dev)
        b.slots = torch.full((c_t * cfg.top_k,), -1, dtype=torch.int64, device=dev)
        b.gates = torch.zeros(c_t * cfg.top_k, dtype=torch.float32, device=dev)
        b.out = None
        return b

    def _experts(self, rows: torch.Tensor) -> torch.Tensor:
        from ray_moe.dispatch.bucket import padded_swiglu

        return padded_swiglu(rows, *self.weights)

    def _layer(self, core: "ShardCore", tag: str) -> torch.Tensor:
        from ray_moe.dispatch.bucket import run_bucket_layer

        return run_bucket_layer(self.h, self.slots, self.gates, shape=self.shape, maps=self.maps,
                                experts=self._experts if self.weights is not None else (lambda r: r),
                                exchange=core.exchange, tag=tag)

    def run(self, core: "ShardCore", h: torch.Tensor, phys: torch.Tensor, gates: torch.Tensor,
            tag: str) -> tuple[torch.Tensor, str]:
        """Stage the valid rows (padding stays masked: slot -1, gate 0, zero hidden) and run the layer."""
        t, r = h.shape[0], phys.numel()
        self.h[:t].copy_(h)
        self.h[t:].zero_()
        self.slots[:r].copy_(phys)
        self.slots[r:].fill_(-1)
        self.gates[:r].copy_(gates)
        self.gates[r:].zero_()
        if not self.capture:
            return self._layer(core, tag)[:t], "bucket"
        if self.graph is None:
            # warm up on a side stream (every rank together: admission was agreed), then capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._layer(core, tag + "/warmup")
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            # thread_local: control-path threads of this actor (digests, copies) may touch CUDA meanwhile
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                self.out = self._layer(core, tag + "/capture")
            self.graph = g
        self.graph.replay()
        return self.out[:t].clone(), "bucket-graph"

    def slot_rows(self, slot_routes) -> dict[int, int]:
        return {q: int(slot_routes[q]) for q in self.local_ids}


def _corrupt_inverse(handle):
    """A handle whose inverse send permutation swaps two routes (or is truncated when there are < 2)."""
    import dataclasses

    src = handle.source
    inv = src.inverse_send.clone()
    if inv.numel() >= 2:
        inv[[0, 1]] = inv[[1, 0]]
    else:
        inv = inv[:0]
    return dataclasses.replace(handle, source=dataclasses.replace(src, inverse_send=inv))


def _layer_stats(layer: int, out, snap: PlacementSnapshot, rank: int, num_experts: int,
                 fallback_reason: str | None = None) -> LayerStats:
    hd = out.handle
    slot_rows = {int(s): int(c) for s, c in zip(hd.receive.slot_ids.tolist(), hd.receive.expert_counts.tolist())}
    return _route_stats(layer, hd.routes.logical_expert, hd.source.dest_rank, snap, rank, num_experts, slot_rows,
                        "variable", fallback_reason)


def _direct_stats(layer: int, hd, snap: PlacementSnapshot, rank: int, num_experts: int,
                  fallback_reason: str | None) -> LayerStats:
    """The engine path's layer statistics from the direct handle's host counts (no device sync)."""
    row = hd.count_matrix[rank].numpy()  # routes this rank sent to every global rank
    sent = np.asarray(hd.sent_slot_counts, dtype=np.int64)
    node = snap.rank_node.numpy()
    counts = np.bincount(snap.phy2log.numpy(), weights=sent, minlength=num_experts).astype(np.int64)
    slot_ids = snap.rank_slot_ids(rank).tolist()
    slot_rows = {int(q): int(c) for q, c in zip(slot_ids, hd.expert_counts)}
    remote = int(row.sum() - row[rank])
    inter = int(row[node != node[rank]].sum())
    return LayerStats(layer, int(row.sum()), remote, inter, counts, row.astype(np.int64), slot_rows, "variable",
                      fallback_reason)


def _route_stats(layer: int, experts: torch.Tensor, dest: torch.Tensor, snap: PlacementSnapshot, rank: int,
                 num_experts: int, slot_rows: dict[int, int], path: str, fallback_reason: str | None) -> LayerStats:
    node = snap.rank_node.to(dest.device)
    remote = int((dest != rank).sum())
    inter = int((node[dest] != node[rank]).sum()) if dest.numel() else 0
    counts = torch.bincount(experts, minlength=num_experts).cpu().numpy()
    rank_routes = torch.bincount(dest, minlength=snap.num_ranks).cpu().numpy()
    return LayerStats(layer, int(experts.numel()), remote, inter, counts, rank_routes, slot_rows, path, fallback_reason)


def _to_tensor(x: Any, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str):
        from ray_moe.dispatch.exchange.object_store import wire_to_tensor

        return wire_to_tensor(x[0], x[1], device)
    with np.errstate(all="ignore"):
        t = torch.from_numpy(np.array(x, copy=not getattr(x, "flags", None) or not x.flags.writeable))
    return t.to(device)


def _to_wire(t: torch.Tensor) -> tuple[np.ndarray, str]:
    from ray_moe.dispatch.exchange.object_store import tensor_to_wire

    return tensor_to_wire(t)


__all__ = ["ShardCore", "StepRequest", "StepResult", "LayerStats", "RouteValidationError"]
