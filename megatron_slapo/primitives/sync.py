"""``sync``: insert a collective at a module's input or output (forward and backward).

Modes: ``fwd_pre`` transforms the module's first input, ``fwd_post`` its first output, and
``bwd_post`` leaves the forward alone and transforms the gradient flowing back out of the module
into its input. Ops: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``scatter`` (see
:mod:`megatron_slapo.parallel.collectives` for each one's backward), or any callable on a tensor.

Megatron's tensor-parallel MLP in these terms: the column-parallel layer gets
``sync("bwd_post", "all_reduce")`` (f), the row-parallel one ``sync("fwd_post", "all_reduce")`` (g).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron_slapo.compat.torch_nn import ConvNd, conv_without_bias, forward_hooks
from megatron_slapo.graph_edit import why_never_called
from megatron_slapo.kernels.vocab import vocab_parallel_embedding
from megatron_slapo.metadata import Role
from megatron_slapo.module_surgery import base_forward
from megatron_slapo.parallel import collectives as C
from megatron_slapo.parallel.layout import block_count
from megatron_slapo.primitives.placement import check_sync, feature_axis, own_forward, scaled_embedding
from megatron_slapo.primitives.registry import primitive

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode

MODES = ("fwd_pre", "fwd_post", "bwd_post")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "scatter")


class _GradTransform(torch.autograd.Function):
    """Identity forward; ``fn(grad)`` backward."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.fn(grad), None


