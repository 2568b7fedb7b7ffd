"""The Python API raises ray-moe's own error types whichever side of the actor boundary refused the call.

``rt.scale(99)`` is refused inside the coordinator actor, ``rt.remove_rank(7)`` and ``rt.expert_weights(99)``
on the driver: all three raise a ``RequestError`` (a ``RayMoEError`` and a ``ValueError``) whose message
names the field, never Ray's ``RayTaskError`` wrapper.
"""

from __future__ import annotations

import pytest
import ray
import torch

import ray_moe
from ray_moe.ray.remote import call
from ray_moe.apps.release_client import ReleaseClient
from ray_moe.core.errors import (
    ExpertUnavailableError,
    GenerationError,
    RayMoEError,
    RequestError,
    error_line,
    unwrap_remote,
)


@pytest.fixture(scope="module")
def rt(ray_session):
    rt = ray_moe.Runtime.start(ray_moe.RuntimeConfig(num_ranks=2, num_experts=4, hidden_size=8, ffn_size=16, top_k=2,
                                                     slots_per_rank=3, name="api-errors"))
    rt.forward(torch.randn(8, 8))
    yield rt
    rt.shutdown()


def assert_own_error(info: pytest.ExceptionInfo, field: str) -> None:
    exc = info.value
    assert isinstance(exc, RequestError) and isinstance(exc, RayMoEError) and isinstance(exc, ValueError)
    assert not isinstance(exc, ray.exceptions.RayError)
    assert str(exc).startswith(field), str(exc)
    assert "ray::" not in str(exc) and "\x1b[" not in str(exc) and "\n" not in str(exc)


@pytest.mark.parametrize("call_, field", [
    (lambda rt: rt.scale(99, 2), "expert=99 is out of range [0, 4)"),          # refused in the coordinator
    (lambda rt: rt.scale(1, 0), "replicas=0 must be >= 1"),                    # refused in the coordinator
    (lambda rt: rt.scale(1, 2, layer=5), "layer=5 is out of range"),           # refused in the coordinator
    (lambda rt: rt.remove_rank(7), "rank=7 is not a live member"),             # refused on the driver
    (lambda rt: rt.expert_weights(99), "expert=99 is out of range [0, 4)"),   # refused on the driver
])
def test_bad_control_input_raises_request_error(rt, call_, field):
    g = rt.placement().generation
    with pytest.raises(ValueError) as info:
        call_(rt)
    assert_own_error(info, field)
    assert rt.placement().generation == g  # nothing was published


def test_project_errors_keep_their_type_across_the_boundary(rt):
    with pytest.raises(GenerationError, match=r"^generation=12345 is not registered"):
        ReleaseClient.for_runtime(rt).activate(12345)  # the coordinator's registry refuses it, before any shard
    w_gate, _, _ = rt.expert_weights(1)
    assert w_gate.shape == (16, 8)


@ray.remote
def _raise(kind: str):
    if kind == "value":
        raise ValueError("expert=5 is out of range [0, 4)")
    if kind == "own":
        raise ExpertUnavailableError("logical expert 3 has no live replica", expert=3)
    raise KeyError("slot 9")


def test_call_unwraps_task_errors(ray_session):
    with pytest.raises(RequestError, match=r"^expert=5 is out of range \[0, 4\)$") as info:
        call(_raise.remote("value"))
    assert isinstance(info.value.__cause__, ray.exceptions.RayTaskError)  # the remote traceback stays chained
    with pytest.raises(ExpertUnavailableError) as info:
        call(_raise.remote("own"))
    assert info.value.expert == 3
    with pytest.raises(KeyError):
        call(_raise.remote("key"))
    assert call([ray.put(1), ray.put(2)]) == [1, 2]


def test_error_line_is_one_plain_line(ray_session):
    try:
        ray.get(_raise.remote("value"))
    except ray.exceptions.RayTaskError as exc:
        wrapped = exc
    assert "ray::" in str(wrapped)  # what a user saw before: Ray's banner and the remote traceback
    assert error_line(wrapped) == "expert=5 is out of range [0, 4)"
    assert isinstance(unwrap_remote(wrapped), RequestError)
    try:
        ray.get(_raise.remote("key"))
    except ray.exceptions.RayTaskError as exc:
        assert error_line(exc) == "KeyError: 'slot 9'"
    assert error_line(RuntimeError("\x1b[31mboom\x1b[0m\nmore")) == "RuntimeError: boom"
