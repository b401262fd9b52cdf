"""A subgraph compiled by torch.compile (inductor: C++ on CPU, Triton on GPU)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx as fx

from megatron_slapo.kernels.subgraph import SubgraphModule


class CompiledSubgraph(SubgraphModule):
    """Runs an extracted subgraph through ``torch.compile(backend=compiler)``, compiled on first use.

    See :class:`SubgraphModule` for how it shares its owner's layers. Compilation is cached by
    torch (``TORCHINDUCTOR_CACHE_DIR``), so a restart with the same graph recompiles quickly.
    """

    def __init__(self, graph: fx.GraphModule, compiler: str = "inductor") -> None:
        super().__init__(graph)
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


@functools.cache
def compiler_problem(backend: str = "inductor") -> str | None:
    """Why ``torch.compile(backend=...)`` cannot build a forward and backward here, or ``None``
    (inductor needs a C++ compiler on a CPU, Triton on a GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.ones(4, device=device, requires_grad=True)
    try:
        with torch.enable_grad():  # the first caller may be inside no_grad (a loss's forward)
            torch.compile(lambda t: (t * 2).sin(), backend=backend, fullgraph=True)(x).sum().backward()
    except Exception as e:  # noqa: BLE001 (whatever the backend raises, the answer is "it cannot")
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"torch.compile(backend={backend!r}) cannot build kernels on {device}: {type(e).__name__} {first}"
    return None
