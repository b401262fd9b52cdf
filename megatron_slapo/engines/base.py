"""The seam between the trainer and an engine (DDP, megatron-core, DeepSpeed, FSDP2).

The trainer hands an engine the built model and the arguments, then only ever asks it to run one
training step over a list of micro-batches, to evaluate, and for its state (for checkpoints).
Checkpoint state: for ``--ckpt-format torch_dist`` (the default), ``sharded_state`` describes what
this rank holds of each weight and AdamW moment, in place, and ``load_sharded_state`` loads into
the same tensors (:mod:`~megatron_slapo.engines.sharded_state`); for the legacy ``torch`` format,
``state_dict`` returns what goes into Megatron's ``model_optim_rng.pt`` (the full TP-local weights
of this rank's pipeline stages), and an engine whose optimizer is partitioned across ranks (ZeRO,
FSDP) additionally writes its own files into the iteration's directory.
Everything engine-specific (wrapping, gradient reduction, optimizer, LR schedule, loss scaling)
stays behind this interface, so the trainer is the same for every engine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from megatron_slapo.engines.optimizer import half_precision
from megatron_slapo.engines.sharded_state import EngineState, Fill
from megatron_slapo.parallel.collectives import Group, group_size

Batch = dict[str, torch.Tensor]
Loss = tuple[torch.Tensor, dict[str, torch.Tensor]]  # (scalar loss to differentiate, metrics to log)


class Task(Protocol):
    """What the engine needs from the task (GPT, BERT): the model's inputs and the loss."""

    def inputs(self, batch: Batch) -> dict[str, Any]:
        """The model's keyword inputs for ``batch`` (a pipeline's first stage takes these)."""
        ...

    def criterion(self, out: Any, batch: Batch) -> Loss:
        """The loss and metrics from the model's output (a pipeline's last stage computes this)."""
        ...

    def loss(self, model: nn.Module, batch: Batch) -> Loss:
        """``criterion`` of ``model``'s output on ``inputs``: a whole-model engine's forward."""
        ...


@dataclass
class StepResult:
    """One optimizer step, as the trainer logs it.

    The metrics stay tensors: reading them waits for the device, which the trainer does only at
    ``--log-interval`` (and TensorBoard's interval), as Megatron-LM does, or for a skipped step.
    """

    metrics: dict[str, torch.Tensor]  # 0-dim fp32, averaged over the micro-batches and data-parallel ranks
    grad_norm: float | None  # before clipping; None when the step was skipped
    loss_scale: float
    skipped: bool  # the optimizer step was skipped (non-finite gradients)
    overflow: bool  # ... because the fp16 loss scale overflowed: routine, not divergence
    learning_rate: float
    params_norm: float | None = None  # with --log-params-norm
    comm: dict[str, int] | None = None  # with --log-comm: bytes per ``op[group]`` (set by the trainer)

    @functools.cached_property
    def loss_finite(self) -> bool:
        """Reads the metrics (a device sync, once: the trainer and the reporter both ask)."""
        return all(math.isfinite(v) for v in metrics_to_floats(self.metrics).values())

    @property
    def diverging(self) -> bool:
        """Non-finite numbers that loss scaling does not explain: a skipped step without an fp16
        overflow, or with a non-finite loss; a step taken on a non-finite gradient norm (an
        optimizer that steps regardless, as DeepSpeed's without ZeRO); and, where the engine has
        no norm to tell by, a non-finite loss. The loss is read (a device sync) only then."""
        if self.skipped:
            return not self.overflow or not self.loss_finite
        if self.grad_norm is None:
            return not self.loss_finite
        return not math.isfinite(self.grad_norm)


