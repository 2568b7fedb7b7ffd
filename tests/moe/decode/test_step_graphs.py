"""The captured steps' store (``moe/decode/graphs.py`` ``StepGraphs``): a step whose key has no graph may run in
the graph of the same key with a larger upper bound at one position (a kernel's grid bound baked into the graph),
the smallest such one, of its own generation only. A captured step is uploaded to the device at capture
(``upload_graph``), so its first replay does not upload it behind the stream's running work."""

from __future__ import annotations

import pytest
import torch

from ray_moe.moe.decode.graphs import StepGraphs


def test_covering_finds_the_smallest_larger_bound_of_an_otherwise_equal_key():
    g = StepGraphs()
    for key in [("prefill", 16, 64, 2048, "packed"), ("prefill", 16, 64, 4096, "packed"),
                ("prefill", 32, 64, 512, "packed"), ("decode", 16, 64, 1024, "packed")]:
        g.put(7, key, object())
    g.put(8, ("prefill", 16, 64, 1024, "packed"), object())
    assert g.covering(7, ("prefill", 16, 64, 1024, "packed"), 3) == ("prefill", 16, 64, 2048, "packed")
    assert g.covering(7, ("prefill", 16, 64, 2048, "packed"), 3) == ("prefill", 16, 64, 2048, "packed")
    assert g.covering(7, ("prefill", 16, 64, 3000, "packed"), 3) == ("prefill", 16, 64, 4096, "packed")
    assert g.covering(7, ("prefill", 16, 64, 8192, "packed"), 3) is None  # nothing bounds it
    assert g.covering(7, ("prefill", 32, 64, 1024, "packed"), 3) is None  # rows differ: no graph of them
    assert g.covering(7, ("prefill", 16, 128, 512, "packed"), 3) is None  # keys differ
    assert g.covering(7, ("prefill", 16, 64, 512, "batched"), 3) is None
    assert g.covering(9, ("prefill", 16, 64, 512, "packed"), 3) is None  # another generation's graphs
    assert g.release(7) == 4 and g.covering(7, ("prefill", 16, 64, 1024, "packed"), 3) is None


class _Runtime:
    """CuPy's runtime module as ``upload_graph`` calls it (records the calls; raises when told)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls, self.error = [], error

    def graphUpload(self, graph_exec: int, stream: int) -> None:  # noqa: N802 - CuPy's name
        self.calls.append((graph_exec, stream))
        if self.error is not None:
            raise self.error


class _Graph:
    def __init__(self, handle: int) -> None:
        self.handle = handle

    def raw_cuda_graph_exec(self) -> int:
        return self.handle


def test_upload_graph_uploads_the_instantiated_graph_in_the_given_stream():
    from ray_moe.moe.decode.graphs import upload_graph

    rt = _Runtime()
    assert upload_graph(_Graph(0xBEEF), rt, stream=7) is True
    assert rt.calls == [(0xBEEF, 7)]


def test_upload_graph_falls_back_to_the_first_replay_and_says_why():
    from ray_moe.moe.decode.graphs import upload_graph

    assert upload_graph(object(), _Runtime(), stream=7) is False  # a torch without raw_cuda_graph_exec
    failed = upload_graph(_Graph(1), _Runtime(RuntimeError("cudaErrorInvalidValue")), stream=7)
    assert failed == "RuntimeError: cudaErrorInvalidValue"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_step_is_uploaded_at_capture_and_replays_its_body():
    from ray_moe.moe.decode.graphs import CapturedStep

    pytest.importorskip("cupy")
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    step = CapturedStep({"x": x.clone()})
    step.capture(lambda inp: (inp["x"] * 2 + 1, None))
    assert step.uploaded is True, step.uploaded
    out, _ = step.replay({"x": x + 1})
    torch.cuda.synchronize()
    assert torch.equal(out, (x + 1) * 2 + 1)
