"""The registry of schedule primitives.

Built-in primitives are ordinary, typed methods of :class:`~megatron_slapo.schedule.Schedule`
(defined in this package, one family per file) marked with :func:`primitive`, so readers and IDEs
see their signatures. :func:`register_primitive` lets users add their own; names are unique.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_PRIMITIVES: dict[str, Callable] = {}


def _add(name: str, fn: Callable) -> None:
    if name in _PRIMITIVES:
        raise ValueError(f"a schedule primitive named {name!r} is already registered")
    _PRIMITIVES[name] = fn


def primitive(fn: F) -> F:
    """Mark a Schedule method as a primitive (listed by :func:`list_primitives`)."""
    _add(fn.__name__, fn)
    return fn


def register_primitive(fn: Callable, name: str | None = None) -> Callable:
    """Add a user primitive: ``fn(sch, *args, **kwargs)`` becomes ``sch.<name>(*args, **kwargs)``.

    Raises ``ValueError`` if the name is taken (by a built-in or an earlier registration).
    Usable as a decorator.
    """
    from megatron_slapo.schedule import Schedule

    name = name or fn.__name__
    if hasattr(Schedule, name) and name not in _PRIMITIVES:
        raise ValueError(f"{name!r} is already an attribute of Schedule and cannot be a primitive")
    _add(name, fn)
    setattr(Schedule, name, fn)
    return fn


def list_primitives() -> dict[str, str]:
    """Every primitive's name and the first line of its docstring."""
    return {name: ((fn.__doc__ or "").strip().splitlines() or [""])[0] for name, fn in _PRIMITIVES.items()}
