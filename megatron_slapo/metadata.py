"""What the primitives record on each schedule node."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


class Role(enum.Enum):
    """What sharding a known layer's weight makes it (see :mod:`megatron_slapo.primitives.placement`)."""

    COLUMN = "column"  # output features partitioned; input replicated
    ROW = "row"  # input features partitioned; output is a partial sum
    VOCAB = "vocab"  # embedding rows partitioned; output is a partial sum; input is token ids
    EMBEDDING_COLUMN = "embedding-column"  # embedding features partitioned; input is token ids

    @property
    def output_is_partial(self) -> bool:
        return self in (Role.ROW, Role.VOCAB)


@dataclass
class ShardSpec:
    """How one tensor of a module was sharded."""

    axis: int
    stride: int | tuple[int, ...]  # parallel.layout.Stride: s equal blocks, or blocks of these relative sizes
    full_shape: torch.Size
    explicit: bool  # False when it was sharded through a tied parameter held by another module


@dataclass(frozen=True)
class ExpertShard:
    """This rank's routed experts of a tensor holding every expert along dim 0 (expert parallelism):
    experts ``[rank * n, (rank + 1) * n)`` of ``full_shape[0]``, ``n = full_shape[0] // size``."""

    rank: int
    size: int
    full_shape: torch.Size


@dataclass
class Metadata:
    """What the primitives applied to one node (consumed by build, Verify and the engines)."""

    shards: dict[str, ShardSpec] = field(default_factory=dict)
    expert_shards: dict[str, ExpertShard] = field(default_factory=dict)  # taken before any shard above
    role: Role | None = None
    syncs: set[tuple[str, Any]] = field(default_factory=set)  # (mode, op name or callable)
    annotations: dict[str, dict[str, Any]] = field(default_factory=dict)
    checkpointed: bool = False
    core_checkpointed: bool = False  # attention_core(checkpoint=True): only the attention core is recomputed
    context_parallel: int = 1  # attention_core(context_parallel=...): the ranks its ring spans
    compiled: str | None = None  # the torch.compile backend, applied by build
    fp8: str | None = None  # fp8(): the recipe its products run in ("fp8 tensorwise hybrid")
    forked_rng: bool = False
    traced: bool = False
    pipeline_cut: bool = False
    replaced: str | None = None  # the class name of the module ``replace`` swapped out here
    # Under --sequence-parallel (plans/sequence.py): "partial lookup" (a vocabulary-parallel
    # embedding left unreduced for the first layer) or "gathers" (the module after the layers that
    # gathers the sequence for the LM head)
    sequence_split: str | None = None
