"""HF's ``colwise_gather_output`` and ``rowwise_split_input`` styles (Phi-3, OLMo 2/3, OLMoE, GLM-4,
Qwen3-Next), translated for ``--schedule auto``.

HF's DTensor plan gathers such a column-parallel layer's output whole and splits it again at the
row-parallel layer that reads it: the module between them (an attention block, a gated MLP) runs
whole on every rank. HF does so where the module's code reads its layers' outputs by the model's
widths. Megatron splits those blocks by heads and features as any other, and so does
:func:`megatron_form` where the module has a row-parallel layer to end the region, after handling
what made HF gather:

- *packed projections* sliced by global widths: Phi-3's ``qkv_proj`` (``[q | k | v]``, unequal under
  grouped-query attention) and ``gate_up_proj`` (``chunk(2)``) are split with a stride, so that each
  rank holds its heads' q, k and v, or its features' gate and up, in the same order;
- *widths read from the config* in the forward (Phi-3's attention slices q at
  ``config.num_attention_heads * head_dim``): the module gets a config copy counting this rank's
  heads (:class:`LocalConfig`);
- *RMSNorms over all heads' width* (OLMo 2's ``q_norm``, ``k_norm``): split with the heads, their sum
  of squares all-reduced (:class:`SplitRMSNorm`, Megatron's placement for such norms).

The attention block then keeps one input-gradient all-reduce and one output all-reduce. A module
whose plan gathers outputs without a row-parallel layer to split them again (Qwen3-Next's linear
attention, which its own code runs on every feature) is followed to the letter: column split,
output all-gathered (its backward keeps this rank's part), input gradient all-reduced.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from megatron_slapo.errors import SchedulingError
from megatron_slapo.kernels.drop_in import rms_norm_form
from megatron_slapo.kernels.split_norm import SplitRMSNormForward
from megatron_slapo.module_surgery import set_base_forward
from megatron_slapo.parallel.layout import Stride
from megatron_slapo.plans.styles import ColumnParallel, compile_pattern
from megatron_slapo.primitives.attention_core import core_kind

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule

GATHERED = ("colwise_gather_output", "rowwise_split_input")


@dataclass(frozen=True)
class SplitRMSNorm:
    """An RMSNorm over a column-parallel layer's whole output width (OLMo 2's q/k norms): its
    weight split as the features are, its mean of squares taken over every rank's part
    (:class:`~megatron_slapo.kernels.split_norm.SplitRMSNormForward`)."""

    heads: int  # the heads it normalises together: each rank must hold whole heads of them
    cast_first: bool  # Llama's form (see SplitRMSNormForward), else OLMo 2's

    def apply(self, sch: Schedule) -> None:
        width = sch.mod.weight.numel()
        if self.heads % sch.world_size:
            raise sch._error(f"it normalises {self.heads} heads together, and the tensor-parallel size "
                             f"{sch.world_size} does not divide them: use a size that does")  # fmt: skip
        sch.shard("weight", axis=0)
        set_base_forward(sch.mod, SplitRMSNormForward(sch.group, width, self.cast_first))


@dataclass(frozen=True)
class LocalConfig:
    """Give an attention module its own copy of the model config, counting this rank's heads: a
    forward that slices its outputs by ``config.num_attention_heads`` (Phi-3's packed q|k|v) then
    slices this rank's. The model and its other modules keep the config they had (the rotary
    embedding, the masks and FLOP counts need the whole model's counts). The copy is the module's
    own from then on: a later change to the model's config (a schedule giving the model another
    attention implementation) does not reach it, so such changes come first (the trainer applies
    context parallelism's before the schedule)."""

    def apply(self, sch: Schedule) -> None:
        config, tp = copy.copy(sch.mod.config), sch.world_size
        for field in ("num_attention_heads", "num_key_value_heads"):
            count = getattr(config, field, None)
            if isinstance(count, int):
                if count % tp:
                    raise sch._error(f"its packed projection holds {count} heads ({field}), which the tensor-parallel "
                                     f"size {tp} does not divide: use a size that does")  # fmt: skip
                setattr(config, field, count // tp)
        sch.mod.config = config


def megatron_form(model: nn.Module, present: list[str], plan: dict[str, str], config: Any) -> tuple[dict, dict, dict]:
    """``(styles, strides, placements)``: HF's ``plan`` (full paths -> styles) with each module's
    gathered styles rewritten as Megatron places them where the module allows (``colwise``,
    ``rowwise``), the stride of each packed projection among them (by path), and the placements
    that requires (:class:`SplitRMSNorm`, :class:`LocalConfig`). The styles left
    ``colwise_gather_output`` are to be followed literally (:func:`gathered_column`)."""
    styles, strides, placements = dict(plan), {}, {}
    holders: dict[str, dict[str, str]] = {}
    for path, style in plan.items():
        if style in GATHERED:
            parent, _, child = path.rpartition(".")
            holders.setdefault(parent, {})[child] = style
    for parent, children in holders.items():
        rows = [name for name, style in children.items() if style == "rowwise_split_input"]
        columns = [name for name, style in children.items() if style == "colwise_gather_output"]
        if not rows:
            continue  # nothing splits the outputs again: gathered as the plan says
        first = next((p for p in present if compile_pattern(parent).match(p)), None)
        if first is None:
            continue  # a module this model's layers lack (an MoE model's dense MLP): left to hf_plan
        module = model.get_submodule(first)
        width = module.get_submodule(rows[0]).in_features  # what the region's columns produce, per block
        attention = core_kind(module) is not None
        for name in columns:
            styles[f"{parent}.{name}"] = "colwise"
            stride = _packed_stride(module.get_submodule(name), width, config, attention, parent, name)
            if stride != 1:
                strides[f"{parent}.{name}"] = stride
        for name in rows:
            styles[f"{parent}.{name}"] = "rowwise"
        if attention and any(path.startswith(parent + ".") for path in strides):
            placements[parent] = LocalConfig()  # a packed q|k|v, sliced by the config's head count
        for name, heads, form in _full_width_norms(module, columns, _head_dim(config)):
            placements[f"{parent}.{name}"] = SplitRMSNorm(heads, cast_first=form == "llama")
    return styles, strides, placements


def gathered_column() -> ColumnParallel:
    """``colwise_gather_output`` to the letter: the output all-gathered whole (each rank then computes
    the same, so the backward keeps this rank's part), the input gradient all-reduced."""
    return ColumnParallel(gather_output=True)


def _packed_stride(layer: nn.Module, width: int, config: Any, attention: bool, parent: str, name: str) -> Stride:
    """The stride of a column-parallel ``layer`` whose output the module slices by global widths:
    1 for one block, ``(H, KV, KV)`` (or 3) for q|k|v of H query and KV key/value heads, and outside
    attention ``n`` for n blocks as wide as the row-parallel layer's input (gate|up, ``chunk(n)``).
    An attention projection of another width (per-head interleaving, a gate) is refused: no stride
    is known to keep its heads with ``o_proj``'s."""
    out, head_dim = layer.out_features, _head_dim(config)
    heads, kv = getattr(config, "num_attention_heads", None) or 0, getattr(config, "num_key_value_heads", None) or 0
    if attention and heads and out == (heads + 2 * kv) * head_dim and kv:
        return 3 if kv == heads else (heads, kv, kv)
    if attention and out in (heads * head_dim, kv * head_dim):
        return 1
    if not attention and out % width == 0:
        return out // width
    raise SchedulingError(f"--schedule auto: {parent}.{name} is planned colwise_gather_output, and its {out} outputs "
                          f"are neither the attention's q, k or v widths nor blocks of the {width} features the "
                          "row-parallel layer reads: no split keeps the module's slicing")  # fmt: skip


def _head_dim(config: Any) -> int:
    heads = getattr(config, "num_attention_heads", None)
    return getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)


def _full_width_norms(module: nn.Module, columns: list[str], head_dim: int) -> list[tuple[str, int, str]]:
    """``(name, heads, form)`` of the RMSNorm children of ``module`` as wide as one of its
    column-parallel layers' output: they normalise across every head of that layer (``heads`` of
    them). Only HF's two RMSNorm forwards (:func:`~megatron_slapo.kernels.drop_in.rms_norm_form`) are
    split; another norm that wide is left to ``check_regions``, which refuses it by name."""
    widths = {module.get_submodule(name).out_features for name in columns}
    found = []
    for name, child in module.named_children():
        weight, form = getattr(child, "weight", None), rms_norm_form(child)
        if form and weight is not None and weight.numel() in widths and head_dim:
            found.append((name, weight.numel() // head_dim, form))
    return found
