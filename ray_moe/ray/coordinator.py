"""CoordinatorActor: named, one per deployment: the deployment's one owner. A thin shell over ``ControlPlane``
(placement generations, refcount fences, digests, the load window, the control timeline) and ``Reconciler``
(``reconciler.py``: the members, their placement-group bundles, the target and the one loop that converges to it;
the healer, the scaler and the autopilot are policies that loop runs). It is never on the per-token path: drivers
ask it for the active generation only when a shard tells them theirs went stale, and follow its membership
(``watch`` / ``fence_ack`` / ``rank_lost``: ``follower.py``); ``add_rank`` / ``remove_rank`` only set a new target.

It survives being killed: Ray restarts it (``max_restarts=-1``) and its ``__init__`` rebuilds the
control plane from the shards' registry mirrors plus a durable record it writes to Ray's GCS KV on
every change (``DurableStore``; what is in it and how the rebuild decides: ``recovery.py``). Reads
are retried by Ray across a restart (``max_task_retries``); so are ``scale`` and ``rebalance``, which
are declarative (a target replica count; a placement for the current load): the rebuild first
completes or abandons the interrupted attempt, the retry then runs once more.

With ``cfg.eplb.mode`` not OFF the autopilot (``control/autopilot.py``) evaluates its policy every ``eplb.tick_s``
seconds on the reconcile loop and takes ``rebalance()``'s path when it says so; decisions: ``status()``, Prometheus.

Every elastic operation runs its stages within ``cfg.deadlines`` (``control/operations.py``): shard calls wait
with ``ray.wait(refs, timeout=...)`` (``fleet.py``), so a hung shard aborts the operation instead of hanging
this actor; ``status()["operation"]`` shows the one in flight (stage, elapsed, bytes copied) and the last ones.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
import warnings
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import ray

from ray_moe.control.autopilot import Autopilot, AutopilotEvent, EplbMode
from ray_moe.control.plane import ControlPlane
from ray_moe.control.restore import restore_plane
from ray_moe.control.recovery import DurableRecord, load_summary, registry_from_bytes, registry_state_bytes
from ray_moe.model.config import RuntimeConfig
from ray_moe.core.types import ExchangeKind, ReleaseState
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.ray.durable import DurableStore
from ray_moe.ray.fleet import RayFleet
from ray_moe.ray.reconciler import Hooks, Reconciler
from ray_moe.ray.prometheus import AutopilotExporter

if TYPE_CHECKING:
    from ray_moe.release.bundle import ReleaseBundle
    from ray_moe.release.lifecycle import ReleaseRecord, ReleaseRegistry, TransitionEvent, Verdict


def coordinator_name(deployment: str) -> str:
    return f"ray-moe-coordinator-{deployment}"


_LOAD_PERSIST_S = 5.0  # the load window (summed) is written at most every 5 s: it only steers EPLB


def _retried(fn):
    """Ray retries this method across a coordinator restart instead of failing the caller. Only for methods
    that are safe to run again: reads, idempotent writes, and declarative operations (the result depends on
    the arguments and the current state, not on how many times it ran)."""
    return ray.method(max_task_retries=-1)(fn)


class CoordinatorActor:
    def __init__(self, cfg_json: str, namespace: str | None = None) -> None:
        self.cfg = RuntimeConfig.model_validate_json(cfg_json)
        self.plane: ControlPlane | None = None
        self.nccl_ids: dict[int, bytes] = {}
        self.extra: dict[str, Any] = {}
        self.restarts = 0
        self.rebuild_error: str | None = None
        self.store: DurableStore | None = None
        self.actor_id: str | None = None
        self._persist_lock = threading.Lock()
        self._load_written = 0.0
        self.autopilot = Autopilot(self.cfg.eplb)  # automatic rebalance: load steps, decisions, last rebalance
        self._rebalance_lock = threading.Lock()  # one rebalance at a time (manual or automatic)
        self._autopilot_metrics: Any = None
        # the deployment's members and the one loop that reconciles them to the target (it ticks the autopilot)
        self.members = Reconciler(self.cfg, Hooks(plane=lambda: self.plane, persist=lambda: self._persist(handles=True),
                                                  put_nccl_id=self._put_nccl_id, autopilot_tick=self._autopilot_tick,
                                                  log=lambda event, detail: self.log(event, None, detail)))
        if namespace is None or not ray.is_initialized():
            return  # constructed outside a Ray actor (tools, tests): no durable record
        ctx = ray.get_runtime_context()
        self.actor_id = ctx.get_actor_id()
        if self.actor_id is None:
            return
        self.store = DurableStore(namespace, self.cfg.name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            restarted = ctx.was_current_actor_reconstructed
        if restarted:
            self._rebuild()
            self.autopilot.rebalanced(0)  # hysteresis across a restart: the interval starts again
        else:
            self.store.clear()  # a record of an earlier deployment under this name is not ours
            self._persist()

    # ---------------------------------------------------------------- durability
    def _persist(self, *, handles: bool = False) -> None:
        """Write the durable record (and the shard handles when they changed). Never fails an operation:
        a failed write is logged on the timeline."""
        if self.store is None:
            return
        try:
            with self._persist_lock:
                plane = self.plane
                topo = self.members.topology
                rec = DurableRecord(
                    deployment=self.cfg.name, actor_id=self.actor_id, restarts=self.restarts,
                    topology_json=None if topo is None else topo.model_dump_json(),
                    group_json=None if plane is None else plane.group.model_dump_json(),
                    nccl_ids={int(k): v.hex() for k, v in dict(self.nccl_ids).items()},
                    plane=None if plane is None else plane.durable_state(),
                    target_json=self.members.target.model_dump_json(), updated_at=time.time())
                self.store.put("record", rec.model_dump_json().encode())
                if handles:
                    self.store.put("handles", pickle.dumps(self.members.durable()))
        except Exception as exc:  # noqa: BLE001
            if self.plane is not None:
                self.plane.log("durable-write-failed", None, f"{type(exc).__name__}: {exc}")

    def _persist_load(self, force: bool = False) -> None:
        if self.store is None or self.plane is None:
            return
        now = time.monotonic()
        if not force and now - self._load_written < _LOAD_PERSIST_S:
            return
        self._load_written = now
        try:
            import json

            self.store.put("load", json.dumps(load_summary(self.plane.load.observations())).encode())
        except Exception:  # noqa: BLE001 - the load window only steers EPLB
            pass

    def _persist_releases(self) -> None:
        if self.store is None or "releases" not in self.extra:
            return
        try:
            self.store.put("releases", registry_state_bytes(self.extra["releases"]))
        except Exception as exc:  # noqa: BLE001
            if self.plane is not None:
                self.plane.log("durable-write-failed", None, f"releases: {type(exc).__name__}: {exc}")

    def _rebuild(self) -> None:
        """After a restart: the record, handles, releases and load from the KV; generations, states,
        manifests and refcounts from the shards (``restore.restore_plane``)."""
        import json
        import traceback

        try:
            rec = self.store.record()
            if rec is None or rec.actor_id != self.actor_id:
                self.rebuild_error = "no durable record of this coordinator; nothing to rebuild"
                self._persist()
                return
            self.restarts = rec.restarts + 1
            self.nccl_ids = {int(k): bytes.fromhex(v) for k, v in rec.nccl_ids.items()}
            raw = self.store.get("handles")
            blob = pickle.loads(raw) if raw else {}
            raw = self.store.get("releases")
            if raw:
                from ray_moe.release.lifecycle import ReleaseRegistry

                self.extra["releases"] = registry_from_bytes(ReleaseRegistry, raw)
            if rec.plane is not None and rec.group_json is not None and blob and rec.topology_json:
                raw = self.store.get("load")
                topology = Topology.model_validate_json(rec.topology_json)
                group = ProcessGroupSpec.model_validate_json(rec.group_json)
                self.members.restore(blob, topology, group, rec.target_json)
                fleet = {r: h for r, h in self.members.handles.items() if r in group.peer_order}
                self.plane = restore_plane(
                    self.cfg, RayFleet(fleet, nccl=self.cfg.exchange_kind is ExchangeKind.NCCL), topology, group,
                    rec.plane, load_rows=json.loads(raw) if raw else ())
                self.plane.on_change = self._persist
                self.members.start()
            self._persist(handles=True)
        except Exception as exc:  # noqa: BLE001 - an __init__ that raises would leave the deployment without one
            self.rebuild_error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
            self.plane = None

    # ---------------------------------------------------------------- setup
    def attach(self, handles: Mapping[int, Any], infos: Sequence[Mapping[str, Any]], pg: Any, expert_bytes: int,
               *, detached: bool = False, autoscale: bool = False) -> None:
        """The start's shards (rank r in bundle r of ``pg``; ``infos``: where each runs): the topology on every
        shard, the exchange of group epoch 0, the control plane. ``detached``: shards started later outlive their
        creator too; ``autoscale``: a cluster's autoscaler may be asked for bundles."""
        if self.plane is not None:
            raise RuntimeError(f"deployment {self.cfg.name!r} already has shards attached")
        self.members.configure(detached=detached, autoscale=autoscale)
        group = ProcessGroupSpec(group_id="ep-group-0", peer_order=tuple(sorted(handles)), epoch=0)
        topology = self.members.attach(dict(handles), list(infos), pg, group)
        self.plane = ControlPlane(self.cfg, RayFleet(dict(handles), nccl=self.cfg.exchange_kind is ExchangeKind.NCCL),
                                  topology, group)
        self.plane.set_expert_bytes(expert_bytes)
        self.plane.on_change = self._persist
        self._persist(handles=True)

    def deploy(self) -> int:
        """Generation 0; then the reconcile loop runs."""
        g = self._plane().deploy_initial()
        self.members.start()
        return g

    def _put_nccl_id(self, epoch: int, uid: bytes) -> None:
        self.nccl_ids[int(epoch)] = uid
        self._persist()

    def _plane(self) -> ControlPlane:
        if self.plane is None:
            why = f" (coordinator restart could not rebuild: {self.rebuild_error})" if self.rebuild_error else ""
            raise RuntimeError(f"deployment {self.cfg.name!r} has no shards attached{why}")
        return self.plane

    @_retried
    def config_json(self) -> str:
        return self.cfg.model_dump_json()

    @_retried
    def shard_handles(self) -> dict[int, Any]:
        return dict(self.members.handles)

    @_retried
    def group_json(self) -> str:
        return self._plane().group.model_dump_json()

    @_retried
    def topology(self) -> str | None:
        topo = self.members.topology
        return None if topo is None else topo.model_dump_json()

    @_retried
    def put_nccl_id(self, epoch: int, uid: bytes) -> None:
        self._put_nccl_id(epoch, uid)

    @_retried
    def nccl_id(self, epoch: int) -> bytes | None:
        return self.nccl_ids.get(epoch)

    @_retried
    def is_deployed(self) -> bool:
        return self.plane is not None and self.plane.active_generation() is not None

    # ---------------------------------------------------------------- queries
    @_retried
    def active_generation(self) -> int | None:
        return self._plane().active_generation()

    @_retried
    def manifest_json(self, generation: int | None = None) -> str:
        return self._plane().manifest(generation).model_dump_json()

    @_retried
    def refcounts(self) -> dict[int, int]:
        return self._plane().refcounts()

    @_retried
    def generations(self) -> dict[int, str]:
        return self._plane().generation_states()

    @_retried
    def timeline(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(e) for e in self._plane().timeline()]

    @_retried
    def retired_with_refcount(self) -> list[tuple[int, int]]:
        return list(self._plane().retired_with_refcount)

    @_retried
    def floors(self) -> list[dict[str, int]]:
        """Replica floors set by manual ``scale`` calls: [{layer, expert, replicas}] (EPLB keeps them)."""
        return self._plane().floor_list()

    @_retried
    def status(self) -> dict[str, Any]:
        """One JSON-able view for ``ray-moe status``: generations, floors, restarts, the last rebuild, the elastic
        operation in flight and the last ones (``operation``) and the autopilot (``eplb``). Never waits on an
        operation: it answers while one runs."""
        plane = self.plane
        out: dict[str, Any] = {"deployment": self.cfg.name, "restarts": self.restarts, "durable": self.store is not None,
                               "rebuild_error": self.rebuild_error}
        if plane is not None:
            out.update(active=plane.active_generation(), generations=plane.generation_states(),
                       floors=plane.floor_list(), group=list(plane.group.peer_order), group_epoch=plane.group.epoch,
                       dead_ranks=sorted(plane.dead_ranks), rebuild=plane.rebuild_report)
            out["operation"] = plane.ops.status(4)  # in flight (stage, elapsed, bytes copied), the last 4 ended
        out["eplb"] = self.autopilot.status(8)  # mode, policy, last rebalance, the last 8 decisions
        out["eplb"]["running"] = self.members.running and self.cfg.eplb.mode is not EplbMode.OFF  # (the loop ticks it)
        out.update(self.members.status())  # target, members, healer, scaler, drivers, fence, recent changes
        return out

    @_retried  # a batch in flight at the kill may count twice; losing every batch of the restart is worse
    def record_load(self, counts: Any, phase: str, generation: int) -> None:
        self._plane().record_load(counts, phase=phase, generation=generation)
        self.autopilot.observe_step()
        self._persist_load()

    @_retried
    def load_matrix(self) -> Any:
        lm = self._plane().load.snapshot()
        return {"weight": lm.weight, "provenance": lm.provenance.model_dump(mode="json")}

    @_retried
    def put(self, key: str, value: Any) -> None:
        """Small shared records (telemetry snapshots from drivers, release records)."""
        self.extra[key] = value

    @_retried
    def get(self, key: str) -> Any:
        return self.extra.get(key)

    @_retried
    def telemetry_snapshots(self) -> list[str]:
        return [v for k, v in sorted(self.extra.items()) if k.startswith("telemetry/")]

    # ---------------------------------------------------------------- elastic operations
    @_retried  # declarative: retried once the restarted coordinator finished or undid the first attempt
    def scale(self, expert: int, replicas: int, layer: int | None = None) -> dict[str, Any]:
        plane = self._plane()
        b0 = plane.fleet.bytes_copied
        out = _report(plane.scale(expert, replicas, layer))
        out["copied_bytes"] = plane.fleet.bytes_copied - b0
        out["floors"] = plane.floor_list()
        return out

    @_retried  # declarative, as scale
    def rebalance(self, migration_aware: bool = True) -> dict[str, Any]:
        with self._rebalance_lock:
            return self._rebalance(migration_aware, reason="EPLB rebalance")

    def _rebalance(self, migration_aware: bool, reason: str) -> dict[str, Any]:
        """EPLB, published live (caller holds ``_rebalance_lock``); ``publish_s``: solve to publish, drain not counted."""
        plane = self._plane()
        t0 = time.perf_counter()
        new = plane.propose_rebalance(migration_aware=migration_aware)
        b0 = plane.fleet.bytes_copied
        out = _report(rep := plane.apply(new, reason=reason))
        out["copied_bytes"] = plane.fleet.bytes_copied - b0
        out["publish_s"] = time.perf_counter() - t0 - rep.timings_s.get("drain_retire", 0.0)
        self.autopilot.rebalanced()
        return out

    @_retried
    def autopilot_history(self, last: int | None = None) -> list[dict[str, Any]]:
        return self.autopilot.history(last)  # the autopilot's decisions, oldest first, as JSON-able dicts

    def _autopilot_tick(self) -> AutopilotEvent | None:
        """One evaluation (``Autopilot.tick``) under the rebalance lock; every event goes to the metrics."""
        with self._rebalance_lock:
            event = self.autopilot.tick(self.plane, lambda why: self._rebalance(True, reason=why))
        try:
            if event is not None:
                self._autopilot_metrics = self._autopilot_metrics or AutopilotExporter()  # Ray metrics, lazily
                self._autopilot_metrics.record(self.cfg.name, event)
        except Exception:  # noqa: BLE001 - metrics never fail a decision
            pass
        return event

    def apply_manifest(self, manifest_json: str, reason: str) -> dict[str, Any]:
        from ray_moe.placement.manifest import PlacementManifest

        return _report(self._plane().apply(PlacementManifest.model_validate_json(manifest_json), reason=reason))

    # ---------------------------------------------------------------- membership (the reconcile loop's)
    @_retried
    def view(self):
        """The membership drivers step with (``MembershipView``)."""
        return self.members.view()

    def add_rank(self, rebalance: bool = True, timeout_s: float = 600.0) -> int:
        """A new target (one more rank); returns the new rank once it serves (not retried: it is not idempotent)."""
        return self.members.ask_add(rebalance=rebalance, timeout_s=timeout_s)

    def remove_rank(self, rank: int, timeout_s: float = 600.0) -> int:
        """A new target without ``rank``; returns the generation published without it."""
        return self.members.ask_remove(int(rank), timeout_s=timeout_s)

    @_retried  # a driver's report: idempotent (a rank already known dead or gone is not taken twice)
    def rank_lost(self, driver: str, ranks: Sequence[int], timeout_s: float = 600.0):
        return self.members.rank_lost(driver, [int(r) for r in ranks], timeout_s)

    def watch(self, driver: str, known_epoch: int, load: Any = None, stepping: bool = False,
              timeout_s: float = 1.0) -> dict[str, Any]:
        return self.members.watch(driver, int(known_epoch), load, bool(stepping), float(timeout_s))

    @_retried
    def fence_ack(self, driver: str, fence_id: int, timeout_s: float = 600.0):
        return self.members.fence_ack(driver, int(fence_id), timeout_s)

    def leave(self, driver: str) -> None:
        self.members.roster.leave(driver)

    def stop_members(self) -> tuple[dict[int, Any], list[Any]]:
        """Stop the reconcile loop (teardown); every shard handle and placement group it holds."""
        self.members.stop()
        return self.members.owned()

    def drain_and_retire(self, generation: int, timeout_s: float = 60.0) -> bool:
        return self._plane().drain_and_retire(generation, timeout_s=timeout_s)

    # ---------------------------------------------------------------- candidates (releases in flight)
    def stage(self, kind: str, expert: int | None = None, replicas: int | None = None,
              manifest_json: str | None = None) -> dict[str, Any]:
        """Plan, materialise and verify a candidate generation without publishing it; it may then serve
        steps that name it (shadow / canary). ``kind``: scale | rebalance | manifest."""
        plane = self._plane()
        if kind == "scale":
            new = plane.propose_scale(int(expert), int(replicas))
        elif kind == "rebalance":
            new = plane.propose_rebalance(migration_aware=True)
        elif kind == "manifest":
            from ray_moe.placement.manifest import PlacementManifest

            new = PlacementManifest.model_validate_json(manifest_json)
        else:
            raise ValueError(f"kind={kind!r} is not one of scale, rebalance, manifest")
        rep = plane.stage(new, reason=f"candidate ({kind})", serve_candidate=True)
        out = _report(rep)
        out["manifest_json"] = new.model_dump_json()
        return out

    def promote(self, generation: int, retire_prior: bool = False) -> int | None:
        return self._plane().promote(generation, retire_prior=retire_prior)

    @_retried
    def stop_dispatch(self, generation: int) -> None:
        self._plane().stop_dispatch(generation)

    @_retried
    def activate(self, generation: int) -> None:
        self._plane().activate(generation)

    @_retried
    def release_graphs(self, generation: int) -> int:
        return self._plane().release_graphs(generation)

    @_retried
    def shard_refcount(self, generation: int) -> int:
        return self._plane().shard_refcount(generation)

    def inject_fault(self, rank: int, kind: str, count: int = 1, generation: int | None = None) -> None:
        ray.get(self.members.handles[rank].inject_fault.remote(kind, count, generation))
        self._plane().log("fault-armed", generation, f"{kind} x{count} on rank {rank}")

    def log(self, event: str, generation: int | None, detail: str) -> None:
        self._plane().log(event, generation, detail)

    # ---------------------------------------------------------------- release lifecycle (owned here)
    # The ``ReleaseRegistry`` lives here; every write is in the durable record before the call returns, and
    # only reads are retried across a restart (a write such as a transition must not run twice).
    def _releases(self) -> ReleaseRegistry:
        from ray_moe.release.lifecycle import ReleaseRegistry

        if "releases" not in self.extra:
            self.extra["releases"] = ReleaseRegistry()
        return self.extra["releases"]

    @contextmanager
    def _release_write(self) -> Iterator[ReleaseRegistry]:
        try:
            yield self._releases()
        finally:
            self._persist_releases()

    def register_release(self, bundle: ReleaseBundle, reason: str = "built") -> ReleaseRecord:
        with self._release_write() as reg:
            return reg.register(bundle, reason)

    def transition_release(self, release_id: str, dst: ReleaseState, reason: str) -> ReleaseRecord:
        with self._release_write() as reg:
            return reg.transition(release_id, dst, reason)

    def begin_canary(self, release_id: str, fraction: float, reason: str = "shadow gate passed") -> ReleaseRecord:
        with self._release_write() as reg:
            return reg.begin_canary(release_id, fraction, reason)

    def set_canary_fraction(self, release_id: str, fraction: float) -> None:
        with self._release_write() as reg:
            reg.set_canary_fraction(release_id, fraction)

    def promote_release(self, release_id: str, verdict: Verdict) -> str | None:
        with self._release_write() as reg:
            return reg.promote(release_id, verdict)

    def stop_release_dispatch(self, release_id: str) -> None:
        with self._release_write() as reg:
            reg.stop_new_dispatch(release_id)

    def activate_release(self, release_id: str) -> None:
        with self._release_write() as reg:
            reg.activate(release_id)

    def retire_release(self, release_id: str) -> None:
        with self._release_write() as reg:
            reg.retire(release_id)

    @_retried
    def release_record(self, release_id: str) -> ReleaseRecord:
        return self._releases().get(release_id)

    @_retried
    def release_records(self) -> tuple[ReleaseRecord, ...]:
        return self._releases().records()

    @_retried
    def release_timeline(self) -> tuple[TransitionEvent, ...]:
        return self._releases().timeline()

    @_retried
    def active_release(self) -> str | None:
        return self._releases().active()

    @_retried
    def candidate_release(self) -> str | None:
        return self._releases().candidate()


def _report(rep) -> dict[str, Any]:
    out = {
        "old_generation": rep.old_generation,
        "new_generation": rep.new_generation,
        "reason": rep.reason,
        "copies": rep.copies,
        "loads": rep.loads,
        "drained_s": rep.drained_s,
        "retired": rep.retired,
        "timings_s": rep.timings_s,
    }
    if rep.plan is not None:
        out["ledger"] = rep.plan.ledger.model_dump(mode="json")
    return out


def coordinator_class():
    """Restartable (``max_restarts=-1``): a restart rebuilds the coordinator's state (see ``_rebuild``)."""
    return ray.remote(max_concurrency=32, max_restarts=-1)(CoordinatorActor)
