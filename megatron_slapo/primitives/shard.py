"""``shard``: keep this rank's slice of a parameter (Megatron-style tensor parallelism).

Sharding is in place and immediate: a real tensor is sliced now (pretrained weights keep their
values), a meta tensor just changes shape and is materialised slice-by-slice in ``build``. The node
then knows the layer's role (see :mod:`.placement`) and rewrites its forward where the maths
changes: a row-parallel Linear/Conv1D adds its bias *after* the reduction that ``sync`` installs
(not once per rank), and a vocabulary-parallel Embedding looks up only the ids it owns. A tensor
shared by several modules (tied embeddings) is sharded once and stays shared by all of them.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from megatron_slapo.compat.torch_nn import ConvNd, own_tensor_tables
from megatron_slapo.metadata import Role, ShardSpec
from megatron_slapo.module_surgery import set_base_forward
from megatron_slapo.parallel.layout import Stride, as_stride, block_sizes, relative_sizes, shard_slice, sharded_shape
from megatron_slapo.primitives.placement import infer_role, linear_axes, own_forward, scaled_embedding
from megatron_slapo.primitives.registry import primitive
from megatron_slapo.primitives.sync import RowParallelForward, VocabParallelForward

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode

# Megatron's parameter attributes: megatron-core's grad clipping and checkpointing read them.
TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _sharded_copy(tensor: torch.Tensor, axis: int, stride: Stride, rank: int, world: int) -> torch.Tensor:
    if tensor.is_meta:
        data = torch.empty(sharded_shape(tensor.shape, axis, world), dtype=tensor.dtype, device="meta")
    else:
        data = shard_slice(tensor.detach(), axis, stride, rank, world)
    new = nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
    new.__dict__.update(tensor.__dict__)  # annotations and other tags survive
    new.tensor_model_parallel, new.partition_dim, new.partition_stride = True, axis, stride
    return new


_SIZE_ATTRS = {  # (module type, role) -> attribute that holds the now-local feature count
    (nn.Linear, Role.COLUMN): ("out_features", 0),
    (nn.Linear, Role.ROW): ("in_features", 1),
    (nn.Embedding, Role.VOCAB): ("num_embeddings", 0),
    (nn.Embedding, Role.EMBEDDING_COLUMN): ("embedding_dim", 1),
    (ConvNd, Role.COLUMN): ("out_channels", 0),
    (ConvNd, Role.ROW): ("in_channels", 1),
}


def _update_size_attrs(module: nn.Module, role: Role) -> None:
    for (kind, kind_role), (attr, dim) in _SIZE_ATTRS.items():
        if isinstance(module, kind) and role is kind_role:
            setattr(module, attr, module.weight.size(dim))
    if linear_axes(module) == (1, 0):  # HF Conv1D's forward reshapes with self.nf
        module.nf, module.nx = module.weight.size(1), module.weight.size(0)


def _divisibility_problem(extent: int, stride: Stride, world: int) -> str | None:
    """Why an axis of ``extent`` cannot be sharded with ``stride`` over ``world`` ranks (each block
    must split evenly), or None."""
    try:
        blocks = block_sizes(extent, stride)
    except ValueError:
        blocks = None
    if blocks is not None and not any(block % world for block in blocks):
        return None
    if isinstance(stride, int):
        times = f" x stride {stride}" if stride > 1 else ""
        return f"size {extent} is not divisible by the group size {world}{times}"
    if blocks is None:
        return f"size {extent} does not split into blocks of relative sizes {list(stride)} (stride {stride})"
    return f"stride {stride} cuts its {extent} into blocks of {blocks}, not all divisible by the group size {world}"


class ShardMixin:
    @primitive
    def shard(self: ScheduleNode, param_name: str, axis: int, *, stride: Stride = 1) -> None:
        """Keep this rank's slice of a parameter or buffer along ``axis`` (tensor parallelism).

        ``stride`` > 1 shards each of ``stride`` equal blocks of the axis separately (a fused
        q|k|v weight uses 3); a tuple shards blocks of those relative sizes separately (a packed
        q|k|v with grouped-query attention: ``(heads, kv_heads, kv_heads)``). Each rank holds its
        piece of every block, in block order (:mod:`megatron_slapo.parallel.layout`). Tied
        parameters are sharded together.
        """
        tensor = self._tensor(param_name)
        if not -tensor.dim() <= axis < tensor.dim():
            raise self._error(f"axis {axis} is out of range for {param_name!r} of shape {tuple(tensor.shape)}")
        axis %= tensor.dim()
        try:
            stride = as_stride(stride)
        except ValueError as e:
            raise self._error(str(e)) from None
        existing = self.metadata.shards.get(param_name)
        if existing is not None:
            self._reshard_tied(param_name, existing, axis, stride)
            return
        world = self.world_size
        problem = _divisibility_problem(tensor.size(axis), stride, world)
        if problem:
            raise self._error(f"cannot shard {param_name!r} of shape {tuple(tensor.shape)} on axis {axis}: {problem}")
        holders = [
            (node, name)
            for _, node in self.root.named_schedules()
            for name, t in chain(*(table.items() for table in own_tensor_tables(node.mod)))
            if t is tensor
        ]
        for node, name in holders:  # check every holder before changing any of them
            problem = _forward_rewrite_problem(node, name, axis)
            if problem:
                raise node._error(problem)
        new = _sharded_copy(tensor, axis, stride, self.rank, world)
        for node, name in holders:
            node._set_tensor(name, new)
            explicit = node is self and name == param_name
            node.metadata.shards[name] = ShardSpec(axis, stride, tensor.shape, explicit)
            node._after_shard(name, axis)

    def _reshard_tied(self: ScheduleNode, param_name: str, existing: ShardSpec, axis: int, stride: Stride) -> None:
        if existing.explicit:
            raise self._error(f"{param_name!r} is already sharded (axis {existing.axis}); shard() applies once")
        if (existing.axis, relative_sizes(existing.stride)) != (axis, relative_sizes(stride)):
            raise self._error(
                f"{param_name!r} is tied to a parameter already sharded on axis {existing.axis} "
                f"(stride {existing.stride}); it cannot also be sharded on axis {axis} (stride {stride})"
            )
        existing.explicit = True

    def _after_shard(self: ScheduleNode, param_name: str, axis: int) -> None:
        """Record the layer's role and rewrite its forward where sharding changes the maths."""
        role = infer_role(self.mod, param_name, axis)
        if role is None:
            return
        self.metadata.role = role
        mod = self.mod
        _update_size_attrs(mod, role)
        if role is Role.VOCAB:  # _forward_rewrite_problem has checked that these rewrites are sound
            set_base_forward(mod, VocabParallelForward(self.group))
        elif role is Role.ROW and getattr(mod, "bias", None) is not None:
            set_base_forward(mod, RowParallelForward())


