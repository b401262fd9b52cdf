"""The fusion pass: Linear children that read the same input computed as one GEMM.

A plan asks for it with ``ParallelRegionInput(fuse=...)``; the kernel that computes the GEMM and
hands each layer its part is :class:`~megatron_slapo.kernels.shared_input.SharedInput`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from megatron_slapo.kernels.shared_input import SharedInput, shared_forward
from megatron_slapo.module_surgery import base_forward, set_base_forward

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule


def why_not_fused(module: nn.Module, names: list[str]) -> str | None:
    """Why the children ``names`` of ``module`` cannot be one GEMM, or ``None``: they must be two or
    more Linear layers of one input width, all with a bias or all without."""
    layers = [getattr(module, name, None) for name in names]
    if len(layers) < 2 or not all(type(layer) is nn.Linear for layer in layers):
        return f"fusing needs two or more nn.Linear children, got {', '.join(names)}"
    if len({layer.in_features for layer in layers}) > 1 or len({layer.bias is None for layer in layers}) > 1:
        return f"{', '.join(names)} differ in input width or in having a bias: not one GEMM"
    if any(base_forward(layer) is not None for layer in layers):
        return f"{', '.join(names)}: a layer already computes in a way of its own (fused, row-parallel)"
    return None


def fuse_projections(sch: Schedule, names: list[str]) -> None:
    """Compute the Linear children ``names`` of ``sch``'s module, which read the same input, as one
    GEMM (module docstring); ``ParallelRegionInput(fuse=...)`` calls it for a plan."""
    problem = why_not_fused(sch.mod, names)
    if problem:
        raise sch._error(problem)
    layers = [getattr(sch.mod, name) for name in names]
    group = SharedInput(layers)
    for layer in layers:
        layer.shared_input = group
        set_base_forward(layer, shared_forward)
