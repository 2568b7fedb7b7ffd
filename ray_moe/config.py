"""RuntimeConfig: everything a deployment is built from, validated before any actor starts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_moe.types import DispatchPath, ExchangeKind, ExchangeSchedule, PayloadFormat, ReplicaPolicy, RunnerKind


class RuntimeConfig(BaseModel):
    """Shape and policy of one ray-moe deployment.

    ``slots_per_rank * num_ranks`` physical slots hold the ``num_experts`` logical experts of each layer;
    the surplus are replicas. ``device="cpu"`` runs the same code path with CPU tensors and the Ray
    object-store exchange; ``device="cuda"`` pins one GPU per rank and exchanges through NCCL (CuPy).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_ranks: int = Field(ge=1, description="expert-parallel ranks (one ExpertShardActor each)")
    num_experts: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    ffn_size: int = Field(ge=1)
    top_k: int = Field(ge=1)
    slots_per_rank: int = Field(ge=1)
    num_layers: int = Field(default=1, ge=1)
    device: str = Field(default="cpu", pattern="^(cpu|cuda)$")
    dtype: str = Field(default="float32", pattern="^(float32|bfloat16|float16)$")
    seed: int = 0
    name: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]+$", description="deployment name")
    runner: RunnerKind = RunnerKind.GROUPED
    exchange: ExchangeKind | None = Field(default=None, description="None: NCCL on cuda, object store on cpu")
    exchange_schedule: ExchangeSchedule = Field(default=ExchangeSchedule.FLAT,
                                                description="flat all-to-all-v or hierarchical through node relays")
    replica_policy: ReplicaPolicy = ReplicaPolicy.ROUND_ROBIN
    payload_format: PayloadFormat = PayloadFormat.NATIVE
    dispatch_path: DispatchPath = Field(default=DispatchPath.AUTO,
                                        description="engine | direct | auto (direct on NCCL with native payload)")
    residual: bool = Field(default=False, description="h <- h + MoE(h) between layers (else h <- MoE(h))")
    router_skew: float = Field(default=0.0, ge=0.0, description="Zipf exponent of a router bias (0 = none)")
    norm_topk: bool = True
    tagged_weights: bool = Field(default=False, description="expert e's output is (e+1) x a shared function")
    checkpoint: str | None = Field(default=None, description="a Hugging Face model folder (config.json + safetensors, "
                                                             "per-expert or fused experts), or a Mixtral-named folder")
    placement_strategy: str = Field(default="PACK", pattern="^(PACK|SPREAD|STRICT_PACK|STRICT_SPREAD)$")
    actor_cpus: float = Field(default=0.5, gt=0)
    exchange_timeout_s: float = Field(default=60.0, gt=0)
    load_window: int = Field(default=64, ge=1)
    num_groups: int = Field(default=1, ge=1, description=(
        "expert groups for hierarchical EPLB. Not checked against num_experts here: the node count is "
        "known only at rebalance time, and the solver uses the groups (and requires them to divide "
        "num_experts) only when num_groups is a multiple of it; otherwise it falls back to the global policy"))
    memory_budget_bytes: int | None = Field(default=None, ge=1, description="per-rank weight budget")
    decode_token_capacity: int = Field(default=32, ge=1, description="C_T: decode tokens per rank in the bucket")
    decode_slot_capacity: int | None = Field(default=None, ge=1, description="C_q per slot (None: 2x even share)")
    decode_buckets: bool = Field(default=True, description="decode steps use the fixed-capacity bucket path")
    cuda_graphs: bool = Field(default=True, description="capture and replay decode buckets as CUDA graphs")
    rebuild_from_checkpoint: bool = Field(
        default=True, description="when a rank dies, rebuild experts with no surviving copy from the checkpoint")

    @model_validator(mode="after")
    def _check(self) -> "RuntimeConfig":
        q = self.slots_per_rank * self.num_ranks
        if q < self.num_experts:
            raise ValueError(
                f"slots_per_rank={self.slots_per_rank} x num_ranks={self.num_ranks} = {q} slots cannot hold "
                f"num_experts={self.num_experts}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.dispatch_path is DispatchPath.DIRECT and (
                self.payload_format is not PayloadFormat.NATIVE or self.exchange_schedule is not ExchangeSchedule.FLAT):
            raise ValueError(
                f"dispatch_path=direct moves native rows over the flat schedule; payload_format="
                f"{self.payload_format.value} / exchange_schedule={self.exchange_schedule.value} need "
                f"dispatch_path=engine (or auto)")
        return self

    @classmethod
    def from_pretrained(cls, folder: str, *, num_ranks: int, device: str = "cpu", dtype: str = "float32",
                        **overrides) -> "RuntimeConfig":
        """Shapes, MoE layers, experts and top-k from a Hugging Face folder's config.json (every expert tensor
        checked from the safetensors headers, in this process); ``slots_per_rank`` defaults to every expert
        plus about a quarter more for replicas. Any field can be overridden."""
        from ray_moe.models.config import config_from_pretrained

        return config_from_pretrained(folder, num_ranks=num_ranks, device=device, dtype=dtype, **overrides)

    @property
    def resolved_dispatch_path(self) -> DispatchPath:
        """ENGINE or DIRECT (AUTO resolved against the exchange, payload format and schedule)."""
        if self.dispatch_path is not DispatchPath.AUTO:
            return self.dispatch_path
        direct = (self.exchange_kind is ExchangeKind.NCCL and self.payload_format is PayloadFormat.NATIVE
                  and self.exchange_schedule is ExchangeSchedule.FLAT)
        return DispatchPath.DIRECT if direct else DispatchPath.ENGINE

    @property
    def num_slots(self) -> int:
        return self.slots_per_rank * self.num_ranks

    @property
    def exchange_kind(self) -> ExchangeKind:
        if self.exchange is not None:
            return self.exchange
        return ExchangeKind.NCCL if self.device == "cuda" else ExchangeKind.OBJECT_STORE
