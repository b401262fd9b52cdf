"""The seam between the trainer and an engine (DDP, megatron-core, DeepSpeed, FSDP2).

The trainer hands an engine the built model and the arguments, then only ever asks it to run one
training step over a list of micro-batches, to evaluate, and for its state (for checkpoints).
Everything engine-specific (wrapping, gradient reduction, optimizer, LR schedule, loss scaling)
stays behind this interface, so the trainer is the same for every engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

Batch = dict[str, torch.Tensor]
# loss_fn(model, micro_batch) -> (scalar loss to differentiate, metrics to log)
LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class StepResult:
    """One optimizer step, as the trainer logs it."""

    metrics: dict[str, float]  # averaged over the micro-batches and data-parallel ranks
    grad_norm: float | None  # before clipping; None when the step was skipped
    loss_scale: float
    skipped: bool  # the optimizer step was skipped (non-finite gradients)
    overflow: bool  # ... because the fp16 loss scale overflowed: routine, not divergence
    learning_rate: float
    params_norm: float | None = None  # with --log-params-norm

    @property
    def loss_finite(self) -> bool:
        return all(math.isfinite(v) for v in self.metrics.values())

    @property
    def diverging(self) -> bool:
        """A non-finite loss, or non-finite gradients that loss scaling does not explain."""
        return not self.loss_finite or (self.skipped and not self.overflow)


class Engine(Protocol):
    model: nn.Module  # the built model, unwrapped

    def train_step(self, microbatches: list[Batch], loss_fn: LossFn) -> StepResult: ...

    def eval_step(self, microbatches: list[Batch], loss_fn: LossFn) -> dict[str, float]: ...

    def state_dict(self, include_optimizer: bool = True) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], load_optimizer: bool = True) -> None: ...
