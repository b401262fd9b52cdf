"""FP8 matrix products for training: torchao's casts and GEMMs, with each scale agreed across the
ranks that split the tensor it scales.

A Linear layer in FP8 (Megatron's ``--fp8-format``, torchao's ``Float8Linear``) computes its three
products (the output, the input's gradient, the weight's gradient) on float8 copies of its
operands: each operand is multiplied by a scale, ``max representable / amax``, and cast. The amax
is the operand's largest magnitude (``tensorwise``) or each row's along the product's inner
dimension (``rowwise``). torchao casts and multiplies (emulated in fp32 where there is no FP8
hardware, ``torch._scaled_mm`` where there is); :class:`Fp8Recipe` is its configuration.

Under Megatron's tensor parallelism a rank holds a slice of the weight and of the input
(row-parallel) or of the output's gradient (column-parallel). An amax taken over a slice differs
from rank to rank and from one process's, so each rank would round differently from the model it
splits. torchao agrees amaxes only through DTensor (torchtitan's ``Float8ColwiseParallel``); our
layers hold plain tensors. So the product here is torchao's ``matmul_with_hp_or_float8_args``
with one change: every amax is all-reduced (max) over the groups that split the dimensions it is
taken over (:class:`Splits`), and a TP2 layer casts exactly what one process casts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_slapo.compat.torchao_float8 import float8_gathered, is_float8, torchao_float8
from megatron_slapo.module_surgery import base_forward
from megatron_slapo.parallel.collectives import Group, all_reduce_max

RECIPES = ("tensorwise", "rowwise")  # torchao's recipes that train every product in FP8
FORMATS = ("e4m3", "hybrid")  # Megatron's: e4m3 throughout, or e5m2 for the gradients (hybrid)


@dataclass(frozen=True)
class Fp8Recipe:
    """Megatron's ``--fp8-recipe`` and ``--fp8-format`` as a torchao configuration; ``emulate``: the
    FP8 products computed in fp32 from the FP8 values (a CPU, or a GPU without FP8 units)."""

    recipe: str = "tensorwise"
    format: str = "hybrid"
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES or self.format not in FORMATS:
            raise ValueError(
                f"FP8 recipe {self.recipe!r} / format {self.format!r}: expected one of {RECIPES} / {FORMATS}"
            )

    @functools.cached_property
    def config(self) -> Any:
        """torchao's ``Float8LinearConfig`` of this recipe, the gradients' dtype set by the format."""
        ao = torchao_float8()
        base = ao.Float8LinearConfig.from_recipe_name(self.recipe)
        grads = torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn
        return dataclasses.replace(
            base, emulate=self.emulate,
            cast_config_grad_output=dataclasses.replace(base.cast_config_grad_output, target_dtype=grads),
            cast_config_grad_output_for_grad_weight=dataclasses.replace(
                base.cast_config_grad_output_for_grad_weight, target_dtype=grads),
        )  # fmt: skip

    @functools.cached_property
    def mm_config(self) -> Any:
        """torchao's ``LinearMMConfig``: the three products' GEMM settings, as ``Float8Linear`` sets them."""
        ao, c = torchao_float8(), self.config
        gemms = (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        return ao.LinearMMConfig(
            *(ao.ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim) for g in gemms)
        )

    def describe(self) -> str:
        """``"fp8 tensorwise hybrid"``; with ``(emulated)`` when it computes in fp32."""
        return f"fp8 {self.recipe} {self.format}" + (" (emulated)" if self.emulate else "")


@dataclass(frozen=True)
class Splits:
    """The groups each dimension of a product ``[tokens, in] x [in, out]`` is split over on this
    rank: ``inputs`` for a row-parallel layer, ``outputs`` for a column-parallel one, ``tokens``
    under context parallelism."""

    tokens: tuple[Group, ...] = ()
    inputs: tuple[Group, ...] = ()
    outputs: tuple[Group, ...] = ()

    def __deepcopy__(self, memo: dict) -> Splits:
        return self  # holds process group handles, shared rather than copied


def _cast(tensor: torch.Tensor, cast: Any, recipe: Fp8Recipe, role: Any, axis: int,
          dims: tuple[tuple[Group, ...], tuple[Group, ...]]) -> torch.Tensor:  # fmt: skip
    """``tensor`` (2-D, its dims split over ``dims``) cast as torchao casts it for ``role`` (rowwise:
    one scale per row along ``axis``), the amax agreed over the groups splitting what it spans."""
    if is_float8(tensor):  # FSDP2's float8 all-gather cast the weight already
        return tensor
    ao = torchao_float8()
    tensorwise = cast.scaling_granularity is ao.ScalingGranularity.TENSORWISE
    with torch.no_grad():
        magnitude = torch.abs(tensor)
        amax = (torch.max(magnitude) if tensorwise else torch.amax(magnitude, dim=axis, keepdim=True)).float()
        for group in (dims[0] + dims[1]) if tensorwise else dims[axis]:
            amax = all_reduce_max(amax, group)
        scale = ao.amax_to_scale(amax, cast.target_dtype, recipe.config.round_scales_to_power_of_2)
    return ao.hp_tensor_and_scale_to_float8(tensor, scale, cast.target_dtype, recipe.mm_config, role,
                                            None if tensorwise else axis)  # fmt: skip


@torch.compiler.allow_in_graph
class _Fp8Product(torch.autograd.Function):
    """``x @ weight_t`` (``weight`` stored as ``(out, in)`` when ``transposed``, as nn.Linear stores
    it) with its three products in FP8, following ``matmul_with_hp_or_float8_args`` cast for cast."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, transposed: bool, recipe: Fp8Recipe,
                splits: Splits) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x, weight)
        ctx.transposed, ctx.recipe, ctx.splits = transposed, recipe, splits
        ao, c = torchao_float8(), recipe.config
        weight_t = weight.t() if transposed else weight
        x_fp8 = _cast(x, c.cast_config_input, recipe, ao.GemmInputRole.INPUT, -1, (splits.tokens, splits.inputs))
        w_fp8 = _cast(
            weight_t, c.cast_config_weight, recipe, ao.GemmInputRole.WEIGHT, 0, (splits.inputs, splits.outputs)
        )
        return torch.mm(x_fp8, w_fp8)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        recipe, splits = ctx.recipe, ctx.splits
        ao, c = torchao_float8(), recipe.config
        weight_t = weight.t() if ctx.transposed else weight
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g = _cast(grad, c.cast_config_grad_output, recipe, ao.GemmInputRole.GRAD_OUTPUT, -1,
                      (splits.tokens, splits.outputs))  # fmt: skip
            w = _cast(weight_t, c.cast_config_weight_for_grad_input, recipe, ao.GemmInputRole.WEIGHT, -1,
                      (splits.inputs, splits.outputs))  # fmt: skip
            grad_x = torch.mm(g, w.t())
        if ctx.needs_input_grad[1]:
            g = _cast(grad, c.cast_config_grad_output_for_grad_weight, recipe, ao.GemmInputRole.GRAD_OUTPUT, 0,
                      (splits.tokens, splits.outputs))  # fmt: skip
            i = _cast(x, c.cast_config_input_for_grad_weight, recipe, ao.GemmInputRole.INPUT, 0,
                      (splits.tokens, splits.inputs))  # fmt: skip
            grad_w = torch.mm(g.t(), i)  # (out, in)
            grad_w = grad_w if ctx.transposed else grad_w.t()
        return grad_x, grad_w, None, None, None


