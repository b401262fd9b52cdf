"""One GEMM for the Linear layers that read the same input (q, k and v; gate and up).

Megatron stores such layers as one weight (``linear_qkv``, ``linear_fc1`` with a gated unit) and
multiplies the input once. HF keeps them apart, and its attention calls ``q_proj(x)``,
``k_proj(x)``, ``v_proj(x)`` one after the other. :func:`~megatron_slapo.plans.fusion.fuse_projections` keeps the layers and
their parameters as they are (names, shards, checkpoints, every engine's optimizer: nothing
changes) and changes only how they compute: the first of them called multiplies the input by the
concatenation of all their weights, in one GEMM, keeps its part and holds the others' parts for
them, each taken when that layer is called with the very same input. Backward, one GEMM gives the
input's gradient and one every weight's.

It falls back to each layer's own product, exactly as before, where the fused one would not be
right or not pay: under ``torch.compile`` (the graph keeps the separate products) and under
autocast (the layers' own products are cast as autocast casts them), when a weight is not whole
in this process (DeepSpeed ZeRO-3 gathers each layer's weight in its own hook; DTensors), and for
good once a layer finds the others' parts computed from another input, or under another grad mode,
or from an input changed in place since (a hook that changes one layer's input, cross-attention,
a recompute wrapped around one layer alone).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from megatron_slapo.compat.torch_internals import tensor_version


class SharedInput:
    """The layers fused, and the parts of the last product that layers have not taken yet, with
    what they were computed from: the input, its version, and whether autograd was recording."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        self.layers = layers
        self.pending: tuple[torch.Tensor, int, bool, dict[int, torch.Tensor]] | None = None
        self.enabled = True

    def __deepcopy__(self, memo: dict) -> SharedInput:
        clone = SharedInput(copy.deepcopy(self.layers, memo))  # the copied model's layers
        clone.enabled = self.enabled  # parts in flight are not copied: they belong to a call of this model
        return clone

    def _fusable(self, x: torch.Tensor) -> bool:
        """Whether the fused product may serve: not compiling, not under autocast, every weight a
        plain tensor held whole here (not a ZeRO-3 partition, not a DTensor)."""
        if (
            not self.enabled
            or torch.compiler.is_compiling()
            or (not x.is_meta and torch.is_autocast_enabled(x.device.type))
        ):
            return False
        return all(
            type(m.weight) in (torch.Tensor, nn.Parameter) and not hasattr(m.weight, "ds_id") for m in self.layers
        )

    def output(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)``, from the fused product where the layers share ``x``."""
        if not self._fusable(x):
            return F.linear(x, layer.weight, layer.bias)
        index = next(i for i, other in enumerate(self.layers) if other is layer)
        if self.pending is not None:
            source, version, recording, parts = self.pending
            self.pending = None
            same = source is x and version == tensor_version(x) and recording == torch.is_grad_enabled()
            if not (same and index in parts):  # the layers do not share one input: stop trying
                self.enabled = False
                return F.linear(x, layer.weight, layer.bias)
            out = parts.pop(index)
            if parts:
                self.pending = (source, version, recording, parts)
            return out
        weights = [other.weight for other in self.layers]
        biases = [other.bias for other in self.layers] if layer.bias is not None else []
        parts = _FusedLinear.apply(x, len(weights), *weights, *biases).split([w.shape[0] for w in weights], dim=-1)
        others = {i: part for i, part in enumerate(parts) if i != index}
        self.pending = (x, tensor_version(x), torch.is_grad_enabled(), others)
        return parts[index]


class _FusedLinear(torch.autograd.Function):
    """``x @ cat(weights).T + cat(biases)``, keeping for the backward the layers' own weights, not
    their concatenation: a copy of every fused weight per layer would cost activation memory (a
    7B Llama: 7 GB in bf16). The backward concatenates them again for the input's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, count: int, *params: torch.Tensor) -> torch.Tensor:
        weights, biases = params[:count], params[count:]
        ctx.count, ctx.has_bias = count, bool(biases)
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights), torch.cat(biases) if biases else None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        count, sizes = ctx.count, [w.shape[0] for w in weights]
        grad_x = grad @ torch.cat(weights) if ctx.needs_input_grad[0] else None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_w: tuple = (None,) * count
        if any(ctx.needs_input_grad[2 : 2 + count]):  # one GEMM for every weight's gradient
            grad_w = (rows.T @ x.reshape(-1, x.shape[-1])).split(sizes)
        grad_b = rows.sum(0).split(sizes) if ctx.has_bias else ()
        return (grad_x, None, *grad_w, *grad_b)


def shared_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
    """A fused layer's forward: its part of the one GEMM (installed by the fusion pass)."""
    return module.shared_input.output(module, input)


def leave_shared_input(module: nn.Linear) -> None:
    """Take ``module`` out of its fused group, so that another computation may be installed as its
    forward (``fp8``: each layer scales its own weight, as one process does); the others keep
    sharing their input among themselves."""
    group = module.__dict__.pop("shared_input")
    group.layers = [layer for layer in group.layers if layer is not module]
    group.pending = None
