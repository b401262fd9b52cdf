"""torch.distributed.checkpoint planners for tensors given as boxes of global tensors.

DCP's own planners take a state dict of plain tensors (replicated), DTensors or ShardedTensors.
Our engines hold neither of the last two in general: a rank's part of a parameter is a run of its
flattened tensor-parallel shard, which :mod:`~megatron_slapo.parallel.shard_geometry` cuts into
boxes of the global tensor. The planners here take those boxes directly (``Pieces``: key -> the
global shape and a list of ``(box, tensor)``), so that no tensor needs to be re-expressed as a
DTensor first; the rest of DCP (the storage format, deduplication of boxes held by several ranks,
the resharding reads) is torch's.

Why DCP and not megatron-core's ``dist_checkpointing``: the latter describes shards as
``ShardedTensor``s made by each megatron-core module's ``sharded_state_dict`` and by its
optimizers; our models are HF modules and two of our engines (DeepSpeed, FSDP2) are not
megatron-core's, so every shard would have been described by us anyway, and its strategies end in
torch's DCP. Writing to DCP directly keeps one layer between our shards and the files.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_slapo.parallel.shard_geometry import Box

Pieces = dict[str, tuple[tuple[int, ...], list[tuple[Box, torch.Tensor]]]]  # key -> (global shape, boxes)


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


class PieceSavePlanner(DefaultSavePlanner):
    """Writes each box this rank gives under its key and global offsets. A box several ranks hold
    (data-parallel replicas, a tied weight's two pipeline copies) is written once: by the rank with
    the least to write when ``balanced`` (Megatron's fully parallel save), else by the lowest rank."""

    def __init__(self, pieces: Pieces, balanced: bool = True) -> None:
        super().__init__(
            flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=not balanced
        )
        self.pieces = pieces
        self.data = {
            MetadataIndex(key, torch.Size(box[0])): t for key, (_, boxes) in pieces.items() for box, t in boxes
        }

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, (shape, boxes) in self.pieces.items():
            for (offsets, sizes), t in boxes:
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=t.dtype), size=torch.Size(shape))
                items.append(WriteItem(MetadataIndex(key, chunk.offsets), WriteItemType.SHARD, tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.data[write_item.index]  # MetadataIndex compares its fqn and offset, not its index hint


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads into each box this rank gives, from whichever saved boxes overlap it (DCP's resharding)."""

    def __init__(self, pieces: Pieces) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:  # fmt: skip
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, (_, boxes) in self.pieces.items():
            saved = self.metadata.state_dict_metadata[key]
            assert isinstance(saved, TensorStorageMetadata)
            chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for (offsets, sizes), _ in boxes]
            items += create_read_items_for_chunk_list(key, saved, chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        _, boxes = self.pieces[read_item.dest_index.fqn]
        return _narrow(boxes[read_item.dest_index.index][1], read_item.dest_offsets, read_item.lengths)
