"""Linear layers with the bias add as a separate op, so it can fuse with what follows.

Both are subclasses of the layer they decompose and compute the same maths, so ``shard`` gives
them the same placement (column / row parallel, a row-parallel bias added once after the
reduction); see :mod:`megatron_slapo.primitives.placement`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D


class DecomposedLinear(nn.Linear):
    """``nn.Linear`` computed as ``matmul`` then ``+ bias``; traced through (never a leaf)."""

    slapo_inline = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        return out + self.bias if self.bias is not None else out


class DecomposedConv1D(Conv1D):
    """HF ``Conv1D`` (weight stored as in x out) computed as ``matmul`` then ``+ bias``; traced through."""

    slapo_inline = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight) + self.bias
