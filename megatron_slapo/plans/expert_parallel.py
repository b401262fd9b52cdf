"""Expert parallelism: an MoE block's routed experts placed whole on ranks, the tokens sent to them.

``--expert-model-parallel-size E`` (Megatron's name and meaning) gives each of E ranks
``num_experts / E`` whole experts of every MoE block: rows ``[r * n, (r + 1) * n)`` of the HF experts
module's 3-D ``gate_up_proj`` and ``down_proj``. The router, the shared experts and the rest of the
layer keep their placement; each rank routes its own tokens, then:

- ``alltoall`` (Megatron's all-to-all dispatcher, the default here): the (token, choice) pairs are
  sorted by expert, so by the rank holding it; one all-to-all sends each pair's hidden row there,
  the rank runs its experts on what it received, and a second all-to-all brings the rows back, where
  they are weighted by the router's scores and summed per token (backward: the two exchanges
  reversed). Only ``tokens x top-k`` rows of ``hidden`` bytes cross, each way.
- ``allgather``: every rank gathers the whole group's tokens, runs its experts on the pairs routed
  to them and reduce-scatters the partial outputs back (more bytes; no data-dependent sizes).

Each expert is then split by its features over the expert-tensor-parallel ranks when that size is
the TP size, with :class:`~megatron_slapo.plans.experts.TensorParallelExperts`' collectives (its
``ExpertsInput`` pre-hook and one reduction of the output) around this exchange. The local experts compute as one grouped GEMM where torch offers it for these tensors
(transformers' ``grouped_mm_experts_forward``), else with the model's own loop over experts; both
see only this rank's experts (``num_experts`` is set to the local count). Tokens are independent in
an MoE layer, so the ranks holding a block's tokens must hold different tokens: the data-parallel
ranks do, and the tensor-parallel ones under ``--sequence-parallel`` (validation requires it).

The experts' weights are tagged for the engines: ``expert_parallel`` (ours) and ``allreduce=False``
(megatron-core's), so their gradients are reduced over the expert-data-parallel group only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from megatron_slapo.compat.transformers_internals import apply_experts_gate, grouped_experts_forward
from megatron_slapo.metadata import ExpertShard
from megatron_slapo.module_surgery import set_base_forward
from megatron_slapo.parallel import collectives as C
from megatron_slapo.parallel.layout import shard_slice, sharded_shape
from megatron_slapo.parallel.state import ExpertGroups, expert_groups
from megatron_slapo.plans.experts import TensorParallelExperts, experts_layout

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule

Dispatcher = Literal["alltoall", "allgather"]
WEIGHTS = ("gate_up_proj", "down_proj")  # an HF experts module's 3-D weights, experts along dim 0


def local_experts(mod: nn.Module, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """This rank's experts on ``rows`` (one per routed pair), expert ``ids[i]`` (local numbering) for
    row ``i``, unweighted: one grouped GEMM where torch offers it, else the model's own forward."""
    ones = rows.new_ones(rows.size(0), 1)
    grouped = grouped_experts_forward(mod, rows)
    if grouped is not None:
        out = grouped(mod, rows, ids.unsqueeze(1), ones)
    else:
        out = type(mod).forward(mod, rows, ids.unsqueeze(1), ones)
    if torch.is_grad_enabled() and not out.requires_grad:  # no rows came (HF's loop then returns a constant):
        # the backward must still pass through here, or this rank would skip the exchanges' backward
        # collectives that the other ranks wait in
        out = out + rows.sum() * 0 + sum(getattr(mod, name).sum() for name in WEIGHTS) * 0
    return out


