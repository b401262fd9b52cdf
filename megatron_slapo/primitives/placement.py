"""What sharding a module's weight does to its inputs and outputs, and which syncs that allows.

Slapo's good idea, kept: when ``shard`` splits a known layer's weight, the schedule knows whether
the layer's output is *partitioned* (each rank holds a slice of the features) or a *partial sum*
(each rank holds a summand), and ``sync`` refuses collectives that contradict it, such as
all-reducing a partitioned output. Layers are recognised by class:

===============  ===================  ==============  =================  ==========================
layer            weight layout        sharded axis    role               output / input
===============  ===================  ==============  =================  ==========================
nn.Linear        (out, in)            0 / 1           column / row       partitioned / partial
HF Conv1D        (in, out)            1 / 0           column / row       (Conv1D stores W^T)
nn.Embedding     (vocab, hidden)      0 / 1           vocab / emb-column partial / partitioned
nn.Conv1d/2d/3d  (out, in, *kernel)   0 / 1           column / row       partitioned / partial (dim 1)
===============  ===================  ==============  =================  ==========================

Subclasses count as their base class, but a subclass that overrides ``forward`` computes something
we do not know: ``shard`` refuses the placements that would have to rewrite that forward (see
:func:`own_forward`).
"""

from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D

from megatron_slapo.compat.torch_nn import ConvNd
from megatron_slapo.kernels.linear import DecomposedConv1D, DecomposedLinear
from megatron_slapo.metadata import Role


def linear_axes(module: nn.Module) -> tuple[int, int] | None:
    """``(output_axis, input_axis)`` of a Linear-like weight (a convolution's channels count as its
    features; a grouped one's do not split as one), or ``None`` for other modules."""
    if isinstance(module, nn.Linear) or (isinstance(module, ConvNd) and module.groups == 1):
        return 0, 1
    if isinstance(module, Conv1D):
        return 1, 0
    return None


def feature_axis(module: nn.Module) -> int:
    """Where a layer's output holds its features: last in a Linear's ``(..., features)``, second in
    a convolution's ``(batch, channels, ...)``."""
    return 1 if isinstance(module, ConvNd) else -1


# Forwards whose computation is known to be the layer's plain maths (``x W^T + b`` for Linear-likes,
# a lookup for Embedding), so ``shard`` may compute the same thing its own way. DecomposedLinear and
# DecomposedConv1D add their bias as a separate op: the same maths.
_KNOWN_FORWARDS = (nn.Linear.forward, Conv1D.forward, nn.Embedding.forward, DecomposedLinear.forward,
                   DecomposedConv1D.forward, nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward)  # fmt: skip


def own_forward(module: nn.Module) -> str | None:
    """The name of the class that overrides the known layer's ``forward``, or ``None``.

    ``Scaled(nn.Linear)`` with ``forward = super().forward(x) * 2`` is still recognised as a Linear
    by its weight layout, but its forward does more than the Linear's maths; a placement that
    replaces the forward (row-parallel with a bias, vocabulary-parallel) would silently drop that.
    """
    forward = type(module).forward
    if any(forward is known for known in _KNOWN_FORWARDS):
        return None
    owner = next(cls for cls in type(module).__mro__ if "forward" in vars(cls))
    return owner.__qualname__


def scaled_embedding(module: nn.Module) -> bool:
    """Whether ``module`` is one of HF's scaled word embeddings (Gemma's, Bart's ``*ScaledWordEmbedding``):
    an Embedding whose forward is the lookup times its ``embed_scale``, which a vocabulary-parallel
    lookup multiplies by itself (:class:`~megatron_slapo.primitives.sync.VocabParallelForward`)."""
    return (isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")
            and hasattr(module, "embed_scale"))  # fmt: skip


def infer_role(module: nn.Module, param_name: str, axis: int) -> Role | None:
    """The role a module takes when ``param_name`` is sharded on ``axis``; ``None`` if unknown."""
    if param_name != "weight":
        return None
    if isinstance(module, nn.Embedding):
        return Role.VOCAB if axis == 0 else Role.EMBEDDING_COLUMN
    axes = linear_axes(module)
    if axes is None:
        return None
    return Role.COLUMN if axis == axes[0] else Role.ROW


def check_sync(role: Role | None, mode: str, op: str, axis: int, features: int = -1) -> str | None:
    """Why ``sync(mode, op, axis=...)`` contradicts ``role``, or ``None`` if it is consistent;
    ``features``: the layer's feature axis (:func:`feature_axis`)."""
    where = "the last dim" if features == -1 else f"dim {features}"
    if mode == "bwd_post":
        if op != "all_reduce":
            return f"bwd_post supports 'all_reduce' (or a callable), not {op!r}"
        if role is Role.ROW:
            return "the input of a row-parallel layer is partitioned, so its gradient needs no all_reduce"
        if role in (Role.VOCAB, Role.EMBEDDING_COLUMN):
            return "an embedding's input is token ids, which have no gradient to reduce"
        return None
    if role is None:
        return None
    if mode == "fwd_post":
        if role.output_is_partial and op not in ("all_reduce", "reduce_scatter"):
            return f"the output is a partial sum ({role.value} sharding): use all_reduce or reduce_scatter, not {op}"
        if role.output_is_partial and op == "reduce_scatter" and axis == features:
            return "reduce_scatter of a partial sum scatters the sequence (or batch) dim, not the features"
        if not role.output_is_partial:
            if op != "all_gather":
                return f"the output is partitioned on {where} ({role.value} sharding): only all_gather fits, not {op}"
            if axis != features:
                return f"the output is partitioned on {where}: all_gather must use axis={features}, not {axis}"
        return None
    # fwd_pre
    if role is Role.COLUMN and op != "all_gather":
        return f"a column-parallel layer needs its full input: only all_gather (sequence parallelism) fits, not {op}"
    if role is Role.COLUMN and axis == features:
        return f"all_gather before a column-parallel layer gathers the sequence dim; axis={features} is the feature dim"
    if role is Role.ROW and (op != "scatter" or axis != features):
        return f"a row-parallel layer expects its input split on {where}: only scatter with axis={features} fits"
    if role in (Role.VOCAB, Role.EMBEDDING_COLUMN) and op in ("all_reduce", "reduce_scatter"):
        return f"{op} of token ids makes no sense"
    return None
