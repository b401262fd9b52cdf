"""How :class:`~megatron_slapo.engines.megatron_core.MegatronEngine` builds what megatron-core runs.

The engine's constructor calls these in order: megatron-core's ``TransformerConfig``
(:func:`transformer_config`: what its schedules and DDP read), the tied embeddings marked
(:func:`mark_tied`), megatron-core's DDP around each model chunk (:func:`wrap_ddp`), its optimizer
(:func:`megatron_optimizer`), and last the hooks by which the schedules drive DDP and the loss
scale (:func:`attach_to_schedules`). Each takes what it reads as arguments and returns what it
builds; megatron-core is imported only when one runs.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from megatron_slapo.engines.base import ModelShape
from megatron_slapo.engines.megatron_experts import norm_counts_each_ranks_experts
from megatron_slapo.engines.stage_chunk import StageChunk
from megatron_slapo.parallel.collectives import Group, group_size
from megatron_slapo.pipeline import PipelineStages


def transformer_config(
    args: argparse.Namespace, shape: ModelShape, total_stages: int, *, pp_size: int, tp_group: Group, cp_size: int,
    dtype: torch.dtype,
) -> Any:  # fmt: skip
    """The settings megatron-core's schedules and DDP read (p2p shapes, dtypes, VPP size):
    ``shape`` sizes the messages between the model's ``total_stages`` stages, sent in ``dtype``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    vpp = total_stages // pp_size if total_stages > pp_size else None
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        tensor_model_parallel_size=group_size(tp_group), pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=dtype, params_dtype=dtype, bf16=args.bf16,
        fp16=args.fp16,
        # With two pipeline ranks the previous and the next rank are the same peer; batched p2p then
        # pairs the interleaved schedule's messages crosswise (cpu-feasibility.md §1): send one by one.
        batch_p2p_comm=not (vpp and pp_size == 2), batch_p2p_sync=torch.cuda.is_available(),
        use_cpu_initialization=True, gradient_accumulation_fusion=False, deallocate_pipeline_outputs=False,
        sequence_parallel=args.sequence_parallel,  # the p2p buffers then hold this rank's part of the sequence
        context_parallel_size=cp_size,
    )  # fmt: skip


def mark_tied(model: nn.Module, chunks: list[StageChunk], pp_rank: int) -> list[nn.Parameter]:
    """Weights shared by the first and the last stage that this rank's ``chunks`` hold: returned
    (the engine sums their gradients over the embedding group) and, where this rank lacks the first
    stage, the copy marked ``shared`` so that megatron-core's gradient norm counts it once.
    ``shared_embedding`` gives each copy a gradient bucket of its own, so that under the
    distributed optimizer both stages shard it alike and the tie's all-reduce adds matching,
    already DP-reduced, shards. Empty without pipeline stages."""
    tied: list[nn.Parameter] = []
    if not isinstance(model, PipelineStages):
        return tied
    local = {id(p) for chunk in chunks for p in chunk.parameters()}
    first = {id(p) for p in model.stages[0].parameters()}
    for name, used in sorted(model.plan.tied.items()):
        owner = model.stages[used[0]]
        p = dict(owner.named_parameters())[name]
        if id(p) in local:
            tied.append(p)
            p.shared_embedding = True
            if pp_rank != 0 or id(p) not in first:
                p.shared = True
    return tied


def wrap_ddp(chunk: StageChunk, config: Any, args: argparse.Namespace, grads_in_fp32: bool) -> nn.Module:
    """megatron-core's DDP around one chunk (its contiguous gradient buffers, in fp32 with
    ``grads_in_fp32``; overlap if asked)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grads_in_fp32, overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )  # fmt: skip
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk)


def megatron_optimizer(args: argparse.Namespace, dtype: torch.dtype, ddp: list[nn.Module]) -> Any:
    """megatron-core's optimizer over the ``ddp`` chunks from the flags: Adam(W), its
    mixed-precision wrapper (weights in ``dtype``) and loss scaler."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=dtype, use_distributed_optimizer=args.use_distributed_optimizer,
        # megatron-core would build a constant scaler for bf16/fp32 too, which only fp16 scales the loss for
        loss_scale=args.loss_scale if args.fp16 else None, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
    )  # fmt: skip
    optimizer = get_megatron_optimizer(config, ddp)
    norm_counts_each_ranks_experts(optimizer)
    return optimizer


def attach_to_schedules(config: Any, ddp: list[nn.Module], optimizer: Any, args: argparse.Namespace) -> None:
    """Tell the schedules, through ``config``, how to drive DDP and the optimizer: its ``no_sync``
    between micro-batches, the fp16 loss scale for each micro-batch's loss, and (with
    ``--overlap-grad-reduce``) when to start the gradients' reduction."""
    no_sync = [m.no_sync for m in ddp]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if args.fp16:  # the schedules scale each micro-batch's loss by the optimizer's loss scale
        config.grad_scale_func = optimizer.scale_loss
    if args.overlap_grad_reduce:
        grad_sync = [m.start_grad_sync for m in ddp]
        config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
