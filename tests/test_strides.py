"""Strides of unequal blocks (``stride=(H, KV, KV)``: a packed q|k|v with grouped-query attention),
in one process: the layout and its inverse, a distributed checkpoint's placement of them, and the
checks that refuse a stride the tensor does not fit.

Expected shards are written out here row by row, independently of :mod:`megatron_slapo.parallel.layout`.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

import megatron_slapo as ms
from megatron_slapo.checkpoints.conversion import _unsharded
from megatron_slapo.kernels.qkv import FusedQKV
from megatron_slapo.parallel.layout import as_stride, block_sizes, shard_slice, unshard
from megatron_slapo.parallel.shard_geometry import Placement, global_pieces


def _rows(sizes: list[int], rank: int, world: int) -> list[int]:
    """The global rows rank ``rank`` holds of an axis cut into blocks of ``sizes``: its piece of each, in order."""
    rows, start = [], 0
    for size in sizes:
        piece = size // world
        rows += range(start + rank * piece, start + (rank + 1) * piece)
        start += size
    return rows


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("axis", [0, 1])
def test_a_tuple_stride_gives_each_rank_its_piece_of_every_block_and_unshards_back(world: int, axis: int) -> None:
    full = torch.randn(64, 3).movedim(0, axis).contiguous()  # 64 along axis: blocks of 32, 16, 16
    shards = [shard_slice(full, axis, (4, 2, 2), r, world) for r in range(world)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, full.index_select(axis, torch.tensor(_rows([32, 16, 16], r, world))))
    assert torch.equal(unshard(shards, axis, (4, 2, 2)), full)


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_an_int_stride_cuts_as_before(stride: int) -> None:
    """s equal blocks, each chunked over the ranks: Megatron's partition_stride, as it always was."""
    full = torch.randn(24, 5)
    for r in range(2):
        expected = torch.cat([b.chunk(2)[r] for b in full.chunk(stride)])
        assert torch.equal(shard_slice(full, 0, stride, r, 2), expected)
    assert torch.equal(unshard([shard_slice(full, 0, stride, r, 2) for r in range(2)], 0, stride), full)


def test_strides_are_blocks_of_relative_sizes() -> None:
    assert block_sizes(64, (4, 2, 2)) == [32, 16, 16]
    assert block_sizes(12, 3) == [4, 4, 4]
    assert block_sizes(4, (4, 2, 2)) == [2, 1, 1]  # relative sizes: (4, 2, 2) is (2, 1, 1)
    with pytest.raises(ValueError, match=r"an axis of 10 does not split into blocks of relative sizes \[2, 1, 1\]"):
        block_sizes(10, (2, 1, 1))
    assert as_stride([4, 2, 2]) == (4, 2, 2)  # a stored tuple read back as a list
    for bad in (0, (), (2, 0), True, "3", 1.5):
        with pytest.raises(ValueError, match="stride must be"):
            as_stride(bad)


def test_placement_blocks_of_a_tuple_stride() -> None:
    """TP2, a global axis of 16 cut (2, 1, 1): blocks 8, 4, 4 whose pieces are 4, 2, 2 rows per rank."""
    starts = [Placement((8, 3), (0, (2, 1, 1)), r, 2).blocks() for r in range(2)]
    assert starts == [[(0, 0, 4), (4, 8, 2), (6, 12, 2)], [(0, 4, 4), (4, 10, 2), (6, 14, 2)]]
    assert Placement((3, 8), (1, (2, 1, 1)), 1, 2).global_shape == (3, 16)


def test_runs_of_tuple_strided_placements_cover_the_global_tensor_once() -> None:
    rng = random.Random(0)
    for _ in range(100):
        tp, stride = rng.choice([1, 2, 4]), rng.choice([(2, 1, 1), (3, 1), (1, 2, 2, 1)])
        nd = rng.randint(1, 3)
        dim = rng.randrange(nd)
        shape = [rng.randint(1, 3) for _ in range(nd)]
        shape[dim] *= sum(stride)  # the TP-local extent
        placements = [Placement(tuple(shape), (dim, stride), r, tp) for r in range(tp)]
        whole = torch.arange(1.0, 1 + torch.Size(placements[0].global_shape).numel()).view(placements[0].global_shape)
        seen = torch.zeros_like(whole)
        for placement in placements:
            local = shard_slice(whole, dim, stride, placement.rank, tp)
            n = local.numel()
            for a, b in itertools.pairwise(sorted({0, n, rng.randrange(n + 1)})):
                for (offsets, sizes), view in global_pieces(placement, local.reshape(-1)[a:b].clone(), a):
                    target = seen[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                    assert not target.any(), "a box written twice"
                    target.copy_(view)
        assert torch.equal(seen, whole)


def test_shard_refuses_a_tuple_stride_its_axis_does_not_fit() -> None:
    sch = ms.create_schedule(nn.Sequential(nn.Linear(4, 10)))
    with pytest.raises(ms.SchedulingError, match=r"size 10 does not split into blocks of relative sizes \[2, 1, 1\]"):
        sch["0"].shard("weight", axis=0, stride=(2, 1, 1))
    with pytest.raises(ms.SchedulingError, match=r"stride must be an int >= 1 or a non-empty tuple"):
        sch["0"].shard("weight", axis=0, stride=(2, 0))


def _fused_shard(sizes: tuple[int, int, int], world: int, stride: int | tuple[int, ...]) -> FusedQKV:
    """A FusedQKV whose projection holds one rank's rows as ``shard`` would leave them (tags included)."""
    fused = FusedQKV(4, sizes, bias=False, head_dim=2)
    weight = nn.Parameter(torch.zeros(sum(sizes) // world, 4))
    weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, 0, stride
    fused.proj.weight = weight
    return fused


def test_a_fused_qkv_with_narrower_k_v_splits_by_a_tuple_stride_and_names_it_otherwise() -> None:
    assert _fused_shard((8, 4, 4), 2, (2, 1, 1)).split_sizes() == [4, 2, 2]
    assert _fused_shard((8, 4, 4), 2, (4, 2, 2)).split_sizes() == [4, 2, 2]  # the same blocks
    problem = _fused_shard((8, 4, 4), 2, 3).schedule_problem()
    assert problem is not None and "with stride (2, 1, 1), or shard separate q, k, v" in problem
    problem = _fused_shard((8, 8, 8), 2, 1).schedule_problem()
    assert problem is not None and "with stride 3, or shard separate" in problem  # equal sizes: an int


def test_conversion_merges_tp_files_whose_stored_stride_came_back_as_a_list() -> None:
    """``--ckpt-format torch``'s per-rank files record ``[partition_dim, partition_stride]``; a tuple
    stride may be read back as a list, and the shards still merge into the whole tensor."""
    full = torch.randn(32, 4)
    states = [{"slapo": {"shards": {"qkv": [0, [2, 1, 1]]}}, "model": {"qkv": shard_slice(full, 0, (2, 1, 1), r, 2)}}
              for r in range(2)]  # fmt: skip
    assert torch.equal(_unsharded(states)["qkv"], full)
