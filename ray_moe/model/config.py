"""RuntimeConfig: everything a deployment is built from, validated before any actor starts (and read from a
Hugging Face checkpoint folder: ``RuntimeConfig.from_pretrained``)."""

from __future__ import annotations

import math
import os
from enum import Enum
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ray_moe.core.errors import ConfigError

from ray_moe.core.types import DispatchPath, ExchangeKind, ExchangeSchedule, PayloadFormat, ReplicaPolicy, RunnerKind

if TYPE_CHECKING:
    from ray_moe.model.spec import ModelSpec


class EplbMode(str, Enum):
    """When the coordinator rebalances by itself (``ray_moe.control.autopilot``)."""

    OFF = "off"  # only on command (``rt.rebalance()``, ``ray-moe rebalance``)
    AUTO = "auto"  # when the predicted gain of an EPLB solve passes the threshold (with budget and hysteresis)
    PERIODIC = "periodic"  # every ``periodic_steps`` load steps, as vLLM's ``step_interval``


class AutopilotPolicy(BaseModel):
    """The ``eplb`` field group of a RuntimeConfig: the automatic-rebalance policy (``control/autopilot.py``).

    A *step* here is one load observation in the coordinator's load window (one driver's load report,
    covering ``flush_every`` served steps), the unit ``LoadWindow`` counts. ``gain`` is the relative drop of
    the bottleneck rank's routed rows an EPLB solve predicts: ``1 - imbalance_after / imbalance_now``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: EplbMode = EplbMode.OFF
    threshold_gain: float = Field(default=0.10, ge=0.0, lt=1.0, description="AUTO: rebalance when gain >= this")
    byte_budget: int | None = Field(default=None, ge=1, description=(
        "most bytes one rebalance may write (copies + checkpoint loads, analytical); None: no limit"))
    min_interval_s: float = Field(default=30.0, ge=0.0, description="AUTO: seconds since the last rebalance")
    min_interval_steps: int = Field(default=16, ge=0, description="AUTO: load steps since the last rebalance")
    periodic_steps: int | None = Field(default=None, ge=1, description="PERIODIC: rebalance every N load steps")
    min_window_steps: int = Field(default=8, ge=1, description="load steps the window must hold to decide")
    tick_s: float = Field(default=1.0, gt=0.0, description="the coordinator evaluates at most this often")
    history: int = Field(default=64, ge=1, description="decisions the coordinator keeps")

    @model_validator(mode="after")
    def _check(self) -> "AutopilotPolicy":
        if self.mode is EplbMode.PERIODIC and self.periodic_steps is None:
            raise ValueError("periodic_steps=None: mode=periodic needs periodic_steps >= 1 (--eplb periodic:N)")
        return self


class OperationStage(str, Enum):
    """The stages of one elastic operation (rebalance, scale, add / remove a rank), in order
    (``ray_moe.control.operations``): plan the migration, reserve the candidate, copy experts shard to shard
    (or load them from the checkpoint), verify every slot's digest, publish, drain the prior generation,
    retire it."""

    PLAN = "plan"
    RESERVE = "reserve"
    COPY = "copy"
    VERIFY = "verify"
    PUBLISH = "publish"
    DRAIN = "drain"
    RETIRE = "retire"


class StageDeadlines(BaseModel):
    """The ``deadlines`` field group of a RuntimeConfig: seconds each stage of an elastic operation may take.

    A stage before publish that passes its deadline aborts the operation (the prior generation keeps serving,
    staged copies are freed); past publish the new generation serves and a late drain or retire leaves the
    prior generation DRAINING for a later change to retire."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan_s: float = Field(default=30.0, gt=0, description="admit the migration plan (checked once it is built)")
    reserve_s: float = Field(default=30.0, gt=0, description="register the candidate (and sweep orphans)")
    copy_s: float = Field(default=300.0, gt=0, description="every expert copy and checkpoint load together")
    verify_s: float = Field(default=120.0, gt=0, description="prepare + digest check on every rank")
    publish_s: float = Field(default=60.0, gt=0, description="every rank publishes the candidate")
    drain_s: float = Field(default=60.0, gt=0, description="the prior generation's refcount reaches 0")
    retire_s: float = Field(default=60.0, gt=0, description="every rank retires the prior generation")

    def of(self, stage: OperationStage) -> float:
        """The deadline of ``stage``, seconds."""
        return float(getattr(self, f"{OperationStage(stage).value}_s"))


