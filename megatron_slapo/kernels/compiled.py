"""A subgraph compiled by torch.compile (inductor: C++ on CPU, Triton on GPU)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn


class CompiledSubgraph(nn.Module):
    """Runs an extracted subgraph through ``torch.compile(backend=compiler)``, compiled on first use.

    The subgraph calls the layers (and weights) of the module it came from, which keeps them
    registered under their names: this module adds no parameters, so state dicts and ``.train()``
    / ``.to()`` work as before. Compilation is cached by
    torch (``TORCHINDUCTOR_CACHE_DIR``), so a restart with the same graph recompiles quickly.
    """

    def __init__(self, graph: fx.GraphModule, compiler: str = "inductor") -> None:
        super().__init__()
        # Not a registered submodule: its layers belong to (and stay registered in) the module it came from.
        self.__dict__["graph"] = graph
        self.compiler = compiler
        self.__dict__["compiled"] = None  # unregistered too (torch.compile wraps the graph in a module)

    def forward(self, *inputs: Any) -> Any:
        if self.compiled is None:
            self.__dict__["compiled"] = torch.compile(self.graph, backend=self.compiler, dynamic=False, fullgraph=True)
        return self.compiled(*inputs)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["compiled"] = None  # compiled artefacts are rebuilt, not copied
        return state
