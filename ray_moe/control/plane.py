"""ControlPlane: the coordinator's logic, over an abstract fleet of shards (no Ray here).

The coordinator actor is a thin shell around one ControlPlane and a ``RayFleet``; tests can run the
same logic over ``LocalFleet`` (ShardCores in this process; both in ``fleet.py``). The control path never sits on the
per-token data path:

    load window -> candidate manifest (EPLB / scale) -> migration plan (admission) -> reserve
    -> materialise (copy / load) -> verify digests -> publish -> drain -> retire

Each of those stages has a deadline (``cfg.deadlines``) and reports progress (``ops``: stage, elapsed,
bytes copied); a stage past its deadline aborts the operation (``operations.py``).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ray_moe.control.fleet import Fleet, LocalFleet
from ray_moe.control.operations import (OperationStage, OperationTracker, RankTimeoutError, StageDeadlineError,
                                        abort_stage, roll_back_publish)
from ray_moe.control.recovery import RETIRED_KEPT, PendingOp, PlaneState
from ray_moe.model.config import RuntimeConfig
from ray_moe.core.errors import GenerationError, RankDeadError
from ray_moe.placement.floors import ReplicaFloors
from ray_moe.placement.load import LoadWindow
from ray_moe.placement.manifest import PlacementManifest, manifest_from_assignment
from ray_moe.placement.migration import MigrationPlan
from ray_moe.placement.planner import Assignment, PlacementPlanner
from ray_moe.placement.registry import GenerationRegistry
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.core.types import GenerationState

Key = tuple[int, int]  # (layer, logical expert)


@dataclass(frozen=True)
class TimelineEvent:
    """One control-path event (logged, and returned by ``ray-moe status``)."""

    seq: int
    t: float
    event: str
    generation: int | None
    detail: str


@dataclass(frozen=True)
class ApplyReport:
    """What one published change did."""

    old_generation: int
    new_generation: int
    reason: str
    plan: MigrationPlan | None
    copies: int
    loads: int
    drained_s: float
    retired: bool
    timings_s: dict[str, float] = field(default_factory=dict)


class ControlPlane:
    """Owns the generation registry, digests, the load window and the control timeline."""

    def __init__(self, cfg: RuntimeConfig, fleet: Fleet, topology: Topology, group: ProcessGroupSpec,
                 *, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.topology = topology
        self.group = group
        self.registry = GenerationRegistry()
        self.load = LoadWindow(cfg.num_layers, cfg.num_experts, cfg.load_window)
        self.digests: dict[Key, str] = {}
        self.checkpoint_version = f"checkpoint-{cfg.checkpoint or f'seed{cfg.seed}'}"
        self.expert_bytes = 0
        self.dead_ranks: set[int] = set()
        self.retired_with_refcount: list[tuple[int, int]] = []  # (generation, refcount at retirement)
        self._clock = clock
        self._timeline: deque[TimelineEvent] = deque(maxlen=10_000)  # bounded: the control path runs for days
        self._seq = 0
        self.lock = threading.RLock()  # one control operation at a time (a restore holds it too)
        self._tl_lock = threading.Lock()
        self.next_generation = 0
        # replica floors set by a manual ``scale``: EPLB keeps at least this many copies of (layer, expert)
        self.floors = ReplicaFloors(cfg.num_layers, cfg.num_experts)
        # durability (see recovery.py): ``on_change`` is called after every change of the plane's own state
        # (the coordinator actor writes its durable record there); ``op`` is the multi-shard operation in
        # flight, recorded before the first shard is touched
        self.on_change: Callable[[], None] | None = None
        self.op: PendingOp | None = None
        self.retired_before: list[int] = []  # generations retired before a restart (ids only)
        self.retire_pending: set[int] = set()  # superseded generations an operation will retire once drained
        self.rebuild_report: dict[str, Any] | None = None
        self.ops = OperationTracker(cfg.deadlines)  # the elastic operation in flight: stage, deadline, progress

    # ---------------------------------------------------------------- durability
    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def begin_op(self, kind: str, generation: int | None, detail: str = "") -> None:
        self.op = PendingOp(kind=kind, generation=generation, detail=detail)
        self._changed()

    def end_op(self) -> None:
        self.op = None
        self._changed()

    def durable_state(self) -> PlaneState:
        """The plane's own state that no shard holds (written on every change; see recovery.py)."""
        retired = set(self.retired_before)
        for g in self.registry.generations():
            if self.registry.state(g) == GenerationState.RETIRED:
                retired.add(g)
        return PlaneState(next_generation=self.next_generation, retired=sorted(retired)[-RETIRED_KEPT:],
                          floors=self.floors.triples(),
                          dead_ranks=sorted(set(self.dead_ranks)), expert_bytes=self.expert_bytes, op=self.op,
                          retire_pending=sorted(set(self.retire_pending)))

    def generation_states(self) -> dict[int, str]:
        """Every generation's state, those retired before a restart included."""
        out = {g: GenerationState.RETIRED.value for g in self.retired_before}
        reg = self.registry
        out.update({g: reg.state(g).value for g in reg.generations()})
        return dict(sorted(out.items()))

    # ---------------------------------------------------------------- timeline
    def log(self, event: str, generation: int | None = None, detail: str = "") -> None:
        with self._tl_lock:
            self._timeline.append(TimelineEvent(self._seq, self._clock(), event, generation, detail))
            self._seq += 1

    def timeline(self) -> list[TimelineEvent]:
        with self._tl_lock:
            return list(self._timeline)

    # ---------------------------------------------------------------- queries
    def active_generation(self) -> int | None:
        return self.registry.active()

    def manifest(self, generation: int | None = None) -> PlacementManifest:
        g = self.registry.active() if generation is None else generation
        if g is None:
            raise GenerationError("no ACTIVE generation")
        return self.registry.manifest(g)

    def live_ranks(self) -> list[int]:
        """Members of the current process group not known to be dead."""
        return [r for r in self.group.peer_order if r not in self.dead_ranks]

    @property
    def planner(self) -> PlacementPlanner:
        """The placement arithmetic over this deployment's shape and the current topology (a regroup replaces it)."""
        cfg = self.cfg
        return PlacementPlanner(cfg.num_layers, cfg.num_experts, cfg.slots_per_rank, self.topology,
                                num_groups=cfg.num_groups)

    def call_live(self, method: str, per_rank: Callable[[int], tuple], *, timed: bool = False) -> dict[int, Any]:
        """``fleet.call`` on the live ranks; a rank found dead is recorded and skipped (control-path reads).
        ``timed``: within the seconds the operation's stage has left (``StageDeadlineError`` past them)."""
        for _ in range(8):
            try:
                if timed:
                    return self.ops.call(self.fleet, method, {r: per_rank(r) for r in self.live_ranks()})
                return self.fleet.call(method, {r: per_rank(r) for r in self.live_ranks()})
            except RankDeadError as exc:
                self.dead_ranks.update(exc.ranks)
                self.log("rank-dead", None, f"{method}: ranks {list(exc.ranks)} unreachable")
                self._changed()
        raise RankDeadError(f"{method}: ranks keep dying", ranks=tuple(self.dead_ranks))

    def refcounts(self) -> dict[int, int]:
        """Exact pins per live generation: coordinator leases + in-flight handles on every shard."""
        out = {}
        for g in self.registry.generations():
            st = self.registry.state(g)
            if st == GenerationState.RETIRED:
                continue
            shard = self.call_live("refcount", lambda r: (g,))
            out[g] = self.registry.refcount(g) + sum(shard.values())
        return out

    # ---------------------------------------------------------------- replica floors
    def set_floor(self, expert: int, replicas: int, layer: int | None = None) -> None:
        """A manual scale: (layer, expert) keeps at least ``replicas`` copies through EPLB rebalances until
        a later scale lowers it (``replicas`` 1 removes the floor)."""
        self.floors.set(expert, replicas, layer)
        self._changed()

    def floor_list(self) -> list[dict[str, int]]:
        return self.floors.as_list()

    def effective_floors(self, num_slots: int) -> tuple[dict[Key, int], list[str]]:
        return self.floors.effective(num_slots)

    def scale(self, expert: int, replicas: int, layer: int | None = None, *,
              drain_timeout_s: float | None = None) -> ApplyReport:
        """Give ``expert`` exactly ``replicas`` copies (live) and record that count as its replica floor."""
        with self.lock:
            new = self.propose_scale(expert, replicas, layer)
            rep = self.apply(new, reason=f"scale expert {expert} to {replicas} replicas", drain_timeout_s=drain_timeout_s)
            self.set_floor(expert, replicas, layer)
            return rep

    # ---------------------------------------------------------------- building manifests
    def _new_manifest(self, a: Assignment) -> PlacementManifest:
        if a.notes:
            self.log("floor-clipped", None, "; ".join(a.notes))
        self.next_generation += 1
        self._changed()  # the id is spent even if the change never publishes
        digests = {(l, e): d for (l, e), d in self.digests.items()}
        return manifest_from_assignment(
            generation=self.next_generation - 1,
            phy2log=a.phy2log, slot_rank=a.slot_rank, num_experts=self.cfg.num_experts, topology=self.topology,
            process_group_id=self.group.group_id, checkpoint_version=self.checkpoint_version, digests=digests,
        )

    def deploy_initial(self) -> int:
        """Generation 0: spread placement, each rank loads only its experts, digests agreed, published."""
        with self.lock:
            initial = self.planner.initial(self.live_ranks())
            need = initial.keys_by_rank()
            t0 = self._clock()
            self.begin_op("deploy", 0)
            got = self.fleet.call("load_experts", {u: (sorted(keys),) for u, keys in need.items()})
            for u, digs in got.items():
                for key, d in digs.items():
                    key = (int(key[0]), int(key[1]))
                    prev = self.digests.setdefault(key, d)
                    if prev != d:
                        raise ValueError(
                            f"parameter_digest: rank {u} loaded (layer, expert) {key} with digest {d[:12]} but another "
                            f"replica has {prev[:12]}: mixed checkpoint state"
                        )
            self.log("load", 0, f"{sum(len(k) for k in need.values())} expert copies loaded in {self._clock() - t0:.2f}s")
            manifest = self._new_manifest(initial)
            self._publish_first(manifest)
            self.end_op()
            return manifest.generation

    def _publish_first(self, manifest: PlacementManifest) -> None:
        self.registry.register(manifest)
        self.fleet.call("prepare_generation", {r: (manifest, self.group) for r in self.live_ranks()})
        self.log("verify", manifest.generation, "all slot digests verified")
        self.fleet.call("publish", {r: (manifest.generation,) for r in self.live_ranks()})
        self.registry.publish(manifest.generation)
        self.log("publish", manifest.generation, f"{len(manifest.slots)} slots active")

    def set_expert_bytes(self, nbytes: int) -> None:
        self.expert_bytes = int(nbytes)
        self._changed()

    def record_load(self, counts: Any, *, phase: str, generation: int) -> None:
        self.load.record(np.asarray(counts, dtype=np.int64), phase=phase, generation=generation,
                         checkpoint=self.checkpoint_version)

    # ---------------------------------------------------------------- candidate placements
    def propose_scale(self, expert: int, replicas: int, layer: int | None = None) -> PlacementManifest:
        """The active placement with ``expert`` at ``replicas`` copies (in ``layer`` or every layer) over the
        live ranks (``PlacementPlanner.scale``)."""
        return self._new_manifest(self.planner.scale(self.manifest(), self.live_ranks(), expert, replicas, layer))

    def propose_rebalance(self, *, migration_aware: bool = True, tolerance: float = 0.05,
                          avoid_same_gpu_duplicates: bool = True) -> PlacementManifest:
        """EPLB on the load window, replica floors kept; slots per rank stay ``cfg.slots_per_rank``
        (``PlacementPlanner.rebalance``). Floors lowered to fit are logged (``floor-clipped``)."""
        a = self.planner.rebalance(self.manifest(), self.live_ranks(), self.load, self.floors,
                                   migration_aware=migration_aware, tolerance=tolerance,
                                   avoid_same_gpu_duplicates=avoid_same_gpu_duplicates)
        return self._new_manifest(a)

    def propose_without(self, dead: Sequence[int]) -> PlacementManifest:
        """The active placement minus the slots of ``dead`` ranks, every expert kept (``PlacementPlanner.without``)."""
        return self._new_manifest(self.planner.without(self.manifest(), self.live_ranks(), dead))

    # ---------------------------------------------------------------- apply
    def apply(self, new: PlacementManifest, *, reason: str, drain_timeout_s: float | None = None,
              sources_alive: Callable[[int], bool] | None = None) -> ApplyReport:
        """Reserve, materialise, verify, publish, drain, retire (spec 0x08G). Traffic keeps flowing. Each stage
        within its deadline (``cfg.deadlines``; ``drain_timeout_s`` overrides the drain's)."""
        with self.lock, self.ops.operation(reason, new.generation):
            staged = self.stage(new, reason=reason, sources_alive=sources_alive)
            old_g = staged.old_generation
            timings = dict(staged.timings_s)
            self.retire_pending.add(old_g)  # a restart before the retire below finishes it (recovery.py)
            self._changed()
            # 5. publish: every shard first, then the registry (drivers refresh from it)
            t = self._clock()
            self.ops.enter(OperationStage.PUBLISH)
            try:
                self._publish(new.generation, timed=True)
            except Exception as exc:
                self.retire_pending.discard(old_g)  # still ACTIVE: nothing to retire
                if isinstance(exc, StageDeadlineError):
                    roll_back_publish(self, new.generation, old_g, exc)
                raise
            timings["publish"] = self._clock() - t
            self.log("publish", new.generation, f"active; generation {old_g} DRAINING")
            # 6. drain + 7. retire (past publish a late stage leaves the prior generation DRAINING, retried later)
            t = self._clock()
            retired = self.drain_and_retire(old_g, timeout_s=drain_timeout_s, timed=True)
            self._retire_leftovers(new.generation)
            timings["drain_retire"] = self._clock() - t
            return ApplyReport(old_g, new.generation, reason, staged.plan, staged.copies, staged.loads,
                               timings["drain_retire"], retired, timings)

    def _publish(self, generation: int, *, timed: bool = False) -> None:
        self.begin_op("publish", generation)
        self.call_live("publish", lambda r: (generation,), timed=timed)
        if self.registry.state(generation) == GenerationState.DRAINING:
            self.registry.reactivate(generation)
        else:
            self.registry.publish(generation)
        self.end_op()

    def promote(self, generation: int, *, retire_prior: bool = True, drain_timeout_s: float | None = None) -> int:
        """A staged candidate becomes ACTIVE; the prior goes DRAINING (and is retired once drained unless
        ``retire_prior`` is False, which keeps it loaded as the rollback fallback). Returns the prior id."""
        with self.lock:
            prior = self.registry.active()
            if retire_prior and prior is not None:
                self.retire_pending.add(prior)
                self._changed()
            self._publish(generation)
            self.log("publish", generation, f"candidate promoted; generation {prior} DRAINING")
            if retire_prior and prior is not None:
                self.drain_and_retire(prior, timeout_s=drain_timeout_s)
            return prior

    def stop_dispatch(self, generation: int) -> None:
        """Stop fence: no new step pins ``generation`` (a candidate is revoked; an ACTIVE one drains)."""
        with self.lock:
            self.begin_op("stop_dispatch", generation)
            self.call_live("stop_dispatch", lambda r: (generation,))
            if self.registry.state(generation) == GenerationState.ACTIVE:
                self.registry.mark_draining(generation)
            self.end_op()
            self.log("stop-dispatch", generation, "no new dispatch may pin it")

    def activate(self, generation: int) -> None:
        """Make a loaded generation (ACTIVE, DRAINING) take new dispatch again (rollback's second step)."""
        with self.lock:
            if self.registry.state(generation) != GenerationState.ACTIVE:
                self._publish(generation)
            self.log("activate", generation, "takes new dispatch")

    def release_graphs(self, generation: int) -> int:
        freed = sum(self.call_live("release_graphs", lambda r: (generation,)).values())
        self.log("release-graphs", generation, f"{freed} captured graphs freed")
        return freed

    def shard_refcount(self, generation: int) -> int:
        shard = self.call_live("refcount", lambda r: (generation,))
        try:
            own = self.registry.refcount(generation)
        except Exception:  # noqa: BLE001
            own = 0
        return own + sum(shard.values())

    def stage(self, new: PlacementManifest, *, reason: str,
              sources_alive: Callable[[int], bool] | None = None, serve_candidate: bool = False) -> ApplyReport:
        """Steps 1-4 of publication (plan with admission, reserve, materialise, verify): the candidate is
        PENDING and verified on every shard ("LOADED"); with ``serve_candidate`` it may serve steps that
        name it (shadow, canary). A stage past its deadline raises ``StageDeadlineError`` after the abort."""
        with self.lock, self.ops.operation(reason, new.generation):
            timings: dict[str, float] = {}
            old_g = self.registry.active()
            if old_g is None:
                raise GenerationError("no ACTIVE generation to migrate from")
            old = self.registry.manifest(old_g)
            # 1. plan + admission: refused plans change nothing
            t = self._clock()
            self.ops.enter(OperationStage.PLAN)
            plan = self.planner.admit(old, new, self.live_ranks(), expert_bytes=self.expert_bytes,
                                      memory_budget_bytes=self.cfg.memory_budget_bytes)
            timings["plan"] = self._clock() - t
            self.log("plan", new.generation, f"{reason}: {_ledger_line(plan)}")
            self._check_deadline(new.generation, "the migration plan")
            self.ops.enter(OperationStage.RESERVE)
            if self.rebuild_report is not None:
                self._sweep_orphans()
            # 2. reserve: register PENDING (nothing else moves until materialisation)
            self.begin_op("stage", new.generation, reason)
            self.registry.register(new)
            self.log("reserve", new.generation, f"{plan.ledger.reserved_bytes} B reserved for non-retained copies")
            staged: dict[int, set[Key]] = defaultdict(set)
            copies = loads = 0
            try:
                self.ops.check("the reservation")
                # 3. materialise: network copies actor to actor, checkpoint loads where no source lives
                t = self._clock()
                moves = self.planner.transfers(
                    plan, lambda r: r not in self.dead_ranks and (sources_alive is None or sources_alive(r)))
                n = sum(len(k) for k in moves.copies.values()) + sum(len(k) for k in moves.loads.values())
                self.ops.enter(OperationStage.COPY, copies_planned=n, bytes_planned=n * self.expert_bytes)
                for (dst, src), keys in sorted(moves.copies.items()):
                    b0 = getattr(self.fleet, "bytes_copied", None)
                    try:
                        digs = self.fleet.copy_within(dst, src, sorted(keys), self.ops.remaining())
                    except RankTimeoutError as exc:
                        raise self.ops.expired(exc.ranks, f"copy of {len(keys)} expert(s) rank {src} -> rank {dst}") from None
                    staged[dst].update(keys)
                    copies += len(keys)
                    b1 = getattr(self.fleet, "bytes_copied", None)
                    self.ops.copied(b1 - b0 if b0 is not None and b1 is not None else len(keys) * self.expert_bytes,
                                    len(keys))
                    self._check_digests(dst, digs)
                if moves.loads:
                    got = self.ops.call(self.fleet, "load_experts", {u: (sorted(k),) for u, k in moves.loads.items()})
                    for u, digs in got.items():
                        staged[u].update(moves.loads[u])
                        loads += len(moves.loads[u])
                        self.ops.copied(len(moves.loads[u]) * self.expert_bytes, len(moves.loads[u]))
                        self._check_digests(u, digs)
                timings["materialize"] = self._clock() - t
                self.log("materialize", new.generation, f"{copies} expert copies moved, {loads} loaded from checkpoint")
                # 4. verify every target slot's digest on its rank (prepare fails on any mismatch)
                t = self._clock()
                self.ops.enter(OperationStage.VERIFY)
                self.ops.call(self.fleet, "prepare_generation", {r: (new, self.group) for r in self.live_ranks()})
                timings["verify"] = self._clock() - t
                self.log("verify", new.generation, "all slot digests verified")
            except BaseException as exc:
                abort_stage(self, new.generation, staged, exc)
                raise
            if serve_candidate:
                self.call_live("allow_candidate", lambda r: (new.generation,))
                self.log("candidate", new.generation, "serves steps that name it (shadow / canary)")
            self.end_op()
            return ApplyReport(old_g, new.generation, reason, plan, copies, loads, 0.0, False, timings)

    def _check_deadline(self, generation: int, what: str) -> None:
        """The coordinator's own work of a stage (the solve) ran past its deadline: nothing moved yet."""
        try:
            self.ops.check(what)
        except StageDeadlineError as exc:
            self.log("deadline", generation, str(exc))
            raise

    def _sweep_orphans(self) -> None:
        """After a restart: a prepare sent by the dead incarnation may land on a shard after the rebuild read
        it. A PENDING, non-candidate generation this registry does not know is such an orphan: abandon it."""
        known = set(self.registry.generations())
        for r, snap in self.call_live("registry_snapshot", lambda r: ()).items():
            for g, info in snap["generations"].items():
                if int(g) not in known and info["state"] == GenerationState.PENDING.value and not info["candidate"]:
                    self.fleet.call("retire", {r: (int(g),)})
                    self.log("orphan-abandoned", int(g), f"rank {r}: PENDING generation unknown to the coordinator")

    def drain_and_retire(self, generation: int, *, timeout_s: float | None = None, timed: bool = False) -> bool:
        """Wait until no lease or in-flight handle pins ``generation``, then retire it everywhere (within
        ``timeout_s``, default the drain deadline). ``timed``: as the drain and retire stages of the operation
        in flight: a rank that does not answer in the stage's seconds leaves ``generation`` DRAINING (False)."""
        timeout_s = self.cfg.deadlines.drain_s if timeout_s is None else float(timeout_s)
        try:
            done = self._drain_and_retire(generation, timeout_s, timed)
        except StageDeadlineError as exc:  # past publish: the new generation serves; a later change retires it
            self.log("deadline", generation, f"{exc}; not retired")
            self.end_op()
            return False
        except Exception:
            self.retire_pending.discard(generation)
            raise
        if done and generation in self.retire_pending:  # not drained in time: kept, retried by a later change
            self.retire_pending.discard(generation)
            self._changed()
        return done

    def _retire_leftovers(self, active: int | None) -> None:
        """Retire superseded generations whose drain timed out earlier (or before a restart) once nothing pins
        them any more; a generation still pinned is left for the next change (no waiting here)."""
        for g in sorted(set(self.retire_pending)):
            try:
                state = self.registry.state(g)
            except GenerationError:
                state = None
            if g == active or state != GenerationState.DRAINING:
                self.retire_pending.discard(g)
                continue
            if self.shard_refcount(g) == 0:
                self.drain_and_retire(g, timeout_s=0.0)

    def _drain_and_retire(self, generation: int, timeout_s: float, timed: bool = False) -> bool:
        deadline = self._clock() + timeout_s
        if timed:
            self.ops.enter(OperationStage.DRAIN, deadline_s=timeout_s)
        while True:
            shard = self.call_live("refcount", lambda r: (generation,), timed=timed)
            total = self.registry.refcount(generation) + sum(shard.values())
            if total == 0:
                break
            if self._clock() > deadline:
                pinned = sorted(r for r, c in shard.items() if c)
                self.log("drain-timeout", generation, f"stage drain passed its {timeout_s:g}s deadline: refcount still "
                                                      f"{total} (rank(s) {pinned} pin it); not retired")
                return False
            time.sleep(0.002)
        self.log("drained", generation, "refcount 0 on coordinator and every shard")
        self.begin_op("retire", generation)
        if timed:
            self.ops.enter(OperationStage.RETIRE)
        done = self.call_live("retire", lambda r: (generation,), timed=timed)
        if not all(done.values()):
            self.end_op()
            self.log("retire-refused", generation, f"shards still pinned: {[r for r, ok in done.items() if not ok]}")
            return False
        self.retired_with_refcount.append((generation, total))
        self.registry.retire(generation)
        self.end_op()
        self.log("retire", generation, "metadata and unreferenced copies freed")
        return True

    def _check_digests(self, rank: int, digests: Mapping[Any, str]) -> None:
        for key, d in digests.items():
            key = (int(key[0]), int(key[1]))
            want = self.digests.get(key)
            if want is not None and want != d:
                raise ValueError(
                    f"parameter_digest: copy of (layer, expert) {key} on rank {rank} has digest {d[:12]}, "
                    f"expected {want[:12]}; not published"
                )

    # ---------------------------------------------------------------- failures
    def remove_ranks(self, dead: Sequence[int], new_group: ProcessGroupSpec) -> ApplyReport:
        """Publish a generation without ``dead`` ranks on the rebuilt group ``new_group``.

        Experts whose only copies lived on dead ranks are re-materialised from the checkpoint (every rank
        can read it); if there is none, ``ExpertUnavailableError`` names the expert and nothing changes.
        """
        with self.lock:
            self.dead_ranks.update(int(r) for r in dead)
            live = list(new_group.peer_order)
            self.planner.require_survivors(self.manifest(), live, can_rebuild=self._has_checkpoint())
            self.group = new_group
            self._changed()
            new = self.propose_without(dead)
            self.log("rank-lost", None, f"ranks {sorted(dead)} removed; group epoch {new_group.epoch}")
            return self.apply(new, reason=f"lost ranks {sorted(dead)}", sources_alive=lambda r: r in live)

    def regroup(self, fleet: Fleet, topology: Topology, group: ProcessGroupSpec, *, rebalance: bool) -> ApplyReport:
        """Switch to a new process group (a rank joined or left; every member's exchange already built for it, no
        step in flight): the active slots of the members, or an EPLB placement over them when ``rebalance`` and
        load was observed, published as a generation of the new group."""
        with self.lock:
            before, active = (self.fleet, self.topology, self.group), self.registry.active()
            self.fleet, self.topology, self.group = fleet, topology, group
            self._changed()
            try:
                if rebalance and len(self.load):
                    return self.apply(self.propose_rebalance(migration_aware=True),
                                      reason=f"regroup to ranks {list(group.peer_order)} + EPLB")
                gone = [r for r in self.manifest().slots_ranks() if r not in group.members]
                return self.apply(self.propose_without(gone), reason=f"regroup to ranks {list(group.peer_order)}")
            except BaseException:
                if self.registry.active() == active:  # nothing published: the prior group serves on
                    self.fleet, self.topology, self.group = before
                    self._changed()
                raise

    def _has_checkpoint(self) -> bool:
        """Seeded weights and a safetensors folder are both checkpoints every rank can read; a deployment can
        declare that it may not rebuild from them (e.g. weights fine-tuned in place)."""
        return self.cfg.rebuild_from_checkpoint


def _ledger_line(plan: MigrationPlan) -> str:
    lg = plan.ledger
    return (f"retain {lg.retained_copies}, same-GPU {lg.same_gpu_copies}, same-node {lg.same_node_copies}, "
            f"cross-node {lg.cross_node_copies}, load {lg.checkpoint_loads}, retire {lg.retired_copies}; "
            f"network {lg.network_bytes} B, peak {lg.peak_bytes} B (analytical)")
