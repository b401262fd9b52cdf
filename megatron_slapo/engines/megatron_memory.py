"""What megatron-core's engine holds per rank, and what it must be told of an MoE model's experts.

:func:`megatron_state` counts the bytes of weights, gradient buffers and optimizer state on a rank
(``MegatronEngine.memory_report`` and ``tools/explain.py`` both use it); an MoE model's
expert-parallel weights have their optimizer state split over the expert-data-parallel ranks
rather than the data-parallel ones (:func:`megatron_state_with_experts`).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megatron_slapo.engines.optimizer import half_precision, megatron_fp32_grads
from megatron_slapo.parallel.collectives import group_size
from megatron_slapo.parallel.state import expert_groups


def megatron_state(args: argparse.Namespace, count: int, dp: int) -> dict[str, int]:
    """Bytes of ``count`` weights on a rank of ``dp`` data-parallel ones: the weights in the
    training dtype; the gradient buffers in fp32 or that dtype (:func:`megatron_fp32_grads`);
    AdamW's fp32 moments, and with --bf16/--fp16 the fp32 main weights, a DP shard of it all with
    the distributed optimizer. :meth:`MegatronEngine.memory_report`'s, and ``tools/explain.py``'s."""
    half = half_precision(args) is not None
    optimizer = count * 4 * (3 if half else 2)
    return {"params": count * (2 if half else 4), "grads": count * (4 if megatron_fp32_grads(args) else 2),
            "optimizer": optimizer // dp if args.use_distributed_optimizer else optimizer}  # fmt: skip


def megatron_state_with_experts(args: argparse.Namespace, params: list[torch.Tensor], dp: int) -> dict[str, int]:
    """:func:`megatron_state` of ``params`` on a rank of ``dp`` data-parallel ones, the
    expert-parallel weights among them counted over their expert-data-parallel group."""
    experts = sum(p.numel() for p in params if getattr(p, "expert_parallel", False))
    report = megatron_state(args, sum(p.numel() for p in params) - experts, dp)
    if experts:
        for key, value in megatron_state(args, experts, group_size(expert_groups().data)).items():
            report[key] += value
    return report


def count_each_ranks_experts(optimizer: Any) -> None:
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
