"""An RMSNorm over features split across the tensor-parallel ranks (OLMo 2's q/k norms).

OLMo 2 normalises q (and k) over all heads' width at once, before splitting them into heads. With
the heads split over the ranks, each rank holds ``1/t`` of that width: the mean of squares must
span every rank's part. Megatron's answer for such norms is kept: the sum of squares is
all-reduced (``b·s`` numbers per norm, forward and backward) and each rank scales its own part,
so q/k/v stay column-parallel and the attention block keeps its one input-gradient all-reduce,
where following HF's ``colwise_gather_output`` literally would gather q, k and v whole.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_slapo.parallel.collectives import Group, reduce_both


class SplitRMSNormForward:
    """Forward of an HF RMSNorm (``weight * x / sqrt(mean(x²) + eps)``, normalised in fp32) whose
    weight and input hold this rank's ``1/t`` of the features. HF's norms cast back to the input's
    dtype in one of two places: Llama's before the weight (``weight * x.to(dtype)``, ``cast_first``),
    OLMo 2's after it (``(weight * x).to(dtype)``); the same one is kept, so 16-bit runs round alike."""

    def __init__(self, group: Group, width: int, cast_first: bool) -> None:
        self.group, self.width, self.cast_first = group, width, cast_first  # width: the whole normalised width

    def __deepcopy__(self, memo: dict) -> SplitRMSNormForward:
        return self  # holds a process group handle, shared rather than copied

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        squares = reduce_both(x.pow(2).sum(-1, keepdim=True), self.group)
        normed = x * torch.rsqrt(squares / self.width + module.variance_epsilon)
        return module.weight * normed.to(dtype) if self.cast_first else (module.weight * normed).to(dtype)
