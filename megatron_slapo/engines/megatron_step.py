"""The megatron engine's training and evaluation steps: megatron-core's pipeline schedules, then our
finish of the gradients and the optimizer step.

:class:`MegatronStep` is mixed into :class:`~megatron_slapo.engines.megatron_core.MegatronEngine`,
whose constructor sets the attributes it declares. A step runs every micro-batch through
megatron-core's ``get_forward_backward_func`` (1F1B, interleaved, or no pipeline), each model chunk
calling the task for its inputs and, on the last stage, its loss. Then, as megatron-core's
``finalize_model_grads`` would for its own models, DDP's reduction is finished, sequence-parallel
gradients summed over TP and tied embeddings' over the embedding group. The step itself is ours:
megatron-core's ``prepare_grads`` and gradient norm decide, on every rank alike, whether the step is
taken (clipped, applied, the LR schedule advanced) or skipped.
"""

from __future__ import annotations

import argparse
import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_slapo.compat import megatron_cpu as cpu_compat
from megatron_slapo.engines.base import Batch, StepResult, Task, average_metrics, metrics_to_floats, to_device
from megatron_slapo.engines.stage_chunk import StageChunk
from megatron_slapo.parallel.collectives import Group, all_reduce_flat, comm_device


class MegatronStep:
    """``train_step`` and ``eval_step`` of the megatron engine, over the state its constructor builds."""

    # set by MegatronEngine.__init__
    args: argparse.Namespace
    dp_group: Group
    tp_group: Group
    pp_rank: int
    pp_size: int
    cp_size: int
    device: torch.device
    config: Any  # megatron-core's TransformerConfig, which the schedules read
    chunks: list[StageChunk]
    ddp: list[nn.Module]  # megatron-core's DDP, one per chunk
    optimizer: Any  # megatron-core's optimizer
    scheduler: Any  # megatron-core's OptimizerParamScheduler
    tied: list[nn.Parameter]
    sequence_parallel_grads: list[torch.Tensor]
    _metric_names: dict[bool, list[str]]  # the last stage's, told the others once (train, eval)

    # -- the schedules -----------------------------------------------------------------------------
    def _forward_step(self, task: Task, data_iterator: Any, chunk: nn.Module) -> tuple[Any, Any]:
        """megatron-core's ``forward_step_func``: the chunk's output and the loss to call on it."""
        batch = to_device(next(data_iterator), self.device)
        return chunk(**task.inputs(batch)), functools.partial(self._loss, task, batch, self.cp_size)

    @staticmethod
    def _loss(task: Task, batch: Batch, cp_size: int, out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The task's loss, with metrics copied (the schedule scales the loss in place). Under context
        parallelism the schedule multiplies the loss by the context-parallel size, as Megatron's loss
        functions return each rank's mean over its own tokens; the task's already carries that factor."""
        loss, metrics = task.criterion(out, batch)
        return loss / cp_size, {k: v.detach().float().clone() for k, v in metrics.items()}

    def _run(self, microbatches: list[Batch], task: Task, forward_only: bool) -> dict[str, torch.Tensor]:
        """All micro-batches through megatron-core's pipeline schedule (1F1B, interleaved, or none with
        one stage), forward only or forward and backward; the metrics on every stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        iterators = [iter(microbatches) for _ in self.ddp]
        inputs = task.inputs(microbatches[0])
        # the pipeline's p2p shape; image models run in one stage (pretrain_vision.py refuses more). The
        # schedule divides the whole sequence by the context-parallel size itself: it is given that.
        seq_length = inputs["input_ids"].size(1) * self.cp_size if "input_ids" in inputs else 1
        with cpu_compat.device_mode():
            schedule = get_forward_backward_func(self.pp_size, self.config.virtual_pipeline_model_parallel_size)
            stored = schedule(
                forward_step_func=functools.partial(self._forward_step, task),
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=self.ddp if len(self.ddp) > 1 else self.ddp[0], num_microbatches=len(microbatches),
                seq_length=seq_length, micro_batch_size=self.args.micro_batch_size, forward_only=forward_only,
            )  # fmt: skip
        return self._metrics(stored, len(microbatches), forward_only)

    # -- the metrics -------------------------------------------------------------------------------
    def _metrics(self, stored: list[dict[str, torch.Tensor]], count: int, evaluating: bool) -> dict[str, torch.Tensor]:
        """Per-micro-batch means, averaged over DP on the last stage, then given to every stage."""
        metrics = None
        if self.pp_rank == self.pp_size - 1:
            totals: dict[str, torch.Tensor] = {}
            for item in stored:
                for k, v in item.items():
                    totals[k] = totals.get(k, 0) + v
            metrics = average_metrics(totals, count, self.dp_group)
        if self.pp_size > 1:
            metrics = self._from_last_stage(metrics, evaluating)
        return metrics

    def _from_last_stage(self, metrics: dict[str, torch.Tensor] | None, evaluating: bool) -> dict[str, torch.Tensor]:
        """The last stage's metrics on every stage: their names once (a pickled broadcast, the
        first time), then one tensor a step, never read here."""
        from megatron.core import parallel_state as ps

        group, last = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
        if evaluating not in self._metric_names:  # training and evaluation may log other metrics
            box = [sorted(metrics) if metrics is not None else None]
            dist.broadcast_object_list(box, src=last, group=group)
            self._metric_names[evaluating] = box[0]
        names = self._metric_names[evaluating]
        device = comm_device(group)
        if metrics is not None and names:
            shared = torch.stack([metrics[n].to(device) for n in names])
        else:
            shared = torch.zeros(len(names), dtype=torch.float32, device=device)
        dist.broadcast(shared, src=last, group=group)
        return dict(zip(names, shared.unbind(), strict=True))

    # -- the optimizer step ------------------------------------------------------------------------
    def _finalize_grads(self) -> None:
        """Finish DDP's gradient reduction, sum sequence-parallel gradients over TP and tied embeddings'
        over the embedding group (what megatron-core's ``finalize_model_grads`` does for its models)."""
        from megatron.core import parallel_state as ps

        for model in self.ddp:
            model.finish_grad_sync()
        all_reduce_flat(self.sequence_parallel_grads, self.tp_group)
        if self.tied and self.pp_size > 1:
            group = ps.get_embedding_group()
            for p in self.tied:
                dist.all_reduce(p.main_grad, group=group)

    def train_step(self, microbatches: list[Batch], task: Task) -> StepResult:
        """Forward and backward through the pipeline schedule, finalise the gradients, then megatron-core's
        gradient preparation and norm (:meth:`_prepare_grads`); a finite step is clipped and applied,
        any other skipped on every rank. The LR schedule advances only on an applied step."""
        for model in self.ddp:
            model.train()
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        metrics = self._run(microbatches, task, forward_only=False)
        with cpu_compat.device_mode():
            self._finalize_grads()
            overflow, grad_norm = self._prepare_grads()
            finite = not overflow and math.isfinite(grad_norm)
            if finite:
                self._clip(grad_norm)
                finite = self.optimizer.step_with_ready_grads()
            loss_scale = float(self.optimizer.get_loss_scale())  # after its update, as Megatron logs it
        if finite:
            self.scheduler.step(increment=self.args.global_batch_size)
        params_norm = self._params_norm() if self.args.log_params_norm else None
        return StepResult(
            metrics=metrics, grad_norm=grad_norm if finite else None, loss_scale=loss_scale, skipped=not finite,
            overflow=overflow, learning_rate=self.optimizer.param_groups[0]["lr"], params_norm=params_norm,
        )  # fmt: skip

    def _prepare_grads(self) -> tuple[bool, float]:
        """Hand the reduced gradients to the optimizer's fp32 (shard's) ``.grad``; with --fp16 its
        scaler unscales them, finds inf/NaN over the model-parallel ranks and updates the scale.
        Then (no overflow) their global norm over megatron-core's gradient-statistics group
        (model-parallel ranks, and the data-parallel ones whose shards the distributed optimizer
        owns): NaN or inf exactly when some gradient is, on any rank, so the step is skipped
        everywhere (megatron-core's own ``step`` would apply it in fp32 and bf16, which have no
        scaler to check). Returns (fp16 overflow, norm)."""
        if self.optimizer.prepare_grads():
            return True, math.nan
        return False, float(self.optimizer.get_grad_norm())

    def _clip(self, grad_norm: float) -> None:
        """Clip to ``--clip-grad`` with the norm already computed (each chained optimizer's shard)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if self.args.clip_grad > 0:
            for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                params = optimizer.get_parameters()
                if params:  # a rank whose shard is empty has nothing to clip
                    clip_grad_by_total_norm_fp32(params, self.args.clip_grad, grad_norm)

    def _params_norm(self) -> float:
        """The weights' global norm (``--log-params-norm``): over TP shards and pipeline stages, tied
        weights once."""
        from megatron.core import parallel_state as ps

        from megatron_slapo.engines.optimizer import global_norm

        params = [p for chunk in self.chunks for p in chunk.parameters() if not getattr(p, "shared", False)]
        experts = ps.get_expert_tensor_and_model_parallel_group() if any(
            getattr(p, "expert_parallel", False) for p in params) else None  # fmt: skip
        squared = torch.tensor(global_norm(params, self.tp_group, of_grads=False, expert_group=experts) ** 2,
                               device=comm_device())  # fmt: skip
        if self.pp_size > 1:
            dist.all_reduce(squared, group=ps.get_pipeline_model_parallel_group())
        return float(squared.sqrt())

    # -- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_step(self, microbatches: list[Batch], task: Task) -> dict[str, float]:
        """The pipeline schedule forward only; metrics averaged and given to every stage."""
        for model in self.ddp:
            model.eval()
        return metrics_to_floats(self._run(microbatches, task, forward_only=True))
