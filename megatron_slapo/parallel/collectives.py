"""Autograd-aware collectives over an arbitrary process group and tensor dimension.

Each function is one of Megatron's "conjugate" pairs: what the forward does on activations, the
backward does the dual on gradients. They take a ``group`` (``None`` means single-process, where
every collective is the identity) and a ``dim`` because HF models are batch-first: sequence
parallelism splits dim 1, tensor parallelism the last dim.

================  =======================  ==========================
function          forward                  backward
================  =======================  ==========================
reduce_forward    all-reduce (Megatron g)  identity
reduce_backward   identity                 all-reduce (Megatron f)
reduce_both       all-reduce               all-reduce
all_gather        all-gather along dim     split, or reduce-scatter
reduce_scatter    reduce-scatter on dim    all-gather
scatter           keep own chunk of dim    all-gather
all_to_all        rows to ranks, by count  the reverse exchange
================  =======================  ==========================

``all_gather`` needs to know what happens downstream: when every rank then computes the same
thing (gathering a tensor-parallel output), each rank already holds the full gradient and the
backward just keeps its slice ("split"); when ranks then compute different things (sequence
parallelism before a column-parallel layer), the gradients are partial sums and the backward must
reduce-scatter them.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.distributed as dist

from megatron_slapo.compat.distributed import traceable_all_reduce_max

Group = dist.ProcessGroup | None


# torch 2.13 renamed the single-tensor collectives; older releases only have the old names. Looked
# up at each call, not at import, so that --log-comm's wrappers on torch.distributed see them.
def _all_gather_single(out: torch.Tensor, src: torch.Tensor, group: Group) -> None:
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, src, group=group)


def _reduce_scatter_single(out: torch.Tensor, src: torch.Tensor, group: Group) -> None:
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, src, group=group)


GatherBackward = Literal["split", "reduce_scatter"]


def group_size(group: Group) -> int:
    """Number of ranks in ``group``; 1 when single-process."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank within ``group``; 0 when single-process."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def comm_device(group: Group = None) -> torch.device:
    """Where small control tensors for collectives on ``group`` must live (CUDA for NCCL)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_divisible(x: torch.Tensor, dim: int, world: int) -> None:
    if x.size(dim) % world:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} is not divisible by the group size {world}")


def _sends(x: torch.Tensor, group: Group) -> bool:
    """Whether a collective on ``x`` is called. Not over one rank, and not on meta tensors (tracing
    only needs the right shape), except over torch's fake process group: there a meta pass plans a
    run (``parallel.simulate``), and the calls, which move nothing, are what ``--log-comm`` counts."""
    if group_size(group) == 1:
        return False
    return not x.is_meta or dist.get_backend(group) == "fake"


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if not _sends(x, group):
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def all_reduce_max(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ``group`` (no autograd: FP8's amaxes,
    :mod:`megatron_slapo.kernels.fp8`), through a collective torch.compile traces. ``--log-comm``
    does not count it: a few bytes per layer, next to the layer's own collectives."""
    return traceable_all_reduce_max(x, group) if _sends(x, group) else x


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.size(0) * world, *src.shape[1:]))
    if _sends(x, group):
        _all_gather_single(out, src, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world)
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world)
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.size(0) // world, *src.shape[1:]))
    if _sends(x, group):
        _reduce_scatter_single(out, src, group=group)
    return out.movedim(0, dim).contiguous()


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    if _sends(x, group):
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


class _ReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceForwardInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if _sends(x, group):
            dist.all_reduce(x, group=group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, backward):
        ctx.dim, ctx.group, ctx.backward_op = dim, group, backward
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_op == "split":
            return _split(grad, ctx.dim, ctx.group), None, None, None
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def reduce_forward(x: torch.Tensor, group: Group, inplace: bool = False) -> torch.Tensor:
    """Sum partial results across ``group`` in the forward; pass gradients through (Megatron's g).

    ``inplace`` reduces ``x`` itself instead of a copy, as Megatron does: only for a tensor that
    nothing else refers to, such as the output a layer has just computed (a copy of b·s·h saved
    per call). Gradients are never reduced in place: autograd may hand one gradient tensor to
    several branches (both inputs of an add), and reducing it would change them all.
    """
    return (_ReduceForwardInPlace if inplace else _ReduceForward).apply(x, group)


def reduce_backward(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity in the forward; sum the gradient across ``group`` in the backward (Megatron's f)."""
    return _ReduceBackward.apply(x, group)


def reduce_both(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` across ``group`` in the forward, and its gradient in the backward: for a sum that
    each rank then uses on its own part of the data (a split RMSNorm's sum of squares), so every
    rank's use contributes to the gradient of every rank's summand."""
    return _ReduceBoth.apply(x, group)


def own_part(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim``, no collective: autograd gives the other parts a zero
    gradient, which an enclosing reduction of the input gradient completes."""
    return _split(x, dim, group)


def all_gather(x: torch.Tensor, dim: int, group: Group, backward: GatherBackward = "split") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; see the module docstring for ``backward``."""
    if backward not in ("split", "reduce_scatter"):
        raise ValueError(f"all_gather backward must be 'split' or 'reduce_scatter', got {backward!r}")
    return _AllGather.apply(x, dim, group, backward)


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum across ``group`` and keep this rank's chunk of ``dim``; all-gather in the backward."""
    return _ReduceScatter.apply(x, dim, group)


def scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Keep this rank's chunk of a replicated ``x`` along ``dim``; all-gather in the backward."""
    return _Scatter.apply(x, dim, group)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
    """Exchange rows of ``x`` (dim 0): ``in_splits[i]`` consecutive rows go to rank ``i``, and
    ``out_splits[i]`` rows come from it, in rank order; backward sends the gradients back the same way."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


@torch.no_grad()
def gather_tensor(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather without autograd, for inspection and export."""
    return _all_gather(x, dim, group)


@torch.no_grad()
def all_reduce_flat(tensors: list[torch.Tensor], group: Group) -> None:
    """Sum each of ``tensors`` across ``group`` in place, in one all-reduce of their concatenation."""
    if not tensors or group_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def allreduce_sequence_parallel_grads(module: torch.nn.Module, group: Group) -> None:
    """Sum the gradients of parameters tagged ``sequence_parallel`` across ``group``.

    Under sequence parallelism a replicated parameter (a LayerNorm's weight, say) only sees this
    rank's part of the sequence, so its gradient is a partial sum. The attribute name is
    Megatron's, so megatron-core's ``finalize_model_grads`` treats these parameters the same way.
    """
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    # A DTensor gradient (FSDP2, after its reduce-scatter over data-parallel ranks) is summed shard by
    # shard: every tensor-parallel rank holds the same shard of a replicated weight.
    all_reduce_flat([g.to_local() if hasattr(g, "to_local") else g for g in grads], group)


def _summed_over(grad: torch.Tensor, group: Group) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def reduce_sequence_parallel_grads_in_backward(module: torch.nn.Module, group: Group) -> None:
    """Sum each ``sequence_parallel`` parameter's gradient across ``group`` as autograd computes it,
    before it reaches ``.grad``: for engines that reduce and step inside their own backward and
    step (DeepSpeed's ZeRO hooks), where a reduction between the two has no place. One small
    all-reduce per parameter and micro-batch, where Megatron does one flat one per step."""
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.requires_grad and not hasattr(p, "sequence_parallel_hook"):
            p.sequence_parallel_hook = p.register_hook(functools.partial(_summed_over, group=group))  # once
