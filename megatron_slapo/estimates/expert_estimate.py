"""What expert parallelism adds to ``tools/explain.py``'s estimate of a rank.

Under ``--expert-model-parallel-size E`` (:mod:`~megatron_slapo.plans.expert_parallel`) each MoE
block's routed experts are split across E ranks, whole experts each, so a rank holds ``1/E`` of
them (and of their gradients and optimizer state; ``1/(E x ETP)`` when each expert is further split
by its features). The engines then keep two gradient groups, as megatron-core does:

- the experts' gradients are reduced over the **expert-data-parallel** group only (the ranks holding
  the same experts: ``world / (pipeline x E x ETP)``), and megatron-core's distributed optimizer
  shards their state over that group; the rest of the model's go over the whole data-parallel group;
- the gradient norm adds the experts' squares over the ranks holding one copy of all the experts
  (one fp32 all-reduce): megatron-core's expert optimizer over its expert tensor-model-pipeline
  group (the distributed optimizer shares the dense one's), our DDP over the expert tensor-and-model
  group (``engines/optimizer.py``'s ``global_norm``).

Tokens move by all-to-all (the ``alltoall`` dispatcher), whose bytes depend on the routing, unknown
before training. They are counted analytically, from what reaches each experts module in the meta
pass (:class:`RoutedTraffic`): each (token, choice) pair's row of ``hidden`` goes out to its
expert's rank and comes back, forward, and its gradient the same way backward, so ``tokens x
top-k x hidden x bytes`` four times per MoE layer and micro-batch (a recomputed layer exchanges
them once more forward). Which rank receives a row does not matter (a rank's own rows
are counted too, as ``--log-comm`` counts a collective's whole payload), so this is every rank's
mean under any routing. Before the exchange the ranks gather how many rows each sends to each
expert: ``E x experts`` int64 counts, forward only.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from megatron_slapo.parallel.comm_log import group_names

COUNT_BYTES = 8  # the routing counts are int64 (torch.bincount)


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is one of an expert-parallel experts module's weights (the plan tags them)."""
    return getattr(p, "expert_parallel", False)


@dataclass(frozen=True)
class ExpertShare:
    """One rank's part of the routed experts (bytes as stored)."""

    expert_parallel: int  # E: the ranks the experts are split across, whole experts each
    expert_tensor_parallel: int  # the ranks each expert is split across by its features
    expert_data_parallel: int  # the ranks holding the same experts (their gradients are reduced over them)
    params: int  # the routed experts' weights on this rank
    model_params: int  # the routed experts' weights of the whole model


def expert_share(sch_nodes: Iterable, local: Iterable[nn.Parameter], weight_bytes: int) -> ExpertShare | None:
    """This rank's :class:`ExpertShare`, or None without expert parallelism. ``sch_nodes``: the
    schedule's nodes (their metadata records each expert tensor's whole shape), ``local``: this
    rank's weights (its pipeline stages'), ``weight_bytes``: a weight's bytes as stored."""
    from megatron_slapo.parallel.collectives import group_size
    from megatron_slapo.parallel.state import expert_groups

    shards = [shard for node in sch_nodes for shard in node.metadata.expert_shards.values()]
    if not shards:
        return None
    groups = expert_groups()
    held = sum(p.numel() for p in local if is_expert(p))
    return ExpertShare(expert_parallel=shards[0].size, expert_tensor_parallel=group_size(groups.tensor),
                       expert_data_parallel=group_size(groups.data), params=held * weight_bytes,
                       model_params=sum(math.prod(s.full_shape) for s in shards) * weight_bytes)  # fmt: skip


class RoutedTraffic:
    """``with RoutedTraffic(model, dispatcher) as traffic:`` around explain's meta pass: forward
    pre-hooks on the expert-parallel experts modules (after the plan's own, so they see the tokens
    the experts get) count each call's all-to-all bytes (module docstring), a hook on its output's
    gradient the backward's (once, however often recomputation ran the forward); then
    :meth:`per_micro_batch` sums the modules of this rank's stages. Under the ``allgather``
    dispatcher nothing is counted here: its collectives have fixed sizes, and the meta pass counts them."""

    def __init__(self, model: nn.Module, dispatcher: str) -> None:
        self.modules = [m for m in model.modules() if any(is_expert(p) for p in m.parameters(recurse=False))]
        self.dispatcher = dispatcher
        self.bytes: dict[int, Counter[str]] = {id(m): Counter() for m in self.modules}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._rows: dict[int, int] = {}  # module -> bytes of its last call's routed rows

    def _count(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        names = ("hidden_states", "top_k_index")  # HF's experts(hidden_states, top_k_index, top_k_weights)
        hidden, index = [*args, *(kwargs[name] for name in names[len(args) :] if name in kwargs)][:2]
        rows = index.numel() * hidden.size(-1) * hidden.element_size()  # tokens x top-k x hidden x bytes
        self._rows[id(module)] = rows
        size = next(p.expert_size for p in module.parameters(recurse=False) if is_expert(p))
        counted = self.bytes[id(module)]
        counted["all_to_all[ep]"] += 2 * rows  # out and back
        counted["all_gather_single[ep]"] += size * module.num_experts * size * COUNT_BYTES  # (ranks, all experts)

    def _count_backward(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not output.requires_grad:
            return
        rows, counted = self._rows[id(module)], self.bytes[id(module)]

        def backward(grad: torch.Tensor) -> None:  # the gradients, back to the experts and out again
            counted["all_to_all[ep]"] += 2 * rows

        output.register_hook(backward)

    def __enter__(self) -> RoutedTraffic:
        if self.dispatcher == "alltoall":
            self._handles = [m.register_forward_pre_hook(self._count, with_kwargs=True) for m in self.modules]
            self._handles += [m.register_forward_hook(self._count_backward) for m in self.modules]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def per_micro_batch(self, stages: Iterable[nn.Module]) -> Counter[str]:
        """The bytes the experts modules inside ``stages`` (this rank's) move per micro-batch."""
        total: Counter[str] = Counter()
        for stage in stages:
            for m in stage.modules():
                total.update(self.bytes.get(id(m), {}))
        return total


def expert_gradient_comm(
    args: argparse.Namespace, experts: int, edp: int, weight_bytes: int, grad_bytes: int
) -> Counter[str]:
    """The engine's reduction of the ``experts`` expert-parallel weights' gradients over the ``edp``
    expert-data-parallel ranks, per step (keyed as ``--log-comm`` keys it), and the gradient norm's
    all-reduce of their squares (module docstring)."""
    from megatron.core import parallel_state as ps

    from megatron_slapo.parallel.state import expert_groups

    comm: Counter[str] = Counter()
    if not experts:
        return comm
    if edp > 1:
        if args.engine == "megatron" and args.use_distributed_optimizer:
            comm["reduce_scatter_single[edp]"] += experts * grad_bytes
            comm["all_gather_single[edp]"] += experts * weight_bytes
        else:  # megatron-core's DDP, and ours (one flat all-reduce)
            comm["all_reduce[edp]"] += experts * grad_bytes
    if args.engine == "megatron" and args.use_distributed_optimizer:
        return comm  # the expert optimizer's norm group is the dense one's: one all-reduce, counted there
    group = (ps.get_expert_tensor_model_pipeline_parallel_group() if args.engine == "megatron"
             else expert_groups().tensor_and_model)  # fmt: skip
    if torch.distributed.get_world_size(group) > 1:
        comm[f"all_reduce[{group_names().get(group, 'other')}]"] += 4  # "other": CommLog's name for an unnamed group
    return comm
