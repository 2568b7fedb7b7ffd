"""The driver's calls across the actor boundary, raising ray-moe's own errors.

``call(ref)`` is ``ray.get`` for the control calls of ``ray_moe.Runtime`` (coordinator, shards): a failure
inside an actor comes back as the original exception (``ExpertUnavailableError``, ``GenerationError``, ...),
bad input refused inside an actor as a ``RequestError`` (also a ``ValueError``) with the actor's message,
never as Ray's ``RayTaskError`` wrapper. The Ray error stays chained (``__cause__``) for its remote
traceback. Errors of Ray itself (an actor that died, a timeout) pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import ray

from ray_moe.core.errors import unwrap_remote


def call(refs: Any, *, timeout: float | None = None) -> Any:
    """``ray.get(refs, timeout=timeout)`` with actor-side exceptions unwrapped (``errors.unwrap_remote``)."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        raise unwrap_remote(exc) from exc
