"""The registry of schedule primitives.

Built-in primitives are ordinary, typed methods of :class:`~megatron_slapo.schedule.Schedule`
(defined in this package, one family per file) marked with :func:`primitive`, so readers and IDEs
see their signatures. ``register_primitive`` (in :mod:`megatron_slapo.schedule`, which owns the class) lets users add
their own; names are unique.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_PRIMITIVES: dict[str, Callable] = {}


def add(name: str, fn: Callable) -> None:
    """Record ``fn`` as the primitive ``name``; ``ValueError`` if the name is taken."""
    if name in _PRIMITIVES:
        raise ValueError(f"a schedule primitive named {name!r} is already registered")
    _PRIMITIVES[name] = fn


def primitive(fn: F) -> F:
    """Mark a Schedule method as a primitive (listed by :func:`list_primitives`)."""
    add(fn.__name__, fn)
    return fn


def is_primitive(name: str) -> bool:
    """Whether ``name`` is a registered primitive."""
    return name in _PRIMITIVES


def list_primitives() -> dict[str, str]:
    """Every primitive's name and the first line of its docstring."""
    return {name: ((fn.__doc__ or "").strip().splitlines() or [""])[0] for name, fn in _PRIMITIVES.items()}
