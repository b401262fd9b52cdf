"""``checkpoint``: activation recomputation of one module.

The module's forward runs under ``torch.utils.checkpoint`` (non-reentrant), so its activations are
dropped after the forward and recomputed in the backward. Dropout must draw the same masks the
second time: torch restores the default generator, and a context restores the tensor-parallel RNG
streams (:mod:`megatron_slapo.parallel.random`) to where they were when the forward started.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from megatron_slapo.graph_edit import external_users, extract, splice, why_never_called
from megatron_slapo.kernels.subgraph import SubgraphModule
from megatron_slapo.module_surgery import add_forward_wrapper
from megatron_slapo.parallel.random import get_rng_tracker
from megatron_slapo.pattern import Subgraph
from megatron_slapo.primitives.registry import primitive

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


def _tracker_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    # Called once per checkpointed forward: snapshot the streams now, replay them on recompute.
    tracker = get_rng_tracker()
    return contextlib.nullcontext(), tracker.replay(tracker.snapshot())


def checkpointed(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Forward wrapper that recomputes ``inner`` in the backward instead of keeping activations."""
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    return torch_checkpoint(inner, *args, use_reentrant=False, context_fn=_tracker_contexts, **kwargs)


class CheckpointedSubgraph(SubgraphModule):
    """Part of a traced graph, run under activation checkpointing."""

    def forward(self, *inputs: Any) -> Any:
        return checkpointed(self.graph, *inputs)


class CheckpointMixin:
    @primitive
    def checkpoint(self: ScheduleNode, subgraph: Subgraph | None = None) -> None:
        """Recompute this module's activations (or only a subgraph's, from ``find``) in the backward pass."""
        if subgraph is not None:
            self._checkpoint_subgraph(subgraph)
            return
        if self.metadata.checkpointed:
            raise self._error("checkpoint() is already applied to this module")
        never = why_never_called(self)
        if never:
            raise self._error(f"checkpoint() cannot apply: {never}; checkpoint a module the graph calls, "
                              "or a subgraph of the traced graph (checkpoint(subgraph=...))")  # fmt: skip
        add_forward_wrapper(self.mod, checkpointed)
        self.metadata.checkpointed = True

    def _checkpoint_subgraph(self: ScheduleNode, subgraph: Subgraph) -> None:
        owner = subgraph.owner
        leaking = [n.name for n, users in external_users(subgraph.nodes).items() if users and n not in subgraph.outputs]
        if leaking:
            raise owner._error(f"cannot checkpoint {subgraph}: {', '.join(leaking)} are also used outside it")
        graph = extract(owner.mod, subgraph.nodes, subgraph.inputs, subgraph.outputs, "CheckpointedPart")
        group = [(subgraph.nodes, subgraph.outputs)]
        callee = CheckpointedSubgraph(graph)
        try:
            splice(owner.mod, group, subgraph.inputs, callee, "checkpointed", callee_runs_replaced=True)
        except ValueError as e:
            raise owner._error(str(e)) from e
        owner._refresh_children()
