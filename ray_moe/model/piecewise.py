# ======================================================================================================
#  A STEP CAPTURED IN PIECES, ATTENTION BETWEEN THEM (one rank; pure torch: no Ray)
#
#   capture (once per step size, at start): the model's forward over the size's static rows, on a side stream
#     piece 0 = CUDA graph [embeddings .. layer 0's projections, rotary, KV write]
#     ──> attention of layer 0: the capture ends; a hole recorded (its query's address, the cache tensors, the
#         layer's module and scale, a static output view); the next piece's capture begins
#     piece 1 = [layer 0's output projection, MoE .. layer 1's projections, KV write] ──> hole 1 ──> ...
#     piece L = [the last layer's output projection, MoE, norm, LM head over ``last``]
#   replay (every step of that size): the step's rows copied into the static inputs
#     piece 0 ──> hole 0: ``attend`` with THIS step's exact plan (its contexts, query runs, decode rows in place),
#     into the static output ──> piece 1 ──> ... ──> piece L
#   so one graph per row count serves every step of that size, whatever its sequences and contexts (vLLM's
#   piecewise CUDA graphs; the holes are its splitting ops).
#
#   memory: the pieces share one pool with every other captured step. What crosses a piece boundary (a hole's
#   query, the step's outputs) is held WEAKLY: the graphs replay one at a time and every output is consumed on
#   the stream before the next replay, so later captures may reuse that memory.
# ======================================================================================================
"""Piecewise CUDA graphs of one step size: ``PiecewiseGraph`` (capture, replay) and its holes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ray_moe.model.attention import AttentionPlan, Kernels, attend
from ray_moe.model import mla
from ray_moe.moe.decode.graphs import copy_inputs, weak


class OutputArena:
    """One buffer the holes write their attention outputs into (every layer and every captured size shares
    it: a hole's output is read by the next piece before the next hole runs). Sized once, before any capture
    (its address is captured): ``rows`` x ``heads`` x ``dim`` elements of ``dtype``."""

    def __init__(self, rows: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows, self.heads, self.dim = int(rows), int(heads), int(dim)
        self.buf = torch.zeros(self.rows * self.heads * self.dim, dtype=dtype, device=device)

    def view(self, rows: int, heads: int, dim: int) -> torch.Tensor:
        """[1, rows, heads, dim] at the buffer's start."""
        if rows * heads * dim > self.buf.numel():
            raise ValueError(f"rows={rows}, heads={heads}, dim={dim}: the attention output arena holds "
                             f"{self.rows} x {self.heads} x {self.dim}")
        return self.buf[: rows * heads * dim].view(1, rows, heads, dim)

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


@dataclass(eq=False)
class Hole:
    """One attention call cut out of a captured forward: the layer's module and scale, its query [1, Hq, R, D]
    (weak: a piece's output), the cache tensors it attends (key / value [1, Hk, C + 1, D]) and the static
    output [1, R, Hq, Dv] the next piece reads."""

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scaling: float | None
    out: torch.Tensor

    def run(self, plan: AttentionPlan, kernels: Kernels) -> None:
        """This step's attention of the plan's real rows into the static output (padding rows keep what they
        held: finite values no real row reads)."""
        attend(self.module, self.query, self.key, self.value, plan, self.scaling, kernels,
               out=self.out[:, : plan.rows])


class _Cutter:
    """The ``StepAttention`` of a capture: each call ends the running piece, records a hole, begins the next."""

    def __init__(self, graph: "PiecewiseGraph", pool: Any, arena: OutputArena) -> None:
        self.graph, self.pool, self.arena = graph, pool, arena
        self.current: Any = None

    def begin(self) -> None:
        self.current = torch.cuda.CUDAGraph()
        self.current.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        self.current.capture_end()
        self.graph.pieces.append(self.current)
        self.current = None

    def __call__(self, module, query, key, value, scaling):
        out = self.arena.view(int(query.shape[2]), int(query.shape[1]), mla.output_dim(module, value))
        self.end()
        self.graph.holes.append(Hole(module, weak(query), key, value, scaling, out))
        self.begin()
        return out


class PiecewiseGraph:
    """One step size captured in pieces (module banner). ``inputs``: the static inputs (owned: every replay
    copies a step's rows into them)."""

    def __init__(self, inputs: dict[str, torch.Tensor]) -> None:
        self.inputs = inputs
        self.pieces: list[Any] = []
        self.holes: list[Hole] = []
        self.output: Any = None

    def capture(self, body: Callable[[dict[str, torch.Tensor], Any], Any], pool: Any, arena: OutputArena,
                stream: Any = None) -> Any:
        """``body(inputs, attention) -> outputs``, recorded (nothing executes) after the caller ran the same
        size eagerly (the warm-up). ``pool``: the graph memory pool shared with every other captured step (None:
        a new one); ``stream``: the side stream captures run on (None: torch's default capture stream, the one
        ``torch.cuda.graph`` uses, so library workspaces bound to it are shared). Returns the pool."""
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        cut = _Cutter(self, pool, arena)
        side = stream
        if side is None:
            if torch.cuda.graph.default_capture_stream is None:
                torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
            side = torch.cuda.graph.default_capture_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            cut.begin()
            try:
                out = body(self.inputs, cut)
            except BaseException:
                if cut.current is not None:  # (an aborted capture must still end)
                    try:
                        cut.current.capture_end()
                    except Exception:  # noqa: BLE001 - the capture's own error is the one raised
                        pass
                raise
            cut.end()
        torch.cuda.current_stream().wait_stream(side)
        self.output = weak(out)
        return pool

    @torch.no_grad()
    def replay(self, staged: dict[str, torch.Tensor], plan: AttentionPlan, kernels: Kernels,
               between: Callable[[], None] | None = None) -> Any:
        """``staged``: this step's static inputs (same names; a shorter 1-D one fills a prefix); ``plan``: its
        attention over the real rows. Returns the captured outputs (valid until the next replay of any graph). The
        holes run without autograd, as the captured pieces did (a hole's output is copied into a static buffer made
        under ``no_grad``). ``between``: host work run after each hole (its launches queued: the device is busy)."""
        copy_inputs(self.inputs, staged)
        for piece, hole in zip(self.pieces, self.holes):
            piece.replay()
            hole.run(plan, kernels)
            if between is not None:
                between()
        self.pieces[-1].replay()
        return self.output

    @property
    def num_pieces(self) -> int:
        return len(self.pieces)


__all__ = ["PiecewiseGraph", "Hole", "OutputArena", "copy_inputs", "weak"]
