# ======================================================================================================
#  ONE OWNER OF THE DEPLOYMENT: THE COORDINATOR'S RECONCILE LOOP (a thread in the CoordinatorActor)
#
#   asks (Runtime.add_rank / remove_rank), the healer (a rank lost), the scaler (the drivers' load)
#     ──> the target (control/target.py DeploymentTarget) ──> one loop, every wake (an ask, a loss, a tick):
#        health check (a ping per live shard) ──> next_step(target, ranks) until HOLD:
#          REGROUP_DEAD  fence ──> survivors' exchange (epoch + 1) ──> ControlPlane.remove_ranks
#          REMOVE        evacuate (under traffic) ──> fence ──> regroup without it ──> stop it, free its bundle
#          REPLACE/ADD   a shard in a bundle (the lost rank's while its node lives; else a free or fresh one)
#                        ──> topology on every shard ──> fence ──> exchange ──> regroup (EPLB onto it)
#        then the policies: the scaler (its tick), the autopilot (its tick)
#   the fence: every stepping driver quiesces (its follower holds the driver's step gate) before the group changes,
#   and adopts the new MembershipView after (ray/follower.py); drivers never change membership themselves
# ======================================================================================================
"""Reconciler: the deployment's members (ranks, their bundles, the drivers that step them) and the loop that
converges them to the target. Ray Serve's ``deployment_state`` does this for replicas; this is it for ranks."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ray_moe.control.drivers import DriverLoad, DriverRoster
from ray_moe.control.healing import HealPolicy
from ray_moe.control.target import (BundleRef, DeploymentTarget, RankRecord, RankState, ReconcileAction,
                                    live_ranks, next_step)
from ray_moe.core.errors import RequestError
from ray_moe.core.types import ExchangeKind
from ray_moe.model.config import RuntimeConfig
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.ray import members as M
from ray_moe.ray.fleet import RayFleet

HEALTH_S = 2.0  # a ping per live shard this often (a shard that died while no driver stepped is found)
START_S = 120.0  # a new shard's start: its bundle's resources free (a dead process gone), its experts' source read
BUNDLE_WAIT_S = 5.0  # a lost rank's bundle whose node died: how long Ray may take to place it again
DEAD_RETRY_S = 5.0  # regrouping the dead failed (an expert with no copy left): retried this often


@dataclass
class Hooks:
    """What the loop needs from its coordinator: the control plane (None before ``attach``), the durable write,
    the NCCL unique id of an epoch, the autopilot's tick, a timeline line."""

    plane: Callable[[], Any]
    persist: Callable[[], None]
    put_nccl_id: Callable[[int, bytes], None]
    autopilot_tick: Callable[[], Any]
    log: Callable[[str, str], None]


