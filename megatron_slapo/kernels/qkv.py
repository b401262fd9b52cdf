"""One projection for q, k and v (three GEMMs become one), tensor-parallel aware.

Under tensor parallelism the fused projection is column-parallel with Megatron's stride layout
(``shard("weight", axis=0, stride=3)``, or ``stride=(H, KV, KV)`` when k and v are narrower than q,
see :mod:`megatron_slapo.parallel.layout`): each rank
holds its own heads of q, k and v, one after the other, so its output splits into *local* sizes
(the global ones divided by the TP size). The layout is checked before anything runs
(:meth:`FusedQKV.schedule_problem`, called by ``build``'s validation).

The fused tensors remember the layers they were made from (:class:`~megatron_slapo.kernels.fused_rows.FusedRows`),
so ``build`` initialises them as the concatenation of what those layers would have been
initialised to, and ``Verify`` compares their gradients with the concatenated gradients of the originals.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megatron_slapo.kernels.fused_rows import FusedRows
from megatron_slapo.parallel.layout import Stride, relative_sizes, shard_slice


@functools.lru_cache(maxsize=64)
def _local_sizes(sizes: tuple[int, ...], local: int, stride: Stride, head_dim: int | None) -> tuple[int, ...] | str:
    """The per-rank sizes of ``sizes`` when a row-sharded ``sum(sizes)`` axis keeps ``local`` rows
    per rank with ``stride``; or why that layout does not give every rank whole, contiguous parts."""
    total = sum(sizes)
    if total % local:
        return f"its projection has {local} output rows on this rank, which does not divide {total}"
    world = total // local
    if any(size % world for size in sizes):
        return f"sizes {list(sizes)} are not all divisible by the tensor-parallel size {world}"
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    fits = relative_sizes(sizes)  # the stride that does: len(sizes) when they are equal
    wanted = len(sizes) if fits == (1,) * len(sizes) else fits
    for rank in range(world):
        own = [
            torch.arange(o + rank * s // world, o + (rank + 1) * s // world)
            for o, s in zip(offsets, sizes, strict=True)
        ]
        try:
            rows = shard_slice(torch.arange(total), 0, stride, rank, world)
        except ValueError:  # the stride's blocks do not even cut this axis whole
            rows = None
        if rows is None or not torch.equal(rows, torch.cat(own)):
            return (
                f"sharding its projection with stride {stride} over {world} ranks does not give each rank its own "
                f"part of q, k and v in turn (sizes {list(sizes)}); shard proj.weight and proj.bias with stride "
                f"{wanted}, or shard separate q, k, v layers instead"
            )
    local_sizes = tuple(size // world for size in sizes)
    if head_dim is not None and any(size % head_dim for size in local_sizes):
        return f"each rank would hold {list(local_sizes)} features, not whole heads of {head_dim}"
    return local_sizes


class FusedQKV(FusedRows):
    """``x -> (q(x), k(x), v(x))`` with the three Linear layers concatenated into one.

    Built from existing layers (:meth:`from_linears`), so pretrained weights carry over.
    ``head_dim``, if given, makes sharding check that every rank holds whole heads.
    """

    def __init__(
        self, in_features: int, out_features: tuple[int, int, int], bias: bool = True, head_dim: int | None = None
    ) -> None:
        super().__init__()
        self.sizes = list(out_features)
        self.head_dim = head_dim
        self.proj = nn.Linear(in_features, sum(out_features), bias=bias)

    @classmethod
    def from_linears(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, head_dim: int | None = None) -> FusedQKV:
        """Fuse three Linear layers (on any device, meta included) into one projection."""
        with torch.device("meta"):
            fused = cls(q.in_features, (q.out_features, k.out_features, v.out_features), q.bias is not None, head_dim)
        fused.take_rows([q, k, v])
        return fused

    def _split(self) -> tuple[int, ...] | str:
        weight = self.proj.weight
        if not getattr(weight, "tensor_model_parallel", False) or weight.partition_dim != 0:
            return tuple(self.sizes)  # unsharded, or sharded on the input features: full-size outputs
        return _local_sizes(tuple(self.sizes), weight.size(0), weight.partition_stride, self.head_dim)

    def schedule_problem(self) -> str | None:
        """Why this rank's shard of the projection cannot be split into its q, k and v, or ``None``."""
        split = self._split()
        return f"FusedQKV: {split}" if isinstance(split, str) else None

    def split_sizes(self) -> list[int]:
        """This rank's sizes of q, k and v in the projection's output."""
        split = self._split()
        if isinstance(split, str):
            raise ValueError(f"FusedQKV: {split}")
        return list(split)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.proj(x).split(self.split_sizes(), dim=-1))
