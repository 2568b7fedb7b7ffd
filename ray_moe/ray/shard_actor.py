"""ExpertShardActor: one per GPU (or per CPU slot locally), pinned by a placement-group bundle.

A thin Ray shell over ``ShardCore``: it owns the core, the mailbox peers deliver into, and the exchange
endpoint (Ray object store or NCCL through CuPy). Threaded (``max_concurrency``) so that ``deliver``
and ``abort_step`` run while a ``step`` waits on its peers.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Mapping, Sequence

import ray
import torch

from ray_moe.core.gc_pauses import GcPauses
from ray_moe.shard.core import ShardCore
from ray_moe.shard.records import StepRequest, StepResult
from ray_moe.model.config import RuntimeConfig
from ray_moe.moe.exchange.mailbox import Mailbox
from ray_moe.moe.exchange.object_store import ObjectStoreExchange
from ray_moe.model.source import weight_source
from ray_moe.moe.experts.weights import ExpertWeights, WeightSource
from ray_moe.placement.manifest import PlacementManifest
from ray_moe.placement.topology import ProcessGroupSpec, Topology
from ray_moe.core.types import ExchangeKind, ExchangeSchedule
from ray_moe.moe.experts.fp8 import Fp8Format
from ray_moe.moe.experts.weights import experts_from_wire, experts_to_wire

class ExpertShardActor:
    """Remote methods are grouped: setup, control path (coordinator), data path (driver), diagnostics."""

    def __init__(self, rank: int, cfg_json: str, source: WeightSource | None = None) -> None:
        """``source``: the weight source the driver built (and validated) once; None builds it here."""
        cfg = RuntimeConfig.model_validate_json(cfg_json)
        self.cfg = cfg
        self.rank = rank
        if cfg.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes exactly the bundle's GPU as device 0
            device = torch.device("cuda", 0)
        else:
            torch.set_num_threads(1)
            device = torch.device("cpu")
        self.device = device
        self.mailbox = Mailbox()
        self.core = ShardCore(rank, cfg, source if source is not None else weight_source(cfg), device=device)
        self._migration = None
        self._migration_stream = None
        self.gc = GcPauses().install()  # this process's collector pauses (one actor per process)

    # ---------------------------------------------------------------- setup
    def node_info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "node_id": ctx.get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "resources": {k: v for k, v in ctx.get_assigned_resources().items()},
        }

    def set_topology(self, topology_json: str) -> None:
        self.core.topology = Topology.model_validate_json(topology_json)

    def topology_json(self) -> str:
        """The topology this rank plans with (diagnostics: every rank must hold the coordinator's)."""
        return self.core.topology.model_dump_json()

    def set_peers(self, peers: Mapping[int, Any], group_json: str) -> None:
        """Object-store exchange over ``group`` with the given peer actor handles."""
        group = ProcessGroupSpec.model_validate_json(group_json)
        self.core.set_exchange(self._schedule(ObjectStoreExchange(
            self.rank, group, peers, self.mailbox, timeout_s=self.cfg.exchange_timeout_s, device=self.device)))

    def _schedule(self, flat):
        """Flat all-to-all-v, or the same endpoint routed through node relays (spec 0x07E)."""
        if self.cfg.exchange_schedule is ExchangeSchedule.HIERARCHICAL:
            from ray_moe.moe.exchange.hierarchical import HierarchicalExchange

            if set(flat.group.peer_order) == {r.rank for r in self.core.topology.ranks}:
                return HierarchicalExchange(flat, self.core.topology)
            # a group that lost or gained ranks against the topology runs flat until the topology is rebuilt
        return flat

    def gloo_endpoint(self) -> tuple[str, int]:
        from ray_moe.moe.exchange.gloo import free_endpoint

        return free_endpoint()

    def init_gloo(self, endpoint: tuple[str, int], group_json: str) -> bool:
        """Gloo process group over ``group`` (CPU); the rendezvous store lives on peer slot 0's node."""
        from ray_moe.moe.exchange.gloo import GlooExchange

        group = ProcessGroupSpec.model_validate_json(group_json)
        if self.core.exchange is not None:
            self.core.exchange.close()
        self.core.set_exchange(self._schedule(GlooExchange(self.rank, group, tuple(endpoint),
                                                           timeout_s=self.cfg.exchange_timeout_s)))
        return True

    def nccl_unique_id(self) -> bytes:
        from ray_moe.moe.exchange.nccl import new_unique_id

        return new_unique_id()

    def init_nccl(self, unique_id: bytes, group_json: str, migration_id: bytes | None = None) -> bool:
        """Data-path communicator over ``group`` (and a second one for weight migration, so copies never
        interleave with step collectives on one communicator)."""
        from ray_moe.moe.exchange.nccl import NcclExchange

        group = ProcessGroupSpec.model_validate_json(group_json)
        if self.core.exchange is not None:
            self.core.exchange.close()
        if self._migration is not None:
            self._migration.close()
            self._migration = None
        self.core.set_exchange(self._schedule(NcclExchange(self.rank, group, unique_id,
                                                           timeout_s=self.cfg.exchange_timeout_s, device=self.device)))
        if migration_id is not None:
            self._migration = NcclExchange(self.rank, group, migration_id, timeout_s=self.cfg.exchange_timeout_s,
                                           device=self.device)
            self._migration_stream = torch.cuda.Stream()
        return True

    # ---------------------------------------------------------------- weight migration over NCCL
    def send_experts(self, keys: Sequence[tuple[int, int]], dest_rank: int) -> int:
        """Send the (layer, expert) weights to ``dest_rank`` over the migration communicator; bytes sent."""
        ws = self.core.export_experts([tuple(k) for k in keys], device=True)
        tensors = [t for k in keys for t in ws[tuple(k)].tensors()]  # (FP8: codes, then their scales)
        with torch.cuda.stream(self._migration_stream):
            self._migration_stream.wait_stream(torch.cuda.default_stream())
            n = self._migration.send(tensors, dest_rank)
            self._migration.wait(f"send experts to rank {dest_rank}")
        return n

    def recv_experts(self, keys: Sequence[tuple[int, int]], source_rank: int) -> dict[tuple[int, int], str]:
        """Receive (layer, expert) weights from ``source_rank``; digests computed from what arrived."""
        f, d = self.cfg.ffn_size, self.cfg.hidden_size
        dt = self.core.dtype
        block = self.core.source.fp8_block  # FP8 experts: codes and their block scales travel together
        one = Fp8Format(block).shapes(f, d) if block is not None else [((f, d), dt), ((f, d), dt), ((d, f), dt)]
        n = len(one)
        with torch.cuda.stream(self._migration_stream):
            ts = self._migration.recv(one * len(keys), source_rank)
            self._migration.wait(f"receive experts from rank {source_rank}")
        weights = {(int(k[0]), int(k[1])): ExpertWeights.from_tensors(int(k[0]), int(k[1]), ts[n * i:n * (i + 1)], block)
                   for i, k in enumerate(keys)}
        return self.core.import_experts(weights)

    def raw_send(self, nbytes: int, dest_rank: int) -> float:
        """Baseline: send ``nbytes`` of a scratch buffer to ``dest_rank`` on the migration communicator; seconds."""
        import time as _time

        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with torch.cuda.stream(self._migration_stream):
            t0 = _time.perf_counter()
            self._migration.send([buf], dest_rank)
            self._migration.wait("raw send")
        return _time.perf_counter() - t0

    def raw_recv(self, nbytes: int, source_rank: int) -> float:
        import time as _time

        with torch.cuda.stream(self._migration_stream):
            t0 = _time.perf_counter()
            self._migration.recv([((nbytes,), torch.uint8)], source_rank)
            self._migration.wait("raw recv")
        return _time.perf_counter() - t0

    # ---------------------------------------------------------------- control path
    # Every call that reads, copies or frees expert weights ends with ``trim_memory``: the staged copies and wire
    # payloads it freed would otherwise stay resident in the C allocator (measured on CPU, bench/ray_moe_bench/
    # cpu_memory.py: the shard's resident growth per slot byte ~1.5-1.75 without, ~1.16 with).
    def load_experts(self, keys: Sequence[tuple[int, int]]) -> dict[tuple[int, int], str]:
        out = self.core.load_experts(keys)
        self.trim_memory()
        return out

    def export_experts(self, keys: Sequence[tuple[int, int]]) -> dict[str, Any]:
        return experts_to_wire(self.core.export_experts(keys))

    def fetch_experts(self, source: Any, keys: Sequence[tuple[int, int]]) -> tuple[dict[tuple[int, int], str], int]:
        """Copy experts from another shard actor through the object store; (digests of what arrived, bytes)."""
        payload = ray.get(source.export_experts.remote(list(keys)))
        weights = experts_from_wire(payload)
        out = self.core.import_experts(weights), sum(w.nbytes for w in weights.values())
        del payload, weights
        self.trim_memory()
        return out

    def import_experts(self, payload: Mapping[str, Any]) -> dict[tuple[int, int], str]:
        out = self.core.import_experts(experts_from_wire(payload))
        self.trim_memory()
        return out

    def prepare_generation(self, manifest_json: str, group_json: str) -> dict[str, Any]:
        return self.core.prepare_generation(PlacementManifest.model_validate_json(manifest_json),
                                            ProcessGroupSpec.model_validate_json(group_json))

    def publish(self, generation: int) -> None:
        self.core.publish(generation)

    def refcount(self, generation: int) -> int:
        return self.core.refcount(generation)

    def retire(self, generation: int) -> bool:
        out = self.core.retire(generation)
        self.trim_memory()
        return out

    def drop_experts(self, keys: Sequence[tuple[int, int]]) -> None:
        self.core.drop_experts(keys)
        self.trim_memory()

    def allow_candidate(self, generation: int) -> None:
        self.core.allow_candidate(generation)

    def registry_snapshot(self) -> dict[str, Any]:
        return self.core.registry_snapshot()

    def generation_manifests(self, generations: Sequence[int]) -> dict[int, str]:
        return {g: m.model_dump_json() for g, m in self.core.generation_manifests(generations).items()}

    def drop_unreferenced(self) -> int:
        out = self.core.drop_unreferenced()
        self.trim_memory()
        return out

    def active_generation(self) -> int | None:
        """This rank's ACTIVE generation (drivers ask while the coordinator restarts)."""
        return self.core.registry.active()

    def stop_dispatch(self, generation: int) -> None:
        self.core.stop_dispatch(generation)

    def release_graphs(self, generation: int) -> int:
        return self.core.release_graphs(generation)

    def inject_fault(self, kind: str, count: int = 1, generation: int | None = None) -> None:
        self.core.inject_fault(kind, count, generation)

    # ---------------------------------------------------------------- data path
    def deliver(self, tag: str, source_peer: int, dest_peer: int, payload: Any) -> None:
        self.mailbox.put((tag, source_peer, dest_peer), payload)

    def abort_step(self, step_id: str, reason: str) -> None:
        self.mailbox.abort(step_id + "/", reason)

    def step(self, req: StepRequest) -> StepResult:
        """One step of the kind the request declares (``ShardCore.step``): the only data-path method of the actor."""
        try:
            # a CUDA output sits in the core's reused pinned buffer: copy it into the object store while the
            # core still holds its step lock (the driver fetches the ref)
            return self.core.step(req, publish=ray.put)
        finally:
            self.mailbox.forget(req.step_id + "/")

    # ---------------------------------------------------------------- serving generation
    def load_model(self, **options: Any) -> dict[str, Any]:
        """``ShardCore.load_model`` (keyword options). On CUDA the heap alive after the model is built is frozen
        (``GcPauses.freeze``): a full collection between two launches would leave the GPU idle for it; young collections
        wait for the core's safe point, right after a launch (``GcPauses.defer_to_safe_points``)."""
        info = self.core.load_model(**options)
        if self.device.type == "cuda":
            self.gc.freeze()
            self.gc.defer_to_safe_points()
            self.core.safe_point = self.gc.safe_point
        return info

    def prepare_steps(self) -> dict[str, Any]:
        """``ShardCore.prepare_steps``: the step lattice captured before the deployment serves."""
        return self.core.prepare_steps()

    # ---------------------------------------------------------------- diagnostics
    def status(self) -> dict[str, Any]:
        st = self.core.status()
        st["counters"] = {**st["counters"], **self.gc.counters()}
        return st

    def expert_weights(self, layer: int, expert: int) -> dict[str, Any] | None:
        w = self.core.expert_weights(layer, expert)
        return None if w is None else experts_to_wire({(layer, expert): w})

    def held_experts(self) -> list[tuple[int, int]]:
        return self.core.held_experts()

    def trim_memory(self) -> bool:
        """Give the C allocator's free pages back to the system (glibc ``malloc_trim(0)``): what a process kept of
        buffers it freed (staged expert copies, wire payloads). False where there is no glibc."""
        try:
            import ctypes

            return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
        except (OSError, AttributeError):
            return False

    def ping(self) -> int:
        return self.rank


def shard_actor_class(cfg: RuntimeConfig):
    """The Ray actor class with the concurrency this deployment needs."""
    return ray.remote(max_concurrency=16)(ExpertShardActor)


__all__ = ["ExpertShardActor", "shard_actor_class"]
