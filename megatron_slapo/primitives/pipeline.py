"""``cut_pipeline_stage``: mark the module where a new pipeline stage starts (see megatron_slapo.pipeline)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from megatron_slapo.primitives.registry import primitive

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


class PipelineMixin:
    @primitive
    def cut_pipeline_stage(self: ScheduleNode) -> None:
        """Start a new pipeline stage at this module (a child of a traced or ModuleList parent)."""
        if self.metadata.pipeline_cut:
            raise self._error("cut_pipeline_stage() is already applied to this module")
        owner = self.parent
        while owner is not None and not isinstance(owner.mod, fx.GraphModule):
            owner = owner.parent
        target = self.path[len(owner.path) :].lstrip(".") if owner is not None else None
        if owner is None or not any(n.op == "call_module" and n.target == target for n in owner.mod.graph.nodes):
            raise self._error("cut_pipeline_stage() needs a traced parent graph that calls this module: trace() first")
        self.metadata.pipeline_cut = True
