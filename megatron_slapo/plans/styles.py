"""Tensor-parallel plans: placements as data, applied with the schedule primitives.

A plan maps module-path patterns (``*`` matches one path component) to a placement::

    GPT2_PLAN = {
        "transformer.wte": VocabParallelEmbedding(),
        "transformer.h.*.attn": LocalHeads("split_size", "num_heads", "embed_dim"),
        "transformer.h.*.attn.c_attn": ColumnParallel(stride=3),
        "transformer.h.*.attn.c_proj": RowParallel(),
        ...
    }
    apply_plan(sch, GPT2_PLAN)

Each placement is a few primitive calls (shard + sync), so a plan reads like Megatron's layer
choices and every decision stays visible in one place; schedules add the primitives that are not
sharding (replace, checkpoint, fuse) as calls.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch.fx as fx
from transformers import PreTrainedModel

from megatron_slapo.compat.torch_nn import ConvNd
from megatron_slapo.errors import SchedulingError
from megatron_slapo.kernels.vocab import VocabParallelLMLoss
from megatron_slapo.parallel.collectives import reduce_backward
from megatron_slapo.parallel.layout import Stride
from megatron_slapo.plans.fusion import fuse_projections
from megatron_slapo.primitives.placement import feature_axis, linear_axes

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule


class Placement(Protocol):
    def apply(self, sch: Schedule) -> None: ...


def _axes(sch: Schedule) -> tuple[int, int]:
    """The (output, input) feature axes of a Linear-like weight or a convolution's (out, in, *kernel)."""
    if isinstance(sch.mod, ConvNd) and sch.mod.groups != 1:
        raise sch._error(f"a grouped convolution (groups={sch.mod.groups}) cannot split its channels as one")
    axes = linear_axes(sch.mod)
    if axes is None:
        raise sch._error(f"expected nn.Linear, HF Conv1D or a convolution, found {type(sch.mod).__name__}")
    return axes


def _shard_bias(sch: Schedule, stride: Stride) -> None:
    if getattr(sch.mod, "bias", None) is not None:
        sch.shard("bias", axis=0, stride=stride)


@dataclass(frozen=True)
class ColumnParallel:
    """Split the output features (a convolution's output channels); all-reduce the input gradient (Megatron's f).

    ``stride`` is the number of fused blocks in the output (3 for q|k|v). ``gather_output``
    all-gathers the result for layers whose consumer needs every feature. ``reduce_input_grad=False``
    leaves the input gradient to a :class:`ParallelRegionInput` on an enclosing module, which
    reduces it once for every layer that reads the same input (q, k and v; gate and up).
    """

    stride: Stride = 1  # or unequal blocks' relative sizes: (heads, kv_heads, kv_heads) for a packed GQA q|k|v
    gather_output: bool = False
    reduce_input_grad: bool = True
    sequence_parallel: bool = False  # the input is split along the sequence: all-gather it (see sequence.py)
    sequence_dim: int = 1  # where the sequence is in the input (0 for tokens flattened to rows, as OPT's MLP)

    def apply(self, sch: Schedule) -> None:
        sch.shard("weight", axis=_axes(sch)[0], stride=self.stride)
        _shard_bias(sch, self.stride)
        if self.reduce_input_grad and self.sequence_parallel:
            sch.sync("fwd_pre", "all_gather", axis=self.sequence_dim)  # backward: reduce-scatter the partials
        elif self.reduce_input_grad:
            sch.sync("bwd_post", "all_reduce")
        if self.gather_output:
            sch.sync("fwd_post", "all_gather", axis=feature_axis(sch.mod))


@dataclass(frozen=True)
class ParallelRegionInput:
    """The entry of a tensor-parallel region: a module (an attention block, a gated MLP) whose
    input is read only by column-parallel layers inside it. Its input gradient, the sum of those
    layers' partial gradients, is all-reduced here once (Megatron's f on the block's input) instead
    of once per layer; the layers take ``ColumnParallel(reduce_input_grad=False)``. Under sequence
    parallelism the input is split along the sequence: it is all-gathered here instead, and its
    gradient reduce-scattered. ``fuse`` names those layers (``"{q,k,v}_proj"``) to multiply the
    input by all their weights in one GEMM, as Megatron's fused ``linear_qkv`` does; ending in ``?``
    it fuses them only where the module has them all. ``input`` names
    another input than the first, by keyword: a cross-attention's ``key_value_states``, which only
    its k and v read (Megatron's fused key-value projection).
    """

    sequence_parallel: bool = False
    sequence_dim: int | None = 1  # as in ColumnParallel; None: the input stays whole (a CNN block's)
    fuse: str = ""  # children that read the input, as one GEMM (see kernels/shared_input.py)
    input: str = ""  # the keyword of the input, when it is not the first

    def apply(self, sch: Schedule) -> None:
        if linear_axes(sch.mod) is not None:
            raise sch._error("ParallelRegionInput is for a module that encloses column-parallel layers, "
                             "not a layer: use ColumnParallel()")  # fmt: skip
        if self.input:
            if self.sequence_parallel:
                raise sch._error(f"ParallelRegionInput(input={self.input!r}) has no sequence-parallel form yet")
            sch.mod.register_forward_pre_hook(KeywordGradReduce(self.input, sch.group), with_kwargs=True)
        elif self.sequence_parallel and self.sequence_dim is not None:
            sch.sync("fwd_pre", "all_gather", axis=self.sequence_dim, backward="reduce_scatter")
        else:
            sch.sync("bwd_post", "all_reduce")
        names = alternatives(self.fuse.removesuffix("?"))
        if self.fuse.endswith("?") and not all(hasattr(sch.mod, name) for name in names):
            return  # a variant without them (T5's plain FFN has one wi where the gated one has wi_0, wi_1)
        if self.fuse:
            fuse_projections(sch, names)


