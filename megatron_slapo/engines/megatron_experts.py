"""What megatron-core's engine must be told of an MoE model's expert-parallel weights.

Their optimizer state is split over the expert-data-parallel ranks rather than the data-parallel
ones (:func:`megatron_state_with_experts`), and the norm of their gradients must count each rank's
own experts (:func:`norm_counts_each_ranks_experts`).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megatron_slapo.engines.megatron_memory import megatron_state
from megatron_slapo.parallel.collectives import group_size
from megatron_slapo.parallel.state import expert_groups


def megatron_state_with_experts(args: argparse.Namespace, params: list[torch.Tensor], dp: int) -> dict[str, int]:
    """:func:`megatron_state` of ``params`` on a rank of ``dp`` data-parallel ones, the
    expert-parallel weights among them counted over their expert-data-parallel group."""
    experts = sum(p.numel() for p in params if getattr(p, "expert_parallel", False))
    report = megatron_state(args, sum(p.numel() for p in params) - experts, dp)
    if experts:
        for key, value in megatron_state(args, experts, group_size(expert_groups().data)).items():
            report[key] += value
    return report


def norm_counts_each_ranks_experts(optimizer: Any) -> None:
    """megatron-core builds an MoE model's expert-parallel weights their own optimizer, whose norm
    counts a weight not tagged ``tensor_model_parallel`` on TP rank 0 only (as a TP duplicate). Its
    own expert layers always carry the tag; ours do not when the experts are not split by features
    (``--expert-tensor-parallel-size 1``), and then each TP rank holds other experts: the duplicate
    test must ask the expert-tensor-parallel group (``tp_group``, which megatron-core sets to the
    dense one, marked as a TODO there)."""
    from megatron.core import parallel_state as ps

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if any(getattr(p, "expert_parallel", False) for p in part.get_parameters()):
            part.tp_group = ps.get_expert_tensor_parallel_group()
