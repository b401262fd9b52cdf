"""``fp8``: run one Linear (or HF Conv1D) layer's products in FP8.

FP8 is a compute format, not a storage one: the weight stays what it was (bf16 with fp32 main
copies under ``--bf16``), its name and ``state_dict`` key unchanged, and each forward casts it, the
input and, in the backward, the output's gradient to float8 with dynamic scales
(:mod:`megatron_slapo.kernels.fp8`). So a checkpoint does not know FP8 was on, and an FP8 run
resumes without it and the reverse.

Applied after ``shard``: a tensor-parallel layer agrees each scale over the ranks that split what
it scales, which the layer's role says (column-parallel: the output features; row-parallel: the
input features); ``tokens``, the group splitting the sequence (context parallelism), is agreed over
too. A layer fused with its siblings (q|k|v computed as one GEMM) leaves the fusion: each layer
scales its own weight. torchao's FP8 GEMM needs both of the layer's dimensions (this rank's shard of them) to be
multiples of 16; a layer named here that is not is refused (the trainer's default set leaves such
layers in their precision with a note, :mod:`megatron_slapo.plans.fp8`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from transformers.pytorch_utils import Conv1D

from megatron_slapo.graph_edit import why_never_called
from megatron_slapo.kernels.fp8 import Fp8Forward, Fp8Recipe, Splits
from megatron_slapo.kernels.shared_input import leave_shared_input, shared_forward
from megatron_slapo.metadata import Role
from megatron_slapo.module_surgery import base_forward, set_base_forward
from megatron_slapo.parallel.collectives import Group, group_size
from megatron_slapo.primitives.placement import own_forward
from megatron_slapo.primitives.registry import primitive
from megatron_slapo.primitives.sync import RowParallelForward

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode

ALIGNMENT = 16  # torch._scaled_mm: both dimensions of the weight multiples of 16


def fp8_problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot run in FP8, or ``None``: not a Linear / HF Conv1D computing its plain
    maths, or dimensions (this rank's shard) that are not multiples of 16."""
    if not isinstance(module, (nn.Linear, Conv1D)):
        return f"{type(module).__name__} is not an nn.Linear or HF Conv1D"
    overrider = own_forward(module)
    if overrider is not None:
        return f"its forward ({overrider}) is not the Linear's plain product"
    shape = tuple(module.weight.shape)
    if any(size % ALIGNMENT for size in shape):
        return f"its weight {shape} is not a multiple of {ALIGNMENT} in both dimensions, as torchao's FP8 GEMM needs"
    return None


class Fp8Mixin:
    @primitive
    def fp8(self: ScheduleNode, recipe: Fp8Recipe, *, tokens: Group = None) -> None:
        """Run this Linear / HF Conv1D layer's three products (output, input and weight gradients) in FP8.

        ``recipe``: torchao's scaling (tensorwise or rowwise) and Megatron's format (e4m3, or
        hybrid: e5m2 gradients). Apply after ``shard``: a split layer's scales are agreed over its
        tensor-parallel group, and over ``tokens`` (the context-parallel group, whose ranks each
        hold part of the sequence), so every rank casts what one process would.
        """
        if self.metadata.fp8:
            raise self._error("fp8() is already applied to this module")
        problem = fp8_problem(self.mod) or why_never_called(self)
        if problem:
            raise self._error(f"fp8() cannot apply: {problem}")
        split = (self.group,) if group_size(self.group) > 1 else ()
        role = self.metadata.role
        splits = Splits(tokens=(tokens,) if group_size(tokens) > 1 else (),
                        inputs=split if role is Role.ROW else (), outputs=split if role is Role.COLUMN else ())  # fmt: skip
        forward = Fp8Forward(recipe, splits)
        base = base_forward(self.mod)
        if base is shared_forward:  # fused with its siblings (q|k|v, gate|up): its own FP8 product instead
            leave_shared_input(self.mod)
            base = None
        if isinstance(base, RowParallelForward):  # reduce the FP8 product, then add the bias
            base.product = forward.product
        elif base is None:
            set_base_forward(self.mod, forward)
        else:
            raise self._error(f"fp8() cannot apply: the layer's forward was replaced by {type(base).__name__}")
        self.metadata.fp8 = recipe.describe()