@dataclass
class _Ask:
    kind: ReconcileAction  # ADD or REMOVE
    rank: int | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def answer(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class Reconciler:
    """``detached``: shards it starts outlive their creator (else they share the coordinator's fate: a restarted
    coordinator finds them dead and heals them); ``autoscale``: on a cluster Ray did not start here, a scale-out
    with no room asks the autoscaler for the bundle."""

    def __init__(self, cfg: RuntimeConfig, hooks: Hooks, *, detached: bool = False, autoscale: bool = False) -> None:
        self.cfg, self.hooks, self.detached, self.autoscale = cfg, hooks, detached, autoscale
        self.records: dict[int, RankRecord] = {}
        self.handles: dict[int, Any] = {}
        self.infos: dict[int, dict[str, Any]] = {}  # every rank ever: its node (the topology keeps them all)
        self.bundles = M.Bundles()
        self.topology: Topology | None = None
        self.target = DeploymentTarget(ranks=cfg.num_ranks)
        self.heal = HealPolicy(cfg.heal_retries)
        self.roster = DriverRoster(lease_s=max(30.0, cfg.exchange_timeout_s))
        self.fence_s = max(30.0, cfg.exchange_timeout_s + 10.0)
        self.changes: deque[dict[str, Any]] = deque(maxlen=64)
        self._lock = threading.RLock()
        self._asks: deque[_Ask] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead_error: BaseException | None = None
        self._dead_attempts = 0
        self._dead_retry_at = 0.0
        self._next_health = 0.0
        self._next_autopilot = 0.0
        self.converged = True
        self.scaler = None
        if cfg.scaling.enabled:
            from ray_moe.ray.scaler import RankScaler

            self.scaler = RankScaler.for_reconciler(self, autoscale=autoscale)

    # ================================================================ setup
    def configure(self, *, detached: bool, autoscale: bool) -> None:
        """How the shards it starts live (``detached``) and whether a scale-out may ask the autoscaler."""
        import dataclasses

        from ray_moe.ray.scaler import request_bundles

        self.detached, self.autoscale = bool(detached), bool(autoscale)
        if self.scaler is not None:
            self.scaler.hooks = dataclasses.replace(self.scaler.hooks,
                                                    request=request_bundles if self.autoscale else None)

    def attach(self, handles: dict[int, Any], infos: list[dict[str, Any]], pg: Any, group: ProcessGroupSpec) -> Topology:
        """The start's shards (rank r in bundle r of ``pg``): topology on every shard, the exchange of ``group``."""
        key = self.bundles.add(pg, extra=False) if pg is not None else None
        for info in infos:
            r = int(info["rank"])
            self.infos[r] = {"rank": r, "node_id": info["node_id"]}
            self.records[r] = RankRecord(r, RankState.LIVE, None if key is None else BundleRef(key, r), info["node_id"])
        self.handles = dict(handles)
        self.topology = M.topology_from_nodes(list(self.infos.values()))
        M.set_topology(self.handles, self.topology)
        M.connect_exchange(self.cfg, self.handles, group, self.hooks.put_nccl_id)
        self.target = DeploymentTarget(ranks=len(handles))
        self.roster.epoch = group.epoch
        return self.topology

    def durable(self) -> dict[str, Any]:
        """What a restarted coordinator needs beside its record (pickled with the shard handles)."""
        with self._lock:
            return {"handles": dict(self.handles), "members": {r: rec.as_dict() for r, rec in self.records.items()},
                    "groups": dict(self.bundles.groups), "extra": sorted(self.bundles.extra),
                    "detached": self.detached, "autoscale": self.autoscale}

    def restore(self, blob: Any, topology: Topology, group: ProcessGroupSpec, target_json: str | None) -> None:
        """After a coordinator restart: members from ``blob`` (``durable``; a plain {rank: handle} of an older
        record), nodes from the topology, the target from the record. Shards this coordinator had started die with
        its old process (unless detached): the health check finds them and the loop heals them."""
        if isinstance(blob, dict) and "handles" in blob and "members" in blob:
            self.handles = dict(blob["handles"])
            self.bundles.groups = dict(blob.get("groups", {}))
            self.bundles.extra = set(blob.get("extra", ()))
            self.configure(detached=blob.get("detached", False), autoscale=blob.get("autoscale", False))
            for r, d in blob["members"].items():
                b = d.get("bundle")
                self.records[int(r)] = RankRecord(int(r), RankState(d["state"]), None if b is None else BundleRef(*b),
                                                  d.get("node"), d.get("lineage"), d.get("replaces"),
                                                  bool(d.get("died")))
        else:
            self.handles = dict(blob or {})
            for r in self.handles:
                self.records[int(r)] = RankRecord(int(r), RankState.LIVE)
        for r, rec in self.records.items():  # a change interrupted by the restart: its rank is not a member
            if rec.state is RankState.STARTING or (rec.state is RankState.LIVE and r not in group.peer_order):
                rec.state = RankState.GONE
                M.kill(self.handles.pop(r, None))
        self.infos = M.infos_of(topology)
        self.topology = topology
        if target_json:
            self.target = DeploymentTarget.model_validate_json(target_json)
        self.roster.epoch = group.epoch

    # ================================================================ the loop
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ray-moe-reconcile", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop the loop (a change under way finishes first); pending asks are refused."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)
        with self._lock:
            while self._asks:
                self._asks.popleft().answer(error=RequestError("the deployment is shutting down"))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def wake(self) -> None:
        self._wake.set()

    def _tick_s(self) -> float:
        out = HEALTH_S
        if self.scaler is not None:
            out = min(out, self.scaler.policy.tick_s)
        if self.cfg.eplb.mode.value != "off":
            out = min(out, self.cfg.eplb.tick_s)
        return max(0.05, out)

    def _run(self) -> None:
        next_scale = 0.0
        while not self._stop.is_set():
            self._wake.wait(self._tick_s())
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
                now = time.monotonic()
                if self.scaler is not None and self.converged and now >= next_scale:
                    next_scale = now + self.scaler.policy.tick_s
                    self.scaler.tick()
                if self.converged and now >= self._next_autopilot and self.cfg.eplb.mode.value != "off":
                    self._next_autopilot = now + self.cfg.eplb.tick_s
                    self.hooks.autopilot_tick()
            except Exception as exc:  # noqa: BLE001 - logged; the loop goes on (it never takes its host down)
                self.hooks.log("reconcile-error", f"{type(exc).__name__}: {exc}"[:300])

    def tick(self) -> None:
        """Health, then steps towards the target until HOLD."""
        if self.hooks.plane() is None:
            return
        now = time.monotonic()
        if now >= self._next_health:
            self._next_health = now + HEALTH_S
            self._health()
        self.converge()

    def _health(self) -> None:
        plane = self.hooks.plane()
        with self._lock:
            live = {r: self.handles[r] for r in live_ranks(self.records) if r in self.handles}
        dead = set(M.dead_among(live)) | (set(plane.dead_ranks) & set(live))
        if dead:
            self.found_dead(sorted(dead))

    def found_dead(self, ranks: list[int]) -> None:
        """Ranks seen dead (a driver's step, the health check, a control call): DEAD, and the healer's word."""
        with self._lock:
            for r in ranks:
                rec = self.records.get(int(r))
                if rec is None or rec.state not in (RankState.LIVE, RankState.DRAINING):
                    continue  # (a starting rank's own step handles its failure)
                leaving = rec.state is RankState.DRAINING or r in self.target.remove
                rec.move(RankState.DEAD)
                self.hooks.log("rank-dead", f"rank {r} found dead")
                if leaving:
                    self.target = self.target.changed(remove=tuple(x for x in self.target.remove if x != r),
                                                      set_by="healer", reason=f"rank {r} died while leaving")
                elif not self.heal.lost(r):
                    why = self.heal.events[-1].get("reason", "left out") if self.heal.events else "left out"
                    self.target = self.target.changed(ranks=max(1, self.target.ranks - 1), set_by="healer",
                                                      reason=f"rank {r} lost: {why}")
            self._dead_retry_at = 0.0
        self.hooks.persist()
        self.wake()

    def converge(self, limit: int = 8) -> None:
        """Steps until HOLD (at most ``limit`` per call); each step's outcome answers the asks it was for."""
        for _ in range(limit):
            with self._lock:
                dead_blocked = self._dead_error is not None and time.monotonic() < self._dead_retry_at
                step = next_step(self.target, self.records, replace_due=self.heal.due(),
                                 replace_pending=self.heal.healing, dead_blocked=dead_blocked)
            self.converged = step.action is ReconcileAction.HOLD
            if self.converged:
                return
            t0 = time.monotonic()
            try:
                out = self._do(step)
                self.changes.append({"action": step.action.value, "ranks": list(step.ranks), "reason": step.reason,
                                     "seconds": round(time.monotonic() - t0, 3), **(out or {})})
            except Exception as exc:  # noqa: BLE001 - the step's owner learns why; the loop goes on
                self.changes.append({"action": step.action.value, "ranks": list(step.ranks), "reason": step.reason,
                                     "error": f"{type(exc).__name__}: {exc}"[:300]})
                self.hooks.log("reconcile-failed", f"{step.action.value} {list(step.ranks)}: {exc}"[:300])
            finally:
                self.hooks.persist()

    def _do(self, step) -> dict[str, Any] | None:
        if step.action is ReconcileAction.REGROUP_DEAD:
            return self._regroup_dead(list(step.ranks))
        if step.action is ReconcileAction.REMOVE:
            return self._remove(step.ranks[0])
        if step.action is ReconcileAction.REPLACE:
            return self._replace(step.ranks[0])
        return self._add()

    # ================================================================ the fence
    def _fenced(self):
        loop = self

        class _Fence:
            def __enter__(self):
                self.fence = loop.roster.raise_fence()
                self.evicted = loop.roster.wait_acks(self.fence, loop.fence_s)
                if self.evicted:
                    loop.hooks.log("fence", f"drivers {sorted(self.evicted)} did not quiesce in {loop.fence_s:g}s")
                return self

            def __exit__(self, *exc):
                loop.roster.lower(self.fence, loop.hooks.plane().group.epoch)
                return False

        return _Fence()

    def _next_group(self, members: list[int]) -> ProcessGroupSpec:
        g = self.hooks.plane().group
        return ProcessGroupSpec(group_id=g.group_id, peer_order=tuple(members), epoch=g.epoch + 1)

    def _reconnect(self) -> None:
        """After a change failed past its exchange step: the group that still serves gets its exchange back."""
        try:
            M.connect_exchange(self.cfg, self.handles, self.hooks.plane().group, self.hooks.put_nccl_id)
        except Exception as exc:  # noqa: BLE001 - a member died meanwhile: the health check finds it
            self.hooks.log("reconnect-failed", f"{type(exc).__name__}: {exc}"[:300])

    def _fleet(self, group: ProcessGroupSpec) -> RayFleet:
        return RayFleet({r: self.handles[r] for r in group.peer_order},
                        nccl=self.cfg.exchange_kind is ExchangeKind.NCCL)

    # ================================================================ the steps
    def _regroup_dead(self, dead: list[int]) -> dict[str, Any]:
        plane = self.hooks.plane()
        self._dead_attempts += 1
        try:
            survivors = [r for r in plane.group.peer_order if r not in dead]
            plane.planner.require_survivors(plane.manifest(), survivors, can_rebuild=self.cfg.rebuild_from_checkpoint)
            with self._fenced():
                group = self._next_group(survivors)
                M.connect_exchange(self.cfg, self.handles, group, self.hooks.put_nccl_id)
                plane.fleet = self._fleet(group)
                rep = plane.remove_ranks(dead, group)
                with self._lock:
                    for r in dead:
                        self.records[r].move(RankState.GONE)
                        self.records[r].died = True
                        M.kill(self.handles.pop(r, None))
                    self._dead_error = None
        except BaseException as exc:
            with self._lock:
                self._dead_error, self._dead_retry_at = exc, time.monotonic() + DEAD_RETRY_S
            raise
        return {"generation": rep.new_generation, "epoch": group.epoch}

    def _remove(self, rank: int) -> dict[str, Any]:
        plane = self.hooks.plane()
        ask = self._ask_for(ReconcileAction.REMOVE, rank)
        rec = self.records[rank]
        try:
            rec.move(RankState.DRAINING)
            plane.apply(plane.propose_without([rank]), reason=f"evacuate rank {rank}")  # under traffic
            with self._fenced():
                group = self._next_group([r for r in plane.group.peer_order if r != rank])
                M.connect_exchange(self.cfg, self.handles, group, self.hooks.put_nccl_id)
                try:
                    rep = plane.regroup(self._fleet(group), self.topology, group, rebalance=False)
                except BaseException:
                    self._reconnect()
                    raise
                with self._lock:
                    rec.move(RankState.GONE)
                    M.kill(self.handles.pop(rank, None))
                    self.target = self.target.changed(remove=tuple(x for x in self.target.remove if x != rank),
                                                      set_by="loop", reason=f"rank {rank} removed")
            self.bundles.release(rec.bundle)
        except BaseException as exc:
            with self._lock:
                if rec.state is RankState.DRAINING:
                    rec.move(RankState.LIVE)
                # the ask is not retried: the target goes back to the rank staying
                self.target = self.target.changed(ranks=self.target.ranks + 1,
                                                  remove=tuple(x for x in self.target.remove if x != rank),
                                                  set_by="loop", reason=f"removing rank {rank} failed: {exc}"[:200])
            if ask is not None:
                ask.answer(error=exc)
            raise
        if ask is not None:
            ask.answer(rep.new_generation)
        return {"generation": rep.new_generation, "epoch": group.epoch}

    def _replace(self, lost: int) -> dict[str, Any]:
        ref = self.records[lost].bundle
        try:
            if ref is not None and self.bundles.node_of(ref) is None:  # its node is gone: Ray places it again
                M.wait_for(lambda: self.bundles.node_of(ref) is not None, BUNDLE_WAIT_S, 0.5)
            bundle = ref if ref is not None and self.bundles.node_of(ref) is not None else None
            new = self._join(bundle, replaces=lost, rebalance=True)
        except Exception as exc:
            with self._lock:
                if not self.heal.failed(lost, f"{type(exc).__name__}: {exc}"):
                    self.target = self.target.changed(ranks=max(1, self.target.ranks - 1), set_by="healer",
                                                      reason=f"rank {lost}'s line left out")
            raise
        with self._lock:
            self.heal.started(lost, new)
        return {"rank": new, "replaces": lost, "bundle": self.records[new].bundle.as_list()}

    def _add(self) -> dict[str, Any]:
        ask = self._ask_for(ReconcileAction.ADD)
        try:
            new = self._join(self.free_bundle(), replaces=None,
                             rebalance=self.target.rebalance_on_join)
        except BaseException as exc:
            with self._lock:  # not retried by itself: the target goes back
                self.target = self.target.changed(ranks=max(1, self.target.ranks - 1), set_by="loop",
                                                  reason=f"adding a rank failed: {exc}"[:200])
            if ask is not None:
                ask.answer(error=exc)
            raise
        if ask is not None:
            ask.answer(new)
        return {"rank": new, "bundle": self.records[new].bundle.as_list()}

    def free_bundle(self) -> BundleRef | None:
        """A bundle of the start's placement group that no rank holds, on a live node (a removed rank's)."""
        held = {rec.bundle for rec in self.records.values() if rec.state is not RankState.GONE}
        for rec in self.records.values():
            b = rec.bundle
            if b is not None and b not in held and b.group not in self.bundles.extra and self.bundles.node_of(b):
                return b
        return None

    def _join(self, bundle: BundleRef | None, *, replaces: int | None, rebalance: bool) -> int:
        """A new rank in ``bundle`` (None: a fresh one-bundle group), joined to the group; returns its rank."""
        plane = self.hooks.plane()
        rank = max(self.infos, default=-1) + 1
        fresh = bundle is None
        if fresh:
            bundle = self.bundles.fresh(self.cfg, f"{M.pg_name(self.cfg.name)}-rank{rank}", detached=self.detached,
                                        timeout_s=START_S)
        try:
            handle, info = M.start_shard(self.cfg, rank, self.bundles.groups[bundle.group], bundle.index,
                                         detached=self.detached, timeout_s=START_S)
        except BaseException:
            if fresh:
                self.bundles.release(bundle)
            raise
        lineage = None if replaces is None else self.heal.lineage(replaces)
        with self._lock:
            self.records[rank] = RankRecord(rank, RankState.STARTING, bundle, info["node_id"], lineage, replaces)
            self.handles[rank] = handle
            self.infos[rank] = {"rank": rank, "node_id": info["node_id"]}
            self.topology = M.topology_from_nodes(list(self.infos.values()), version=f"topology-v{rank}")
        try:
            M.set_topology({r: self.handles[r] for r in [*plane.group.peer_order, rank] if r in self.handles},
                           self.topology)
            with self._fenced():
                group = self._next_group([*plane.group.peer_order, rank])
                M.connect_exchange(self.cfg, self.handles, group, self.hooks.put_nccl_id)
                try:
                    plane.regroup(self._fleet(group), self.topology, group, rebalance=rebalance)
                except BaseException:
                    self._reconnect()
                    raise
                with self._lock:
                    self.records[rank].move(RankState.LIVE)
        except BaseException:
            with self._lock:
                self.records[rank].move(RankState.GONE)
                M.kill(self.handles.pop(rank, None))
            if fresh:
                self.bundles.release(bundle)
            raise
        return rank

    # ================================================================ asks (callers set the target, then wait)
    def ask_add(self, *, rebalance: bool = True, set_by: str = "caller", timeout_s: float = 600.0) -> int:
        """One more rank (the target + 1); returns its rank once it serves."""
        with self._lock:
            self.target = self.target.changed(ranks=self.target.ranks + 1, rebalance_on_join=bool(rebalance),
                                              set_by=set_by, reason="add a rank")
            ask = _Ask(ReconcileAction.ADD)
            self._asks.append(ask)
        return self._wait(ask, timeout_s)

    def ask_remove(self, rank: int, *, set_by: str = "caller", timeout_s: float = 600.0) -> int:
        """``rank`` out (drained, then stopped; the target - 1); returns the generation published without it."""
        with self._lock:
            group = list(self.hooks.plane().group.peer_order)
            live = [r for r in group if self.records.get(r) and self.records[r].state is RankState.LIVE]
            if rank not in live or rank in self.target.remove:
                raise RequestError(f"rank={rank} is not a live member of the group {group}")
            if len(live) == 1:
                raise RequestError(f"rank={rank} is the last rank; shut the deployment down instead")
            self.target = self.target.changed(ranks=max(1, self.target.ranks - 1), remove=(*self.target.remove, rank),
                                              set_by=set_by, reason=f"remove rank {rank}")
            ask = _Ask(ReconcileAction.REMOVE, rank)
            self._asks.append(ask)
        return self._wait(ask, timeout_s)

    def _wait(self, ask: _Ask, timeout_s: float) -> Any:
        self.hooks.persist()
        if threading.current_thread() is self._thread:  # the scaler, inside the loop: converge now
            self.converge()
        else:
            self.wake()
        if not ask.done.wait(timeout_s):
            raise TimeoutError(f"{ask.kind.value}: the deployment did not converge within {timeout_s:g}s")
        if ask.error is not None:
            raise ask.error
        return ask.result

    def _ask_for(self, kind: ReconcileAction, rank: int | None = None) -> _Ask | None:
        with self._lock:
            for ask in self._asks:
                if ask.kind is kind and (rank is None or ask.rank == rank):
                    self._asks.remove(ask)
                    return ask
        return None

    # ================================================================ drivers
    def watch(self, driver: str, known_epoch: int, load: DriverLoad | None, stepping: bool,
              timeout_s: float) -> dict[str, Any]:
        """A driver's poll: its load and whether it steps; back when it must quiesce (``fence``), when the
        membership moved past ``known_epoch`` (``view``), or after ``timeout_s``."""
        self.roster.heard(driver, load=load, stepping=stepping)
        out = self.roster.wait(driver, known_epoch, timeout_s)
        if out.get("fence") is None and out["epoch"] > known_epoch:
            out["view"] = self.view()
        return out

    def fence_ack(self, driver: str, fence_id: int, timeout_s: float = 600.0) -> M.MembershipView:
        """``driver`` holds its step gate: wait until the change is done; the membership to adopt."""
        self.roster.ack(driver, fence_id)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.roster.wait(driver, 0, min(5.0, max(0.0, deadline - time.monotonic())),
                                    fence_id=fence_id).get("timeout"):
                break
        return self.view()

    def rank_lost(self, driver: str, ranks: list[int], timeout_s: float = 600.0) -> M.MembershipView:
        """A driver's step found ``ranks`` dead (it holds its step gate meanwhile): they are regrouped away before
        this returns the membership to adopt; a regroup that cannot be done (an expert with no copy left) raises."""
        self.roster.quiesced(driver, True)
        try:
            with self._lock:
                seq = self._dead_attempts
            self.found_dead(list(ranks))
            deadline = time.monotonic() + timeout_s
            while True:
                with self._lock:
                    pending = [r for r in ranks if self.records.get(int(r)) is not None
                               and self.records[int(r)].state is not RankState.GONE]
                    err = self._dead_error if self._dead_attempts > seq else None
                if not pending and self.roster.fence_status() is None:
                    return self.view()
                if pending and err is not None:
                    raise err
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {pending} were not regrouped away within {timeout_s:g}s")
                time.sleep(0.02)
        finally:
            self.roster.quiesced(driver, False)

    def view(self) -> M.MembershipView:
        plane = self.hooks.plane()
        with self._lock:
            group = plane.group
            return M.MembershipView(
                epoch=group.epoch, handles={r: self.handles[r] for r in group.peer_order if r in self.handles},
                group_json=group.model_dump_json(), topology_json=self.topology.model_dump_json(),
                generation=plane.active_generation(),
                lost=tuple(sorted(r for r, rec in self.records.items() if rec.died)))

    # ================================================================ status
    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"target": self.target.model_dump(mode="json"),
                    "members": {str(r): rec.as_dict() for r, rec in sorted(self.records.items())},
                    "converged": self.converged, "running": self.running, "healer": self.heal.status(),
                    "scaler": None if self.scaler is None else self.scaler.status(),
                    "drivers": self.roster.drivers(), "fence": self.roster.fence_status(),
                    "changes": list(self.changes)[-8:]}

    def owned(self) -> tuple[dict[int, Any], list[Any]]:
        """Every shard handle it holds and every placement group (teardown)."""
        with self._lock:
            return dict(self.handles), list(self.bundles.groups.values())


__all__ = ["Hooks", "Reconciler"]
