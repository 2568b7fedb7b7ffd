"""Starting a deployment all or nothing, and tearing it down (the Ray side of ``Runtime.start/shutdown``).

``Runtime.start`` runs, in order:

1. **validate in the driver**, before any actor exists: the config, and the checkpoint through the same
   weight source every shard builds (``weight_source(cfg)``); a ``ConfigError`` propagates unwrapped.
2. **claim the name**: a live, deployed coordinator under the name is an error ("already running; use
   Runtime.connect"); so is a never-deployed one whose driver job is alive (a start in progress). A dead
   or dying one, or a never-deployed one left by a job that is gone (a crashed start), is killed
   together with the shards it knows and the placement groups named after the deployment, and the name
   is waited free. A coordinator is never reused.
3. **create**, recording every actor and placement group made: coordinator (restartable; its name is
   the lock a concurrent start of the same name runs into), placement group (waited for at most
   ``timeout_s``; when resources are short the error names what is missing and which placement groups
   hold it), shard actors, topology, exchange, attach, generation 0.
4. on **any** failure after step 2: kill the shards and the coordinator, remove the placement group,
   delete the durable record, wait until the coordinator's name is free and the actors are dead, and
   raise ``DeploymentStartError`` (``ResourcesUnavailableError`` for resources) naming the stage and the
   root cause (``__cause__``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_moe.ray.coordinator import coordinator_class, coordinator_name
from ray_moe.ray.durable import DurableStore
from ray_moe.ray.members import PG_PREFIX, pg_name, shard_bundle
from ray_moe.ray.shard_actor import shard_actor_class
from ray_moe.model.config import RuntimeConfig
from ray_moe.core.errors import (
    ConfigError,
    DeploymentExistsError,
    DeploymentStartError,
    ResourcesUnavailableError,
    root_cause,
)

DEFAULT_START_TIMEOUT_S = 60.0


# ================================================================ 1. validation (driver, no actors)
def validate_start(cfg: Any) -> tuple[RuntimeConfig, Any]:
    """(config re-validated, its weight source): the checkpoint is read in the driver (headers only) by the
    weight source the shards are then given. Raises ``ConfigError``; one from the weight source propagates
    unchanged, any other checkpoint failure is wrapped in one naming the folder."""
    from ray_moe.model.source import weight_source

    if isinstance(cfg, Mapping):
        try:
            cfg = RuntimeConfig.model_validate(dict(cfg))
        except ValueError as exc:
            raise ConfigError(f"config: {exc}") from None
    if not isinstance(cfg, RuntimeConfig):
        raise ConfigError(f"cfg: expected a RuntimeConfig, got {type(cfg).__name__}")
    try:
        RuntimeConfig.model_validate_json(cfg.model_dump_json())  # a model_construct()ed config is checked too
    except ValueError as exc:
        raise ConfigError(f"config: {exc}") from None
    try:
        source = weight_source(cfg, validate=True)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001
        where = f"checkpoint={cfg.checkpoint!r}" if cfg.checkpoint else "weight source"
        raise ConfigError(f"{where}: {type(exc).__name__}: {exc}") from exc
    return cfg, source


# ================================================================ actor / placement-group bookkeeping
def _actor_state(handle: Any) -> str | None:
    """ALIVE / RESTARTING / DEAD / PENDING_CREATION / DEPENDENCIES_UNREADY from the GCS, or None."""
    try:
        from ray._private import state

        info = state.actors(handle._actor_id.hex())
        return info.get("State") if info else None
    except Exception:  # noqa: BLE001 - private API: absence only costs a probe
        return None


def _owner_job(handle: Any) -> tuple[str | None, bool]:
    """(job id that created the actor, whether that job is still running); (None, False) when unknown."""
    try:
        from ray._private import state

        job = (state.actors(handle._actor_id.hex()) or {}).get("JobID")
        for j in state.jobs():
            if j.get("JobID") == job:
                return job, not j.get("IsDead", True)
        return job, False
    except Exception:  # noqa: BLE001 - private API
        return None, False


def wait_name_free(name: str, namespace: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def wait_dead(handles: list[Any], timeout_s: float) -> list[Any]:
    """Wait until the GCS reports every actor DEAD; returns those still not dead at the deadline."""
    deadline = time.monotonic() + timeout_s
    left = list(handles)
    while left and time.monotonic() < deadline:
        left = [h for h in left if _actor_state(h) not in ("DEAD", None)]
        if left:
            time.sleep(0.05)
    return left


def deployment_pgs(deployment: str) -> list[dict[str, Any]]:
    """Placement groups (not removed) named after ``deployment``: the start's, and the one-bundle groups its
    coordinator's loop created since (``<name>-rank<r>``)."""
    try:
        table = placement_group_table()
    except Exception:  # noqa: BLE001
        return []
    name = pg_name(deployment)
    return [p for p in table.values() if p.get("state") != "REMOVED"
            and (p.get("name") == name or (p.get("name") or "").startswith(name + "-rank"))]


