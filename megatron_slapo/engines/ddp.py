"""Data parallelism with torch DDP over megatron-core's data-parallel group.

The scheduled model already carries its tensor parallelism; DDP averages gradients across the
data-parallel replicas. Mixed precision is autocast (fp32 master weights, like Megatron's
``--bf16``/``--fp16``), with Megatron's dynamic loss scale for fp16 (:mod:`megatron_slapo.engines.loss_scaler`).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from megatron_slapo.compat.distributed import ddp_ignore
from megatron_slapo.engines.base import (
    Batch,
    ModelShape,
    StepResult,
    Task,
    adamw_state,
    autocast,
    evaluate,
    tensor_bytes,
    to_device,
)
from megatron_slapo.engines.local_step import LocalStep
from megatron_slapo.engines.optimizer import global_norm
from megatron_slapo.engines.sharded_state import EngineState, Fill, whole
from megatron_slapo.parallel.collectives import Group, all_reduce_flat, allreduce_sequence_parallel_grads, group_size
from megatron_slapo.parallel.state import expert_groups


class DDPEngine:
    """Gradient accumulation, DDP, clipping, AdamW and the LR schedule for one built model."""

    # What --bf16/--fp16 mean here (printed at start: the engines differ)
    MIXED_PRECISION = {d: f"autocast over fp32 weights: matmuls in {d}, fp32 gradients, reduced in fp32"
                       for d in ("bf16", "fp16")}  # fmt: skip

    def __init__(
        self, model: nn.Module, args: argparse.Namespace, dp_group: Group, tp_group: Group, shape: ModelShape
    ) -> None:
        """Wrap ``model`` in torch DDP over ``dp_group`` (not at all with one data-parallel rank) and build
        the step's optimizer, LR schedule and loss scaler over its parameters. ``tp_group``: the ranks
        that share its tensor-parallel shards (for the norm and sequence-parallel gradients)."""
        self.model, self.args, self.dp_group, self.tp_group = model, args, dp_group, tp_group
        self.device = next(model.parameters()).device
        experts = [name for name, p in model.named_parameters() if getattr(p, "expert_parallel", False)]
        self.experts = expert_groups() if experts else None  # an MoE model's expert-parallel weights: their groups
        if experts:  # reduced over the expert-data-parallel ranks instead (_reduce_expert_grads)
            ddp_ignore(model, experts)
        self.wrapped = DistributedDataParallel(model, process_group=dp_group) if group_size(dp_group) > 1 else model
        if args.log_comm and self.wrapped is not model:  # the C++ reducer bypasses torch.distributed's functions
            self.wrapped.register_comm_hook(dp_group, default_hooks.allreduce_hook)
        self.step = LocalStep(model, args)
        self.params, self.optimizer = self.step.params, self.step.optimizer

    def memory_report(self) -> dict[str, int]:
        """Replicated: full (TP-local) fp32 weights and gradients; AdamW keeps two moments per weight."""
        return adamw_state(tensor_bytes(self.params))

    def train_step(self, microbatches: list[Batch], task: Task) -> StepResult:
        """Accumulate every micro-batch's gradients (DDP reduces only during the last backward), sum
        sequence-parallel gradients over TP, then :meth:`LocalStep.finish` (unscale, norm over the TP
        shards, skip or clip and step)."""
        self.wrapped.train()

        def loss_of(batch: Batch) -> tuple[torch.Tensor, dict]:
            with autocast(self.args, self.device):
                return task.loss(self.wrapped, to_device(batch, self.device))

        def sync(last: bool) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext() if last or self.wrapped is self.model else self.wrapped.no_sync()

        totals = self.step.backward(microbatches, loss_of, sync)
        allreduce_sequence_parallel_grads(self.model, self.tp_group)
        if self.experts:
            self._reduce_expert_grads()
        experts = self.experts.tensor_and_model if self.experts else None
        # the norm is the same on every rank of the model
        return self.step.finish(
            totals, len(microbatches), self.dp_group,
            lambda grads: global_norm(self.params, self.tp_group, grads, expert_group=experts),
        )  # fmt: skip

    def _reduce_expert_grads(self) -> None:
        """Sum the expert-parallel weights' gradients over the ranks holding the same experts and divide
        by the data-parallel size, as megatron-core's DDP does: an expert's gradient on one rank already
        sums what every rank of its expert-parallel group sent it, from as many data-parallel replicas."""
        experts = [p for p in self.params if getattr(p, "expert_parallel", False)]
        for p in experts:  # experts no token reached this step: every rank must send the same buffer
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in experts]
        all_reduce_flat(grads, self.experts.data)
        for grad in grads:
            grad.div_(group_size(self.dp_group))

    def eval_step(self, microbatches: list[Batch], task: Task) -> dict[str, float]:
        """Forward only under the run's autocast, metrics averaged over micro-batches and DP ranks."""
        return evaluate(self.model, microbatches, task, self.device, self.dp_group, autocast(self.args, self.device))

    def state_dict(self, directory: str, include_optimizer: bool = True) -> dict[str, Any]:
        """The model's (TP-local) state dict and, with ``include_optimizer``, AdamW's, the LR schedule's
        and the fp16 loss scaler's; every data-parallel rank holds the same, so nothing goes to
        ``directory``."""
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if include_optimizer:
            state.update(optimizer=self.optimizer.state_dict(), **self.step.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any], directory: str, load_optimizer: bool = True) -> None:
        """Load the weights, and the optimizer, LR schedule and loss scale when asked and present."""
        self.model.load_state_dict(state["model"])
        if load_optimizer and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.step.load_state_dict(state)

    def sharded_state(self, include_optimizer: bool = True) -> EngineState:
        """Every rank holds each parameter whole: the weights and AdamW's moments as they are."""
        state = whole(self.model, (lambda p: self.optimizer.state[p]) if include_optimizer else None)
        if include_optimizer:
            state.scalars = self.step.sharded_scalars()
        return state

    def load_sharded_state(self, fill: Fill, load_optimizer: bool = True) -> None:
        """Load into the weights and AdamW's moments in place; then the step count, LR schedule and loss scale."""
        self.step.load_sharded(self.sharded_state, fill, load_optimizer)
