"""The geometry of a distributed checkpoint, and our DCP planners, in one process.

Every tensor-parallel placement (strided blocks as GPT-2's q|k|v, a padded vocabulary) with every
data-parallel cut into runs must cover the global tensor exactly once with the right values; and
boxes written by one layout's ranks must read back into another layout's.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_slapo.checkpoints.dcp_planners import PieceLoadPlanner, PieceSavePlanner
from megatron_slapo.parallel.shard_geometry import Placement, global_pieces, run_boxes


def _narrow(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for dim, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
        t = t.narrow(dim, o, s)
    return t


def _local(whole: torch.Tensor, placement: Placement) -> torch.Tensor:
    """What a TP rank holds of ``whole`` under ``placement`` (padding rows: -1)."""
    local = torch.full(placement.local_shape, -1.0, dtype=whole.dtype)
    dim = placement.partition[0] if placement.partition else 0
    for start, at, length in placement.blocks():
        local.narrow(dim, start, length).copy_(whole.narrow(dim, at, length))
    return local


def _placements(rng: random.Random) -> tuple[list[Placement], tuple[int, ...]]:
    """All TP ranks' placements of one random tensor, and its global shape."""
    nd, tp, stride = rng.randint(1, 3), rng.choice([1, 2, 4]), rng.choice([1, 1, 3])
    dim = rng.randrange(nd)
    shape = [rng.randint(1, 4) for _ in range(nd)]
    shape[dim] *= stride
    partition, rows = rng.choice([None, (dim, stride)]), None
    if rng.random() < 0.3:  # a padded vocabulary (dim 0), split or not
        partition = rng.choice([None, (0, 1)])
        rows = rng.randint(1, shape[0] * (tp if partition else 1))
    ranks = tp if partition else 1
    placements = [Placement(tuple(shape), partition, r, tp, rows) for r in range(ranks)]
    return placements, placements[0].global_shape


def test_runs_of_every_placement_cover_the_global_tensor_once() -> None:
    rng = random.Random(0)
    for _ in range(300):
        placements, shape = _placements(rng)
        whole = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float64).view(shape)
        seen = torch.zeros(shape, dtype=torch.float64)
        for placement in placements:
            local = _local(whole, placement)
            n = local.numel()
            cuts = sorted({0, n, *rng.sample(range(n + 1), k=min(3, n + 1))})
            for a, b in itertools.pairwise(cuts):
                run = local.reshape(-1)[a:b].clone()
                for (offsets, sizes), view in global_pieces(placement, run, a):
                    target = _narrow(seen, offsets, sizes)
                    assert not target.any(), "a box written twice"
                    target.copy_(view)
        assert torch.equal(seen, whole)


@pytest.mark.parametrize("shape, start, end", [((3, 4), 1, 11), ((2, 3, 4), 5, 19), ((5,), 2, 4), ((2, 2), 0, 4)])
def test_run_boxes_are_row_major_and_contiguous(shape: tuple[int, ...], start: int, end: int) -> None:
    flat = torch.arange(torch.Size(shape).numel()).view(shape)
    covered = []
    for (offsets, sizes), first in run_boxes(shape, start, end):
        box = _narrow(flat, offsets, sizes)
        assert box.reshape(-1).tolist() == list(range(first, first + box.numel()))
        covered += box.reshape(-1).tolist()
    assert sorted(covered) == list(range(start, end))


def test_boxes_saved_at_one_layout_load_at_another(tmp_path) -> None:
    """GPT-2's q|k|v (stride 3), Phi-3's grouped-query q|k|v rows (``[q: 16 | k: 8 | v: 8]``, stride
    (2, 1, 1)) and a padded vocabulary, written by two TP ranks cut into data-parallel runs; read
    back by one rank holding all, and by four TP ranks, through DCP."""
    hidden = 4
    qkv = torch.randn(hidden, 3 * hidden)
    packed = torch.randn(32, hidden)
    vocab = torch.randn(10, hidden)

    def pieces(tp: int, cut: bool) -> dict:
        out: dict = {}
        for r in range(tp):
            for key, whole, placement in [
                ("model.qkv", qkv, Placement((hidden, 3 * hidden // tp), (1, 3), r, tp)),
                ("model.qkv_proj", packed, Placement((32 // tp, hidden), (0, (2, 1, 1)), r, tp)),
                ("model.wte", vocab, Placement((16 // tp, hidden), (0, 1), r, tp, rows=10)),
            ]:
                local = _local(whole, placement)
                halves = [(0, local.numel() // 2), (local.numel() // 2, local.numel())] if cut else [(0, local.numel())]
                for a, b in halves:
                    shape, boxes = out.setdefault(key, (placement.global_shape, []))
                    boxes += global_pieces(placement, local.reshape(-1)[a:b].clone(), a)
        return out

    dcp.save({}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), planner=PieceSavePlanner(pieces(2, cut=True)),
             no_dist=True)  # fmt: skip
    for tp in (1, 4):
        targets = pieces(tp, cut=False)
        for _, boxes in targets.values():
            for _, view in boxes:
                view.zero_()
        dcp.load(
            {}, storage_reader=dcp.FileSystemReader(str(tmp_path)), planner=PieceLoadPlanner(targets), no_dist=True
        )
        for key, whole in (("model.qkv", qkv), ("model.qkv_proj", packed), ("model.wte", vocab)):
            for (offsets, sizes), view in targets[key][1]:
                assert torch.equal(view, _narrow(whole, offsets, sizes)), (tp, key)
