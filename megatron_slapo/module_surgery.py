"""Moving what a module carries besides its weights (hooks) onto its replacement."""

from __future__ import annotations

from torch import nn

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def move_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the forward/backward hooks of ``old``; the hook dicts themselves move, so
    handles returned before the move keep working."""
    for attr in _HOOK_DICTS:
        hooks = getattr(old, attr)
        hooks.update(getattr(new, attr))
        setattr(new, attr, hooks)
        setattr(old, attr, type(hooks)())  # the old module no longer runs them
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook
