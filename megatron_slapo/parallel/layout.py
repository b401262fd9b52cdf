"""How a full tensor maps onto its tensor-parallel shards, and back.

A shard along ``axis`` with a ``stride`` cuts that axis into blocks and gives rank r the r-th
chunk *of every block*, concatenated in block order, so each rank holds its own heads of q, k and
v rather than, say, all of q. This is Megatron's ``partition_stride``, generalised:

- an int s: s equal blocks (s=3 for GPT-2's fused ``q|k|v``); ``stride=1`` is a plain contiguous split;
- a tuple of positive ints: blocks of those relative sizes, for blocks of unequal widths, as
  ``(H, KV, KV)`` for a packed ``q|k|v`` with grouped-query attention (Phi-3's ``qkv_proj``):
  ``stride=(4, 2, 2)`` on an axis of 64 rows means blocks of 32, 16 and 16 rows.

:func:`block_sizes` is that geometry, used by every reader of a stride.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

Stride = int | tuple[int, ...]  # s equal blocks, or blocks of these relative sizes


def as_stride(value: int | Sequence[int]) -> Stride:
    """``value`` as a :data:`Stride`: a list (a tuple stored as JSON, or passed by a user) becomes a
    tuple; raises ValueError unless it is an int >= 1 or a non-empty sequence of ints >= 1."""
    if _is_int(value):
        if value < 1:
            raise ValueError(f"stride must be >= 1, got {value}")
        return int(value)
    if isinstance(value, Sequence) and not isinstance(value, str):
        sizes = tuple(value)
        if sizes and all(_is_int(s) and s >= 1 for s in sizes):
            return tuple(int(s) for s in sizes)
    raise ValueError(f"stride must be an int >= 1 or a non-empty tuple of ints >= 1, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def relative_sizes(stride: Stride) -> tuple[int, ...]:
    """The blocks' relative sizes in lowest terms: ``3`` and ``(2, 2, 2)`` are both ``(1, 1, 1)``
    (two strides cut every axis alike exactly when these are equal)."""
    if isinstance(stride, int):
        return (1,) * stride
    common = math.gcd(*stride)
    return tuple(s // common for s in stride)


def block_count(stride: Stride) -> int:
    """How many blocks ``stride`` cuts an axis into (1: a plain contiguous split)."""
    return stride if isinstance(stride, int) else len(stride)


def block_sizes(extent: int, stride: Stride) -> list[int]:
    """The sizes of the blocks ``stride`` cuts an axis of ``extent`` into, in order; raises
    ValueError when they would not be whole."""
    weights = relative_sizes(stride)
    unit, left = divmod(extent, sum(weights))
    if left:
        shape = f"{stride} equal blocks" if isinstance(stride, int) else f"blocks of relative sizes {list(stride)}"
        raise ValueError(f"an axis of {extent} does not split into {shape}")
    return [w * unit for w in weights]


def shard_slice(full: torch.Tensor, axis: int, stride: Stride, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a contiguous copy)."""
    if world == 1:
        return full
    blocks = full.split(block_sizes(full.size(axis), stride), dim=axis)
    return torch.cat([block.chunk(world, dim=axis)[rank] for block in blocks], dim=axis).contiguous()


def sharded_shape(shape: Sequence[int], axis: int, world: int) -> torch.Size:
    """The shape of one shard of a tensor of ``shape``."""
    out = list(shape)
    out[axis] //= world
    return torch.Size(out)


def unshard(shards: Sequence[torch.Tensor], axis: int, stride: Stride) -> torch.Tensor:
    """Reassemble the full tensor from every rank's shard (the inverse of :func:`shard_slice`)."""
    if len(shards) == 1:
        return shards[0]
    per_rank_blocks = [s.split(block_sizes(s.size(axis), stride), dim=axis) for s in shards]
    blocks = [
        torch.cat([rank_blocks[b] for rank_blocks in per_rank_blocks], dim=axis) for b in range(block_count(stride))
    ]
    return torch.cat(blocks, dim=axis)
