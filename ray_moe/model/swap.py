"""Instance ``forward`` swaps for the fused kernels (``norms``, ``router_topk``, ``qkv``): a module's forward
replaced on the instance (the seam transformers' kernels hub uses), the original kept under a named
attribute and restored by name; and the loop that fuses every module of the classes a check accepts.

``fuse_by_class`` runs ``verdict`` once per class (on the first module of it: the kernel against the class's
own forward on the model's device and dtype) and swaps the forward of every module of an accepted class;
modules already swapped under the same attribute are left alone (fusing twice changes nothing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch


@dataclass(frozen=True)
class Fused:
    """What a fusing pass did: ``modules`` now take the kernel, of the classes ``classes``; ``skipped``: class
    name -> why its modules keep their own forward."""

    modules: int = 0
    classes: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)


R = TypeVar("R", bound=Fused)


def swap_forward(module: torch.nn.Module, attr: str, make: Callable[[Any], Callable[..., Any]]) -> None:
    """``module.forward = make(original forward)`` on the instance; the original kept as ``module.<attr>``."""
    original = module.forward
    object.__setattr__(module, attr, original)
    object.__setattr__(module, "forward", make(original))


def restore_forwards(model: torch.nn.Module, attr: str, member: str = "forward") -> int:
    """Give every module of ``model`` swapped under ``attr`` its own ``member`` back (the instance's override
    removed: the class's method again); returns how many."""
    n = 0
    for module in model.modules():
        if hasattr(module, attr):
            object.__delattr__(module, member)
            object.__delattr__(module, attr)
            n += 1
    return n


def fuse_by_class(model: torch.nn.Module, attr: str, record: type[R],
                  candidate: Callable[[torch.nn.Module], bool],
                  verdict: Callable[[torch.nn.Module], tuple[str | None, Any]],
                  make: Callable[[torch.nn.Module, Any, Any], Callable[..., Any]]) -> R:
    """Swap the forward of every ``candidate`` module whose class ``verdict`` accepts.

    verdict(first module of a class) -> (None, info) to take the class (``info`` is handed to ``make``), or
    (why not, _); make(module, original forward, info) -> the module's new forward.
    """
    seen: dict[type, tuple[str | None, Any]] = {}
    fused, classes = 0, []
    for module in model.modules():
        if not candidate(module) or hasattr(module, attr):
            continue
        cls = type(module)
        if cls not in seen:
            seen[cls] = verdict(module)
            if seen[cls][0] is None:
                classes.append(cls.__name__)
        why, info = seen[cls]
        if why is not None:
            continue
        swap_forward(module, attr, lambda original, m=module, i=info: make(m, original, i))
        fused += 1
    return record(fused, tuple(classes), {c.__name__: why for c, (why, _) in seen.items() if why is not None})


__all__ = ["Fused", "fuse_by_class", "restore_forwards", "swap_forward"]
