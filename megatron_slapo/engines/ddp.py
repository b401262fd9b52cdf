"""Data parallelism with torch DDP over megatron-core's data-parallel group.

The scheduled model already carries its tensor parallelism; DDP averages gradients across the
data-parallel replicas. Mixed precision is autocast (fp32 master weights, like Megatron's
``--bf16``/``--fp16``), with Megatron's dynamic loss scale for fp16 (:mod:`..training.loss_scaler`).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from megatron_slapo.engines.base import (
    Batch,
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
from megatron_slapo.parallel.collectives import Group, allreduce_sequence_parallel_grads, group_size


class DDPEngine:
    """Gradient accumulation, DDP, clipping, AdamW and the LR schedule for one built model."""

    # What --bf16/--fp16 mean here (printed at start: the engines differ)
    MIXED_PRECISION = {d: f"autocast over fp32 weights: matmuls in {d}, fp32 gradients, reduced in fp32"
                       for d in ("bf16", "fp16")}  # fmt: skip

    def __init__(self, model: nn.Module, args: argparse.Namespace, dp_group: Group, tp_group: Group) -> None:
        self.model, self.args, self.dp_group, self.tp_group = model, args, dp_group, tp_group
        self.device = next(model.parameters()).device
        self.wrapped = DistributedDataParallel(model, process_group=dp_group) if group_size(dp_group) > 1 else model
        if args.log_comm and self.wrapped is not model:  # the C++ reducer bypasses torch.distributed's functions
            self.wrapped.register_comm_hook(dp_group, default_hooks.allreduce_hook)
        self.step = LocalStep(model, args)
        self.params, self.optimizer = self.step.params, self.step.optimizer

    def memory_report(self) -> dict[str, int]:
        """Replicated: full (TP-local) fp32 weights and gradients; AdamW keeps two moments per weight."""
        return adamw_state(tensor_bytes(self.params))

    def train_step(self, microbatches: list[Batch], task: Task) -> StepResult:
        self.wrapped.train()

        def loss_of(batch: Batch) -> tuple[torch.Tensor, dict]:
            with autocast(self.args, self.device):
                return task.loss(self.wrapped, to_device(batch, self.device))

        def sync(last: bool) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext() if last or self.wrapped is self.model else self.wrapped.no_sync()

        totals = self.step.backward(microbatches, loss_of, sync)
        allreduce_sequence_parallel_grads(self.model, self.tp_group)
        # the norm is the same on every rank of the model
        return self.step.finish(
            totals, len(microbatches), self.dp_group, lambda grads: global_norm(self.params, self.tp_group, grads)
        )

    def eval_step(self, microbatches: list[Batch], task: Task) -> dict[str, float]:
        return evaluate(self.model, microbatches, task, self.device, self.dp_group, autocast(self.args, self.device))

    def state_dict(self, directory: str, include_optimizer: bool = True) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if include_optimizer:
            state.update(optimizer=self.optimizer.state_dict(), **self.step.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any], directory: str, load_optimizer: bool = True) -> None:
        self.model.load_state_dict(state["model"])
        if load_optimizer and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.step.load_state_dict(state)
