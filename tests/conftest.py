"""Shared fixtures. One local Ray instance per test session (ray.init costs seconds here)."""

from __future__ import annotations

import os

import pytest

# pytest's `pythonpath` ini puts dev/ and bench/ on this process's path only; the subprocesses some tests start
# and the Ray workers (which inherit the environment of the process that starts the local instance) need them too
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEV_PATHS = [os.path.join(_ROOT, "dev"), os.path.join(_ROOT, "bench"), _ROOT]
os.environ["PYTHONPATH"] = os.pathsep.join(
    _DEV_PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in _DEV_PATHS])


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
        n = torch.cuda.device_count() if has_cuda else 0
    except Exception:  # pragma: no cover
        has_cuda, n = False, 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by every test that needs one (token auth stays on)."""
    import ray

    if not ray.is_initialized():
        # address="local": always a fresh instance, never a cluster another process left running here
        ray.init(address="local", num_cpus=int(os.environ.get("RAY_MOE_TEST_CPUS", "8")), include_dashboard=False,
                 log_to_driver=False, namespace="ray-moe-tests")
    yield ray
    ray.shutdown()


# ---- the CUDA-graph step paths on CPU
@pytest.fixture
def eager_capture(monkeypatch):
    """The CUDA-graph step paths on CPU: every shard built after this captures (its data paths say so) with
    the eager emulations of ``ray_moe_dev.testing.graphs`` (generation steps' lattice, expert-only steps)."""
    import dataclasses

    import ray_moe.shard.graph_runner as graph_runner
    import ray_moe.shard.pipeline as pipeline
    from ray_moe_dev.testing.graphs import EagerCapture, EagerGraphs

    pick = pipeline.DataPaths.pick.__func__
    monkeypatch.setattr(pipeline.DataPaths, "pick",
                        classmethod(lambda cls, *a, **k: dataclasses.replace(pick(cls, *a, **k), capture=True)))
    monkeypatch.setattr(graph_runner, "CudaGraphs", EagerGraphs)
    monkeypatch.setattr(pipeline, "CapturedStep", EagerCapture)
    return EagerCapture


@pytest.fixture
def paged_references(monkeypatch):
    """The H200's attention path on CPU: the varlen backend and the in-place decode path, their per-sequence
    references standing in for FlashAttention and the Triton kernel (each host built after this picks them)."""
    import ray_moe.model.attention as attn
    import ray_moe.model.paged_decode as paged
    import ray_moe.model.paged_varlen as paged_varlen

    monkeypatch.setattr(attn, "check_flash", lambda *a, **k: None)
    monkeypatch.setattr(paged, "check_paged", lambda *a, **k: None)
    monkeypatch.setattr(paged_varlen, "check_paged_varlen", lambda *a, **k: None)
    monkeypatch.setattr(attn, "flash_varlen", attn.sequence_reference)
    monkeypatch.setattr(paged, "paged_decode", paged.paged_decode_reference)
    monkeypatch.setattr(paged_varlen, "paged_varlen", paged_varlen.paged_varlen_reference)