class KeywordGradReduce:
    """Forward pre-hook: all-reduce the gradient of the keyword input ``name`` (Megatron's f)."""

    def __init__(self, name: str, group) -> None:
        self.name, self.group = name, group

    def __deepcopy__(self, memo: dict) -> KeywordGradReduce:
        return self  # holds a process group handle, shared rather than copied

    def __call__(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        value = kwargs.get(self.name)
        if value is None:
            raise RuntimeError(f"{type(module).__name__} was called without {self.name}=, whose gradient it reduces")
        return args, {**kwargs, self.name: reduce_backward(value, self.group)}


@dataclass(frozen=True)
class ColumnParallelEmbedding:
    """Split an embedding's columns: T5's relative position bias, one column per head, keeps this
    rank's heads. The input is ids (no gradient) and the output stays split: nothing to reduce."""

    def apply(self, sch: Schedule) -> None:
        sch.shard("weight", axis=1)


@dataclass(frozen=True)
class RowParallel:
    """Split the input features (a convolution's input channels); all-reduce the output (Megatron's
    g), then add the bias once; under sequence parallelism reduce-scatter it along the sequence instead."""

    sequence_parallel: bool = False
    sequence_dim: int = 1  # as in ColumnParallel

    def apply(self, sch: Schedule) -> None:
        sch.shard("weight", axis=_axes(sch)[1])
        if self.sequence_parallel:
            sch.sync("fwd_post", "reduce_scatter", axis=self.sequence_dim)
        else:
            sch.sync("fwd_post", "all_reduce")


@dataclass(frozen=True)
class VocabParallelEmbedding:
    """Split the embedding table along the vocabulary; all-reduce the looked-up vectors.

    ``positions=False`` says that nothing is added to the lookup before the first layer (no
    position or token-type embeddings, as Llama): under sequence parallelism the lookup then stays
    a partial sum, which the first layer reduce-scatters along the sequence (see sequence.py).
    """

    positions: bool = True
    sequence_parallel: bool = False

    def apply(self, sch: Schedule) -> None:
        sch.shard("weight", axis=0)
        if self.positions or not self.sequence_parallel:
            sch.sync("fwd_post", "all_reduce")
        else:
            sch.metadata.sequence_split = "partial lookup"


@dataclass(frozen=True)
class VocabParallelHead:
    """An LM head whose logits stay split along the vocabulary (Megatron's ``parallel_output``).

    The weight is sharded like the (usually tied) embedding, the input gradient is all-reduced (under
    sequence parallelism the module before the head gathers the sequence and reduce-scatters this
    gradient: see ``SplitAlongSequence``), and the enclosing HF model's ``loss_function`` becomes
    the vocabulary-parallel cross-entropy, so ``model(input_ids, labels=labels).loss`` stays
    correct without gathering ``B x S x V`` logits.
    """

    causal: bool = True
    sequence_parallel: bool = False

    def apply(self, sch: Schedule) -> None:
        sch.shard("weight", axis=0)
        _shard_bias(sch, 1)
        if not self.sequence_parallel:
            sch.sync("bwd_post", "all_reduce")
        owner = sch.parent
        while owner is not None and not isinstance(owner.mod, PreTrainedModel):
            owner = owner.parent
        if owner is not None:
            owner.mod.loss_function = VocabParallelLMLoss(sch.group, causal=self.causal)
        elif not any(
            isinstance(node.mod, fx.GraphModule) for node in _ancestors(sch)
        ):  # a traced model has no ``labels=`` path to fix
            raise sch._error("VocabParallelHead needs an enclosing HF PreTrainedModel to compute the loss")


def _ancestors(sch: Schedule) -> list[Schedule]:
    out, node = [], sch.parent
    while node is not None:
        out.append(node)
        node = node.parent
    return out


@dataclass(frozen=True)
class LocalHeads:
    """Divide integer attributes that count heads or features by the TP size.

    Some HF attention modules size their reshapes from attributes (GPT-2's ``split_size``); after
    sharding the projections they must describe this rank's heads. Without arguments: the usual
    ``num_heads`` and ``embed_dim``.
    """

    attrs: tuple[str, ...]

    def __init__(self, *attrs: str) -> None:
        object.__setattr__(self, "attrs", attrs or ("num_heads", "embed_dim"))

    def apply(self, sch: Schedule) -> None:
        for attr in self.attrs:
            value = getattr(sch.mod, attr, None)
            if not isinstance(value, int):
                raise sch._error(f"{type(sch.mod).__name__} has no integer attribute {attr!r}")
            if value % sch.world_size:
                raise sch._error(f"{attr}={value} is not divisible by the tensor-parallel size {sch.world_size}")
            setattr(sch.mod, attr, value // sch.world_size)


@dataclass(frozen=True)
class HeadParallelDropout:
    """Attention-probability dropout on this rank's heads draws from the model-parallel RNG stream,
    so that each head gets its own mask, as when one process runs them all (Megatron forks the
    stream around its core attention). Applied to the HF attention module; see ``attention_core``."""

    def apply(self, sch: Schedule) -> None:
        sch.attention_core(fork_rng=True)


def alternatives(name: str) -> list[str]:
    """The names a plan path component stands for: ``"{q,k,v}_proj"`` -> q_proj, k_proj, v_proj."""
    pieces = re.split(r"\{([^{}]*)\}", name)
    names = [""]
    for i, piece in enumerate(pieces):
        names = [n + p for n in names for p in (piece.split(",") if i % 2 else [piece])]
    return names


def _component(part: str) -> str:
    """One path component: ``*`` is any name, ``{q,k,v}_proj`` any of the names the braces list."""
    if part == "*":
        return "[^.]+"
    pieces = re.split(r"\{([^{}]*)\}", part)  # literal, alternatives, literal, ...
    return "".join(re.escape(p) if i % 2 == 0 else "(?:" + "|".join(map(re.escape, p.split(","))) + ")"
                   for i, p in enumerate(pieces))  # fmt: skip


def compile_pattern(pattern: str) -> re.Pattern:
    """The regular expression of a plan pattern (see :func:`apply_plan`), matching whole paths."""
    return re.compile("\\.".join(_component(part) for part in pattern.removesuffix("?").split(".")) + "$")


def matching(sch: Schedule, pattern: str) -> list[str]:
    """The paths of ``sch``'s submodules that a plan ``pattern`` matches (see :func:`apply_plan`)."""
    regex = compile_pattern(pattern)
    return [p for p, _ in sch.named_schedules() if p and regex.match(p)]


def placements_of(entry: Placement | tuple[Placement, ...]) -> tuple[Placement, ...]:
    """A plan entry's placements: the tuple it is, or its one placement."""
    return entry if isinstance(entry, tuple) else (entry,)


def apply_plan(sch: Schedule, plan: Mapping[str, Placement | tuple[Placement, ...]]) -> list[str]:
    """Apply each placement (or tuple of placements) to every module whose path matches its
    pattern; return the paths.

    In a pattern, ``*`` matches one path component and ``{a,b}`` one of the listed names
    (``layers.*.self_attn.{q,k,v}_proj``). Patterns are applied in the plan's order. A pattern that
    matches nothing is an error (a plan written for another model family would otherwise silently
    do nothing) unless it ends in ``?``: a module some variants of the family lack. So is a column-parallel
    layer that leaves its input gradient to a :class:`ParallelRegionInput` the plan does not give it.
    """
    paths = [p for p, _ in sch.named_schedules() if p]
    applied: list[str] = []
    regions: list[str] = []
    unreduced: list[str] = []
    for pattern, placements in plan.items():
        regex = compile_pattern(pattern)
        matched = [p for p in paths if regex.match(p)]
        if not matched and not pattern.endswith("?"):
            raise SchedulingError(f"plan pattern {pattern!r} matches no submodule of {type(sch.mod).__name__}")
        for placement in placements_of(placements):
            for path in matched:
                placement.apply(sch[path])
            if isinstance(placement, ParallelRegionInput):
                regions.extend(matched)
            if isinstance(placement, ColumnParallel) and not placement.reduce_input_grad:
                unreduced.extend(matched)
        applied.extend(matched)
    for path in unreduced:
        if not any(path.startswith(region + ".") for region in regions):
            raise SchedulingError(
                f"plan: {path} is ColumnParallel(reduce_input_grad=False) but no enclosing module is "
                "ParallelRegionInput(); its input gradient would stay a partial sum"
            )
    return applied
