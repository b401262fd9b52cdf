"""Sequence parallelism (Megatron's ``--sequence-parallel``) on top of a tensor-parallel plan.

Between the tensor-parallel regions of a layer (norms, dropout, residual adds) every rank holds the
same activations; sequence parallelism splits them along the sequence instead, so each rank keeps
and computes ``1/t`` of them. A region is then entered by all-gathering the sequence (its backward
reduce-scatters the partial gradients) instead of Megatron's ``f``, and left by reduce-scattering
the partial outputs instead of the all-reduce ``g``: the same bytes, fewer activations.

Here the split spans the transformer layers: the first layer's input is scattered along the
sequence and the last layer's output gathered (the embeddings before and the head after stay
replicated, so no model needs its position embeddings or pooler rewritten). A parameter used on
the split activations (a norm's weight, a row-parallel layer's bias) sees only this rank's part of
the sequence, so its gradient is a partial sum: it is tagged ``sequence_parallel``, Megatron's
attribute, and the engines sum it over the tensor-parallel ranks.

Activations are batch-first in HF models: the sequence is dim 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from megatron_slapo.parallel.plans import ColumnParallel, ParallelRegionInput, RowParallel

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule

SEQUENCE_DIM = 1


def sequence_parallel_plan(plan: Mapping[str, Any]) -> dict[str, Any]:
    """``plan`` with every region entry and exit in its sequence-parallel form."""

    def rewrite(placement: Any) -> Any:
        if isinstance(placement, tuple):
            return tuple(rewrite(p) for p in placement)
        if isinstance(placement, (ColumnParallel, ParallelRegionInput, RowParallel)):
            return dataclasses.replace(placement, sequence_parallel=True)
        return placement

    return {pattern: rewrite(placement) for pattern, placement in plan.items()}


def plan_for(plan: Mapping[str, Any], args: Any) -> Mapping[str, Any]:
    """The plan a schedule applies: sequence-parallel when ``--sequence-parallel`` is given."""
    return sequence_parallel_plan(plan) if getattr(args, "sequence_parallel", False) else plan


def split_layers(sch: Schedule, layers: list[str]) -> None:
    """Split the activations along the sequence from the first layer's input to the last layer's
    output, and tag the parameters that then see part of the sequence."""
    sch[layers[0]].sync("fwd_pre", "scatter", axis=SEQUENCE_DIM)
    sch[layers[-1]].sync("fwd_post", "all_gather", axis=SEQUENCE_DIM, backward="split")
    for layer in layers:
        for _, node in sch[layer].named_schedules():
            for name, _ in node.mod.named_parameters(recurse=False):
                tagged = node.metadata.annotations.get(name, {}).get("sequence_parallel")
                if name not in node.metadata.shards and not tagged:
                    node.annotate(name, "sequence_parallel", True)
