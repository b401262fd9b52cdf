"""Where a rank's piece of a tensor lies in the whole tensor: the geometry of a distributed checkpoint.

Two kinds of partitioning stack up on a parameter. Tensor parallelism (Megatron's tags
``partition_dim`` and ``partition_stride``) gives each TP rank a slice of the global tensor along
one dimension; with a stride the slice is one piece of each of the blocks the stride cuts that
dimension into (:mod:`megatron_slapo.parallel.layout`): GPT-2's fused q|k|v has stride 3, three
equal blocks, and Phi-3's ``qkv_proj`` with grouped-query attention stride ``(H, KV, KV)``, blocks
of those relative sizes; either way rank ``r`` holds ``q_r | k_r | v_r``. Data-parallel
partitioning (ZeRO, the distributed optimizer, FSDP2) then gives each rank a run of consecutive
elements of its TP-local tensor flattened. A run is split here into row-major boxes
(:func:`run_boxes`), each box into the parts that fall into one tensor-parallel block
(:func:`global_pieces`), each part being a box of the global tensor with a view of the rank's data.

Vocabulary padding: a Megatron vocabulary is padded to a multiple that depends on the TP size, so
a padded embedding may be another size at another layout. ``Placement.rows`` cuts such a tensor to
the rows a checkpoint holds: a run reads the rows both layouts have and leaves the rest as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_slapo.parallel.layout import Stride, block_sizes

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class Placement:
    """A TP-local tensor's place in the global one.

    ``local_shape``: the TP-local shape (padded rows included). ``partition``: ``(dim, stride)``
    of a tensor-parallel shard, or None. ``rank``/``size``: the TP rank and size. ``rows``: the
    size of dim 0 of the global tensor when it is a vocabulary padded to another size than this
    run's (the rows past it are left out), else None. ``experts``: ``(rank, size)`` of an
    expert-parallel tensor, whose dim 0 (the experts) this rank holds the ``rank``-th of ``size``
    equal parts of (before any tensor-parallel split of another dim), else None."""

    local_shape: tuple[int, ...]
    partition: tuple[int, Stride] | None
    rank: int = 0
    size: int = 1
    rows: int | None = None
    experts: tuple[int, int] | None = None

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape (dim 0 cut to ``rows`` when given)."""
        shape = list(self.local_shape)
        if self.partition is not None:
            shape[self.partition[0]] *= self.size
        if self.experts is not None:
            shape[0] *= self.experts[1]
        if self.rows is not None:
            shape[0] = self.rows
        return tuple(shape)

    @property
    def first_expert(self) -> int:
        """Where this rank's experts start along dim 0 of the global tensor (0 without expert parallelism)."""
        return self.experts[0] * self.local_shape[0] if self.experts is not None else 0

    def blocks(self) -> list[tuple[int, int, int]]:
        """``(local start, global start, length)`` along the partition dimension (dim 0 when only
        ``rows`` is given): where each of this rank's blocks lies, cut to ``rows``."""
        dim, stride = self.partition if self.partition is not None else (0, 1)
        if not self.local_shape or (self.partition is None and self.rows is None):
            return [(0, 0, self.local_shape[0] if self.local_shape else 1)]
        lengths = block_sizes(self.local_shape[dim], stride)  # this rank's piece of each block
        size = self.size if self.partition is not None else 1
        rank = self.rank if self.partition is not None else 0
        limit = self.rows if self.rows is not None and dim == 0 else None
        found, local = [], 0
        for length in lengths:
            start = local * size + rank * length  # the blocks before, whole, then the ranks before's pieces
            end = start + length if limit is None else min(start + length, limit)
            if end > start:
                found.append((local, start, end - start))
            local += length
        return found


def run_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[Box, int]]:
    """Elements ``[start, end)`` of a tensor of ``shape`` flattened row-major, as boxes each of
    which is contiguous in the flat order: ``((offsets, sizes), flat start)`` (at most two per
    dimension: a partial row at each end, whole rows between)."""
    if start >= end:
        return []
    if not shape:
        return [(((), ()), 0)]
    inner = math.prod(shape[1:])
    first_row, first_col = divmod(start, inner)
    last_row, last_col = divmod(end, inner)

    def in_row(row: int, lo: int, hi: int) -> list[tuple[Box, int]]:
        return [(((row, *o), (1, *s)), row * inner + f) for (o, s), f in run_boxes(shape[1:], lo, hi)]

    if first_row == last_row:  # within one row
        return in_row(first_row, first_col, last_col)
    boxes, row = [], first_row
    if first_col:  # the partial row the run starts in
        boxes += in_row(row, first_col, inner)
        row += 1
    if last_row > row:  # whole rows
        boxes.append((((row, *[0] * (len(shape) - 1)), (last_row - row, *shape[1:])), row * inner))
    if last_col:  # the partial row it ends in
        boxes += in_row(last_row, 0, last_col)
    return boxes


def global_pieces(placement: Placement, data: torch.Tensor, start: int) -> list[tuple[Box, torch.Tensor]]:
    """The boxes of the global tensor that ``data`` (elements ``[start, start + numel)`` of the
    TP-local tensor flattened) covers, each with the view of ``data`` holding it."""
    flat = data.view(-1)  # contiguous (a Run's rule): a copy would lose what is loaded into it
    dim = placement.partition[0] if placement.partition is not None else 0
    pieces = []
    for (offsets, sizes), first in run_boxes(placement.local_shape, start, start + flat.numel()):
        box = flat[first - start : first - start + math.prod(sizes)].view(sizes)
        if not offsets:
            pieces.append((((), ()), box))
            continue
        for local, glob, length in placement.blocks():
            lo, hi = max(offsets[dim], local), min(offsets[dim] + sizes[dim], local + length)
            if hi <= lo:
                continue
            at = list(offsets)
            at[dim] = glob + (lo - local)
            at[0] += placement.first_expert
            extent = list(sizes)
            extent[dim] = hi - lo
            pieces.append(((tuple(at), tuple(extent)), box.narrow(dim, lo - offsets[dim], hi - lo)))
    return pieces
