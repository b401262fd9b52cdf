"""``torch.nn.Module`` internals: the tables a module holds its tensors, children and hooks in.

``nn.Module`` keeps its own parameters, buffers and children in ordered dicts (``_parameters``,
``_buffers``, ``_modules``) and its hooks in more (``_forward_hooks``, ...). The public API reads
them only recursively or without ``None`` entries (``named_parameters``, ``children``) and offers
no way to put a tensor into a slot in place, to reorder children, or to list and move hooks. The
schedule primitives need each of those, so they come from here.

Written against torch 2.13 (the tables have been stable since torch 2.0; ``_forward_hooks_always_called``
and the ``*_with_kwargs`` sets appeared in 2.0 and 2.1).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.dropout import _DropoutNd

# torch's private common bases of its layer families: the only way to say "any convolution"
# (Conv1d/2d/3d and the transposed ones), "any BatchNorm" (1d/2d/3d, Sync, Lazy) or "any dropout".
ConvNd = _ConvNd
BatchNormNd = _BatchNorm
DropoutNd = _DropoutNd

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def own_parameters(module: nn.Module) -> MutableMapping[str, nn.Parameter | None]:
    """``module._parameters``: the parameters the module holds itself, in registration order, the
    live dict (writing a slot replaces the parameter in place, keeping its position). torch 2.13."""
    return module._parameters


def own_buffers(module: nn.Module) -> MutableMapping[str, torch.Tensor | None]:
    """``module._buffers``: as :func:`own_parameters`, for buffers. torch 2.13."""
    return module._buffers


def own_tensor_tables(module: nn.Module) -> tuple[MutableMapping, MutableMapping]:
    """The module's own parameter table, then its buffer table (``_parameters``, ``_buffers``).

    Every tensor slot of a module, ``None`` ones included, as the live dicts: ``shard`` and the
    initialiser swap a tensor in its slot (no ``register_*`` call re-checks it or moves it to the
    end). torch 2.13."""
    return module._parameters, module._buffers


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """``module._non_persistent_buffers_set``: the names of its buffers left out of the state dict,
    live (``register_buffer(persistent=False)`` is the only public way in, and it re-registers the
    tensor). torch 2.13."""
    return module._non_persistent_buffers_set


def child_modules(module: nn.Module) -> MutableMapping[str, nn.Module | None]:
    """``module._modules``: its children in registration order, the live dict (``named_children``
    skips ``None`` entries and cannot reorder or swap a child without re-registering it). torch 2.13."""
    return module._modules


def forward_pre_hooks(module: nn.Module) -> MutableMapping[int, Callable]:
    """``module._forward_pre_hooks``: its forward pre-hooks by handle id (no public API lists
    hooks; the schedule checks for user hooks and finds its own trace guards there). torch 2.13."""
    return module._forward_pre_hooks


def forward_hooks(module: nn.Module) -> MutableMapping[int, Callable]:
    """``module._forward_hooks``: as :func:`forward_pre_hooks`, for forward hooks. torch 2.13."""
    return module._forward_hooks


def backward_pre_hooks(module: nn.Module) -> MutableMapping[int, Callable]:
    """``module._backward_pre_hooks``: as :func:`forward_pre_hooks`, for full backward pre-hooks. torch 2.13."""
    return module._backward_pre_hooks


def backward_hooks(module: nn.Module) -> MutableMapping[int, Callable]:
    """``module._backward_hooks``: as :func:`forward_pre_hooks`, for (full) backward hooks. torch 2.13."""
    return module._backward_hooks


def remove_forward_pre_hook(module: nn.Module, key: int) -> None:
    """Remove the forward pre-hook with handle id ``key`` (``_forward_pre_hooks`` and its
    ``_forward_pre_hooks_with_kwargs`` flag), as its ``RemovableHandle.remove()`` would, for a hook
    whose handle was not kept (a trace guard found on a module). torch 2.13."""
    del module._forward_pre_hooks[key]
    module._forward_pre_hooks_with_kwargs.pop(key, None)


def move_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the forward/backward hooks of ``old``; the hook dicts themselves move, so
    handles returned before the move keep working (a handle holds its dicts, which is why they are
    moved whole rather than re-registered). The hook dicts and ``_is_full_backward_hook``: torch 2.13."""
    for attr in _HOOK_DICTS:
        hooks = getattr(old, attr)
        hooks.update(getattr(new, attr))
        setattr(new, attr, hooks)
        setattr(old, attr, type(hooks)())  # the old module no longer runs them
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook


def conv_without_bias(module: ConvNd, x: torch.Tensor) -> torch.Tensor:
    """The convolution ``module`` computes, without its bias: ``_ConvNd._conv_forward(x, weight, None)``,
    which applies the layer's padding mode (``F.conv2d`` alone does not: ``padding_mode="circular"``
    pads first) for every dimensionality. torch 2.13."""
    return module._conv_forward(x, module.weight, None)