class ScalingPolicy(BaseModel):
    """The ``scaling`` field group of a RuntimeConfig: load-driven scaling of the rank count
    (``ray_moe.control.scaling``; the scaler thread: ``ray_moe.ray.scaler``). Off by default.

    A rank is added when the oldest waiting request has waited more than ``target_wait_s``; one is drained and
    removed once the deployment had no work for ``idle_s``. No change within ``cooldown_s`` of the last one; a
    change that reverses the last one (a removal after an addition, or the other way) needs its threshold
    passed by the ``hysteresis`` fraction more (wait > target x (1 + h), idle >= idle_s x (1 + h)), so a load
    that comes and goes does not make the rank count thrash."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    min_ranks: int = Field(default=1, ge=1, description="never fewer live ranks (also kept: replica floors, "
                                                         "the ranks that hold every expert once)")
    max_ranks: int = Field(default=8, ge=1, description="never more live ranks")
    target_wait_s: float = Field(default=2.0, gt=0.0, description="add a rank when the oldest wait passes this")
    idle_s: float = Field(default=60.0, gt=0.0, description="remove a rank after this long without work")
    cooldown_s: float = Field(default=30.0, ge=0.0, description="seconds between two changes")
    hysteresis: float = Field(default=0.25, ge=0.0, le=4.0, description="margin a reversing change needs")
    tick_s: float = Field(default=1.0, gt=0.0, description="the scaler samples the signals this often")
    history: int = Field(default=256, ge=1, description="decisions the scaler keeps")

    @model_validator(mode="after")
    def _check(self) -> "ScalingPolicy":
        if self.min_ranks > self.max_ranks:
            raise ValueError(f"min_ranks={self.min_ranks} exceeds max_ranks={self.max_ranks}")
        return self


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
    seeded_on_device: bool = Field(default=False, description=(
        "seeded experts are drawn by a generator on the shard's device (start of checkpoint-sized random shapes "
        "without a CPU draw; CUDA's values differ from the CPU draw, the same for every rank and run)"))
    checkpoint: str | None = Field(default=None, description="a Hugging Face model folder (config.json + safetensors, "
                                                             "per-expert or fused experts), or a Mixtral-named folder")
    quantization: str | None = Field(default=None, pattern="^fp8$", description=(
        "fp8: the routed experts of an unquantized checkpoint (or seeded weights) quantized at load to block-scaled "
        "FP8 (e4m3 codes, float32 scales per 128 x 128 block, as DeepSeek-V3 ships), held and computed as an FP8 "
        "checkpoint's are; the non-expert modules stay in dtype. An FP8 checkpoint is served as it is either way"))
    placement_strategy: str = Field(default="PACK", pattern="^(PACK|SPREAD|STRICT_PACK|STRICT_SPREAD)$")
    actor_cpus: float = Field(default=0.5, gt=0)
    exchange_timeout_s: float = Field(default=60.0, gt=0)
    heal_retries: int = Field(default=0, ge=0, le=10, description=(
        "self-healing ranks: a dead shard is replaced by a new one (start attempts per lost rank, and the "
        "replacements one line of ranks may lose before it is left out); 0: off (the deployment runs short)"))
    load_window: int = Field(default=64, ge=1)
    num_groups: int = Field(default=1, ge=1, description=(
        "expert groups for hierarchical EPLB. Not checked against num_experts here: the node count is "
        "known only at rebalance time, and the solver uses the groups (and requires them to divide "
        "num_experts) only when num_groups is a multiple of it; otherwise it falls back to the global policy"))
    memory_budget_bytes: int | None = Field(default=None, ge=1, description="per-rank weight budget")
    staging_slots: int = Field(default=2, ge=0, description=(
        "spare rows per layer in a shard's expert slot buffers (migration staging); more grow the buffer"))
    decode_token_capacity: int | None = Field(default=None, ge=1, description=(
        "C_T: the decode bucket's largest token capacity per rank (its captured decode sizes stop there); None: "
        "the running sequences of a rank when serving (ceil(max_running / ranks)), 32 for expert-only steps"))
    decode_slot_capacity: int | None = Field(default=None, ge=1, description="C_q per slot (None: 2x even share)")
    decode_buckets: bool = Field(default=True, description="decode steps use the fixed-capacity bucket path")
    cuda_graphs: bool = Field(default=True, description="capture and replay decode buckets as CUDA graphs")
    rebuild_from_checkpoint: bool = Field(
        default=True, description="when a rank dies, rebuild experts with no surviving copy from the checkpoint")
    eplb: AutopilotPolicy = Field(default_factory=AutopilotPolicy,
                                  description="automatic rebalance (off by default; ray-moe serve: auto)")
    deadlines: StageDeadlines = Field(default_factory=StageDeadlines,
                                      description="per-stage deadlines of elastic operations (seconds)")
    scaling: ScalingPolicy = Field(default_factory=ScalingPolicy,
                                   description="load-driven scaling of the rank count (off by default)")

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
        if self.seeded_on_device and self.checkpoint:
            raise ValueError(f"seeded_on_device=True draws random experts, but checkpoint={self.checkpoint!r} "
                             f"gives them (drop one)")
        if self.eplb.mode is not EplbMode.OFF and self.eplb.min_window_steps > self.load_window:
            raise ValueError(f"eplb.min_window_steps={self.eplb.min_window_steps} exceeds load_window="
                             f"{self.load_window}: the window never holds enough steps for the autopilot to decide")
        if self.scaling.enabled:
            hold = math.ceil(self.num_experts * self.num_layers / (self.slots_per_rank * self.num_layers))
            if self.scaling.max_ranks < hold:
                raise ValueError(f"scaling.max_ranks={self.scaling.max_ranks}: {hold} ranks of slots_per_rank="
                                 f"{self.slots_per_rank} are needed to hold num_experts={self.num_experts} once")
            if not self.scaling.min_ranks <= self.num_ranks <= self.scaling.max_ranks:
                raise ValueError(f"num_ranks={self.num_ranks} is outside scaling [min_ranks={self.scaling.min_ranks}, "
                                 f"max_ranks={self.scaling.max_ranks}]")
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
        return config_from_pretrained(folder, num_ranks=num_ranks, device=device, dtype=dtype, **overrides)

    @property
    def resolved_dispatch_path(self) -> DispatchPath:
        """ENGINE or DIRECT (AUTO resolved against the exchange, payload format and schedule)."""
        if self.dispatch_path is not DispatchPath.AUTO:
            return self.dispatch_path
        direct = (self.exchange_kind is ExchangeKind.NCCL and self.payload_format is PayloadFormat.NATIVE
                  and self.exchange_schedule is ExchangeSchedule.FLAT)
        return DispatchPath.DIRECT if direct else DispatchPath.ENGINE

    def start_warnings(self) -> list[str]:
        """What this configuration leaves slower or less protected than a user may assume (said at start):
        healing off; an FP8 payload format on one rank (which exchanges nothing)."""
        out = []
        if self.heal_retries == 0:
            out.append("healing is off (heal_retries=0): a shard that dies is not replaced and the deployment runs "
                       "one rank short (RuntimeConfig(heal_retries=2) heals, as ray-moe serve does by default)")
        if self.payload_format is not PayloadFormat.NATIVE and self.num_ranks == 1:
            out.append(f"payload_format={self.payload_format.value}: a deployment of one rank exchanges no rows: it "
                       f"applies to none")
        return out

    @property
    def num_slots(self) -> int:
        return self.slots_per_rank * self.num_ranks

    @property
    def exchange_kind(self) -> ExchangeKind:
        if self.exchange is not None:
            return self.exchange
        return ExchangeKind.NCCL if self.device == "cuda" else ExchangeKind.OBJECT_STORE

def default_slots_per_rank(num_experts: int, num_ranks: int) -> int:
    """Slots per rank when the caller gives none: every expert once, spread evenly, plus about a quarter
    more for replicas (at least one per rank):

        base = ceil(E / P);  slots_per_rank = base + max(1, ceil(base / 4))

    e.g. E=8, P=4 -> 2 + 1 = 3 (12 slots, 4 replicas); E=256, P=8 -> 32 + 8 = 40 (320 slots, 64 replicas).
    One rank: every expert once, no replica (a second replica on the same device balances nothing; it would
    only make every generation row-mapped over the slot buffers, ``moe/experts/slab.py``).
    """
    if num_experts < 1 or num_ranks < 1:
        raise ConfigError(f"num_experts={num_experts} / num_ranks={num_ranks} must be >= 1")
    if num_ranks == 1:
        return num_experts
    base = math.ceil(num_experts / num_ranks)
    return base + max(1, math.ceil(base / 4))


def config_from_pretrained(folder: str, *, num_ranks: int, device: str = "cpu", dtype: str = "float32",
                           spec: "ModelSpec | None" = None, validate: bool = True, **overrides: Any) -> RuntimeConfig:
    """RuntimeConfig of a checkpoint folder.

    num_experts, hidden_size, ffn_size (the MoE intermediate size), top_k and num_layers (= number of MoE
    layers) come from the folder's ModelSpec, ``checkpoint=folder``; ``slots_per_rank`` defaults to
    ``default_slots_per_rank``. ``overrides`` (any RuntimeConfig field) win. ``validate=True`` also checks
    every expert tensor of the checkpoint from the file headers (no tensor data read), so a broken folder
    fails here, in the driver, before any actor starts. Every problem raises ConfigError naming the field,
    file or tensor.
    """
    folder = os.fspath(folder)
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ConfigError(f"num_ranks={num_ranks!r}: must be an integer >= 1")
    from ray_moe.model.spec import build_spec  # transformers: loaded only for a folder

    spec = spec if spec is not None else build_spec(folder)
    if validate:
        from ray_moe.model.checkpoint import CheckpointIndex

        CheckpointIndex(folder, spec).validate()
    if spec.top_k is None:
        raise ConfigError(f"checkpoint={folder!r}: the config has no num_experts_per_tok; pass top_k=")
    fields: dict[str, Any] = {
        "num_ranks": num_ranks,
        "num_experts": spec.num_experts,
        "hidden_size": spec.hidden_size,
        "ffn_size": spec.ffn_size,
        "top_k": spec.top_k,
        "num_layers": spec.num_moe_layers,
        "device": device,
        "dtype": dtype,
        "checkpoint": folder,
    }
    fields["slots_per_rank"] = default_slots_per_rank(spec.num_experts, num_ranks)
    fields.update(overrides)
    unknown = sorted(set(fields) - set(RuntimeConfig.model_fields))
    if unknown:
        raise ConfigError(f"{unknown[0]}={fields[unknown[0]]!r}: not a RuntimeConfig field")
    try:
        return RuntimeConfig(**fields)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()))
            msg = str(err.get("msg", "")).removeprefix("Value error, ")  # model checks name their fields
            parts.append(f"{loc}={fields[loc]!r}: {msg}" if loc in fields else f"{loc}: {msg}" if loc else msg)
        raise ConfigError(f"RuntimeConfig from {folder!r}: " + "; ".join(parts)) from exc
