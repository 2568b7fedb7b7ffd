"""Serving test fixtures."""

from __future__ import annotations

import pytest

from ray_moe.phases.decode import CapturedStep


class EagerCapture(CapturedStep):
    """A captured step without CUDA: 'capture' keeps the body, 'replay' copies the staged inputs into the
    captured buffers (same names and shapes, as a graph replay requires) and runs the body eagerly."""

    def capture(self, body):
        self.body = body

    def replay(self, staged):
        assert staged.keys() == self.inputs.keys()
        for name, t in staged.items():
            assert t.shape == self.inputs[name].shape, name
            self.inputs[name].copy_(t)
        return self.body(self.inputs)


@pytest.fixture
def eager_capture(monkeypatch):
    """The static-shape (CUDA-graph) step paths on CPU: generation captures become ``EagerCapture``."""
    import ray_moe.serving.engine as engine

    monkeypatch.setattr(engine, "CapturedStep", EagerCapture)
    return EagerCapture
