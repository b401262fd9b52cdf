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
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_slapo.compat import megatron_cpu as cpu_compat
from megatron_slapo.engines.base import (
    Batch,
    ModelShape,
    StepResult,
    Task,
    average_metrics,
    metrics_to_floats,
    to_device,
)
from megatron_slapo.engines.loss_scaler import load_scaler_state
from megatron_slapo.engines.megatron_experts import megatron_state_with_experts, norm_counts_each_ranks_experts
from megatron_slapo.engines.megatron_state import (
    adam_optimizers,
    adam_steps,
    all_names,
    copy_main_to_model,
    describe,
    main_tensors,
    optimizer_parts,
    set_adam_steps,
)
from megatron_slapo.engines.optimizer import build_scheduler, half_precision, megatron_fp32_grads
from megatron_slapo.engines.sharded_state import EngineState, Fill, init_adam_state
from megatron_slapo.engines.stage_chunk import StageChunk, check_plan
from megatron_slapo.errors import CheckpointError
from megatron_slapo.parallel.collectives import Group, all_reduce_flat, comm_device, group_size
from megatron_slapo.pipeline import PipelineStages

PARAMETER_STATE = "distrib_optim.pt"  # Megatron-LM's file for the distributed optimizer's shards
# Not actionable here: a default of TransformerConfig, and the missing apex (see the README's notes).
warnings.filterwarnings("ignore", "full scope is deprecated", UserWarning)
warnings.filterwarnings("ignore", "Apex is not installed", UserWarning)


