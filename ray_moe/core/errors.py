"""Typed errors. Every error names the field and the value that caused it."""

from __future__ import annotations

import re


class RayMoEError(Exception):
    """The root of every ray-moe error. Bad input raises the subclasses that are also ``ValueError``s
    (``RouteValidationError``, ``ConfigError``, ``AdmissionError``)."""


class ConfigError(RayMoEError, ValueError):
    """A deployment's configuration or checkpoint is unusable (named field, file or tensor)."""


class RouteValidationError(RayMoEError, ValueError):
    """A route batch, a physical assignment or a handle field is malformed (raised before any exchange)."""


class CountAgreementError(RayMoEError):
    """Peers disagreed on counts or coordinates in the control round; every rank aborts before payload."""


class StaleGenerationError(RayMoEError):
    """A dispatch named a generation that is not eligible for new dispatches (DRAINING, RETIRED, unknown).

    ``active`` carries the generation that is active now, when known, so the caller can replan."""

    def __init__(self, message: str, *, requested: int | None = None, active: int | None = None):
        super().__init__(message)
        self.requested = requested
        self.active = active

    def __reduce__(self):  # keep the keyword fields across Ray's pickling
        return (_rebuild_stale, (str(self), self.requested, self.active))


class GenerationError(RayMoEError):
    """An illegal registry transition: retire with live leases, release twice, unknown lease, ..."""


class ExchangeTimeoutError(RayMoEError):
    """A peer did not deliver within the exchange watchdog (a dead or stuck rank)."""


class ExpertUnavailableError(RayMoEError):
    """A logical expert has no live replica and no checkpoint to rebuild one from."""

    def __init__(self, message: str, *, expert: int, layer: int = 0):
        super().__init__(message)
        self.expert = expert
        self.layer = layer

    def __reduce__(self):
        return (_rebuild_unavailable, (str(self), self.expert, self.layer))


class RankDeadError(RayMoEError):
    """A shard actor is gone (its process died or was killed); ``ranks`` names the dead ranks."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)

    def __reduce__(self):
        return (_rebuild_dead, (str(self), self.ranks))


class StepMemoryError(RayMoEError):
    """A generation step ran out of device memory on a rank. The step failed alone: the shard freed its cached
    blocks and keeps serving; the driver gives the step's sequences back to the queue (re-prefilled later, what
    they generated kept) and makes its steps smaller."""

    def __init__(self, message: str, *, rank: int = -1, step_id: str = ""):
        super().__init__(message)
        self.rank, self.step_id = int(rank), str(step_id)

    def __reduce__(self):
        return (_rebuild_memory, (str(self), self.rank, self.step_id))


def _rebuild_memory(message: str, rank: int, step_id: str) -> "StepMemoryError":
    return StepMemoryError(message, rank=rank, step_id=step_id)


class AdmissionError(RayMoEError, ValueError):
    """A plan was refused before anything moved (memory budget, layout change under one generation)."""


class RequestError(RayMoEError, ValueError):
    """An argument of a driver or control call is out of range or names nothing that exists (expert, layer,
    rank, replica count, ...). Raised on the driver, or by the coordinator / a shard and unwrapped by
    ``ray_moe.ray.remote.call``."""


class ClusterConnectionError(RayMoEError, ConnectionError):
    """No Ray cluster answers at the address given (or none runs on this machine)."""


class ClusterAuthError(ClusterConnectionError):
    """The Ray cluster refused this client: Ray token authentication (``RAY_AUTH_MODE=token``)."""


class DeploymentStartError(RayMoEError, RuntimeError):
    """``Runtime.start`` failed after validation; everything it had created was removed. ``stage`` names
    the step that failed; ``__cause__`` is the root cause (not Ray's wrapper)."""

    def __init__(self, message: str, *, stage: str = ""):
        super().__init__(message)
        self.stage = stage


class DeploymentExistsError(DeploymentStartError):
    """A live deployment already holds the name (use ``Runtime.connect``)."""


class ResourcesUnavailableError(DeploymentStartError):
    """The deployment's placement group could not be placed within the start timeout. ``missing``: resource
    -> amount short now; ``holders``: who holds those resources (other deployments' placement groups)."""

    def __init__(self, message: str, *, stage: str = "reserving resources", missing: dict | None = None,
                 holders: list | None = None):
        super().__init__(message, stage=stage)
        self.missing = dict(missing or {})
        self.holders = list(holders or [])


def _rebuild_stale(message: str, requested: int | None, active: int | None) -> StaleGenerationError:
    return StaleGenerationError(message, requested=requested, active=active)


def _rebuild_unavailable(message: str, expert: int, layer: int) -> ExpertUnavailableError:
    return ExpertUnavailableError(message, expert=expert, layer=layer)


def _rebuild_dead(message: str, ranks: tuple[int, ...]) -> RankDeadError:
    return RankDeadError(message, ranks=ranks)


def root_cause(exc: BaseException) -> BaseException:
    """The original exception behind Ray's wrappers (RayTaskError keeps it in ``cause``)."""
    seen = 0
    while seen < 8:
        cause = getattr(exc, "cause", None)
        if cause is None or cause is exc:
            return exc
        exc = cause
        seen += 1
    return exc


def unwrap_remote(exc: BaseException) -> BaseException:
    """The exception a caller of ray-moe should see for ``exc`` raised across an actor boundary.

    1. Behind Ray's ``RayTaskError`` wrappers (nested ones too), the original exception (``root_cause``).
    2. A ray-moe error as it is; a plain ``ValueError`` (bad input refused inside an actor) as a
       ``RequestError`` with the same message; anything else as its original type. (A Ray error whose
       cause did not survive pickling stays Ray's error.)
    """
    cause = root_cause(exc)
    if isinstance(cause, ValueError) and not isinstance(cause, RayMoEError) and not _is_ray_error(cause):
        return RequestError(str(cause))
    return cause


def _is_ray_error(exc: BaseException) -> bool:
    """One of Ray's own exception classes (checked by name: this module does not import Ray)."""
    return any(k.__name__ == "RayError" and k.__module__ == "ray.exceptions" for k in type(exc).__mro__)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def error_line(exc: BaseException) -> str:
    """One plain line for ``exc``: the root cause's message without Ray's banner, traceback or ANSI codes.

    ray-moe's own errors and bad input (``ValueError``) read as their message; other errors are prefixed by
    their type name. A Ray task error whose cause did not survive pickling gives its last line (the
    ``Type: message`` of the remote traceback); other multi-line messages give their first line.
    """
    cause = root_cause(exc)
    lines = [ln.strip() for ln in _ANSI.sub("", str(cause)).splitlines() if ln.strip()]
    if not lines:
        return type(cause).__name__
    banner = lines[0].startswith(("ray::", "Traceback"))
    text = lines[-1] if banner else lines[0]
    if banner or isinstance(cause, (RayMoEError, ValueError)):
        return text
    return f"{type(cause).__name__}: {text}"
