"""One projection for q, k and v (three GEMMs become one)."""

from __future__ import annotations

import torch
from torch import nn


class FusedQKV(nn.Module):
    """``x -> (q(x), k(x), v(x))`` with the three Linear layers concatenated into one.

    Built from existing layers (:meth:`from_linears`), so pretrained weights carry over.
    """

    def __init__(self, in_features: int, out_features: tuple[int, int, int], bias: bool = True) -> None:
        super().__init__()
        self.sizes = list(out_features)
        self.proj = nn.Linear(in_features, sum(out_features), bias=bias)

    @classmethod
    def from_linears(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> FusedQKV:
        fused = cls(q.in_features, (q.out_features, k.out_features, v.out_features), bias=q.bias is not None)
        fused.to(device=q.weight.device, dtype=q.weight.dtype)
        with torch.no_grad():
            fused.proj.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            if q.bias is not None:
                fused.proj.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        return fused

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.proj(x).split(self.sizes, dim=-1))