class MegatronEngine:
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
            self.config = self._transformer_config(total, shape)
            self.chunks = [StageChunk(stage, k == 0, k == total - 1, self.config) for k, stage in stages]
            self._mark_tied(model)
            if self.dtype != torch.float32:  # Megatron's --bf16/--fp16: such weights, fp32 main copies in the optimizer
                for chunk in self.chunks:
                    for p in chunk.parameters():
                        p.data = p.data.to(self.dtype)
            self.ddp = [self._wrap(chunk) for chunk in self.chunks]
            # Weights that saw part of the sequence on each TP rank: their gradient buffers (views
            # into DDP's, fixed from here on) are summed over TP after each backward, as
            # megatron-core's finalize_model_grads does for its own models.
            self.sequence_parallel_grads = [p.main_grad for chunk in self.chunks for p in chunk.parameters()
                                            if getattr(p, "sequence_parallel", False)]  # fmt: skip
            self.optimizer = self._optimizer()
        self.model = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        self.scheduler = build_scheduler(self.optimizer, args)
        no_sync = [m.no_sync for m in self.ddp]
        self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if args.fp16:  # the schedules scale each micro-batch's loss by the optimizer's loss scale
            self.config.grad_scale_func = self.optimizer.scale_loss
        if args.overlap_grad_reduce:
            grad_sync = [m.start_grad_sync for m in self.ddp]
            self.config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync

    # -- construction -----------------------------------------------------------------------------
    def _transformer_config(self, total_stages: int, shape: ModelShape) -> Any:
        """The settings megatron-core's schedules and DDP read (p2p shapes, dtypes, VPP size)."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        a = self.args
        vpp = total_stages // self.pp_size if total_stages > self.pp_size else None
        return TransformerConfig(
            num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
            tensor_model_parallel_size=group_size(self.tp_group), pipeline_model_parallel_size=self.pp_size,
            virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=self.dtype, params_dtype=self.dtype, bf16=a.bf16,
            fp16=a.fp16,
            # With two pipeline ranks the previous and the next rank are the same peer; batched p2p then
            # pairs the interleaved schedule's messages crosswise (cpu-feasibility.md §1): send one by one.
            batch_p2p_comm=not (vpp and self.pp_size == 2), batch_p2p_sync=torch.cuda.is_available(),
            use_cpu_initialization=True, gradient_accumulation_fusion=False, deallocate_pipeline_outputs=False,
            sequence_parallel=a.sequence_parallel,  # the p2p buffers then hold this rank's part of the sequence
            context_parallel_size=self.cp_size,
        )  # fmt: skip

    def _mark_tied(self, model: nn.Module) -> None:
        """Weights shared by the first and the last stage: remember them (their gradients are summed
        over the embedding group) and, where this rank lacks the first stage, mark the copy
        ``shared`` so that megatron-core's gradient norm counts it once. ``shared_embedding`` gives
        each copy a gradient bucket of its own, so that under the distributed optimizer both stages
        shard it alike and the tie's all-reduce adds matching, already DP-reduced, shards."""
        self.tied: list[nn.Parameter] = []
        if not isinstance(model, PipelineStages):
            return
        local = {id(p) for chunk in self.chunks for p in chunk.parameters()}
        first = {id(p) for p in model.stages[0].parameters()}
        for name, used in sorted(model.plan.tied.items()):
            owner = model.stages[used[0]]
            p = dict(owner.named_parameters())[name]
            if id(p) in local:
                self.tied.append(p)
                p.shared_embedding = True
                if self.pp_rank != 0 or id(p) not in first:
                    p.shared = True

    def _wrap(self, chunk: StageChunk) -> nn.Module:
        """megatron-core's DDP around one chunk (its contiguous gradient buffers, overlap if asked)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.grads_in_fp32, overlap_grad_reduce=self.args.overlap_grad_reduce,
            use_distributed_optimizer=self.args.use_distributed_optimizer,
        )  # fmt: skip
        return DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk)

    def _optimizer(self) -> Any:
        """megatron-core's optimizer from the flags: Adam(W), its mixed-precision wrapper and loss scaler."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        a = self.args
        config = OptimizerConfig(
            optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.clip_grad, bf16=a.bf16, fp16=a.fp16,
            params_dtype=self.dtype, use_distributed_optimizer=a.use_distributed_optimizer,
            # megatron-core would build a constant scaler for bf16/fp32 too, which only fp16 scales the loss for
            loss_scale=a.loss_scale if a.fp16 else None, initial_loss_scale=a.initial_loss_scale,
            min_loss_scale=a.min_loss_scale,
            loss_scale_window=a.loss_scale_window, hysteresis=a.hysteresis,
        )  # fmt: skip
        optimizer = get_megatron_optimizer(config, self.ddp)
        norm_counts_each_ranks_experts(optimizer)
        return optimizer

    # -- steps -------------------------------------------------------------------------------------
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

    @torch.no_grad()
    def eval_step(self, microbatches: list[Batch], task: Task) -> dict[str, float]:
        """The pipeline schedule forward only; metrics averaged and given to every stage."""
        for model in self.ddp:
            model.eval()
        return metrics_to_floats(self._run(microbatches, task, forward_only=True))

    # -- accounting and checkpoints ----------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """This rank's stages, as :func:`megatron_state` counts them; an MoE model's expert-parallel
        weights with their optimizer state split over the expert-data-parallel ranks instead."""
        params = [p for chunk in self.chunks for p in chunk.parameters()]
        return megatron_state_with_experts(self.args, params, group_size(self.dp_group))

    def _model_state(self) -> dict[str, torch.Tensor]:
        """This rank's stages' weights, under the model's own parameter names."""
        state: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            state.update(chunk.stage.state_dict())
        return state

    def state_dict(self, directory: str, include_optimizer: bool = True) -> dict[str, Any]:
        """This rank's stages' weights and, with ``include_optimizer``, megatron-core's optimizer state
        (with the distributed optimizer: its parameter state gathered into Megatron-LM's
        ``distrib_optim.pt`` under ``directory`` by DP rank 0, and Adam's step count) and the LR
        schedule's."""
        state: dict[str, Any] = {"model": self._model_state()}
        if include_optimizer:
            with cpu_compat.device_mode():
                state["optimizer"] = self.optimizer.state_dict()
                if self.args.use_distributed_optimizer:
                    state["optimizer"] = {"distributed": state["optimizer"], "files": PARAMETER_STATE,
                                          "steps": adam_steps(self.optimizer)}  # fmt: skip
                    path = self._parameter_state_file(directory)
                    if self._dp_rank() == 0:
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                    self.optimizer.save_parameter_state(path)  # gathered onto data-parallel rank 0
            state["opt_param_scheduler"] = self.scheduler.state_dict()  # the loss scaler is in the optimizer's
        return state

    def _dp_rank(self) -> int:
        """This rank's place in the data-parallel group (0 with one rank)."""
        return dist.get_rank(self.dp_group) if group_size(self.dp_group) > 1 else 0

    def _parameter_state_file(self, directory: str) -> str:
        """Where the distributed optimizer's parameter state goes, beside this rank's checkpoint file."""
        from megatron_slapo.parallel.state import Layout

        return os.path.join(directory, Layout.current().rank_dir(), PARAMETER_STATE)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], directory: str, load_optimizer: bool = True) -> None:
        """Load this rank's stages' weights (refusing a checkpoint that lacks some: another pipeline
        layout); then, when asked, the optimizer, which must match ``--use-distributed-optimizer``
        (``CheckpointError`` otherwise), and the LR schedule. Without the optimizer, its fp32 main
        weights are reloaded from the new weights."""
        saved = state["model"]
        for chunk in self.chunks:
            own = chunk.stage.state_dict()
            missing = sorted(set(own) - set(saved))
            if missing:
                raise RuntimeError(f"the checkpoint lacks {missing[:5]} (saved with another pipeline layout?)")
            chunk.stage.load_state_dict({k: saved[k] for k in own})
        for model in self.ddp:  # the optimizer's fp32 copies and the DDP buffers follow the weights
            model.zero_grad_buffer()
        if not (load_optimizer and "optimizer" in state):
            with cpu_compat.device_mode():
                self.optimizer.reload_model_params()
            return
        if "grad_scaler" in state and self.args.fp16:  # its fp32 optimizer state still fits fp32 runs
            raise CheckpointError(f"{directory} was saved by an earlier --fp16 of this engine (autocast over fp32 "
                                  "weights); load its weights with --no-load-optim")  # fmt: skip
        optimizer = _without_constant_scaler(state["optimizer"])
        distributed = isinstance(optimizer, dict) and "distributed" in optimizer
        if distributed != bool(self.args.use_distributed_optimizer):
            raise CheckpointError(
                f"{directory} was saved {'with' if distributed else 'without'} --use-distributed-optimizer; "
                "pass the same flag, or --no-load-optim to load only the weights"
            )
        with cpu_compat.device_mode():
            if distributed:
                self.optimizer.load_state_dict(optimizer["distributed"])
                for torch_optimizer in adam_optimizers(self.optimizer):
                    for param_state in torch_optimizer.state.values():
                        param_state.pop("step", None)
                self.optimizer.load_parameter_state(self._parameter_state_file(directory))
                set_adam_steps(self.optimizer, optimizer["steps"])
            else:
                self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(state["opt_param_scheduler"])

    def sharded_state(self, include_optimizer: bool = True) -> EngineState:
        """This rank's stages' weights (the fp32 main copies under --bf16/--fp16) and, with
        ``include_optimizer``, Adam's moments, where megatron-core's optimizer keeps them
        (:mod:`~megatron_slapo.engines.megatron_state`); the step count, the LR schedule and the
        fp16 loss scaler's state. The tensors are the live ones."""
        stages = [chunk.stage for chunk in self.chunks]
        state = EngineState(describe(stages, self.tensor_names, main_tensors(self.optimizer), include_optimizer))
        if include_optimizer:
            state.scalars = {
                "optimizer_step": adam_steps(self.optimizer),
                "opt_param_scheduler": self.scheduler.state_dict(),
            }
            if self.args.fp16:  # every chained optimizer's scaler steps alike
                state.scalars["grad_scaler"] = optimizer_parts(self.optimizer)[0].grad_scaler.state_dict()
        return state

    @torch.no_grad()
    def load_sharded_state(self, fill: Fill, load_optimizer: bool = True) -> None:
        """Give Adam its state (zeros) if it has none yet, let ``fill`` write into the tensors
        :meth:`sharded_state` describes, then cast the fp32 main weights into the model's (with the
        distributed optimizer, each rank its run, then all-gathered as after a step), clear the
        gradient buffers and set the step count, LR schedule and loss scale."""
        mains = main_tensors(self.optimizer)
        if load_optimizer:
            for torch_optimizer in adam_optimizers(self.optimizer):
                init_adam_state(torch_optimizer)
        state = self.sharded_state(load_optimizer)
        fill(state)
        stages = [chunk.stage for chunk in self.chunks]
        with cpu_compat.device_mode():
            copy_main_to_model(stages, mains)
            for model in self.ddp:
                if self.args.use_distributed_optimizer:
                    model.start_param_sync(force_sync=True)
                model.zero_grad_buffer()
        if load_optimizer:
            set_adam_steps(self.optimizer, state.scalars["optimizer_step"])
            self.scheduler.load_state_dict(state.scalars["opt_param_scheduler"])
            if self.args.fp16 and "grad_scaler" in state.scalars:
                for part in optimizer_parts(self.optimizer):
                    load_scaler_state(part.grad_scaler, state.scalars["grad_scaler"])


def _without_constant_scaler(state: Any) -> Any:
    """An optimizer state saved with ``--loss-scale`` holds the constant scaler's empty state, which a
    dynamic scaler cannot load: leave it out, so that the dynamic scale starts from its flags. (The
    state of megatron-core's chained optimizer is a list of states; the distributed one's is nested.)"""
    if isinstance(state, list):
        return [_without_constant_scaler(s) for s in state]
    if not isinstance(state, dict):
        return state
    return {k: _without_constant_scaler(v) if k == "distributed" else v for k, v in state.items()
            if not (k == "grad_scaler" and v == {})}  # fmt: skip
