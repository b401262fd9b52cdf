"""How a full tensor maps onto its tensor-parallel shards, and back.

A shard along ``axis`` with ``stride`` s treats that axis as s equal blocks (s=3 for a fused
``q|k|v`` projection) and gives rank r the r-th chunk *of every block*, so each rank holds its own
heads of q, k and v rather than, say, all of q. ``stride=1`` is a plain contiguous split. This is
Megatron's ``partition_stride``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def shard_slice(full: torch.Tensor, axis: int, stride: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a contiguous copy)."""
    if world == 1:
        return full
    blocks = full.chunk(stride, dim=axis)
    return torch.cat([block.chunk(world, dim=axis)[rank] for block in blocks], dim=axis).contiguous()


def sharded_shape(shape: Sequence[int], axis: int, world: int) -> torch.Size:
    """The shape of one shard of a tensor of ``shape``."""
    out = list(shape)
    out[axis] //= world
    return torch.Size(out)


def unshard(shards: Sequence[torch.Tensor], axis: int, stride: int) -> torch.Tensor:
    """Reassemble the full tensor from every rank's shard (the inverse of :func:`shard_slice`)."""
    if len(shards) == 1:
        return shards[0]
    per_rank_blocks = [s.chunk(stride, dim=axis) for s in shards]
    blocks = [torch.cat([rank_blocks[b] for rank_blocks in per_rank_blocks], dim=axis) for b in range(stride)]
    return torch.cat(blocks, dim=axis)
