"""``--moe-expert-capacity-factor``: at most ``capacity`` routed tokens per expert, the rest dropped.

Megatron's token dropping: each expert takes at most ``ceil(tokens x top-k / experts x factor)`` of
the (token, choice) pairs routed to it in a forward, and the others are dropped: their routing
weight becomes zero, so they add nothing to the output and get no gradient (a token whose choices
are all dropped passes through the block's residual connection alone). ``--moe-token-drop-policy``
decides which pairs an expert keeps: those of highest routing weight (``probs``, Megatron's
default) or the first tokens (``position``).

Under expert parallelism the pairs dropped are not sent to their experts' ranks at all (the
all-to-all's bytes shrink with the drops). The count is over the tokens an experts module sees in one call: a micro-batch's on one device and
on a data- or expert-parallel rank (the same tokens, so the same drops), the whole micro-batch's
sequence when the experts gather it (``--sequence-parallel`` with experts split by features), a
rank's part of the sequence when they do not (Megatron too counts each rank's tokens). The pairs
dropped are counted here (:data:`DROPPED`) for the trainer to report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from megatron_slapo.compat.torch_nn import forward_pre_hooks
from megatron_slapo.module_surgery import base_forward
from megatron_slapo.parallel.collectives import comm_device
from megatron_slapo.plans.expert_parallel import ExpertParallelExperts, ExpertParallelForward
from megatron_slapo.plans.experts import TensorParallelExperts, experts_arguments

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule

DropPolicy = Literal["probs", "position"]


class DroppedTokens:
    """The (token, choice) pairs dropped and routed in this process since the last :meth:`take_fraction`."""

    def __init__(self) -> None:
        self.dropped = self.routed = 0

    def take_fraction(self) -> torch.Tensor:
        """The fraction of the pairs routed since the last call that were dropped, over every rank
        (a collective: every rank calls it), and start afresh."""
        counts = torch.tensor([self.dropped, self.routed], dtype=torch.float64, device=comm_device())
        self.dropped = self.routed = 0
        if dist.is_initialized():
            dist.all_reduce(counts)
        return (counts[0] / counts[1].clamp(min=1)).float()


DROPPED = DroppedTokens()  # one trainer a process: its experts modules all count here


def kept(index: torch.Tensor, weights: torch.Tensor, experts: int, capacity: int, policy: DropPolicy) -> torch.Tensor:
    """Which (token, choice) pairs of ``index`` (tokens x top-k expert ids) their experts keep, each
    expert at most ``capacity``: the highest ``weights`` first (``probs``), or the first tokens."""
    flat = index.reshape(-1)
    if policy == "probs":
        order = torch.argsort(weights.detach().reshape(-1), descending=True, stable=True)
    else:
        order = torch.arange(flat.numel(), device=flat.device)
    ranked = flat[order]  # expert ids in priority order
    by_expert = torch.argsort(ranked, stable=True)  # grouped by expert, in priority order within each
    counts = torch.bincount(ranked, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.empty_like(flat)
    place[by_expert] = torch.arange(flat.numel(), device=flat.device) - starts[ranked[by_expert]]
    keep = torch.empty(flat.numel(), dtype=torch.bool, device=flat.device)
    keep[order] = place < capacity
    return keep.view_as(index)


class DropOverCapacity:
    """Forward pre-hook of an experts module: zero the routing weights of the pairs over capacity."""

    def __init__(self, experts: int, factor: float, policy: DropPolicy) -> None:
        self.experts, self.factor, self.policy = experts, factor, policy

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, index, weights = experts_arguments(module, args, kwargs)
        if index.is_meta:  # planning: nothing is known of the routing
            return (hidden, index, weights), kwargs
        capacity = math.ceil(index.numel() / self.experts * self.factor)
        keep = kept(index, weights, self.experts, capacity, self.policy)
        DROPPED.dropped += int(keep.numel() - keep.sum())
        DROPPED.routed += keep.numel()
        if isinstance(base_forward(module), ExpertParallelForward):  # its dispatch leaves them out, sends nothing
            index = index.masked_fill(~keep, self.experts)
        return (hidden, index, weights * keep.to(weights.dtype)), kwargs


@dataclass(frozen=True)
class ExpertCapacity:
    """Plan placement on an HF experts module, after the one that splits it: Megatron's token
    dropping over ``factor`` times an even share of the routed pairs (module docstring)."""

    factor: float
    policy: DropPolicy = "probs"

    def apply(self, sch: Schedule) -> None:
        split = sch.metadata.expert_shards.get("gate_up_proj")  # expert parallelism keeps some experts here
        experts = split.full_shape[0] if split else sch.mod.gate_up_proj.size(0)
        sch.hook("fwd_pre", DropOverCapacity(experts, self.factor, self.policy), with_kwargs=True)


def drops_tokens(model: nn.Module) -> bool:
    """Whether some experts module of ``model`` drops the pairs over its capacity."""
    return any(isinstance(h, DropOverCapacity) for m in model.modules() for h in forward_pre_hooks(m).values())


def limit_expert_capacity(plan: dict[str, Any], args: Any) -> dict[str, Any]:
    """``plan`` with :class:`ExpertCapacity` after each experts placement when
    ``--moe-expert-capacity-factor`` is given (``plan`` itself otherwise)."""
    factor = getattr(args, "moe_expert_capacity_factor", None)
    if factor is None:
        return plan
    capacity = ExpertCapacity(factor, args.moe_token_drop_policy)
    experts = (ExpertParallelExperts, TensorParallelExperts)
    return {path: (p, capacity) if isinstance(p, experts) else p for path, p in plan.items()}
