"""Linear layers with the bias add as a separate op, so it can fuse with what follows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DecomposedLinear(nn.Linear):
    """``nn.Linear`` computed as ``matmul`` then ``+ bias``; traced through (never a leaf)."""

    slapo_inline = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        return out + self.bias if self.bias is not None else out


class DecomposedConv1D(nn.Module):
    """HF ``Conv1D`` (weight stored as in x out) computed as ``matmul`` then ``+ bias``."""

    slapo_inline = True

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.empty(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight) + self.bias