class SyncOp:
    """One configured collective (or user function), applied to a tensor."""

    def __init__(self, mode: str, op: str | Callable, group: C.Group, axis: int, backward: str, path: str) -> None:
        self.mode, self.op, self.group, self.axis, self.backward, self.path = mode, op, group, axis, backward, path

    def __deepcopy__(self, memo: dict) -> SyncOp:
        return self  # holds a process group handle, which is shared rather than copied

    def __call__(self, x: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        """Apply to ``x``; ``fresh``: nothing else refers to ``x``, so an all-reduce may work in place."""
        try:
            return self._run(x, fresh)
        except ValueError as e:  # e.g. a dim that the group size does not divide
            raise ValueError(f"[{self.path}] sync({self.mode!r}, {self.op!r}): {e}") from e

    def _run(self, x: torch.Tensor, fresh: bool) -> torch.Tensor:
        if self.mode == "bwd_post":
            if self.op == "all_reduce":
                return C.reduce_backward(x, self.group)
            return _GradTransform.apply(x, self.op)
        if callable(self.op):
            return self.op(x)
        if self.op == "all_reduce":
            return C.reduce_forward(x, self.group, inplace=fresh)
        if self.op == "all_gather":
            return C.all_gather(x, self.axis, self.group, self.backward)
        if self.op == "reduce_scatter":
            return C.reduce_scatter(x, self.axis, self.group)
        return C.scatter(x, self.axis, self.group)


# The forwards ``shard`` installs when the maths changes; the reductions ``sync`` adds run inside them.
class RowParallelForward:
    """Forward of a Linear/Conv1D/convolution sharded on its input features: reduce first, then add the bias."""

    def __init__(self) -> None:
        self.reductions: list[SyncOp] = []  # applied to the product, which nothing else holds: in place
        # The product without the bias, when another primitive computes it (``fp8``): (module, x) -> y
        self.product: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None

    def __deepcopy__(self, memo: dict) -> RowParallelForward:
        clone = RowParallelForward()
        clone.reductions = list(self.reductions)  # the ops themselves hold shared group handles
        clone.product = self.product
        return clone

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.product is not None:
            y = self.product(module, x)
        elif isinstance(module, nn.Linear):
            y = F.linear(x, module.weight)
        elif isinstance(module, ConvNd):
            y = conv_without_bias(module, x)
        else:  # HF Conv1D: weight is (in, out)
            y = torch.mm(x.reshape(-1, x.size(-1)), module.weight).view(*x.shape[:-1], -1)
        for reduce in self.reductions:
            y = reduce(y, fresh=True)
        if isinstance(module, ConvNd):  # one bias per channel, dim 1
            return y + module.bias.view(-1, *[1] * (y.dim() - 2))
        return y + module.bias


class VocabParallelForward:
    """Forward of an Embedding sharded on its vocabulary rows (output is a partial sum)."""

    def __init__(self, group: C.Group) -> None:
        self.group = group
        self.reductions: list[SyncOp] = []  # sync("fwd_post", "all_reduce"), in place on the lookup

    def __deepcopy__(self, memo: dict) -> VocabParallelForward:
        clone = VocabParallelForward(self.group)
        clone.reductions = list(self.reductions)
        return clone

    def __call__(self, module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        out = vocab_parallel_embedding(ids, module.weight, self.group, module.padding_idx)
        if scaled_embedding(module):  # the lookup times embed_scale, as HF's forward computes it
            scale = module.embed_scale
            out = out * (scale.to(module.weight.dtype) if isinstance(scale, torch.Tensor) else scale)
        for reduce in self.reductions:
            out = reduce(out, fresh=True)
        return out


def _first_param_name(module: nn.Module) -> str | None:
    # The class's forward: the instance's may be a PatchedForward(*args, **kwargs) by now.
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # drop self
    return (
        params[0].name if params and params[0].kind not in (params[0].VAR_KEYWORD, params[0].VAR_POSITIONAL) else None
    )


class InputSync:
    """Forward pre-hook (with kwargs) applying a :class:`SyncOp` to the module's first input."""

    def __init__(self, op: SyncOp) -> None:
        self.op = op

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (self._apply(args[0]), *args[1:]), kwargs
        name = _first_param_name(module)
        if name not in kwargs:
            raise RuntimeError(f"[{self.op.path}] sync({self.op.mode}): the module was called without an input")
        return args, {**kwargs, name: self._apply(kwargs[name])}

    def _apply(self, x: Any) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise RuntimeError(f"[{self.op.path}] sync({self.op.mode}) expects a tensor input, got {type(x).__name__}")
        return self.op(x)


class OutputSync:
    """Forward hook applying a :class:`SyncOp` to the module's output (first element of a tuple);
    ``fresh``: the output is a product the layer has just computed (an all-reduce may work in place)."""

    def __init__(self, op: SyncOp, fresh: bool = False) -> None:
        self.op, self.fresh = op, fresh

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return self.op(output, self.fresh)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            return type(output)((self.op(output[0]), *output[1:]))
        raise RuntimeError(f"[{self.op.path}] sync(fwd_post) expects a tensor output, got {type(output).__name__}")


class SyncMixin:
    @primitive
    def sync(
        self: ScheduleNode,
        mode: str,
        sync_op_or_fn: str | Callable[[torch.Tensor], torch.Tensor] = "all_reduce",
        *,
        axis: int = -1,
        backward: str | None = None,
    ) -> None:
        """Insert a collective (or function) at the module's input (fwd_pre), output (fwd_post) or input gradient (bwd_post).

        ``axis`` is the tensor dim for all_gather / reduce_scatter / scatter. ``backward`` chooses
        all_gather's backward: "split" when what follows is replicated, "reduce_scatter" when it is
        partitioned (sequence parallelism); it is inferred for sharded layers and required
        otherwise. The collective is checked against what ``shard`` left behind: an all_reduce of
        a partitioned output raises. On a row-parallel layer with a bias, all_reduce and
        reduce_scatter run before the bias add; a callable always sees the layer's output. A module
        that a traced ancestor's graph no longer calls (traced through) is refused: its hooks never run.
        """
        op_name = self._check_sync(mode, sync_op_or_fn, axis)
        if backward is not None and op_name != "all_gather":
            raise self._error("backward= only applies to all_gather")
        if op_name == "all_gather" and backward is None:
            backward = self._default_gather_backward(mode)
        if backward not in (None, "split", "reduce_scatter"):
            raise self._error(f"backward must be 'split' or 'reduce_scatter', got {backward!r}")
        op = SyncOp(mode, sync_op_or_fn, self.group, axis, backward or "", self.path)
        self.metadata.syncs.add((mode, sync_op_or_fn))
        base = base_forward(self.mod)
        if mode == "fwd_post" and isinstance(base, VocabParallelForward) and op_name == "all_reduce":
            base.reductions.append(op)  # on the lookup's own output: in place
        elif (
            mode == "fwd_post" and isinstance(base, RowParallelForward) and op_name in ("all_reduce", "reduce_scatter")
        ):
            base.reductions.append(op)  # reduce before the bias add, in place
            if op_name == "reduce_scatter":
                # The bias now meets only this rank's part of the sequence: its gradient is a
                # partial sum, reduced like Megatron's sequence-parallel parameters.
                self.annotate("bias", "sequence_parallel", True)
        elif mode == "fwd_post":
            self.mod.register_forward_hook(OutputSync(op, fresh=self._output_is_fresh()))
        else:
            self.mod.register_forward_pre_hook(InputSync(op), with_kwargs=True)

    def _check_sync(self: ScheduleNode, mode: str, sync_op_or_fn: str | Callable, axis: int) -> str:
        """Validate a sync request; return the op's name."""
        if mode not in MODES:
            raise self._error(f"unknown sync mode {mode!r}; expected one of {MODES}")
        never = why_never_called(self)
        if never:
            raise self._error(f"sync({mode!r}) cannot apply: {never}; sync a module that the graph calls")
        if isinstance(sync_op_or_fn, str):
            if sync_op_or_fn not in OPS:
                raise self._error(f"unknown sync op {sync_op_or_fn!r}; expected one of {OPS} or a callable")
            problem = check_sync(self.metadata.role, mode, sync_op_or_fn, axis, feature_axis(self.mod))
            weight = self.metadata.shards.get("weight")
            strided = weight is not None and block_count(weight.stride) > 1
            if not problem and sync_op_or_fn == "all_gather" and mode == "fwd_post" and strided:
                problem = f"the weight is sharded with stride {weight.stride}: gathering would interleave its blocks"
            if problem:
                raise self._error(f"invalid sync({mode!r}, {sync_op_or_fn!r}): {problem}")
            op_name = sync_op_or_fn
        elif callable(sync_op_or_fn):
            op_name = getattr(sync_op_or_fn, "__name__", repr(sync_op_or_fn))
        else:
            raise self._error(f"sync op must be a name or a callable, got {type(sync_op_or_fn).__name__}", TypeError)
        if (mode, sync_op_or_fn) in self.metadata.syncs:
            raise self._error(f"sync({mode!r}, {op_name!r}) is already applied to this module")
        return op_name

    def _output_is_fresh(self: ScheduleNode) -> bool:
        """Whether the module returns the product it computes, which nothing else holds: a
        row-parallel nn.Linear / Conv1D without a bias, its forward neither overridden, patched nor hooked."""
        mod = self.mod
        return (self.metadata.role is Role.ROW and own_forward(mod) is None and "forward" not in mod.__dict__
                and not forward_hooks(mod))  # fmt: skip

    def _default_gather_backward(self: ScheduleNode, mode: str) -> str:
        role = self.metadata.role
        if role is not None and mode == "fwd_post" and not role.output_is_partial:
            return "split"  # gathering a tensor-parallel output: what follows is replicated
        if role is Role.COLUMN and mode == "fwd_pre":
            return "reduce_scatter"  # sequence parallelism: the layer's input gradients are partial sums
        raise self._error(
            "all_gather on a module whose sharding is unknown needs backward='split' (what follows is "
            "replicated) or backward='reduce_scatter' (what follows is partitioned, as in sequence parallelism)"
        )