def remove_pg_id(pg_id: str) -> None:
    from ray.util.placement_group import PlacementGroup

    try:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    except Exception:  # noqa: BLE001
        pass


def teardown(deployment: str, namespace: str, *, coordinator: Any = None, shards: Mapping[int, Any] | None = None,
             pgs: list[Any] = (), wait_s: float = 30.0, named_pgs: bool = True, clear_record: bool = True) -> None:
    """Kill the shards and the coordinator (no restart), remove the placement groups (``pgs`` and, with
    ``named_pgs``, every one named after the deployment), delete the durable record (``clear_record``), and
    wait until the coordinator's name is free and the actors are dead (bounded by ``wait_s``)."""
    handles = list((shards or {}).values())
    for h in handles:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
    if coordinator is not None:
        try:
            ray.kill(coordinator, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
    for pg in pgs:
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
    if named_pgs:
        for p in deployment_pgs(deployment):
            remove_pg_id(p["placement_group_id"])
    if clear_record:
        try:
            DurableStore(namespace, deployment).clear()
        except Exception:  # noqa: BLE001
            pass
    deadline = time.monotonic() + wait_s
    wait_name_free(coordinator_name(deployment), namespace, wait_s)
    wait_dead([*handles, *([coordinator] if coordinator is not None else [])], max(0.0, deadline - time.monotonic()))


# ================================================================ 2. the name
def claim_name(cfg: RuntimeConfig, namespace: str, *, probe_s: float = 10.0, wait_s: float = 30.0) -> list[str]:
    """Make the coordinator name usable for a new deployment. Returns what was replaced (for the log).

    A live coordinator whose deployment has an ACTIVE generation raises ``DeploymentExistsError``. One that
    is dead or dying (its actor is DEAD, or a call fails with an actor error) or alive but never deployed (a
    failed or crashed start) is killed along with the shards it still knows and the placement groups named
    after the deployment. One that is restarting is waited for (``wait_s``); one that does not answer is
    never replaced blindly: that is an error naming it."""
    name = coordinator_name(cfg.name)
    replaced: list[str] = []
    try:
        old = ray.get_actor(name, namespace=namespace)
    except ValueError:
        old = None
    if old is None:
        for p in deployment_pgs(cfg.name):  # a crashed start's placement group with no coordinator left
            remove_pg_id(p["placement_group_id"])
            replaced.append(f"placement group {p['name']!r} ({p['placement_group_id'][:8]}) with no coordinator")
        return replaced
    deadline = time.monotonic() + wait_s
    state = _actor_state(old)
    while state in ("RESTARTING", "PENDING_CREATION", "DEPENDENCIES_UNREADY") and time.monotonic() < deadline:
        time.sleep(0.1)
        state = _actor_state(old)
    shards: dict[int, Any] = {}
    if state == "DEAD":
        replaced.append(f"coordinator {name!r} is dead")
    else:
        try:
            deployed = bool(ray.get(old.is_deployed.remote(), timeout=probe_s))
            if deployed:
                raise DeploymentExistsError(
                    f"deployment {cfg.name!r} is already running; use Runtime.connect({cfg.name!r}) (its coordinator "
                    f"{name!r} is live with an ACTIVE generation), or shut it down first", stage="claiming the name")
            job, running = _owner_job(old)
            if running and job != ray.get_runtime_context().get_job_id():
                raise DeploymentStartError(
                    f"deployment {cfg.name!r}: coordinator {name!r} is alive but not deployed, and job {job} that "
                    f"started it is still running (a start in progress, or a restart that could not rebuild); "
                    f"wait for it or stop that job first", stage="claiming the name")
            shards = ray.get(old.shard_handles.remote(), timeout=probe_s)
            replaced.append(f"coordinator {name!r} is alive but never deployed (a failed or crashed start)")
        except ray.exceptions.RayActorError as exc:
            replaced.append(f"coordinator {name!r} is dying ({type(exc).__name__})")
        except ray.exceptions.GetTimeoutError:
            raise DeploymentStartError(
                f"deployment {cfg.name!r}: coordinator {name!r} exists ({state or 'state unknown'}) but did not answer "
                f"within {probe_s:g}s; it is not replaced blindly. Wait for it (Runtime.connect) or stop it "
                f"(Runtime.connect({cfg.name!r}).shutdown() / ray.kill) first", stage="claiming the name") from None
    teardown(cfg.name, namespace, coordinator=old, shards=shards, wait_s=wait_s)
    if not wait_name_free(name, namespace, 0.0):
        raise DeploymentStartError(f"the stale coordinator {name!r} did not release its name within {wait_s:.0f}s",
                                   stage="claiming the name")
    return replaced


# ================================================================ resources
def _base(res: str) -> bool:
    return "_group_" not in res and not res.startswith("node:") and res not in ("memory", "object_store_memory")


def resource_report(bundles: list[dict[str, float]], strategy: str, own_pg_id: str | None,
                    deployment: str, waited_s: float) -> ResourcesUnavailableError:
    """Why ``bundles`` could not be placed: what is missing and who holds it."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + float(v)
    total = {k: float(v) for k, v in ray.cluster_resources().items() if _base(k)}
    avail = {k: float(v) for k, v in ray.available_resources().items() if _base(k)}
    missing = {k: round(v - avail.get(k, 0.0), 6) for k, v in need.items() if v - avail.get(k, 0.0) > 1e-9}
    beyond = {k: round(v - total.get(k, 0.0), 6) for k, v in need.items() if v - total.get(k, 0.0) > 1e-9}
    holders: list[dict[str, Any]] = []
    reserved: dict[str, float] = {}
    try:
        table = placement_group_table()
    except Exception:  # noqa: BLE001
        table = {}
    for pid, p in table.items():
        if pid == own_pg_id or p.get("state") != "CREATED":
            continue
        held: dict[str, float] = {}
        for b in (p.get("bundles") or {}).values():
            for k, v in b.items():
                if _base(k):
                    held[k] = held.get(k, 0.0) + float(v)
        for k, v in held.items():
            reserved[k] = reserved.get(k, 0.0) + v
        if not any(held.get(k, 0.0) > 0 for k in (missing or need)):
            continue
        name = p.get("name") or ""
        who = (f"ray-moe deployment {name[len(PG_PREFIX):]!r} (placement group {name!r})" if name.startswith(PG_PREFIX)
               else f"placement group {name!r}" if name else f"unnamed placement group {pid[:12]}")
        holders.append({"holder": who, "placement_group_id": pid, "resources": held})
    holders.sort(key=lambda h: -sum(h["resources"].get(k, 0.0) for k in (missing or need)))
    outside = {k: round(total.get(k, 0.0) - avail.get(k, 0.0) - reserved.get(k, 0.0), 6) for k in need}
    outside = {k: v for k, v in outside.items() if v > 1e-9}
    fmt = lambda d: ", ".join(f"{k} {v:g}" for k, v in sorted(d.items())) or "none"  # noqa: E731
    lines = [f"Runtime.start({deployment!r}): the placement group of {len(bundles)} bundles x {fmt(bundles[0])} "
             f"({strategy}; {fmt(need)} in all) was not placed within {waited_s:.1f}s."]
    if beyond:
        lines.append(f"It needs more than the cluster has in total ({fmt(total)}): {fmt(beyond)} beyond the cluster's "
                     f"capacity (add nodes, lower num_ranks / actor_cpus, or wait longer for an autoscaler with "
                     f"timeout_s).")
    lines.append(f"Missing now: {fmt(missing) if missing else 'none in total (a per-node fit or the strategy)'}; "
                 f"available {fmt(avail)} of {fmt(total)}.")
    if holders:
        lines.append("Held by: " + "; ".join(f"{h['holder']}: {fmt(h['resources'])}" for h in holders) + ".")
    if outside:
        lines.append(f"Used outside placement groups (tasks / actors): {fmt(outside)}.")
    return ResourcesUnavailableError(" ".join(lines), stage="reserving resources", missing=missing,
                                     holders=[h["holder"] for h in holders])


# ================================================================ 3. create, 4. clean up on failure
@dataclass
class Launch:
    """One start attempt: everything it created, so that a failure removes exactly that."""

    cfg: RuntimeConfig
    namespace: str
    source: Any = None  # the weight source validated in the driver (each shard gets it: no re-read there)
    timeout_s: float = DEFAULT_START_TIMEOUT_S
    detached: bool = False
    stage: str = "claiming the name"
    coordinator: Any = None
    pg: Any = None
    shards: dict[int, Any] = field(default_factory=dict)
    replaced: list[str] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)  # seconds per stage (cleanup included)
    failed_stage: str | None = None

    def __setattr__(self, key: str, value: Any) -> None:
        if key == "stage":  # time every stage: a slow start says where the time went
            now = time.monotonic()
            prev = self.__dict__.get("stage")
            if prev is not None and "_t" in self.__dict__ and "timings_s" in self.__dict__:
                self.timings_s[prev] = round(self.timings_s.get(prev, 0.0) + now - self._t, 3)
            object.__setattr__(self, "_t", now)
        object.__setattr__(self, key, value)

    def _lifetime(self) -> dict[str, Any]:
        return {"lifetime": "detached"} if self.detached else {}

    def create_coordinator(self) -> Any:
        self.stage = "starting the coordinator"
        cfg = self.cfg
        try:
            self.coordinator = coordinator_class().options(
                name=coordinator_name(cfg.name), namespace=self.namespace, num_cpus=0, **self._lifetime()
            ).remote(cfg.model_dump_json(), self.namespace)
        except ValueError as exc:  # the name was taken between the claim and now (a concurrent start)
            raise DeploymentExistsError(f"deployment {cfg.name!r}: {exc}", stage=self.stage) from None
        return self.coordinator

    def reserve(self) -> Any:
        self.stage = "reserving resources"
        cfg = self.cfg
        bundles = [shard_bundle(cfg) for _ in range(cfg.num_ranks)]
        kw = {"lifetime": "detached"} if self.detached else {}
        self.pg = placement_group(bundles, strategy=cfg.placement_strategy, name=pg_name(cfg.name), **kw)
        t0 = time.monotonic()
        try:
            ray.get(self.pg.ready(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise resource_report(bundles, cfg.placement_strategy, self.pg.id.hex(), cfg.name,
                                  time.monotonic() - t0) from None
        return self.pg

    def create_shards(self) -> tuple[dict[int, Any], list[dict[str, Any]]]:
        self.stage = "starting the shard actors"
        cfg = self.cfg
        gpus = 1 if cfg.device == "cuda" else 0
        actor_cls = shard_actor_class(cfg)
        for r in range(cfg.num_ranks):
            self.shards[r] = actor_cls.options(
                num_cpus=cfg.actor_cpus, num_gpus=gpus, **self._lifetime(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
            ).remote(r, cfg.model_dump_json(), self.source)
        infos = ray.get([self.shards[r].node_info.remote() for r in range(cfg.num_ranks)], timeout=self.timeout_s)
        return dict(self.shards), infos

    def cleanup(self) -> None:
        self.stage = "cleaning up"
        teardown(self.cfg.name, self.namespace, coordinator=self.coordinator, shards=self.shards, pgs=[self.pg],
                 named_pgs=False)

    def failed(self, exc: BaseException) -> DeploymentStartError:
        """The error to raise after ``cleanup``: a project error naming the stage and the root cause."""
        cause = root_cause(exc)
        if isinstance(cause, DeploymentStartError):
            return cause
        if isinstance(exc, ray.exceptions.GetTimeoutError) or isinstance(cause, ray.exceptions.GetTimeoutError):
            detail = f"timed out after {self.timeout_s:g}s (timeout_s; ray-moe serve --start-timeout)"
        else:
            detail = f"{type(cause).__name__}: {cause}"
        made = [f"{len(self.shards)} shard actor(s)"] if self.shards else []
        made += ["the coordinator"] if self.coordinator is not None else []
        made += ["the placement group"] if self.pg is not None else []
        err = DeploymentStartError(
            f"Runtime.start({self.cfg.name!r}) failed while {self.failed_stage}: {detail}. Cleaned up: "
            f"{', '.join(made) or 'nothing had been created'}; the name is free for another start.",
            stage=self.failed_stage or self.stage)
        err.__cause__ = cause if cause is not exc else exc
        err.timings_s = dict(self.timings_s)
        return err

    def run(self, finish: Callable[["Launch", dict[int, Any], list[dict[str, Any]]], Any]) -> Any:
        """Claim, create and ``finish`` (topology, exchange, attach, deploy); all or nothing."""
        try:
            self.replaced = claim_name(self.cfg, self.namespace)
            self.create_coordinator()  # first: the named coordinator is the lock on the name
            self.reserve()
            shards, infos = self.create_shards()
            out = finish(self, shards, infos)
            self.stage = "done"
            return out
        except DeploymentExistsError:
            # the name belongs to a live deployment or a concurrent start: remove only our placement group
            teardown(self.cfg.name, self.namespace, pgs=[self.pg], named_pgs=False, clear_record=False, wait_s=0.0)
            raise
        except BaseException as exc:
            self.failed_stage = self.stage
            self.cleanup()
            self.stage = "cleaned up"
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise self.failed(exc) from (root_cause(exc) if root_cause(exc) is not exc else exc)


__all__ = ["DEFAULT_START_TIMEOUT_S", "Launch", "claim_name", "deployment_pgs", "pg_name", "resource_report",
           "teardown", "validate_start", "wait_name_free"]
