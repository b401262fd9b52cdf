"""Where the megatron engine keeps each weight's most precise copy, its Adam moments and Adam's
step count (for ``--ckpt-format torch_dist``, :mod:`megatron_slapo.engines.sharded_state`).

megatron-core wraps a torch AdamW in one of three optimizers (a ``ChainedOptimizer`` may hold
several, one per group of parameters):

- ``FP32Optimizer`` (fp32): AdamW steps the model's parameters themselves;
- ``Float16OptimizerWithFloat16Params`` (``--bf16``/``--fp16``): AdamW steps an fp32 copy of each
  low-precision parameter (``main_param``), cast into the model after each step;
- ``DistributedOptimizer`` (``--use-distributed-optimizer``): each data-parallel rank steps a flat
  range of every parameter's elements (megatron-core's "param range", ``[start, end)`` of the
  parameter flattened, the ranks' ranges tiling it): an fp32 copy of that range under bf16/fp16, a
  view into the parameter itself in fp32; after the step the ranks all-gather the weights.

So for a model parameter AdamW steps a :class:`Main` tensor, a run of its elements starting at
``start``, and keeps the moments beside it, in the same shape. Under fp32 the parameter is its own
most precise copy, whole on every rank (the distributed optimizer's all-gather keeps it so), and
is described whole: a load then writes every element where it is used, with no all-gather.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_slapo.compat.megatron_internals import distributed_optimizer_range
from megatron_slapo.engines.sharded_state import (
    MOMENTS,
    WEIGHT,
    ParamShards,
    Run,
    adam_step,
    expert_partition,
    named_once,
    tensor_parallel_partition,
)


@dataclass
class Main:
    """What AdamW steps for one model parameter on this rank: ``tensor`` (the parameter, its fp32
    copy, or a flat range of either) holds the parameter's elements from ``start``; ``optimizer``,
    the torch AdamW whose state holds its moments."""

    tensor: torch.Tensor
    start: int
    optimizer: torch.optim.Optimizer


def optimizer_parts(optimizer: Any) -> list[Any]:
    """The megatron-core optimizers inside ``optimizer`` (a ``ChainedOptimizer``'s, or itself),
    less those with no torch optimizer (a rank that steps nothing)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in parts if part.optimizer is not None]


def adam_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch AdamWs inside megatron-core's ``optimizer``."""
    return [part.optimizer for part in optimizer_parts(optimizer)]


def adam_steps(optimizer: Any) -> float:
    """Adam's step count. torch's AdamW counts steps per parameter, which megatron-core's
    parameter-state file (written for fused Adams that count per group) leaves out. Every
    parameter steps together, so one count is kept (data-parallel ranks hold different shards)."""
    return max((adam_step(o) for o in adam_optimizers(optimizer)), default=0.0)


def set_adam_steps(optimizer: Any, count: float) -> None:
    """Give every parameter of the torch AdamWs the step count ``count``."""
    for o in adam_optimizers(optimizer):
        for group in o.param_groups:
            for p in group["params"]:
                o.state[p]["step"] = torch.tensor(count, dtype=torch.float32)


def _pairs(part: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(model parameter, the tensor AdamW steps for it) for one megatron-core optimizer."""
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params

    if isinstance(part, DistributedOptimizer):
        groups = [(part.model_float16_groups, part.shard_fp32_from_float16_groups),
                  (part.model_fp32_groups, part.shard_fp32_groups)]  # fmt: skip
    elif isinstance(part, Float16OptimizerWithFloat16Params):
        groups = [(part.float16_groups, part.fp32_from_float16_groups),
                  (part.fp32_from_fp32_groups, part.fp32_from_fp32_groups)]  # fmt: skip
    else:  # FP32Optimizer: AdamW steps the parameters
        params = [group["params"] for group in part.optimizer.param_groups]
        groups = [(params, params)]
    for model_groups, main_groups in groups:
        for model_group, main_group in zip(model_groups, main_groups, strict=True):
            yield from zip(model_group, main_group, strict=True)


def main_tensors(optimizer: Any) -> dict[int, Main]:
    """``id(model parameter)`` -> its :class:`Main` on this rank, for every parameter whose
    elements (some of them, under the distributed optimizer) this rank steps."""
    from megatron.core.optimizer import DistributedOptimizer

    found = {}
    for part in optimizer_parts(optimizer):
        distributed = isinstance(part, DistributedOptimizer)
        for param, main in _pairs(part):
            start = distributed_optimizer_range(part, param)[0] if distributed else 0
            found[id(param)] = Main(main, start, part.optimizer)
    return found


def all_names(stages: list[nn.Module]) -> dict[str, list[str]]:
    """Each name of a parameter or persistent buffer in the model's ``stages`` (all of them, not
    only this rank's) -> all its names there, in stage order. A weight tied across pipeline stages
    is one tensor under several names (GPT-2's embedding: the first stage's
    ``transformer.wte.weight``, the last's ``lm_head.weight``), and each rank holding a copy
    describes it by all of them, as one process holding the whole model would."""
    found: dict[int, list[str]] = {}
    for stage in stages:
        for names, t in named_once(stage):
            known = found.setdefault(id(t), [])
            known.extend(n for n in names if n not in known)
    return {name: names for names in found.values() for name in names}


def describe(stages: list[nn.Module], names_of: dict[str, list[str]], mains: dict[int, Main],
             include_optimizer: bool) -> list[ParamShards]:  # fmt: skip
    """Every parameter and persistent buffer of this rank's ``stages`` once, under all its names in
    the model (``names_of``, :func:`all_names`), with its ``weight`` (the fp32 main copy of a
    low-precision parameter, the tensor itself otherwise) and, with ``include_optimizer``, the
    moments, where this rank holds them: under the distributed optimizer a low-precision
    parameter's main copy, and any parameter's moments, are the run of elements this
    data-parallel rank steps."""
    described: dict[int, ParamShards] = {}
    for stage in stages:
        for names, t in named_once(stage):
            if id(t) in described:  # one parameter in two of this rank's stages
                continue
            full = names_of.get(names[0], names)
            shards = described[id(t)] = ParamShards(full, t.shape, tensor_parallel_partition(t),
                                                    experts=expert_partition(t))  # fmt: skip
            main = mains.get(id(t))
            if t.dtype == torch.float32 or not (isinstance(t, nn.Parameter) and t.requires_grad):
                shards.tensors[WEIGHT] = Run(t.data)  # its own most precise copy, whole
            elif main is not None:  # else another data-parallel rank steps its elements
                shards.tensors[WEIGHT] = Run(main.tensor.data, main.start)
            if include_optimizer and main is not None:
                state = main.optimizer.state.get(main.tensor, {})  # none before the first step
                shards.tensors.update({k: Run(state[k], main.start) for k in MOMENTS if k in state})
    return list(described.values())


@torch.no_grad()
def copy_main_to_model(stages: list[nn.Module], mains: dict[int, Main]) -> None:
    """Cast each low-precision parameter's fp32 main copy (its run, under the distributed
    optimizer: the caller then all-gathers the rest) into the parameter, as a step does."""
    for stage in stages:
        for p in stage.parameters():
            main = mains.get(id(p))
            if main is not None and p.dtype != torch.float32:
                flat = main.tensor.detach().view(-1)
                p.detach().view(-1)[main.start : main.start + flat.numel()].copy_(flat)
