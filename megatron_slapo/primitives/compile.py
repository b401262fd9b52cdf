"""``compile``: run a module's computation through ``torch.compile`` (inductor by default).

Compiling each transformer layer on its own (regional compilation, as torchtitan does) fuses what
HF runs as separate kernels: the row-parallel layer's bias add after its all-reduce, the residual
dropout and the residual add, the layer norms, GeLU with its bias. Layers of one class share the
compiled code where dynamo can tell them apart by their inputs alone (an unsharded model); under
tensor parallelism each layer compiles on its own, quickly after the first (inductor's cache).

What is compiled is the module's *computation* (its class ``forward``, or the one ``shard``
installed), not the wrappers of ``checkpoint`` and ``fork_rng`` around it: recompute and the
tensor-parallel RNG streams stay in eager Python, and collectives that dynamo cannot trace (the
RNG fork) become graph breaks, not errors. It is applied by ``build``, after every other
primitive, so the order in which a schedule calls them does not matter.

Random ops in compiled code draw from torch's own generator, as eager ones (inductor's
``fallback_random``): a compiled layer's dropout masks are those its eager twin draws, the
tensor-parallel RNG streams and recompute's replay included, so parity holds with dropout on.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megatron_slapo.compat.dynamo import outside_function_modes, raise_recompile_limits
from megatron_slapo.graph_edit import why_never_called
from megatron_slapo.module_surgery import base_forward, set_base_forward
from megatron_slapo.primitives.registry import primitive

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


class CompileMixin:
    @primitive
    def compile(self: ScheduleNode, backend: str = "inductor") -> None:
        """Run this module's computation through ``torch.compile(backend=...)`` (applied by ``build``)."""
        if self.metadata.compiled:
            raise self._error("compile() is already applied to this module")
        never = why_never_called(self)
        if never:
            raise self._error(f"compile() cannot apply: {never}; compile a module the graph calls")
        self.metadata.compiled = backend


class CompiledForward:
    """A module computation ``fn(module, *args)`` run through ``torch.compile``. The module is an
    input of the compiled code, so modules of one class can share it; a deep copy of the model
    compiles anew (compiled code is not copied)."""

    def __init__(self, fn: Callable[..., Any], backend: str) -> None:
        self.fn, self.backend = fn, backend
        # Static shapes: a recompute must run the very graph the forward ran, which automatic
        # dynamic shapes (a static graph first, a dynamic one after a new shape) does not ensure.
        # Random ops through torch's generator (inductor's own is slower on a CPU): dropout
        # draws the masks eager would, so a compiled model trains exactly as its eager twin.
        options = {"fallback_random": True} if backend == "inductor" else None
        self.compiled = torch.compile(fn, backend=backend, dynamic=False, options=options)

    def __deepcopy__(self, memo: dict) -> CompiledForward:
        return CompiledForward(copy.deepcopy(self.fn, memo), self.backend)

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # Without the active TorchFunctionModes (the CPU shim's, around megatron-core's schedules:
        # see megatron_slapo.compat.megatron_cpu). Compiled code is specialised to the modes it ran
        # under, and a recompute in the backward runs outside them: with the modes popped, the
        # forward and its recompute run the same graph.
        with outside_function_modes():
            return self.compiled(module, *args, **kwargs)


def apply_compiles(sch: ScheduleNode) -> list[str]:
    """Swap in the compiled computation of every node marked by ``compile``; return their paths."""
    paths = []
    for path, node in sch.named_schedules():
        if node.metadata.compiled:
            fn = base_forward(node.mod) or type(node.mod).forward
            set_base_forward(node.mod, CompiledForward(fn, node.metadata.compiled))
            paths.append(path)
    # dynamo keeps a few compiled versions per function (one per set of guards), then runs it eagerly.
    # Layers that hold patched forwards (row-parallel layers under tensor parallelism) each get
    # their own version, guarded on those objects: allow enough for every compiled module (the
    # repeats are cheap, inductor's cache holds their code).
    raise_recompile_limits(4 * len(paths) + 8)
    return paths
