"""Base for modules that run a piece of their owner's graph (compiled or checkpointed subgraphs)."""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn


class SubgraphModule(nn.Module):
    """Holds an extracted subgraph that calls its owner's layers, without registering them twice.

    The graph is kept outside the module's registered children: its layers (and weights) stay
    registered in the owner under their own names, so parameter names, ``state_dict`` keys,
    ``.train()`` and ``.to()`` behave as before. :meth:`targets` tells graph edits and the
    pipeline partitioner which of the owner's layers this module still needs.
    """

    def __init__(self, graph: fx.GraphModule) -> None:
        super().__init__()
        self.__dict__["graph"] = graph

    def train(self, mode: bool = True) -> SubgraphModule:
        """Also the graph's own mode: functional dropout in it reads ``training`` at run time, and
        the graph is not a registered child that ``.train()`` / ``.eval()`` would reach."""
        super().train(mode)
        self.graph.training = mode
        return self

    def targets(self) -> set[str]:
        """Owner-relative paths of the modules and attributes the subgraph uses."""
        return {str(n.target) for n in self.graph.graph.nodes if n.op in ("call_module", "get_attr")}

    def forward(self, *inputs: Any) -> Any:
        raise NotImplementedError
