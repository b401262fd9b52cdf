"""AdamW with Megatron's parameter groups and LR schedule, and tensor-parallel-aware clipping."""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from megatron_slapo.parallel.collectives import Group, group_rank, group_size


def half_precision(args: argparse.Namespace) -> torch.dtype | None:
    """The dtype of ``--bf16``/``--fp16``, or None in fp32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


def megatron_fp32_grads(args: argparse.Namespace) -> bool:
    """Whether ``--engine megatron`` accumulates and reduces gradients in fp32: always in fp32 and
    with --bf16 (as Megatron), with --fp16 only given --accumulate-allreduce-grads-in-fp32, never
    with --grad-reduce-in-bf16."""
    return (args.accumulate_allreduce_grads_in_fp32 or not args.fp16) and not args.grad_reduce_in_bf16


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices only; biases and norm weights (1-D) are not decayed (Megatron). A
    ZeRO-3 parameter is already partitioned (an empty tensor): its true shape is ``ds_shape``."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel (CUDA and CPU have one)."""
    return torch.optim.AdamW(
        param_groups(model), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
        weight_decay=args.weight_decay, fused=True,
    )  # fmt: skip


def build_scheduler(optimizer: torch.optim.Optimizer, args: argparse.Namespace):
    """megatron-core's OptimizerParamScheduler, stepped in samples like Megatron-LM (lengths from
    --lr-*-samples with --train-samples, else --lr-*-iters x global batch)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup, decay, total = lr_schedule_samples(args)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=total, wd_incr_style="constant",
    )  # fmt: skip


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``t``: an FSDP2 DTensor's shard, a ZeRO-3 parameter's partition, or ``t``."""
    if hasattr(t, "to_local"):
        return t.to_local()
    return t.ds_tensor if hasattr(t, "ds_tensor") else t


def global_norm(
    params: list[nn.Parameter], tp_group: Group, of_grads: bool = True, partition_group: Group = None,
    expert_group: Group = None,
) -> float:  # fmt: skip
    """The L2 norm of the whole model's gradients (or weights) under tensor parallelism.

    A sharded parameter contributes its shard on every TP rank; a replicated one is counted once
    (on TP rank 0), as in Megatron's ``param_is_not_tensor_parallel_duplicate``. When the engine
    partitions tensors across data-parallel ranks (ZeRO-3, FSDP), ``partition_group`` sums the
    partitions first. An MoE model's expert-parallel weights (other experts on each rank) are
    counted on every rank and summed over ``expert_group``, the expert tensor-and-model-parallel ranks.
    """
    first = group_rank(tp_group) == 0
    device = params[0].device if params else torch.device("cpu")
    held = [(p, t) for p in params if (t := p.grad if of_grads else p) is not None]
    dense = [t for p, t in held if not getattr(p, "expert_parallel", False)
             and (getattr(p, "tensor_model_parallel", False) or first)]  # fmt: skip
    total = _squares(dense, device)
    for group in (partition_group, tp_group):
        if group_size(group) > 1:
            dist.all_reduce(total, group=group)
    if expert_group is not None:
        experts = _squares([t for p, t in held if getattr(p, "expert_parallel", False)], device)
        if group_size(expert_group) > 1:
            dist.all_reduce(experts, group=expert_group)
        total += experts
    return math.sqrt(total.item())


def _squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of ``tensors``' (local parts') elements, in fp32."""
    tensors = [local_part(t).detach() for t in tensors]
    tensors = [t if t.dtype == torch.float32 else t.float() for t in tensors]  # bf16/fp16 summed in fp32
    # torch's foreach kernels: one launch per dtype and device, not one reduction per tensor
    return get_total_norm(tensors).pow(2) if tensors else torch.zeros((), device=device)


@torch.no_grad()
def clip_grads(params: list[nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale gradients so that their global norm is at most ``max_norm`` (torch's foreach clip)."""
    if max_norm > 0 and norm > max_norm:
        clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, torch.tensor(norm))


def lr_schedule_samples(args: argparse.Namespace) -> tuple[float, int, int]:
    """(warmup, decay, weight-decay increment) lengths of the LR schedule, in samples, as Megatron-LM
    computes them: from ``--*-samples`` with ``--train-samples``, else ``--*-iters`` x global batch;
    ``--lr-warmup-fraction`` is a fraction of the decay."""
    gbs = args.global_batch_size
    if getattr(args, "train_samples", None) is not None:
        decay = args.lr_decay_samples or args.train_samples
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_samples
        return warmup, decay, args.train_samples
    return args.lr_warmup_iters * gbs, args.lr_decay_iters * gbs, args.train_iters * gbs
