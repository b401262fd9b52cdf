"""What an engine holds of the training state, described shard by shard (for ``--ckpt-format torch_dist``).

A distributed checkpoint stores every tensor once, under its global identity, so that any layout
can read it back. The engines differ in where the numbers live: DDP keeps each parameter whole
(its tensor-parallel shard), megatron-core's distributed optimizer and ZeRO-1/2 keep a flat range
of each parameter's elements on every data-parallel rank, ZeRO-3 and FSDP2 partition the weights
themselves. All of these are, for one parameter, *a run of consecutive elements of its TP-local
tensor, flattened row-major*: the whole tensor is the run from 0, an FSDP2 shard (rows of dim 0)
is the run from ``row * row_size``. So an engine describes its state as, per parameter, for each
kind of state (``weight``, ``exp_avg``, ``exp_avg_sq``), the tensor holding its run and where that
run starts. The checkpoint (``megatron_slapo.checkpoints.dist_checkpoint``) maps runs to boxes of the
global tensor, through the parameter's tensor-parallel placement.

``weight`` is the most precise copy of a weight the engine keeps: the fp32 main weight under
``--bf16``/``--fp16`` (megatron-core, DeepSpeed), the parameter itself otherwise. Loading writes
into the same tensors, in place; the engine then brings its other copies up to date.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron_slapo.parallel.layout import Stride, as_stride

WEIGHT = "weight"
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's, as torch names them


@dataclass
class Run:
    """``data`` holds elements ``[start, start + data.numel())`` of the TP-local tensor flattened
    row-major. ``data`` is contiguous (any shape: it is read and written through ``view(-1)``)."""

    data: torch.Tensor
    start: int = 0


@dataclass
class ParamShards:
    """One parameter (or persistent buffer) as this rank holds it.

    ``names``: its names in this rank's model (tied weights have several; a pipeline stage keeps the
    whole model's names). ``shape``: its TP-local shape (this rank's tensor-parallel shard, whole).
    ``partition``: ``(dim, stride)`` of a tensor-parallel shard (Megatron's ``partition_dim`` and
    ``partition_stride``), None when every TP rank holds all of it. ``tensors``: state name ->
    the run this rank holds (a state it does not hold at all is left out). ``experts``: an MoE
    model's routed experts held by expert-parallel rank ``r`` of ``E`` (``(r, E)``; the global
    tensor has ``E`` times the experts along dim 0), None for every other tensor.
    """

    names: list[str]
    shape: torch.Size
    partition: tuple[int, Stride] | None
    tensors: dict[str, Run] = field(default_factory=dict)
    experts: tuple[int, int] | None = None


@dataclass
class EngineState:
    """All of an engine's state on this rank: the tensors, shard by shard, and the scalars
    (``optimizer_step``: Adam's step count, every parameter steps together; ``opt_param_scheduler``:
    the LR schedule's state dict; ``grad_scaler``: the fp16 loss scaler's, when there is one)."""

    params: list[ParamShards]
    scalars: dict[str, Any] = field(default_factory=dict)


Fill = Callable[[EngineState], None]  # loads a checkpoint into the runs it is given, and sets the scalars


def tensor_parallel_partition(p: torch.Tensor) -> tuple[int, Stride] | None:
    """Megatron's tags on a parameter: ``(partition_dim, partition_stride)``, or None when replicated
    (the stride an int, or a tuple of unequal blocks' relative sizes: :mod:`megatron_slapo.parallel.layout`)."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    return int(p.partition_dim), as_stride(getattr(p, "partition_stride", 1))


def expert_partition(p: torch.Tensor) -> tuple[int, int] | None:
    """``(expert-parallel rank, size)`` of an expert-parallel weight (plans/expert_parallel.py's tags), else None."""
    return (p.expert_rank, p.expert_size) if getattr(p, "expert_parallel", False) else None


def named_once(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """``model``'s parameters and persistent buffers, each once with all its names (tied weights
    have several), in the model's order."""
    found: dict[int, tuple[list[str], torch.Tensor]] = {}
    persistent = set(model.state_dict(keep_vars=True))
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in persistent:
            found.setdefault(id(t), ([], t))[0].append(name)
    return list(found.values())


def whole(model: nn.Module, optimizer_state: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None,
          run: Callable[[torch.Tensor], Run] = lambda t: Run(t.data)) -> EngineState:  # fmt: skip
    """The weights (and persistent buffers) of an engine whose optimizer works on the model's
    parameters themselves (DDP, FSDP2), and, given ``optimizer_state`` (a parameter -> its state
    tensors by name), AdamW's moments; ``run`` says what this rank holds of a tensor (all of it,
    by default)."""
    params = []
    for names, t in named_once(model):
        shards = ParamShards(names, t.shape, tensor_parallel_partition(t), {WEIGHT: run(t)}, expert_partition(t))
        if optimizer_state is not None and isinstance(t, nn.Parameter) and t.requires_grad:
            shards.tensors.update({k: run(v) for k, v in optimizer_state(t).items() if k in MOMENTS})
        params.append(shards)
    return EngineState(params)


def init_adam_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor] | None = None) -> None:
    """Give every parameter of a torch Adam(W) (or ``params``: those it steps, where it is handed
    them only for the step) its state (zero moments, step 0) if it has none yet, so that a
    checkpoint can be loaded into it in place before the first step."""
    for p in params if params is not None else [p for group in optimizer.param_groups for p in group["params"]]:
        state = optimizer.state[p]
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adam_step(optimizer: torch.optim.Optimizer) -> float:
    """The step count of a torch Adam(W) (every parameter steps together; 0 before the first)."""
    counts = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(counts, default=0.0)


def set_adam_step(optimizer: torch.optim.Optimizer, count: float) -> None:
    """Give every parameter's state of a torch Adam(W) the step count ``count``."""
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].fill_(count) if torch.is_tensor(state["step"]) else state.update(step=count)
