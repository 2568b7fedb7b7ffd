"""ShardCore: everything one expert-shard rank does, with no Ray in it.

The Ray actor (``expert_shard.py``) is a thin shell that owns one ShardCore, its mailbox and its
exchange endpoint. Tests drive ShardCores directly over the in-process exchange (``tests/actors``).

State owned here:
* expert weights by (layer, logical expert) in an ``ExpertStore`` (content-addressed, shared by every
  generation that places that expert on this rank);
* per generation: the manifest, one PlacementSnapshot per layer and the SlotWeights per layer (views of the
  store's slot buffers: a slot map, not a copy);
* a local GenerationRegistry mirror: a step pins its generation here (exact per-step refcounts), the
  coordinator publishes / drains / retires through it and reads the refcounts back;
* the data paths picked once when the exchange is set (``DataPaths``) and the step executor
  (``step.py``); armed faults (``faults.py``) wrap them for the steps they fire in.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ray_moe.shard.expert_store import ExpertStore, Key
from ray_moe.shard.fault_wrappers import ShardFault, ShardFaults, wrap_paths
from ray_moe.shard.pipeline import (DataPaths, DecodeKeys, Marks, PinnedStaging, StepCompletions, StepExecutor, StepOrder,
                                   StepPipeline)
from ray_moe.shard.records import ExpertOnlyOutput, StepKind, StepRequest, StepResult
from ray_moe.model.config import RuntimeConfig
from ray_moe.moe.exchange.base import Exchange
from ray_moe.moe.dispatch.protocol import ControlStatus
from ray_moe.core.errors import GenerationError, StaleGenerationError
from ray_moe.moe.experts.runners.fp8 import fast_path_reason
from ray_moe.moe.experts.runners.fp8_configs import untuned_reason
from ray_moe.moe.experts.weights import ExpertWeights, WeightSource, parse_dtype
from ray_moe.moe.router import Router
from ray_moe.model.routers import checkpoint_router
from ray_moe.moe.layer import PlacementView
from ray_moe.placement.manifest import PlacementManifest
from ray_moe.placement.registry import GenerationRegistry
from ray_moe.placement.selector import make_selector
from ray_moe.placement.snapshot import snapshots_for
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.core.types import GenerationState

if TYPE_CHECKING:
    from ray_moe.shard.token_steps import TokenStepExecutor
    from ray_moe.shard.pending import PendingStep


@dataclass
class _Generation:
    manifest: PlacementManifest
    view: PlacementView
    keys: frozenset[Key] = field(default_factory=frozenset)


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
        self.selector = make_selector(cfg.replica_policy)
        self.paths: DataPaths | None = None
        self.decode_cap: int | None = None  # the decode bucket's largest capacity, once the lattice sets it
        self.faults = ShardFaults()
        # called on the generation thread right after each launch, while the device runs it: the process's
        # collector safe point (``GcPauses.safe_point``; the actor sets it on CUDA)
        self.safe_point: Callable[[], Any] = lambda: None
        self.store = ExpertStore(rank, self.device, self.dtype, staging_slots=cfg.staging_slots)
        self._gens: dict[int, _Generation] = {}
        self.decode_keys = DecodeKeys(cfg, self.dtype)
        self._lock = threading.RLock()
        self._step_lock = threading.Lock()
        # routeless steps: a checkpoint's own router modules (transformers' code); the synthetic softmax
        # router only for synthetic deployments
        router: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
        if cfg.checkpoint:
            router = checkpoint_router(cfg, source, device=self.device, dtype=self.dtype)
        else:
            router = Router([source.router(l) for l in range(cfg.num_layers)], num_experts=cfg.num_experts,
                            top_k=cfg.top_k, norm_topk=cfg.norm_topk, skew=cfg.router_skew, seed=cfg.seed,
                            device=self.device)
        self.counters: dict[str, int] = {"steps": 0, "stale_rejects": 0, "aborted_steps": 0}
        # candidate generations (a release in SHADOW / CANARY) serve pinned steps while still PENDING
        self._candidates: set[int] = set()
        self._candidate_pins: dict[int, int] = {}
        self._staging = PinnedStaging()
        self.generator: "TokenStepExecutor | None" = None  # the hosted model (load_model)
        self._order = StepOrder()  # steps run in launch order (a request names the one it follows)
        # completions of steps done on the device, run by the launching thread between a piecewise step's pieces
        self._completions = StepCompletions()
        self._gen_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ray-moe-gen-r{rank}")
        self._gen_slots = threading.BoundedSemaphore(2)
        # one step pipeline (decode round, captured graphs, overflow rerun) for both fronts: the expert-only
        # executor here, the generation executor once a model is loaded
        self.pipeline = StepPipeline()
        self.executor = StepExecutor(rank, dtype=self.dtype, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                                     residual=cfg.residual, device=self.device, router=router,
                                     decode_key=self._decode_key, pipeline=self.pipeline)

    @property
    def exchange(self) -> Exchange | None:
        return None if self.paths is None else self.paths.exchange

    # ================================================================ control path
    def set_exchange(self, exchange: Exchange) -> None:
        """Pick the data paths of this deployment (``DataPaths.pick``: every rank picks alike)."""
        self.paths = DataPaths.pick(self.cfg, exchange, self.selector, dtype=self.dtype, device=self.device,
                                    decode_cap=self.decode_cap)
        self.decode_keys.forget()
        if self.generator is not None and self.generator.graph_runner.lattice is not None:
            self.generator.configure(self.generator.graph_runner.lattice, self.paths)

    # ---------------------------------------------------------------- weights (expert_store.py)
    def load_experts(self, keys: Sequence[Key]) -> dict[Key, str]:
        """Load (layer, expert) weights from the weight source; returns their parameter digests."""
        with self._lock:
            return self.store.load(keys, self.source)

    def export_experts(self, keys: Sequence[Key], *, device: bool = False) -> dict[Key, ExpertWeights]:
        """Weights this rank holds, for an actor-to-actor copy (CPU tensors, or device tensors for NCCL)."""
        return self.store.export(keys, device=device)

    def import_experts(self, weights: Mapping[Key, ExpertWeights]) -> dict[Key, str]:
        """Store copied weights; returns the digests computed from the bytes that arrived. An armed ``hang_copy``
        fault stalls here first, outside the control lock (steps and the abort path go on meanwhile)."""
        self.faults.stall(ShardFault.HANG_COPY)
        with self._lock:
            return self.store.put(weights)

    def held_experts(self) -> list[Key]:
        return self.store.held()

    def _live_keys(self) -> set[Key]:
        return set().union(*(g.keys for g in self._gens.values())) if self._gens else set()

    def drop_experts(self, keys: Sequence[Key]) -> None:
        """Free staged weights that no generation uses (an aborted migration)."""
        with self._lock:
            self.store.drop(keys, self._live_keys())

    def drop_unreferenced(self) -> int:
        """Free every held weight no prepared generation uses (copies staged by a control operation that
        died before it prepared them); returns how many (layer, expert) weights were freed."""
        with self._lock:
            return self.store.drop_unreferenced(self._live_keys())

    def expert_weights(self, layer: int, expert: int) -> ExpertWeights | None:
        w = self.store.get((layer, expert))
        return None if w is None else w.to("cpu")

    # ---------------------------------------------------------------- generations
    def prepare_generation(self, manifest: PlacementManifest, group: ProcessGroupSpec) -> dict[str, Any]:
        """Materialise this rank's slots of a new generation (weights must already be held) and verify every
        slot's parameter digest. Registers the generation PENDING in the local mirror."""
        with self._lock:
            snaps = snapshots_for(manifest, self.topology, group)
            weights, keys = self.store.stack(manifest)  # verifies every slot's parameter digest
            if manifest.generation not in self._gens:
                self.registry.register(manifest)
            view = PlacementView(manifest.generation, snaps, weights)
            self._gens[manifest.generation] = _Generation(manifest, view, keys)
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
        """Free the captured steps keyed to ``generation``; returns how many were freed."""
        if self.generator is not None:
            self.generator.graph_runner.release(generation)
        return self.pipeline.graphs.release(generation)

    def inject_fault(self, kind: ShardFault | str, count: int = 1, generation: int | None = None) -> None:
        """Arm a data-path fault for the next ``count`` steps (of ``generation`` only, if given)."""
        self.faults.arm(kind, count, generation)

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
            self.release_graphs(generation)
            self.decode_keys.forget(generation)
            if state == GenerationState.PENDING:
                self.registry.abandon(generation)
            else:
                self.registry.retire(generation)
            del self._gens[generation]
            self.store.drop_unreferenced(self._live_keys())
            return True

    def registry_snapshot(self) -> dict[str, Any]:
        """This rank's registry mirror, for a coordinator that rebuilds itself after a restart: every
        prepared generation's state, exact refcount (leases + candidate pins), candidate flag and manifest
        digest, and the (layer, expert) weights held. Taken under the control lock, so a prepare in
        flight is either fully in or not at all."""
        with self._lock:
            gens = {}
            for g, gen in self._gens.items():
                gens[g] = {"state": self.registry.state(g).value, "refcount": self.refcount(g),
                           "candidate": g in self._candidates, "digest": gen.manifest.content_digest()}
            return {"rank": self.rank, "active": self.registry.active(), "generations": gens,
                    "held": self.store.held()}

    def generation_manifests(self, generations: Sequence[int]) -> dict[int, PlacementManifest]:
        """The manifests of prepared generations (as prepared here)."""
        with self._lock:
            return {int(g): self._gens[int(g)].manifest for g in generations if int(g) in self._gens}

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "rank": self.rank,
                "active": self.registry.active(),
                "generations": {g: {"state": self.registry.state(g).value, "refcount": self.registry.refcount(g)}
                                for g in self._gens},
                "experts_held": len(self.store),
                "weight_bytes": self.store.nbytes,  # the slot buffers' bytes (held and free rows)
                "slot_buffers": self.store.slab_info(),  # per layer: capacity, used, free rows
                "slot_buffer_grows": self.store.grows,
                "counters": {**self.counters, **self.executor.counters, **self.pipeline.counters, **self.faults.fired,
                             **({} if self.generator is None else {**self.generator.counters,
                                                                   **self.generator.graph_runner.counters})},
                "graphs": len(self.pipeline.graphs),
                "capture_error": self.pipeline.capture_error,
                # the step lattice, the path each step kind takes, what each generation's capture took
                "steps": None if self.generator is None else self.generator.status(),
                "fused_kernels": None if self.generator is None else self.generator.fused_kernels(),
                # the KV block pool: free / held / cached blocks and cached blocks evicted (``model/prefix_cache``)
                "kv_blocks": None if self.generator is None else {**self.generator.host.kv.pool.counts(),
                                                                   "evictions": self.generator.host.kv.pool.evictions},
                "memory": self._memory(),
            }

    def _memory(self) -> dict[str, int]:
        """Bytes on this rank's device (MEASURED): the expert slot buffers, the hosted model's other modules and
        KV cache tensors (``ModelHost.memory``), and on CUDA the allocator's allocated / reserved bytes and peak."""
        out = {"expert_bytes": self.store.nbytes,
               **({} if self.generator is None else self.generator.host.memory())}
        if self.device.type == "cuda":
            out.update(allocated_bytes=torch.cuda.memory_allocated(self.device),
                       reserved_bytes=torch.cuda.memory_reserved(self.device),
                       peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device))
        return out

    # ================================================================ data path
    def step(self, req: StepRequest, publish: Callable[[np.ndarray], Any] | None = None) -> StepResult:
        """One step SPMD with the other ranks (one call per step, not per layer), of the kind the request
        declares (``StepKind``): GENERATION (token ids in, sampled token ids out, over the hosted model) or
        EXPERT_ONLY (hidden states through the MoE layers). Either waits for the step it follows (``after``),
        pins its generation and takes the step pipeline. A request of no known kind, or whose input is another
        kind's, is refused first (``StepRequest.check``): nothing waits, pins or counts.

        On CUDA an expert-only step's output reaches the host through a reused pinned buffer; the output's
        ``hidden`` is a view of it only until the step lock is released. ``publish(array)`` (called under the
        lock) moves it somewhere durable (the actor shell: ``ray.put``); without it the view is copied here.
        """
        kind = req.check()
        if self.paths is None or (kind is StepKind.GENERATION and self.generator is None):
            raise RuntimeError(f"rank {self.rank}: no exchange set" if self.paths is None else
                               f"rank {self.rank}: no model loaded (load_model)")
        t0 = time.perf_counter()
        self._order.wait_turn(req.step_id, req.after, self.cfg.exchange_timeout_s)
        if kind is StepKind.GENERATION:
            return self._generation_step(req, t0)
        return self._expert_only_step(req, t0, publish)

    @contextmanager
    def _pinned(self, generation: int, step_id: str) -> Iterator[tuple[ControlStatus, PlacementView, DataPaths]]:
        """Pin ``generation`` for one step (exact refcount) and yield (status, view, the step's data paths
        with any fired fault installed). A refused generation still yields a view (the active one) so the
        rank takes part in the step's first control round and every peer aborts together."""
        status, lease, candidate = ControlStatus.OK, None, False
        try:
            lease = self.registry.acquire_generation(generation, holder=step_id)
        except (StaleGenerationError, GenerationError, KeyError, ValueError):
            with self._lock:
                candidate = generation in self._candidates
                if candidate:
                    self._candidate_pins[generation] = self._candidate_pins.get(generation, 0) + 1
            if not candidate:
                self.counters["stale_rejects"] += 1
                status = ControlStatus.STALE_GENERATION
        gen = self._gens.get(generation) if status == ControlStatus.OK else self._any_generation()
        try:
            if gen is None:
                raise StaleGenerationError(f"rank {self.rank} holds no generation at all", requested=generation)
            # a refused (stale) step fires nothing: it only takes part in the abort
            fired = self.faults.take(generation) if status == ControlStatus.OK else frozenset()
            if ShardFault.CRASH in fired:
                raise RuntimeError(f"injected fault: rank {self.rank} failed serving generation {generation}")
            yield status, gen.view, wrap_paths(fired, self.paths)
            self.counters["steps"] += 1
        except StaleGenerationError as exc:
            self.counters["aborted_steps"] += 1
            if status == ControlStatus.STALE_GENERATION:
                raise StaleGenerationError(
                    f"{exc} (rank {self.rank}: step pinned generation {generation}, active {self.registry.active()})",
                    requested=generation, active=self.registry.active()) from None
            raise
        except BaseException:
            self.counters["aborted_steps"] += 1
            raise
        finally:
            if lease is not None:
                self.registry.release(lease)
            if candidate:
                with self._lock:
                    self._candidate_pins[generation] -= 1

    def _expert_only_step(self, req: StepRequest, t0: float, publish: Callable[[np.ndarray], Any] | None) -> StepResult:
        """One expert-only step (hidden states through the MoE layers), its turn come (``step``)."""
        inp = req.input
        try:
            with self._step_lock:
                t1 = time.perf_counter()
                marks = Marks(inp.marks, self.device.type == "cuda", t1)
                with self._pinned(req.generation, req.step_id) as (status, view, paths):
                    y, stats, routes = self.executor.run(req, view, paths, status, marks)
                observe = getattr(self.selector, "observe", None)
                if observe is not None and stats:  # least-load / locality selectors learn from the rows really sent
                    observe(torch.from_numpy(np.sum([ls.rank_routes for ls in stats], axis=0)))
                arr, dt = self._staging.to_host(y)
                marks("hidden_out")
                routes = tuple((i.cpu().numpy(), w.cpu().numpy()) for i, w in routes) if inp.return_routes else None
                t2 = time.perf_counter()
                if self._staging.holds(arr):  # a view of the pinned buffer: moved somewhere durable under the lock
                    arr = np.array(arr) if publish is None else publish(arr)
        finally:
            self._order.launched(req.step_id)
        return StepResult(self.rank, req.step_id, req.generation, ExpertOnlyOutput(arr, dt, routes, marks.done()),
                          stats, t2 - t1, self.registry.active(), queued_s=t1 - t0, actor_s=time.perf_counter() - t0)

    # ================================================================ serving generation
    def load_model(self, *, kv_tokens: int | None, block_size: int = 16, random_model: dict | None = None,
                   fused_kernels: bool = True, attention: str = "auto",
                   memory_fraction: float | None = None, prefix_caching: bool = True,
                   rank_running: int | None = None, step_tokens: int | None = None) -> dict[str, Any]:
        """Host the model's non-expert modules from the checkpoint (or seeded random ones of the transformers
        config dict ``random_model``); routed experts stay this shard's slots. ``fused_kernels``: the model's
        RMSNorm layers and rotary embedding take fused kernels on CUDA (``models.norms``, ``models.rotary``).
        ``attention``: an ``AttentionBackend`` value. ``kv_tokens`` None: the cache is sized from the memory
        ``memory_fraction`` of the GPU leaves after the weights (``TokenStepExecutor.load``). ``prefix_caching``:
        KV blocks of identical prompt prefixes shared (``shard/prefix.py``). ``rank_running`` / ``step_tokens``:
        the deployment's step lattice (``shard/lattice.py``: sequences per rank, prompt tokens per step; the
        decode bucket follows the running sequences unless the config names its capacity), captured by
        ``prepare_steps``. Returns the model's limits and how each step kind runs here."""
        from ray_moe.shard.token_steps import TokenStepExecutor
        from ray_moe.shard.lattice import StepLattice

        lattice = None if rank_running is None or step_tokens is None else StepLattice.build(rank_running, step_tokens)
        with self._step_lock:
            if self.generator is None:
                cfg = self.cfg
                self.generator = TokenStepExecutor.load(
                    self.rank, checkpoint=cfg.checkpoint, random_model=random_model, num_layers=cfg.num_layers,
                    hidden_size=cfg.hidden_size, top_k=cfg.top_k, seed=cfg.seed, device=self.device,
                    dtype=self.dtype, kv_tokens=kv_tokens, block_size=block_size, fused_kernels=fused_kernels,
                    attention=_backend(attention), pipeline=self.pipeline, prefix_caching=prefix_caching,
                    **({} if memory_fraction is None else {"memory_fraction": memory_fraction}))
                self.generator.graph_runner.between_pieces = self._between_pieces
            if lattice is not None:
                if self.cfg.decode_token_capacity is None and self.decode_cap != lattice.rank_running:
                    self.decode_cap = lattice.rank_running
                    if self.paths is not None:
                        self.set_exchange(self.paths.exchange)  # (the decode bucket re-sized to the lattice)
                if self.paths is not None:
                    self.generator.configure(lattice, self.paths)
            # FP8 slots: whether the FP8 expert kernels serve them here (checked now, before any capture)
            fp8 = sorted({fast_path_reason(self.device, self.dtype, d, f, b) or "" for d, f, b in self.store.fp8_shapes})
            # ... and whether the GPU's tuned launch table covers the shapes its kernels run
            untuned = untuned_reason(self.device, () if any(fp8) else self.store.fp8_shapes,
                                     self.generator.host.fp8_gemm_shapes())
            return {**self.generator.info(), "fp8_expert_layers": self.store.fp8_layers,
                    "fp8_dequantized_reason": "; ".join(r for r in fp8 if r) or None, "fp8_untuned_reason": untuned}

    def prepare_steps(self) -> dict[str, Any]:
        """Capture the step lattice of the active generation before the deployment serves (every rank of the
        group at once: the warm-ups of an expert-parallel group's decode sizes exchange). Returns what it took
        and how each step kind runs here."""
        if self.generator is None or self.paths is None:
            raise RuntimeError(f"rank {self.rank}: no model loaded (load_model)")
        return self._gen_thread.submit(self._prepare_steps).result()

    def _prepare_steps(self) -> dict[str, Any]:
        with self._step_lock:
            active = self.registry.active()
            with self._pinned(active, f"prepare-{active}") as (status, view, paths):
                report = (self.generator.capture(view, paths, at_start=True)
                          if paths.capture and self.generator.graph_runner.lattice is not None else {})
            return {"rank": self.rank, "capture": report, **self.generator.status()}

    def _generation_step(self, req: StepRequest, t0: float) -> StepResult:
        """One generation step (token ids in, sampled token ids out), its turn come (``step``)."""
        # always on the same thread: the actor's calls arrive on any of its pool threads, and CUDA library
        # state (cuBLAS / cuDNN handles, attention plan caches) is per thread
        with self._gen_slots:  # at most two launched steps not completed
            done = None
            try:
                pending, stack, queued = self._gen_thread.submit(self._launch_step, req, t0).result()
                if pending.ready:  # complete already: its result is queued before any later launch
                    done = self._gen_thread.submit(self._complete_step, pending, stack)
            finally:
                self._order.launched(req.step_id)  # the next step may launch now
            if done is None:
                # a step still on the device completes behind the next step's launch when that one is
                # already here: the device runs the next step while the host reads this one's tokens. Once
                # its device work is done, the next step's launch may read it between its pieces (a long
                # launch blocks on a full command buffer: ``StepCompletions``), else the generation thread
                try:
                    pending.wait()
                except BaseException:
                    pending.abandon()
                    if not stack.__exit__(*sys.exc_info()):
                        raise
                    raise  # pragma: no cover - the pin never swallows an error
                job = self._completions.add(lambda: self._complete_held(pending, stack))
                self._gen_thread.submit(self._complete_queued, job)
                res = job.result()
            else:
                res = done.result()
        return dataclasses.replace(res, active_generation=self.registry.active(), queued_s=queued,
                                   actor_s=time.perf_counter() - t0)

    def _launch_step(self, req: StepRequest, t0: float):
        stack = ExitStack()
        try:
            with self._step_lock:
                status, view, paths = stack.enter_context(self._pinned(req.generation, req.step_id))
                t1 = time.perf_counter()
                pending = self.generator.launch(req, view, paths, status,
                                                self._decode_key(view) if paths.bucket else 0)
        except BaseException:
            if not stack.__exit__(*sys.exc_info()):
                raise
            raise  # pragma: no cover - the pin never swallows an error
        self.safe_point()
        return pending, stack, t1 - t0

    def _complete_step(self, pending: "PendingStep", stack: ExitStack) -> StepResult:
        with self._step_lock:
            return self._complete_held(pending, stack)

    def _complete_queued(self, job: Any) -> None:
        """A completion's turn on the generation thread (unless a launch ran it between its pieces)."""
        with self._step_lock:
            self._completions.run_queued(job)

    def _between_pieces(self) -> None:
        """The launching thread, between a piecewise step's pieces (step lock held): completions now due."""
        ran = self._completions.run_ready()
        if ran and self.generator is not None:
            self.generator.count("completions_between_pieces", ran)

    def _complete_held(self, pending: "PendingStep", stack: ExitStack) -> StepResult:
        """The step's result (the caller holds the step lock); its generation's pin is released with it."""
        try:
            res = pending.complete()
        except BaseException:
            if not stack.__exit__(*sys.exc_info()):
                raise
            raise  # pragma: no cover
        stack.close()
        return res

    def _decode_key(self, view: PlacementView) -> int:
        return self.decode_keys(view, self.paths.bucket)

    def _any_generation(self) -> _Generation | None:
        active = self.registry.active()
        if active is not None and active in self._gens:
            return self._gens[active]
        return next(iter(self._gens.values()), None)


def _backend(value: str) -> Any:
    """An ``AttentionBackend`` from its value; raises ``ValueError`` naming ``attention`` otherwise."""
    from ray_moe.core.types import AttentionBackend

    try:
        return AttentionBackend(value)
    except ValueError:
        raise ValueError(f"attention={value!r}: must be one of {[b.value for b in AttentionBackend]}") from None


__all__ = ["ShardCore"]