def _forward_rewrite_problem(node: ScheduleNode, param_name: str, axis: int) -> str | None:
    """Why sharding ``param_name`` of ``node``'s module on ``axis`` cannot rewrite its forward as it must.

    Row-parallel Linear/Conv1D layers with a bias and vocabulary-parallel Embeddings get a forward
    of our own (see :meth:`ShardMixin._after_shard`); it must compute what the layer computed, so a
    subclass with a forward of its own is refused rather than silently changed.
    """
    mod = node.mod
    if node.metadata.fp8 and infer_role(mod, param_name, axis) is not None:
        return "the layer already runs in FP8: apply fp8() after shard(), which decides the ranks its scales span"
    role = infer_role(mod, param_name, axis)
    rewrites = role is Role.VOCAB or (role is Role.ROW and getattr(mod, "bias", None) is not None)
    if not rewrites:
        return None
    overrider = own_forward(mod)
    if overrider is not None and not (role is Role.VOCAB and scaled_embedding(mod)):
        how = (
            "a vocabulary-parallel embedding must look up only this rank's rows"
            if role is Role.VOCAB
            else "a row-parallel layer with a bias must add it after the reduction"
        )
        return (
            f"cannot shard {param_name!r} on axis {axis}: {type(mod).__name__} overrides forward() "
            f"({overrider}.forward) and {how}, which takes the place of that forward and would drop what it "
            f"computes; replace() the layer with a plain {_known_base(mod)} and compute the rest outside it"
        )
    if role is Role.VOCAB and (mod.max_norm is not None or mod.sparse or mod.scale_grad_by_freq):
        return "vocab-parallel Embedding does not support max_norm, sparse or scale_grad_by_freq"
    if role is Role.ROW and any(mode == "fwd_post" for mode, _ in node.metadata.syncs):
        return "shard() a row-parallel layer before sync(): its bias must follow the reduction"
    return None


def _known_base(mod: nn.Module) -> str:
    for base in (nn.Linear, Conv1D, nn.Embedding, ConvNd):
        if isinstance(mod, base):
            return base.__name__
    return type(mod).__name__
