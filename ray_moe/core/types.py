"""Identity namespaces and enums shared by every stage of ray-moe.

Glossary: the six identity namespaces (spec 0x01A0)
====================================================
An integer such as ``3`` is never a sufficient expert identifier. ray-moe keeps six namespaces apart and
gives each its own name in code:

=====================  ===========================================  ==========================================
namespace              stable within                                 name in code (type alias below)
=====================  ===========================================  ==========================================
logical expert         model architecture and checkpoint             ``LogicalExpertId`` (int, ``0..E-1``)
physical slot          one placement generation (and one layer)      ``PhysicalSlotId`` (int, ``0..Q-1``)
replica                one logical expert and checkpoint             ``ReplicaId`` (str, ``"e{e}-r{j}"``)
rank                   one process-group epoch                        ``Rank`` (int, global rank ``0..P-1``)
process group          one communicator membership epoch             ``ProcessGroupId`` (str, ``"ep-group-0"``)
generation             a dispatch handle's lifetime                   ``GenerationId`` (int; ``placement-v{g}``)
=====================  ===========================================  ==========================================

Two more coordinates are derived, never free: a *peer slot* is a position inside one process group's
peer order (``ProcessGroupSpec.peer_order[i]`` is the global rank at peer slot ``i``), and a *local slot
index* is a physical slot's position among the slots of its destination rank, in manifest order.

The router emits logical experts. Placement may choose among replicas of that logical expert (a
physical slot), which fixes the destination rank. Nothing after the router may change the logical
expert or the gate of a route (the 0x00E firewall).
"""

from __future__ import annotations

from enum import Enum

LogicalExpertId = int
PhysicalSlotId = int
ReplicaId = str
Rank = int
ProcessGroupId = str
GenerationId = int


def placement_version(generation: GenerationId) -> str:
    """``placement-v{g}``: the human name of a generation (spec 0x02B2)."""
    return f"placement-v{generation}"


def replica_name(expert: LogicalExpertId, replica_index: int) -> ReplicaId:
    """``e{e}-r{j}``: replica ``j`` of logical expert ``e``."""
    return f"e{expert}-r{replica_index}"


class Phase(str, Enum):
    """Serving phase of an execution unit (spec 0x05)."""

    PREFILL = "prefill"
    DECODE = "decode"


class GenerationState(str, Enum):
    """State of a placement generation (spec 0x02B3).

    PENDING: reserved and materialising, not yet eligible for dispatch.
    ACTIVE: eligible for new dispatches. DRAINING: serves pinned handles only.
    RETIRED: resolves nothing.
    """

    PENDING = "PENDING"
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    RETIRED = "RETIRED"


class RunnerKind(str, Enum):
    """Local expert runner representations (spec 0x04)."""

    PADDED = "padded"
    GROUPED = "grouped"
    BLOCK = "block"
    LOOP = "loop"


class ExchangeKind(str, Enum):
    """Exchange backends behind the one all-to-all-v interface."""

    LOCAL = "local"
    OBJECT_STORE = "object_store"
    NCCL = "nccl"
    GLOO = "gloo"  # torch.distributed gloo between CPU actors: one collective per round


class ReplicaPolicy(str, Enum):
    """Replica selection policies (spec 0x08H)."""

    ROUND_ROBIN = "round_robin"
    HASH = "hash"
    LEAST_LOAD = "least_load"
    LOCALITY = "locality"
    EXPLICIT = "explicit"  # a frozen upstream assignment (the spec fixtures)


class RouteClass(str, Enum):
    """Physical class of one route (spec 0x07C)."""

    SAME_GPU = "same-gpu"
    SAME_NODE = "same-node-remote-gpu"
    CROSS_NODE = "different-node"


class PayloadFormat(str, Enum):
    """Dispatch payload representation (spec 0x0AB)."""

    NATIVE = "native"  # the activation dtype itself (bf16 on GPU, fp32 in CPU tests)
    FP8_ROW = "fp8_row"  # e4m3 + one fp32 scale per row
    FP8_BLOCK128 = "fp8_block128"  # e4m3 + one fp32 scale per 128 values per row


class DispatchPath(str, Enum):
    """Which implementation moves a normal (variable) step's rows.

    ENGINE: ``dispatch/engine.py``, the reference protocol (slot ids travel with the rows, every payload
    format, the hierarchical schedule). DIRECT: ``dispatch/direct.py``, the fast path (own rows bypass
    the network, a captured plan, one-pass combine; native payload, flat schedule). AUTO: DIRECT where it
    applies (NCCL exchange, native payload, flat schedule), else ENGINE.
    """

    ENGINE = "engine"
    DIRECT = "direct"
    AUTO = "auto"


class DispatchMode(str, Enum):
    """The data path a dispatcher implements (one typed output per mode, ``dispatch/protocol.py``).

    ENGINE: the reference (``engine.py``); DIRECT: the fast normal mode (``direct.py``); BUCKET: the
    fixed-capacity decode mode (``bucket.py``, CUDA-graph capturable); LOCAL: a one-rank group (``local.py``).
    """

    ENGINE = "engine"
    DIRECT = "direct"
    BUCKET = "bucket"
    LOCAL = "local"  # a group of one: no exchange (``local.py``), prefill and decode


class AttentionBackend(str, Enum):
    """How a shard's model attends over its paged KV cache (``model/attention.py``).

    MASKED: SDPA over the gathered packed contexts with a block-diagonal mask (CPU, fp32: the reference).
    VARLEN: FlashAttention-2 variable-length forward, per sequence, no mask (CUDA, fp16 / bf16).
    AUTO: VARLEN where its kernel check passes on the shard's device and dtype, else MASKED.
    """

    MASKED = "masked"
    VARLEN = "varlen"
    AUTO = "auto"


class ExchangeSchedule(str, Enum):
    """Flat all-to-all-v or hierarchical through node relays (spec 0x07E)."""

    FLAT = "flat"
    HIERARCHICAL = "hierarchical"


class ReleaseState(str, Enum):
    """Release lifecycle (spec 0x0EA)."""

    BUILT = "BUILT"
    VERIFIED = "VERIFIED"
    LOADED = "LOADED"
    SHADOW = "SHADOW"
    CANARY = "CANARY"
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    RETIRED = "RETIRED"
