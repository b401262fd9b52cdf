"""The optimizer step shared by the engines whose gradients end up in ``p.grad`` (DDP, FSDP2).

After the backward passes (and the engine's own gradient reduction): unscale (fp16), take the
model-wide gradient norm, skip the step if it is not finite (fp16 overflow, or divergence), else
clip, step AdamW and the LR schedule; then update the loss scale. Every rank of a model computes
the same norm, so all skip or step together.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable

import torch
from torch import nn

from megatron_slapo.engines.base import Batch, StepResult, accumulate, average_metrics
from megatron_slapo.engines.loss_scaler import load_scaler_state, loss_scaler_for
from megatron_slapo.engines.optimizer import build_optimizer, build_scheduler, clip_grads
from megatron_slapo.engines.sharded_state import EngineState, Fill, adam_step, init_adam_state, set_adam_step
from megatron_slapo.parallel.collectives import Group


class LocalStep:
    """AdamW, the LR schedule and (``--fp16``) the loss scaler of one model; see the module doc."""

    def __init__(self, model: nn.Module, args: argparse.Namespace) -> None:
        """AdamW (:func:`build_optimizer`) over ``model``'s trainable parameters, megatron-core's LR
        schedule, and a loss scaler under ``--fp16`` (none otherwise)."""
        self.args = args
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, args)
        self.scheduler = build_scheduler(self.optimizer, args)
        self.scaler = loss_scaler_for(args)

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale now; 1 without a scaler."""
        return float(self.scaler.scale) if self.scaler else 1.0

    def backward(self, microbatches: list[Batch], loss_of: Callable[[Batch], tuple[torch.Tensor, dict]],
                 sync: Callable[[bool], contextlib.AbstractContextManager]) -> dict[str, torch.Tensor]:  # fmt: skip
        """Forward and backward every micro-batch, each loss scaled by 1/n (and the fp16 loss scale);
        the data-parallel reduction happens inside ``sync(last)`` for the last one only. Returns the
        summed metrics."""
        totals: dict[str, torch.Tensor] = {}
        n = len(microbatches)
        scale = self.loss_scale / n  # read once a step
        for i, batch in enumerate(microbatches):
            with sync(i == n - 1):
                loss, metrics = loss_of(batch)
                (loss * scale).backward()
            accumulate(totals, metrics)
        return totals

    def finish(self, totals: dict[str, torch.Tensor], count: int, dp_group: Group,
               norm: Callable[[bool], float]) -> StepResult:  # fmt: skip
        """Step on the accumulated gradients; ``norm(of_grads)`` is the engine's global norm."""
        scale = self.loss_scale
        if scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(scale)
        grad_norm = norm(True)
        finite = math.isfinite(grad_norm)
        if finite:
            clip_grads(self.params, self.args.clip_grad, grad_norm)
            self.optimizer.step()
            self.scheduler.step(increment=self.args.global_batch_size)
        if self.scaler:
            self.scaler.update(found_inf=not finite)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(
            metrics=average_metrics(totals, count, dp_group),
            grad_norm=grad_norm if finite else None,
            loss_scale=self.loss_scale,  # after its update, as Megatron logs it
            skipped=not finite,
            overflow=not finite and self.scaler is not None,
            learning_rate=self.optimizer.param_groups[0]["lr"],
            params_norm=norm(False) if self.args.log_params_norm else None,
        )

    def state_dict(self) -> dict:
        """The LR schedule's state, and the loss scaler's under ``--fp16`` (Megatron's key names)."""
        state = {"opt_param_scheduler": self.scheduler.state_dict()}
        if self.scaler:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (a scaler's state only when this run has one)."""
        self.scheduler.load_state_dict(state["opt_param_scheduler"])
        if self.scaler and "grad_scaler" in state:
            load_scaler_state(self.scaler, state["grad_scaler"])

    def sharded_scalars(self) -> dict:
        """The scalars of a distributed checkpoint: AdamW's step count, the LR schedule, the loss scale."""
        return {"optimizer_step": adam_step(self.optimizer), **self.state_dict()}

    def load_sharded(self, describe: Callable[[bool], EngineState], fill: Fill, load_optimizer: bool) -> None:
        """Load a distributed checkpoint into what ``describe(load_optimizer)`` gives (the engine's
        live tensors: AdamW's state is created first if it has not stepped yet), then the step
        count, LR schedule and loss scale."""
        if load_optimizer:
            init_adam_state(self.optimizer)
        state = describe(load_optimizer)
        fill(state)
        if load_optimizer:
            set_adam_step(self.optimizer, state.scalars["optimizer_step"])
            self.load_state_dict(state.scalars)