@dataclass(frozen=True)
class ModelShape:
    """The model's size in Megatron's terms, which megatron-core's ``TransformerConfig`` requires:
    its pipeline sizes the messages between stages by ``hidden_size``. The trainer reads it from
    the HF config (an image model: its last stage's channels, and the TP size as "heads")."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int


class Engine(Protocol):
    """What the trainer asks of every engine (``ENGINES`` in :mod:`megatron_slapo.engines`).

    An engine is constructed with the built model (this rank's TP shards; with pipeline
    parallelism, its stages), the arguments, the data- and tensor-parallel groups and the model's
    :class:`ModelShape` (which only megatron-core reads), and owns everything between a list of
    micro-batches and an updated model: wrapping, gradient accumulation and reduction, mixed precision, clipping,
    the optimizer, the LR schedule and the loss scale. Every method is collective over the ranks
    that hold the model (call it on every rank, in the same order).
    """

    model: nn.Module  # the built model, unwrapped
    MIXED_PRECISION: dict[str, str]  # what --bf16 / --fp16 ("bf16", "fp16") mean on this engine

    def train_step(self, microbatches: list[Batch], task: Task) -> StepResult:
        """One optimizer step over the global batch's micro-batches on this rank: forward and
        backward each (``task.loss``), reduce gradients over the data-parallel ranks, then clip and
        step, or skip the step on every rank when the gradients are not finite. The metrics are
        averaged over micro-batches and data-parallel ranks, so every rank logs the same numbers."""
        ...

    def eval_step(self, microbatches: list[Batch], task: Task) -> dict[str, float]:
        """Forward only, in evaluation mode: the metrics averaged as in :meth:`train_step`; no
        gradient, no state changes (a pipeline runs its forward-only schedule)."""
        ...

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for ``params``, ``grads`` and ``optimizer`` state (logged at start;
        ``tools/explain.py`` plans with the same accounting)."""
        ...

    def state_dict(self, directory: str, include_optimizer: bool = True) -> dict[str, Any]:
        """What goes into this rank's ``model_optim_rng.pt``: the TP-local weights of its stages, whole
        whatever the engine (``model``), and with ``include_optimizer`` the optimizer, LR schedule and
        loss-scale state. An engine that partitions the optimizer over data-parallel ranks writes its
        partition into ``directory`` (the temporary iteration directory) and keeps a pointer here.
        Collective: every rank calls it."""
        ...

    def load_state_dict(self, state: dict[str, Any], directory: str, load_optimizer: bool = True) -> None:
        """Restore what :meth:`state_dict` returned (``state``) and wrote into ``directory``; without
        ``load_optimizer`` (``--no-load-optim``, ``--finetune``) only the weights. Collective."""
        ...

    def sharded_state(self, include_optimizer: bool = True) -> EngineState:
        """This rank's state for a distributed checkpoint (``--ckpt-format torch_dist``): each
        parameter's weight (the fp32 main copy where the engine keeps one) and, with
        ``include_optimizer``, AdamW's moments, as the runs of elements this rank holds (see
        :mod:`~megatron_slapo.engines.sharded_state`), plus the scalars (Adam's step count, the LR
        schedule, the loss scaler). The tensors may be the live ones: the caller copies them if it
        writes while training goes on. Collective."""
        ...

    def load_sharded_state(self, fill: Fill, load_optimizer: bool = True) -> None:
        """Load a distributed checkpoint: describe the tensors to load into as :meth:`sharded_state`
        does (creating the optimizer's state first if it has none yet), call ``fill`` on it (which
        writes the saved values into them, in place, and sets ``scalars`` to the saved ones), then
        bring every other copy up to date (low-precision weights from fp32 main weights, the step
        count, the LR schedule, the loss scale). Without ``load_optimizer``, only the weights.
        Collective."""
        ...


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch's tensors on ``device`` (copied asynchronously where the device allows)."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def accumulate(totals: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    """Add one micro-batch's metrics into ``totals`` (detached)."""
    for k, v in metrics.items():
        totals[k] = totals.get(k, 0) + v.detach()


def average_metrics(totals: dict[str, torch.Tensor], count: int, dp_group: Group) -> dict[str, torch.Tensor]:
    """Per-micro-batch means of ``totals``, averaged over the data-parallel ranks (one all-reduce);
    tensors, so that no step waits for the device to read them."""
    names = sorted(totals)
    if not names:
        return {}
    values = torch.stack([totals[n].detach().float() for n in names]) / count
    if group_size(dp_group) > 1:
        dist.all_reduce(values, group=dp_group)
        values /= group_size(dp_group)
    return dict(zip(names, values.unbind(), strict=True))


def metrics_to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Read metric tensors at once (one device sync)."""
    names = list(metrics)
    values = torch.stack([metrics[n].float() for n in names]).tolist() if names else []
    return dict(zip(names, values, strict=True))


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes held by ``tensors`` (their elements, not their storage's slack)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def adamw_state(weight_bytes: int) -> dict[str, int]:
    """The state of an engine that keeps fp32 weights (``weight_bytes`` of them on this rank), fp32
    gradients alike, and AdamW's two fp32 moments: DDP's and FSDP's :meth:`Engine.memory_report`
    (also ``tools/explain.py``'s)."""
    return {"params": weight_bytes, "grads": weight_bytes, "optimizer": 2 * weight_bytes}


def autocast(args: argparse.Namespace, device: torch.device) -> contextlib.AbstractContextManager:
    """Megatron's ``--bf16``/``--fp16`` as autocast around the forward: fp32 master weights, matmuls
    in the low precision; a no-op in fp32."""
    dtype = half_precision(args)
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: nn.Module, microbatches: list[Batch], task: Task, device: torch.device, dp_group: Group,
             precision: contextlib.AbstractContextManager | None = None) -> dict[str, float]:  # fmt: skip
    """Forward-only pass of an engine that runs the whole model on each rank: metrics averaged
    over the micro-batches and the data-parallel ranks."""
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    for batch in microbatches:
        with precision or contextlib.nullcontext():
            _, metrics = task.loss(model, to_device(batch, device))
        accumulate(totals, metrics)
    return metrics_to_floats(average_metrics(totals, len(microbatches), dp_group))
