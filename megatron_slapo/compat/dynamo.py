"""torch.compile's internals: dynamo's recompile limits and torch's function-mode stack.

Written against torch 2.13.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch._dynamo.config as dynamo_config


def raise_recompile_limits(limit: int) -> None:
    """Let dynamo keep at least ``limit`` compiled versions of a function (and ``16 * limit`` in all)
    before it falls back to eager. ``torch._dynamo.config.recompile_limit`` and
    ``accumulated_recompile_limit``: ``torch.compiler.config`` does not carry them. torch 2.13."""
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, limit)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 16 * limit)


@contextlib.contextmanager
def outside_function_modes() -> Iterator[None]:
    """Run without the active ``TorchFunctionMode``s, restored after. ``torch.overrides``'
    ``_get_current_function_mode_stack`` and ``_pop_mode_temporarily``: torch offers no public way
    to step out of modes another library entered. torch 2.13."""
    with contextlib.ExitStack() as stack:
        while torch.overrides._get_current_function_mode_stack():
            stack.enter_context(torch.overrides._pop_mode_temporarily())
        yield
