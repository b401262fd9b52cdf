"""``hook``: attach a forward or backward hook, kept by later ``replace`` calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.utils.hooks import RemovableHandle

from megatron_slapo.graph_edit import why_never_called
from megatron_slapo.primitives.registry import primitive

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode

_REGISTER = {
    "fwd_pre": "register_forward_pre_hook",
    "fwd_post": "register_forward_hook",
    "bwd_pre": "register_full_backward_pre_hook",
    "bwd_post": "register_full_backward_hook",
}


class HookMixin:
    @primitive
    def hook(self: ScheduleNode, mode: str, fn: Callable[..., Any], **kwargs: Any) -> RemovableHandle:
        """Register ``fn`` as a fwd_pre / fwd_post / bwd_pre / bwd_post hook (PyTorch signatures).

        Refused on a module that a traced ancestor's graph no longer calls (a decomposed layer traced
        through, a level inlined by ``flatten=True``): the hook would never run.
        """
        if mode not in _REGISTER:
            raise self._error(f"unknown hook mode {mode!r}; expected one of {tuple(_REGISTER)}")
        if not callable(fn):
            raise self._error(f"hook function must be callable, got {type(fn).__name__}", TypeError)
        never = why_never_called(self)
        if never:
            raise self._error(f"hook({mode!r}) cannot apply: {never}; hook a module that the graph calls")
        return getattr(self.mod, _REGISTER[mode])(fn, **kwargs)
