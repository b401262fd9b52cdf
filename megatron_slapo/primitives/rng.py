"""``fork_rng``: run a module on the tensor-parallel RNG stream.

Use it on modules whose dropout acts on partitioned activations (attention probabilities of this
rank's heads, say): their masks must differ across tensor-parallel ranks, while dropout on
replicated activations must agree. See :mod:`megatron_slapo.parallel.random`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_slapo.graph_edit import why_never_called
from megatron_slapo.module_surgery import add_forward_wrapper
from megatron_slapo.parallel.random import get_rng_tracker
from megatron_slapo.primitives.registry import primitive

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


def on_model_parallel_rng(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Forward wrapper that runs ``inner`` with the model-parallel stream swapped in."""
    with get_rng_tracker().fork():
        return inner(*args, **kwargs)


class ForkRngMixin:
    @primitive
    def fork_rng(self: ScheduleNode) -> None:
        """Run this module under the model-parallel RNG stream (dropout differs across TP ranks)."""
        if self.metadata.forked_rng:
            raise self._error("fork_rng() is already applied to this module")
        never = why_never_called(self)
        if never:
            raise self._error(f"fork_rng() cannot apply: {never}; fork the RNG of a module the graph calls")
        add_forward_wrapper(self.mod, on_model_parallel_rng)
        self.metadata.forked_rng = True
