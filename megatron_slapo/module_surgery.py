"""Rewriting a module in place without changing its class or parameter names.

The ``*_forward`` functions rewrite a module's forward per instance (moving a module's hooks onto
its replacement is :func:`megatron_slapo.compat.torch_nn.move_hooks`).

Some primitives must change a module's computation without changing its class or its parameter
names (so HF ``state_dict`` keys and pretrained weights still fit): ``shard`` replaces the maths of
a Linear whose bias must be added after a reduction, or of a vocabulary-parallel Embedding;
``checkpoint`` and ``fork_rng`` wrap whatever the module computes. A :class:`PatchedForward` is
installed as ``module.forward`` and composes one *base* (the computation, by default the class's
own ``forward``) with *wrappers* applied outside it, in the order they were added, so the
primitives can be applied in any order.

The base is stored as a method bound to the module, never as a closure over it, so a
``copy.deepcopy`` of the model rebinds to the copy; base objects with state of their own copy
that state in their ``__deepcopy__``.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn

Wrapper = Callable[..., Any]  # wrapper(inner_forward, *args, **kwargs) -> output


class PatchedForward:
    """``base`` wrapped by ``wrappers`` (first added = innermost)."""

    def __init__(self, base: Callable[..., Any]) -> None:
        self.base = base
        self.wrappers: list[Wrapper] = []

    def __deepcopy__(self, memo: dict) -> PatchedForward:
        base = self.base
        if isinstance(base, types.MethodType):  # copy.deepcopy would share the method's function
            base = types.MethodType(copy.deepcopy(base.__func__, memo), copy.deepcopy(base.__self__, memo))
        clone = PatchedForward(base)
        clone.wrappers = list(self.wrappers)
        return clone

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.base
        for wrapper in self.wrappers:
            fn = functools.partial(wrapper, fn)
        return fn(*args, **kwargs)


def _patched(module: nn.Module) -> PatchedForward:
    current = module.__dict__.get("forward")
    if isinstance(current, PatchedForward):
        return current
    if current is not None:
        raise RuntimeError(f"{type(module).__name__} already has an instance-level forward that is not ours")
    patched = PatchedForward(module.forward)
    module.forward = patched
    return patched


def set_base_forward(module: nn.Module, fn: Callable[..., Any]) -> None:
    """Replace the computation of ``module`` with ``fn(module, *args, **kwargs)``."""
    _patched(module).base = types.MethodType(fn, module)


def add_forward_wrapper(module: nn.Module, wrapper: Wrapper) -> None:
    """Run ``module``'s computation through ``wrapper(inner, *args, **kwargs)``."""
    _patched(module).wrappers.append(wrapper)


def base_forward(module: nn.Module) -> Callable[..., Any] | None:
    """The computation installed by :func:`set_base_forward`, or ``None``."""
    current = module.__dict__.get("forward")
    if isinstance(current, PatchedForward) and isinstance(current.base, types.MethodType):
        return current.base.__func__
    return None