def fp8_product(x: torch.Tensor, weight: torch.Tensor, transposed: bool, recipe: Fp8Recipe,
                splits: Splits = Splits()) -> torch.Tensor:  # fmt: skip
    """``x @ weight.T`` (``transposed``: nn.Linear's ``(out, in)`` weight) or ``x @ weight`` (HF
    Conv1D's ``(in, out)``) in FP8, over ``x``'s last dimension, without a bias. Under autocast the
    operands are cast to its dtype first, as ``F.linear`` would be."""
    device = x.device.type
    autocast = device != "meta" and torch.is_autocast_enabled(device)  # meta: a run explain plans
    if autocast:
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight if is_float8(weight) else weight.to(dtype)
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        out = _Fp8Product.apply(x.reshape(-1, x.size(-1)), weight, transposed, recipe, splits)
    return out.view(*x.shape[:-1], out.size(-1))


class Fp8Forward:
    """The forward of an nn.Linear or HF Conv1D in FP8, as a module's base computation
    (:func:`megatron_slapo.module_surgery.set_base_forward`): the product, then the bias."""

    def __init__(self, recipe: Fp8Recipe, splits: Splits = Splits()) -> None:
        self.recipe, self.splits = recipe, splits

    def __deepcopy__(self, memo: dict) -> Fp8Forward:
        return self  # no state of its own beyond the recipe and group handles

    def product(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The layer's product without its bias (a row-parallel layer reduces it before the bias)."""
        return fp8_product(x, module.weight, isinstance(module, nn.Linear), self.recipe, self.splits)

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = self.product(module, x)
        return out if module.bias is None else out + module.bias.to(out.dtype)


def fp8_forward(module: nn.Module) -> Fp8Forward | None:
    """The :class:`Fp8Forward` ``module`` computes with: its base forward, or the product inside
    the base that a row-parallel layer with a bias keeps (reduce, then add the bias)."""
    product = getattr(base_forward(module), "product", None)  # a bound Fp8Forward.product in both cases
    owner = getattr(product, "__self__", None)
    return owner if isinstance(owner, Fp8Forward) else None


def gather_weights_in_fp8(model: nn.Module) -> int:
    """Make FSDP2 all-gather the weights of ``model``'s FP8 layers in float8 (``--fp8-param-gather``:
    half the bytes of bf16), each shard cast with the whole weight's scale; call before
    ``fully_shard``. Returns how many weights."""
    count = 0
    for module in model.modules():
        forward = fp8_forward(module)
        if forward is not None:
            dtype = forward.recipe.config.cast_config_weight.target_dtype
            module.weight = float8_gathered(module.weight, forward.recipe.mm_config, dtype)
            count += 1
    return count
