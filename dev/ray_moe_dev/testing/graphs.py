"""CUDA-graph step paths on a CPU: captures that keep their body and replay it eagerly over the captured static
inputs (the same input copies a replay makes, the same holes a piecewise replay runs), so the padding, the static
inputs and the holes' per-step plans are tested token-equal where no GPU is (``tests/conftest.py``
``eager_capture``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ray_moe.model.attention import AttentionPlan, Kernels
from ray_moe.model.piecewise import Hole, OutputArena, PiecewiseGraph
from ray_moe.moe.decode.graphs import CapturedStep, copy_inputs


class EagerCapture(CapturedStep):
    """A whole-step capture without CUDA: 'capture' keeps the body, 'replay' copies the staged inputs into the
    captured buffers (a shorter slot vector into its prefix, as a replay does) and runs the body eagerly."""

    def capture(self, body: Callable, pool: Any = None) -> Any:
        self.body = body
        return pool

    def replay(self, staged: dict[str, torch.Tensor]) -> Any:
        copy_inputs(self.inputs, staged)
        return self.body(self.inputs)


class EagerPiecewise(PiecewiseGraph):
    """A piecewise capture without CUDA: 'replay' copies the staged rows into the static inputs and runs the body
    eagerly, every attention call a hole (``Hole.run``: the step's plan, into the shared output arena) followed by
    the ``between`` hook."""

    def capture(self, body: Callable, pool: Any, arena: OutputArena) -> Any:
        self.body, self.arena = body, arena
        return pool

    def replay(self, staged: dict[str, torch.Tensor], plan: AttentionPlan, kernels: Kernels,
               between: Callable[[], None] | None = None) -> Any:
        copy_inputs(self.inputs, staged)

        def hole(module, query, key, value, scaling):
            out = self.arena.view(int(query.shape[2]), int(query.shape[1]), int(value.shape[-1]))
            Hole(module, query, key, value, scaling, out).run(plan, kernels)
            if between is not None:  # (after each hole, as ``PiecewiseGraph.replay``)
                between()
            return out

        return self.body(self.inputs, hole)


class EagerGraphs:
    """The ``StepGraphRunner`` backend of the CPU tests (``graph_runner.CudaGraphs``' two methods); no warm-up
    (nothing is compiled for a shape here: every replay runs the body eagerly)."""

    warmup = False

    def full(self, inputs: dict[str, torch.Tensor]) -> EagerCapture:
        return EagerCapture(inputs)

    def piecewise(self, inputs: dict[str, torch.Tensor]) -> EagerPiecewise:
        return EagerPiecewise(inputs)


__all__ = ["EagerCapture", "EagerPiecewise", "EagerGraphs"]
