"""megatron-core's engine: its pipeline schedules, its DDP and its optimizer, around scheduled stages.

The built model arrives as :class:`~megatron_slapo.pipeline.PipelineStages` (one module per
``cut_pipeline_stage``; the trainer cuts evenly at the transformer layers) or, without pipeline
parallelism, as the model itself. This rank keeps its stages: with ``P`` pipeline ranks and ``V``
virtual stages each, rank ``r`` runs stages ``r, r + P, ...`` (Megatron's interleaving). Each stage
becomes a :class:`StageChunk`, the object megatron-core's schedules expect: it takes the
micro-batch, receives the previous stage's activation through ``set_input_tensor`` and returns the
next one (``[s, b, h]``, Megatron's layout). Values that only depend on the inputs (attention
masks, position ids) are recomputed by every stage rather than sent, so one tensor crosses each cut.

Gradients: megatron-core's DDP accumulates them in contiguous buffers (``main_grad``) and reduces
them over the data-parallel group (overlapped with the backward under ``--overlap-grad-reduce``);
weights used by the first and the last stage (tied embeddings) then get their gradients summed
over megatron-core's embedding group, so both copies stay equal. megatron-core's optimizer clips
with the norm over all model-parallel ranks (each tied weight counted once) and, with
``--use-distributed-optimizer``, shards its state over the data-parallel ranks.

Precision is Megatron-LM's: with ``--bf16`` or ``--fp16`` the stages' weights are in that dtype,
megatron-core's mixed-precision optimizer keeps fp32 main weights (and steps them), and pipeline
messages travel in that dtype. Gradients accumulate and reduce in fp32 buffers with bf16 (bf16 ones
with ``--grad-reduce-in-bf16``); with fp16 in fp16 buffers unless
``--accumulate-allreduce-grads-in-fp32``. fp16 scales the loss with
megatron-core's ``DynamicGradScaler`` (or ``ConstantGradScaler`` for ``--loss-scale``), which
unscales the gradients, checks them for inf/NaN over the model-parallel ranks and skips the step.

The engine is split by job; this class assembles the parts behind the engine seam
(:class:`~megatron_slapo.engines.base.Engine`):

- :mod:`.megatron_build`: the pieces above (megatron-core's ``TransformerConfig``, the tied
  embeddings, DDP per chunk, the optimizer), which the constructor calls in order;
- :mod:`.megatron_step` (:class:`MegatronStep`): ``train_step`` and ``eval_step``;
- :mod:`.megatron_checkpoint` (:class:`MegatronCheckpoint`): the state in both checkpoint formats,
  with :mod:`.megatron_state` finding the optimizer's copies of each weight;
- :mod:`.stage_chunk` (a stage as the schedules drive it), :mod:`.megatron_memory` and
  :mod:`.megatron_experts` (the memory report, and what MoE weights need).
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

from megatron_slapo.compat import megatron_cpu as cpu_compat
from megatron_slapo.engines.base import ModelShape
from megatron_slapo.engines.megatron_build import (
    attach_to_schedules,
    mark_tied,
    megatron_optimizer,
    transformer_config,
    wrap_ddp,
)
from megatron_slapo.engines.megatron_checkpoint import MegatronCheckpoint
from megatron_slapo.engines.megatron_experts import megatron_state_with_experts
from megatron_slapo.engines.megatron_state import all_names
from megatron_slapo.engines.megatron_step import MegatronStep
from megatron_slapo.engines.optimizer import build_scheduler, half_precision, megatron_fp32_grads
from megatron_slapo.engines.stage_chunk import StageChunk, check_plan
from megatron_slapo.parallel.collectives import Group, group_size
from megatron_slapo.pipeline import PipelineStages

# Not actionable here: a default of TransformerConfig, and the missing apex (see the README's notes).
warnings.filterwarnings("ignore", "full scope is deprecated", UserWarning)
warnings.filterwarnings("ignore", "Apex is not installed", UserWarning)


class MegatronEngine(MegatronStep, MegatronCheckpoint):
    """megatron-core's ``get_forward_backward_func`` over this rank's stages; its DDP and optimizer."""

    # What --bf16/--fp16 mean here (printed at start: the engines differ)
    MIXED_PRECISION = {
        "bf16": "bf16 weights with fp32 main copies in megatron-core's optimizer; gradients accumulated and "
        "reduced in fp32 (bf16 with --grad-reduce-in-bf16); pipeline messages in bf16",
        "fp16": "fp16 weights with fp32 main copies in megatron-core's optimizer and its loss scaler; gradients "
        "accumulated and reduced in fp16 (fp32 with --accumulate-allreduce-grads-in-fp32); pipeline messages in fp16",
    }

    def __init__(
        self, model: nn.Module, args: argparse.Namespace, dp_group: Group, tp_group: Group, shape: ModelShape
    ) -> None:
        """Wrap this rank's pipeline stages (``model`` itself without pipeline parallelism) as
        megatron-core model chunks: weights in the training dtype, its DDP per chunk, its optimizer
        (distributed or not) and our LR schedule; tied embeddings are marked so their gradients are
        summed over the embedding group and counted once in the norm. ``shape`` sizes megatron-core's
        ``TransformerConfig`` (and so the messages between pipeline stages)."""
        from megatron.core import parallel_state as ps

        self.args, self.dp_group, self.tp_group = args, dp_group, tp_group
        self.pp_rank, self.pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        self.cp_size = ps.get_context_parallel_world_size()
        self._metric_names: dict[bool, list[str]] = {}  # the last stage's, told the others once (train, eval)
        if isinstance(model, PipelineStages):
            check_plan(model)
        stages = model.local(self.pp_rank, self.pp_size) if isinstance(model, PipelineStages) else [(0, model)]
        total = len(model.stages) if isinstance(model, PipelineStages) else 1
        # every weight's names in the whole model, for distributed checkpoints (tied ones have several)
        self.tensor_names = all_names(list(model.stages) if isinstance(model, PipelineStages) else [model])
        self.device = next(stages[0][1].parameters()).device
        # weights and pipeline messages
        self.dtype = half_precision(args) or torch.float32
        self.grads_in_fp32 = megatron_fp32_grads(args)
        with cpu_compat.device_mode():
            self.config = transformer_config(args, shape, total, pp_size=self.pp_size, tp_group=tp_group,
                                             cp_size=self.cp_size, dtype=self.dtype)  # fmt: skip
            self.chunks = [StageChunk(stage, k == 0, k == total - 1, self.config) for k, stage in stages]
            self.tied = mark_tied(model, self.chunks, self.pp_rank)
            if self.dtype != torch.float32:  # Megatron's --bf16/--fp16: such weights, fp32 main copies in the optimizer
                for chunk in self.chunks:
                    for p in chunk.parameters():
                        p.data = p.data.to(self.dtype)
            self.ddp = [wrap_ddp(chunk, self.config, args, self.grads_in_fp32) for chunk in self.chunks]
            # Weights that saw part of the sequence on each TP rank: their gradient buffers (views
            # into DDP's, fixed from here on) are summed over TP after each backward, as
            # megatron-core's finalize_model_grads does for its own models.
            self.sequence_parallel_grads = [p.main_grad for chunk in self.chunks for p in chunk.parameters()
                                            if getattr(p, "sequence_parallel", False)]  # fmt: skip
            self.optimizer = megatron_optimizer(args, self.dtype, self.ddp)
        self.model = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        self.scheduler = build_scheduler(self.optimizer, args)
        attach_to_schedules(self.config, self.ddp, self.optimizer, args)

    def memory_report(self) -> dict[str, int]:
        """This rank's stages, as :func:`megatron_state` counts them; an MoE model's expert-parallel
        weights with their optimizer state split over the expert-data-parallel ranks instead."""
        params = [p for chunk in self.chunks for p in chunk.parameters()]
        return megatron_state_with_experts(self.args, params, group_size(self.dp_group))
