"""A subgraph compiled by torch.compile (inductor: C++ on CPU, Triton on GPU)."""

from __future__ import annotations

import functools
from collections.abc import Callable
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


# What torch raises where it cannot build kernels on this machine, by class name (torch._inductor.exc
# and torch._dynamo.exc are private modules): no working C++ compiler (a missing or broken ``cc``),
# a C++/CUDA compile that fails (missing headers, a toolchain inductor cannot drive), Triton missing
# or the GPU too old for it. (A backend name torch does not know is the caller's mistake, answered
# before compiling.)
CANNOT_BUILD = frozenset({"InvalidCxxCompiler", "CppCompileError", "TritonMissing", "GPUTooOldForTriton"})


def _cannot_build(error: BaseException) -> BaseException | None:
    """The exception in ``error``'s chain that says kernels cannot be built here, or ``None``.

    Dynamo wraps what a backend raises (``BackendCompilerFailed``, inductor's ``InductorError``) and
    keeps it as ``inner_exception``; inductor raises its own errors ``from`` the subprocess's."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(c.__name__ in CANNOT_BUILD and c.__module__.startswith("torch.") for c in type(error).__mro__):
            return error
        error = getattr(error, "inner_exception", None) or error.__cause__
    return None


@functools.cache
def compiler_problem(backend: str | Callable = "inductor") -> str | None:
    """Why ``torch.compile(backend=...)`` cannot build a forward and backward here, or ``None``
    (inductor needs a C++ compiler on a CPU, Triton on a GPU).

    Only that answer is an answer: any other error of the probe's compile (a bug in torch, in the
    backend or in how it is called) is raised as it is, so that a broken compiler fails the run, or
    the test, rather than passing for a machine without one."""
    if isinstance(backend, str) and backend not in torch.compiler.list_backends(exclude_tags=()):
        return f"torch.compile has no backend {backend!r} (it has: {', '.join(torch.compiler.list_backends())})"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.ones(4, device=device, requires_grad=True)
    try:
        with torch.enable_grad():  # the first caller may be inside no_grad (a loss's forward)
            torch.compile(lambda t: (t * 2).sin(), backend=backend, fullgraph=True)(x).sum().backward()
    except Exception as e:
        cause = _cannot_build(e)
        if cause is None:
            raise
        text = str(cause).strip()
        first = text.splitlines()[0] if text else ""
        return f"torch.compile(backend={backend!r}) cannot build kernels on {device}: {type(cause).__name__} {first}"
    return None