def _meta_experts(mod: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """On meta tensors (planning): this rank's experts on ``rows`` as one GEMM per projection over
    all of them, as the grouped GEMM does (its FLOPs and saved tensors), expert 0 standing for each."""
    gate_up, down = mod.gate_up_proj[0], mod.down_proj[0]
    if getattr(mod, "is_transposed", False):
        gate_up, down = gate_up.t(), down.t()
    return torch.nn.functional.linear(apply_experts_gate(mod, torch.nn.functional.linear(rows, gate_up)), down)


def _split_evenly(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


class ExpertParallelForward:
    """The forward of an expert-parallel experts module: ``(hidden_states, top_k_index,
    top_k_weights) -> output`` as HF's, with the tokens exchanged over ``group`` (module docstring)."""

    def __init__(self, group: C.Group, local: int, dispatcher: Dispatcher) -> None:
        self.group, self.local, self.dispatcher = group, local, dispatcher

    def __deepcopy__(self, memo: dict) -> ExpertParallelForward:
        return self  # holds a process group handle, shared rather than copied

    def __call__(
        self, mod: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self.dispatcher == "allgather":
            return self._allgather(mod, hidden, index, weights)
        return self._alltoall(mod, hidden, index, weights)

    def _alltoall(
        self, mod: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = index.shape
        world, rank = C.group_size(self.group), C.group_rank(self.group)
        experts = self.local * world
        if hidden.is_meta:  # planning: the routing is unknown, so count it as even
            sent = received = _split_evenly(tokens * k, world)
            arrived = C.all_to_all(hidden.repeat_interleave(k, 0), received, sent, self.group)
            back = C.all_to_all(_meta_experts(mod, arrived), sent, received, self.group)
            return (back.view(tokens, k, -1) * weights.unsqueeze(-1).to(back.dtype)).sum(1).to(hidden.dtype)
        flat = index.reshape(-1)
        # pairs by expert, so by the rank that holds it; pairs dropped over capacity (expert id
        # ``experts``, expert_capacity.py) sort last and are not sent
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=experts + 1)[:experts]
        everyone = C.gather_tensor(counts.unsqueeze(0), 0, self.group).tolist()  # (ranks, experts): who sends what
        sent = [sum(everyone[rank][r * self.local : (r + 1) * self.local]) for r in range(world)]
        mine = [row[rank * self.local : (rank + 1) * self.local] for row in everyone]  # (source rank, my expert)
        received = [sum(row) for row in mine]
        routed = order[: sum(sent)]
        arrived = C.all_to_all(hidden[routed // k], received, sent, self.group)  # by source rank, each by expert
        ids = torch.repeat_interleave(torch.arange(self.local, device=flat.device).repeat(world),
                                      torch.tensor(mine, device=flat.device).reshape(-1))  # fmt: skip
        back = C.all_to_all(local_experts(mod, arrived, ids), sent, received, self.group)
        pairs = back.new_zeros(tokens * k, back.size(-1)).index_copy(0, routed, back)  # in (token, choice) order
        out = (pairs.view(tokens, k, pairs.size(-1)) * weights.unsqueeze(-1).to(pairs.dtype)).sum(1)
        return out.to(hidden.dtype)

    def _allgather(
        self, mod: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        hidden = C.all_gather(hidden, 0, self.group, "reduce_scatter")
        weights = C.all_gather(weights, 0, self.group, "reduce_scatter")
        index = C.gather_tensor(index, 0, self.group)
        k, first = index.size(1), C.group_rank(self.group) * self.local
        if hidden.is_meta:  # planning (tools/explain.py): shapes only
            return C.reduce_scatter(hidden.new_empty(hidden.shape), 0, self.group)
        flat = index.reshape(-1)
        pairs = ((flat >= first) & (flat < first + self.local)).nonzero().squeeze(1)  # routed to my experts
        rows = local_experts(mod, hidden[pairs // k], flat[pairs] - first)
        weighted = rows * weights.reshape(-1)[pairs].unsqueeze(1).to(rows.dtype)
        out = hidden.new_zeros(hidden.shape).index_add(0, pairs // k, weighted.to(hidden.dtype))
        return C.reduce_scatter(out, 0, self.group)


def shard_experts(sch: Schedule, name: str, rank: int, size: int) -> None:
    """Keep experts ``[rank * n, (rank + 1) * n)`` of ``name`` (dim 0), ``n`` = its experts / ``size``;
    a meta tensor only changes shape (``build`` initialises the whole and takes these rows)."""
    tensor = sch._tensor(name)
    if tensor.size(0) % size:
        raise sch._error(f"{tensor.size(0)} experts do not split over {size} expert-parallel ranks")
    if tensor.is_meta:
        data = torch.empty(sharded_shape(tensor.shape, 0, size), dtype=tensor.dtype, device="meta")
    else:
        data = shard_slice(tensor.detach(), 0, 1, rank, size)
    new = nn.Parameter(data, requires_grad=tensor.requires_grad)
    new.__dict__.update(tensor.__dict__)
    new.expert_parallel, new.allreduce = True, False  # ours; megatron-core DDP's expert-data-parallel tag
    new.expert_rank, new.expert_size = rank, size
    sch._set_tensor(name, new)
    sch.metadata.expert_shards[name] = ExpertShard(rank, size, tensor.shape)


@dataclass(frozen=True)
class ExpertParallelExperts:
    """Plan placement on an HF experts module (HF's ``ep_dispatch_experts``): whole experts on the
    expert-parallel ranks, the tokens moved to them (module docstring); each expert further split by
    its features over the tensor-parallel ranks when the expert-tensor-parallel size is the TP size."""

    groups: ExpertGroups | None
    dispatcher: Dispatcher = "alltoall"
    sequence_parallel: bool = False

    def apply(self, sch: Schedule) -> None:
        try:
            experts_layout(sch.mod)  # a layout the split knows, before any of it is changed
        except ValueError as e:
            raise sch._error(f"{type(sch.mod).__name__}: {e}") from None
        if self.groups is None:
            raise sch._error("expert parallelism needs its groups: parallel.initialize(..., expert_parallel=E) first")
        size, rank = C.group_size(self.groups.model), C.group_rank(self.groups.model)
        experts = sch.mod.gate_up_proj.size(0)
        for name in WEIGHTS:
            shard_experts(sch, name, rank, size)
        sch.mod.num_experts = experts // size  # HF's forward counts the experts it holds
        set_base_forward(sch.mod, ExpertParallelForward(self.groups.model, experts // size, self.dispatcher))
        if C.group_size(self.groups.tensor) > 1:  # each expert also split by its features, around the exchange
            TensorParallelExperts(self.sequence_parallel).apply(sch)


def expert_parallel_placement(args: Any) -> ExpertParallelExperts | None:
    """The placement ``--expert-model-parallel-size`` (> 1) asks for, over the groups
    :func:`~megatron_slapo.parallel.state.initialize` laid out; None without expert parallelism."""
    if getattr(args, "expert_model_parallel_size", 1) == 1:
        return None
    return ExpertParallelExperts(expert_groups(), args.moe_token_dispatcher_type, args.sequence_parallel)
