"""The driver API: ``ray_moe.Runtime``.

    cfg = ray_moe.RuntimeConfig(num_ranks=4, num_experts=8, hidden_size=64, ffn_size=128, top_k=2,
                                slots_per_rank=3, device="cpu", dtype="float32", seed=0)
    rt = ray_moe.Runtime.start(cfg)        # joins a running Ray cluster, or starts a local one
    y = rt.forward(hidden, topk_ids, topk_weights, phase="prefill")   # [T, d] -> [T, d]
    y = rt.forward(hidden)                 # the runtime's own router (softmax top-k over E)
    rt.scale(expert=3, replicas=2); rt.rebalance()
    rt.shutdown()

The driver splits a batch over the live ranks as origin partitions and submits ONE actor call per rank
per step, for all layers. The coordinator is consulted only when a shard reports the driver's cached
generation as stale (after a publish); per-step generation pins live on the shards and are exact.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import ray
import torch

from ray_moe.control.drivers import DriverLoad
from ray_moe.ray.coordinator import coordinator_name
from ray_moe.ray.remote import call
from ray_moe.ray.members import MembershipView, topology_from_nodes
from ray_moe.ray.executor import LayerExecutor
from ray_moe.ray.follower import MembershipFollower
from ray_moe.ray.transport import RayTransport, fetch_outputs
from ray_moe.shard.records import ExpertOnlyInput, StepKind, StepRequest, StepResult
from ray_moe.model.config import RuntimeConfig
from ray_moe.core.routes import RouteBatch
from ray_moe.core.env import EnvSettings, read_env
from ray_moe.core.errors import (
    ExchangeTimeoutError,
    RequestError,
    RouteValidationError,
)
from ray_moe.moe.experts.weights import parse_dtype
from ray_moe.placement.manifest import PlacementManifest
from ray_moe.driver.books import RuntimeStats, StepBooks
from ray_moe.core.telemetry.metrics import Telemetry, TelemetrySnapshot, merge_snapshots
from ray_moe.core.types import Phase
from ray_moe.core.wire import tensor_to_wire, wire_to_tensor
from ray_moe.moe.experts.weights import experts_from_wire

if TYPE_CHECKING:
    from ray_moe.driver.loop import GenerationLoop

log = logging.getLogger("ray_moe")

# the driver's background telemetry export (Prometheus + the shared snapshot) runs at most this often: an export
# holds the driver's GIL for milliseconds, which every fourth step paid when it ran per load flush
TELEMETRY_EXPORT_INTERVAL_S = 1.0


class Runtime:
    """A ray-moe deployment seen from one driver. The coordinator owns the deployment (its members, their target,
    the loop that reconciles them); a Runtime steps it and follows its membership (``MembershipFollower``)."""

    def __init__(self, cfg: RuntimeConfig, coordinator: Any, view: MembershipView, env: EnvSettings,
                 owns_ray: bool) -> None:
        self.cfg = cfg
        self.coordinator = coordinator
        self._env = env
        self.owns_ray = owns_ray  # this driver started the local Ray instance (its shutdown stops it)
        # ask every shard for host timestamps of its step stages (ExpertOnlyOutput.marks): profiling only
        self.record_marks = False
        self._lock = threading.Lock()
        self.dtype = parse_dtype(cfg.dtype)
        self.telemetry = Telemetry(f"driver-{uuid.uuid4().hex[:6]}")
        self.books = StepBooks(cfg.num_layers, cfg.num_experts, self.telemetry, release_id=cfg.name)
        self._exporter = None
        self._publishing = False  # a background export is scheduled or running
        self._published_at = float("-inf")  # when the last background export ended (monotonic)
        self._publish_timer: threading.Timer | None = None
        self._engine = None  # the generation loop (serving)
        # how steps reach the ranks (shard handles, the process group, the cached ACTIVE generation), as the
        # coordinator last said; the follower keeps it current and reports this driver's load with every poll
        self.transport = RayTransport(cfg, coordinator, view, self.books, self._account)
        poll_s = min(1.0, cfg.scaling.tick_s) if cfg.scaling.enabled else 1.0
        self.transport.follower = MembershipFollower(coordinator, self.transport, load=self.load, poll_s=poll_s)

    # the transport's state, as the deployment's own (read-only: the coordinator changes membership)
    shards = property(lambda self: self.transport.shards)
    lost_ranks = property(lambda self: self.transport.lost_ranks)
    group = property(lambda self: self.transport.group)
    topology = property(lambda self: self.transport.topology)

    _generation = property(lambda self: self.transport.generation,
                           lambda self, generation: setattr(self.transport, "generation", generation))

    _step_lock = property(lambda self: self.transport.gate)

    @property
    def engine(self) -> "GenerationLoop | None":
        """The generation loop, once ``serving`` started it (None before)."""
        return self._engine

    def load(self) -> DriverLoad:
        """What this driver reports to the coordinator (the scaler's signals): its generation loop's queue, else
        the forward steps it ran."""
        engine = self._engine
        if engine is None:
            return DriverLoad(steps=int(self.books.stats.steps))
        sig = engine.signals()
        return DriverLoad(waiting=sig.waiting, running=sig.running, oldest_wait_s=sig.oldest_wait_s, steps=sig.steps,
                          since_work_s=sig.since_work_s)

    # ================================================================ lifecycle
    @classmethod
    def start(cls, cfg: RuntimeConfig, *, address: str | None = None, num_cpus: int | None = None,
              timeout_s: float = 60.0, detached: bool = False) -> "Runtime":
        """Create the coordinator, the placement group and one shard actor per rank; publish generation 0.

        All or nothing (``ray_moe.ray.launch``): the config and the checkpoint are validated here in the
        driver before any actor starts (``ConfigError``); a failure after that removes every actor and
        placement group this start created, frees the coordinator name and raises ``DeploymentStartError``
        naming the stage and the root cause. ``timeout_s`` bounds the wait for resources (a placement group
        that cannot be placed raises ``ResourcesUnavailableError`` naming what is missing and who holds it)
        and for the shards to start. ``detached``: the actors and placement group outlive this driver (a
        new driver reattaches with ``Runtime.connect(name)``; stop it with ``shutdown``).

        Healing follows ``cfg.heal_retries`` (``ray-moe serve`` heals twice by default); with 0, as the library's
        default, a dead shard is not replaced: the start says so (a warning)."""
        from ray_moe.ray import launch

        cfg, source = launch.validate_start(cfg)  # checkpoint shapes and headers checked here, before any actor
        env = read_env()
        owns = False
        if not ray.is_initialized():
            addr = address or env.ray_address
            if addr:
                ray.init(address=addr, namespace=env.namespace, log_to_driver=False)
            else:
                ray.init(address="local", num_cpus=num_cpus or max(4, int(np.ceil(cfg.num_ranks * cfg.actor_cpus)) + 2),
                         namespace=env.namespace, include_dashboard=False, log_to_driver=False)
                owns = True
        ns = ray.get_runtime_context().namespace

        def finish(attempt: "launch.Launch", shards: dict[int, Any], infos: list[dict[str, Any]]) -> "Runtime":
            attempt.stage = "connecting the exchange"
            expert_bytes = 3 * cfg.hidden_size * cfg.ffn_size * torch.tensor([], dtype=parse_dtype(cfg.dtype)).element_size()
            ray.get(attempt.coordinator.attach.remote(shards, infos, attempt.pg, expert_bytes, detached=detached,
                                                      autoscale=not owns))
            attempt.stage = "deploying generation 0"
            ray.get(attempt.coordinator.deploy.remote())
            return cls(cfg, attempt.coordinator, ray.get(attempt.coordinator.view.remote()), env, owns)

        try:
            attempt = launch.Launch(cfg, ns, source=source, timeout_s=timeout_s, detached=detached)
            rt = attempt.run(finish)
        except BaseException:
            if owns:
                ray.shutdown()
            raise
        for note in cfg.start_warnings():
            log.warning("ray-moe: deployment %r: %s", cfg.name, note)
        return rt

    @classmethod
    def connect(cls, name: str = "default", *, address: str | None = None, timeout_s: float = 60.0) -> "Runtime":
        """Attach to a running deployment through its named coordinator (``ray-moe status/scale``). A
        coordinator that is restarting is waited for (``timeout_s``); a dead or never-deployed one is an error."""
        env = read_env()
        if not ray.is_initialized():
            ray.init(address=address or env.ray_address or "auto", namespace=env.namespace, log_to_driver=False)
        try:
            coord = ray.get_actor(coordinator_name(name), namespace=ray.get_runtime_context().namespace)
        except ValueError:
            raise ValueError(f"name={name!r}: no running ray-moe deployment (coordinator "
                             f"{coordinator_name(name)!r} not found)") from None
        try:
            status = cls._coord_call(coord, "status", timeout_s=timeout_s)
        except ray.exceptions.RayActorError:
            raise ValueError(f"name={name!r}: no running ray-moe deployment (coordinator {coordinator_name(name)!r} "
                             f"is dead)") from None
        if status.get("active") is None:
            why = f"; its restart could not rebuild: {status['rebuild_error']}" if status.get("rebuild_error") else ""
            raise ValueError(f"name={name!r}: deployment has no ACTIVE generation (a start that is in progress or "
                             f"failed{why})")
        cfg = RuntimeConfig.model_validate_json(cls._coord_call(coord, "config_json", timeout_s=timeout_s))
        return cls(cfg, coord, cls._coord_call(coord, "view", timeout_s=timeout_s), env, False)

    @staticmethod
    def _coord_call(coord: Any, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        """One coordinator call that waits out a coordinator restart (``ActorUnavailableError``) for up to
        ``timeout_s`` instead of failing; a coordinator that is dead for good still raises."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(getattr(coord, method).remote(*args), timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def close(self) -> None:
        """Stop following the deployment (it runs on; ``shutdown`` stops it); the coordinator forgets this driver. (A
        driver process that ends says so too, at exit; one killed outright is waited for by a membership change until
        its lease passes, 30 s.)"""
        self.transport.follower.close()
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def shutdown(self) -> None:
        """Stop every actor of the deployment and free its placement groups, its durable coordinator record
        and its name (waited for, bounded). The coordinator's loop stops first (a change under way finishes)."""
        from ray_moe.ray import launch

        self.transport.follower.close()
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._publish_timer is not None:
            self._publish_timer.cancel()  # a scheduled export would find the deployment gone

        if ray.is_initialized():
            try:
                handles, pgs = ray.get(self.coordinator.stop_members.remote(), timeout=180)
            except Exception:  # noqa: BLE001 - a coordinator already gone: what this driver knows
                handles, pgs = dict(self.shards), []
            launch.teardown(self.cfg.name, ray.get_runtime_context().namespace, coordinator=self.coordinator,
                            shards={**self.shards, **handles}, pgs=pgs)
        self.transport.shards = {}
        if self.owns_ray:
            ray.shutdown()

    # ================================================================ data path
    def forward(self, hidden: torch.Tensor | np.ndarray, topk_ids: Any = None, topk_weights: Any = None, *,
                layer: int | None = None, phase: Phase | str = Phase.PREFILL, return_routes: bool = False,
                generation: int | None = None) -> Any:
        """One model step over every MoE layer, or over MoE layer ``layer`` only: [T, d] -> [T, d].

        topk_ids / topk_weights: [T, k] (the same routes for every layer) or [L, T, k]; with ``layer`` the
        [T, k] routes of that layer exactly as the model's router produced them (weights need not sum to 1).
        None routes with the runtime's router. With ``return_routes`` the result is ``(hidden, routes)`` where
        routes is a list of per-layer ([T, k] ids, [T, k] gates) actually used. ``generation`` pins the step
        to one generation (a candidate in shadow / canary); a pinned step is never replanned onto another.
        """
        phase = Phase(phase)
        h = torch.as_tensor(hidden)
        layers = self._layers(layer)
        attempted = int(h.shape[0]) * self.cfg.top_k * len(layers) if h.dim() == 2 else 0
        served = False
        try:
            ids, gates = self._validate(h, topk_ids, topk_weights, len(layers))
            h = h.to(self.dtype)
            with self._step_lock:
                out = self._forward(h, ids, gates, phase, return_routes, generation, layers)
            served = True
            return out
        finally:
            self.books.attempted(phase, attempted, served)

    def moe_executor(self) -> "LayerExecutor":
        """An executor for transformers' ``ray_moe`` experts seam: every MoE block of a driver-side model
        runs its routed experts as one ``forward(..., layer=l)`` step of this deployment
        (``ray_moe.model.seam.bind(model, rt.moe_executor())``)."""
        return LayerExecutor(self)

    def _layers(self, layer: int | None) -> tuple[int, ...] | None:
        if layer is None:
            return tuple(range(self.cfg.num_layers))
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.cfg.num_layers:
            raise RouteValidationError(f"layer={layer!r} is not a MoE layer of this deployment "
                                       f"[0, {self.cfg.num_layers})")
        return (int(layer),)

    def _forward(self, h: torch.Tensor, ids: torch.Tensor | None, gates: torch.Tensor | None, phase: Phase,
                 return_routes: bool, pinned: int | None, layers: tuple[int, ...]) -> Any:
        cfg = self.cfg
        t0 = time.perf_counter()

        def requests(ranks: list[int], step_id: str, gen: int) -> dict[int, StepRequest]:
            parts = torch.tensor_split(torch.arange(h.shape[0]), len(ranks))
            reqs = {}
            for r, idx in zip(ranks, parts):
                lo, hi = (int(idx[0]), int(idx[-1]) + 1) if idx.numel() else (0, 0)
                reqs[r] = StepRequest(step_id, gen, StepKind.EXPERT_ONLY, ExpertOnlyInput(
                    hidden=tensor_to_wire(h[lo:hi]),
                    topk_ids=None if ids is None else ids[:, lo:hi].numpy(),
                    topk_weights=None if gates is None else gates[:, lo:hi].numpy(),
                    phase=phase, return_routes=return_routes, marks=self.record_marks,
                    layers=None if len(layers) == cfg.num_layers else layers,
                ))
            return reqs

        ranks, results = self.transport.submit(requests, pinned)
        outs = [results[r].output for r in ranks]
        out = torch.cat([wire_to_tensor(a, o.hidden_dtype) for o, a in zip(outs, fetch_outputs(results, ranks))], 0)
        self._account(results, ranks, phase, h.shape[0], (time.perf_counter() - t0) * 1e3)
        if return_routes:
            routes = []
            for l in range(len(layers)):
                routes.append((torch.cat([torch.from_numpy(o.routes[l][0]) for o in outs], 0),
                               torch.cat([torch.from_numpy(o.routes[l][1]) for o in outs], 0)))
            return out, routes
        return out

    def forward_mixed(self, hidden: torch.Tensor | np.ndarray, decode_mask: Any, topk_ids: Any = None,
                      topk_weights: Any = None) -> torch.Tensor:
        """A mixed outer batch, split by phase before dispatch (spec 0x05E): the prefill rows run as one
        variable unit, the decode rows as one decode unit (bucket / CUDA graph when admitted); outputs are
        scattered back to the original row order. decode_mask: [T] bool, True for decode rows."""
        h = torch.as_tensor(hidden)
        mask = torch.as_tensor(decode_mask, dtype=torch.bool)
        if mask.shape != (h.shape[0],):
            raise RouteValidationError(f"decode_mask: expected shape [{h.shape[0]}], got {tuple(mask.shape)}")
        ids = None if topk_ids is None else torch.as_tensor(topk_ids)
        gates = None if topk_weights is None else torch.as_tensor(topk_weights)
        self._validate(h, ids, gates)  # the whole batch is checked before either unit runs
        out = torch.empty(h.shape, dtype=self.dtype)
        for phase, idx in ((Phase.PREFILL, torch.nonzero(~mask).flatten()), (Phase.DECODE, torch.nonzero(mask).flatten())):
            if idx.numel() == 0:
                continue
            sub_ids = None if ids is None else ids.index_select(-2, idx)
            sub_gates = None if gates is None else gates.index_select(-2, idx)
            out[idx] = self.forward(h.index_select(0, idx), sub_ids, sub_gates, phase=phase)
        return out

    def _validate(self, h: torch.Tensor, topk_ids: Any, topk_weights: Any,
                  num_layers: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Reject bad input before any actor is called; routes come back as [L', T, k] for the L' layers run."""
        cfg = self.cfg
        nl = cfg.num_layers if num_layers is None else num_layers
        if h.dim() != 2 or h.shape[1] != cfg.hidden_size:
            raise RouteValidationError(f"hidden: expected [T, {cfg.hidden_size}], got shape {tuple(h.shape)}")
        if not h.is_floating_point():
            raise RouteValidationError(f"hidden: expected a floating dtype, got {h.dtype}")
        if (topk_ids is None) != (topk_weights is None):
            raise RouteValidationError("topk_ids and topk_weights: give both or neither")
        if topk_ids is None:
            if not bool(torch.isfinite(h).all()):
                raise RouteValidationError("hidden: NaN or infinite value")
            return None, None
        ids = torch.as_tensor(topk_ids)
        gates = torch.as_tensor(topk_weights)
        if ids.dim() == 2:
            ids = ids.unsqueeze(0).expand(nl, *ids.shape)
        if gates.dim() == 2:
            gates = gates.unsqueeze(0).expand(nl, *gates.shape)
        if ids.dim() != 3 or ids.shape[0] != nl:
            raise RouteValidationError(f"topk_ids: expected [T, k] or [L={nl}, T, k], got {tuple(ids.shape)}")
        same = torch.as_tensor(topk_ids).dim() == 2  # one route set for every layer: validate it once
        for l in range(1 if same else nl):
            RouteBatch(0, h, ids[l], gates[l]).validate(cfg.num_experts, cfg.hidden_size)
        if ids.shape[2] != cfg.top_k:
            raise RouteValidationError(f"topk_ids: k={ids.shape[2]} but the deployment has top_k={cfg.top_k}")
        return ids.to(torch.int64).contiguous(), gates.to(torch.float32).contiguous()

    # ================================================================ elastic ranks (asked of the coordinator)
    def add_rank(self, *, rebalance: bool = True) -> int:
        """Scale out: ask the coordinator for one more rank (a new target its loop converges to: a shard started in a
        free or fresh bundle, regrouped in, and with load observed an EPLB placement onto it). Returns the new rank
        id once it serves; this driver follows the new membership before it returns."""
        self.flush_load()
        rank = call(self.coordinator.add_rank.remote(bool(rebalance)))
        self._follow()
        return rank

    def remove_rank(self, rank: int) -> int:
        """Scale in: ask the coordinator to take ``rank`` out (its slots moved away while traffic flows, then the
        group regrouped without it and its actor stopped). Returns the new generation id."""
        g = call(self.coordinator.remove_rank.remote(rank))
        self._follow()
        return g

    def _follow(self) -> None:
        """Adopt the coordinator's membership now (the follower would within a poll)."""
        view = call(self.coordinator.view.remote())
        with self._step_lock:
            self.transport.adopt(view)

    def members(self) -> dict[str, Any]:
        """The coordinator's view of the deployment: ``target`` (ranks, ranks asked out, who set it and why),
        ``members`` (per rank: state, bundle, node, lineage), ``healer`` / ``scaler`` (their policy and events),
        ``drivers``, the ``changes`` its loop made last."""
        st = call(self.coordinator.status.remote())
        return {k: st.get(k) for k in ("target", "members", "converged", "healer", "scaler", "drivers", "fence",
                                       "changes", "group", "group_epoch")}

    def heal_events(self) -> list[dict[str, Any]]:
        """The healer's outcomes (``HealPolicy.events``): replacements, failed starts, lines left out."""
        return list((self.members()["healer"] or {}).get("events", []))

    def scale_events(self) -> list[dict[str, Any]]:
        """The scaler's decisions and outcomes (empty when scaling is off)."""
        return list((self.members()["scaler"] or {}).get("events", []))

    def _account(self, results: dict[int, StepResult], ranks: Sequence[int], phase: Phase, tokens: int, ms: float) -> None:
        """Book one served step (``StepBooks.record``); ship the load window and telemetry when due."""
        flush = self.books.record(results, ranks, phase, tokens, ms, topology_version=self.topology.version)
        if flush is not None:
            self.coordinator.record_load.remote(flush.counts, flush.phase.value, flush.generation)
            self._publish_soon()

    def _publish_soon(self) -> None:
        """Telemetry export off the step path (a Prometheus export takes milliseconds of the driver's GIL):
        one at a time and at most one per ``TELEMETRY_EXPORT_INTERVAL_S``; a flush while one is scheduled or
        running is covered by it (it reads the books when it starts), so the last steps are exported within
        one interval. Readers in this driver (``telemetry_snapshot``) export first and never see stale books."""
        with self._lock:
            if self._publishing:
                return
            self._publishing = True
            delay = max(0.0, self._published_at + TELEMETRY_EXPORT_INTERVAL_S - time.monotonic())

        def job() -> None:
            try:
                self.publish_telemetry()
            except Exception:  # noqa: BLE001 - a deployment shut down meanwhile; metrics never fail a step
                pass
            finally:
                with self._lock:
                    self._publishing = False
                    self._published_at = time.monotonic()

        timer = threading.Timer(delay, job)
        timer.name, timer.daemon = "ray-moe-telemetry", True
        self._publish_timer = timer
        timer.start()

    def publish_telemetry(self) -> None:
        """Export this driver's telemetry to Prometheus (ray.util.metrics) and share it with ``ray-moe status``."""
        snap = self.telemetry.snapshot()
        try:
            if self._exporter is None:
                from ray_moe.ray.prometheus import PrometheusExporter

                self._exporter = PrometheusExporter()
            self._exporter.export(snap)
        except Exception:  # noqa: BLE001 - metrics export must never fail a step
            pass
        self.coordinator.put.remote(f"telemetry/{self.telemetry.source}", snap.model_dump_json())

    def telemetry_snapshot(self) -> dict[str, Any] | None:
        """Merged telemetry of every driver of this deployment (as shared through the coordinator)."""
        snap = self._merged_telemetry()
        return None if snap is None else snap.model_dump(mode="json")

    def telemetry_table(self) -> str:
        snap = self._merged_telemetry()
        return "" if snap is None else snap.render_table()

    def _merged_telemetry(self):
        if self.telemetry.snapshot().ratios:
            self.publish_telemetry()
        blobs = call(self.coordinator.telemetry_snapshots.remote())
        snaps = [TelemetrySnapshot.model_validate_json(b) for b in blobs]
        return merge_snapshots(snaps) if snaps else None

    def flush_load(self) -> None:
        """Push the driver's pending load counts to the coordinator's window now."""
        flush = self.books.take_load(self._generation)
        if flush is not None:
            call(self.coordinator.record_load.remote(flush.counts, flush.phase.value, flush.generation))

    # ================================================================ inspection
    def placement(self, generation: int | None = None) -> PlacementManifest:
        return PlacementManifest.model_validate_json(call(self.coordinator.manifest_json.remote(generation)))

    def stats(self) -> dict[str, Any]:
        return self.books.snapshot()

    def refcounts(self) -> dict[int, int]:
        return call(self.coordinator.refcounts.remote())

    def floors(self) -> list[dict[str, int]]:
        """Replica floors set by ``scale`` and kept by ``rebalance``: [{layer, expert, replicas}]."""
        return call(self.coordinator.floors.remote())

    def generations(self) -> dict[int, str]:
        return call(self.coordinator.generations.remote())

    def timeline(self) -> list[dict[str, Any]]:
        return call(self.coordinator.timeline.remote())

    def shard_status(self) -> dict[int, dict[str, Any]]:
        return dict(zip(self.shards, call([h.status.remote() for h in self.shards.values()])))

    def expert_weights(self, expert: int, layer: int = 0, *, raw: bool = False) -> Any:
        """(w_gate [f, d], w_up [f, d], w_down [d, f]) of a logical expert, read from a rank hosting it; an FP8
        expert's dequantized float32 values (code x block scale). ``raw``: the ExpertWeights as the rank holds it
        (FP8: float8_e4m3fn codes with ``scales`` and ``block``)."""
        if not 0 <= expert < self.cfg.num_experts:
            raise RequestError(f"expert={expert} is out of range [0, {self.cfg.num_experts})")
        man = self.placement()
        for s in man.replicas(expert, layer):
            payload = call(self.shards[s.destination_rank].expert_weights.remote(layer, expert))
            if payload is not None:
                w = experts_from_wire(payload)[(layer, expert)]
                w = w if raw or not w.quantized else w.dequantized(torch.float32)
                return w if raw else (w.w_gate, w.w_up, w.w_down)
        raise RequestError(f"expert={expert}: no live rank holds layer {layer}")

    # ================================================================ elastic operations
    def scale(self, expert: int, replicas: int, layer: int | None = None) -> int:
        """Give logical ``expert`` exactly ``replicas`` copies; returns the new generation id."""
        self.flush_load()
        rep = call(self.coordinator.scale.remote(expert, replicas, layer))
        self._generation = rep["new_generation"]
        return rep["new_generation"]

    def rebalance(self, *, migration_aware: bool = True) -> int:
        """EPLB over the coordinator's load window, migrated live; returns the new generation id."""
        self.flush_load()
        rep = call(self.coordinator.rebalance.remote(migration_aware))
        self._generation = rep["new_generation"]
        return rep["new_generation"]

    # ================================================================ serving generation
    def serving(self, *, kv_tokens: int | None = None, block_size: int = 16, step_tokens: int | None = None,
                max_running: int | None = None, max_queued: int = 4096, random_model: dict[str, Any] | None = None,
                decode_steps: int | None = None, fused_kernels: bool = True, attention: str = "auto",
                memory_fraction: float | None = None, prefix_caching: bool = True) -> "GenerationLoop":
        """The deployment's generation loop (started on first use: every shard loads the model's non-expert
        modules and a paged KV cache; the arguments are ``GenerationLoop``'s and apply to the first call).
        ``random_model`` (a transformers config dict): seeded random non-expert weights of that model instead
        of the checkpoint's, for benchmarks of checkpoint-sized shapes (the experts come from the config's
        weight source as always)."""
        with self._lock:
            if self._engine is None:
                from ray_moe.driver.loop import GenerationLoop

                if not self.cfg.checkpoint and random_model is None:
                    raise ValueError("checkpoint=None: generation needs a model folder "
                                     "(RuntimeConfig.from_pretrained(folder, ...))")
                self._engine = GenerationLoop(self.transport, device=self.cfg.device, kv_tokens=kv_tokens, block_size=block_size,
                                              step_tokens=step_tokens, max_running=max_running, max_queued=max_queued,
                                              random_model=random_model, decode_steps=decode_steps,
                                              fused_kernels=fused_kernels, attention=attention,
                                              memory_fraction=memory_fraction, prefix_caching=prefix_caching)
            return self._engine

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, *, timeout_s: float | None = None) -> list[list[int]]:
        """The new tokens of each prompt (token ids), generated inside the shards with continuous batching.
        Every prompt is validated before any is queued; ``seed`` seeds prompt i with ``seed + i``."""
        handles = self._submit_all(prompts, max_new_tokens, temperature, top_p, seed)
        return [h.result(timeout_s) for h in handles]

    def generate_stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                        top_p: float = 1.0, seed: int | None = None) -> Iterator[tuple[int, int]]:
        """(prompt index, token) as each token is sampled, interleaved across prompts."""
        handles = self._submit_all(prompts, max_new_tokens, temperature, top_p, seed)
        merged: "queue.Queue" = queue.Queue()

        def pump(i: int, h) -> None:
            try:
                for tok in h.stream():
                    merged.put((i, tok))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                merged.put(exc)
            merged.put(None)

        for i, h in enumerate(handles):
            threading.Thread(target=pump, args=(i, h), daemon=True).start()
        left = len(handles)
        while left:
            item = merged.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    def _submit_all(self, prompts, max_new_tokens, temperature, top_p, seed) -> list:
        from ray_moe.model.sampling import SamplingParams

        engine = self.serving()
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 seed=None if seed is None else seed + i) for i in range(len(prompts))]
        return engine.submit_many([(p, sp, None) for p, sp in zip(prompts, params)])  # all or none, at once


__all__ = ["LayerExecutor", "Runtime", "RuntimeConfig", "RuntimeStats", "topology_from_nodes", "ExchangeTimeoutError"]
