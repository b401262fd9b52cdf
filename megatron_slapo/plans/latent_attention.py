"""Multi-head latent attention (DeepSeek's MLA) under tensor parallelism, split by heads as Megatron splits it.

transformers' plans leave MLA out (DeepSeek-V3's names only its MLPs and experts) or name a style
nothing implements (DeepSeek-V2's ``mla_kv_a_proj``), so ``--schedule auto`` places the attention
itself, wherever a model has such a module (:func:`is_latent_attention`). HF's MLA module:

- queries: ``q_proj`` (hidden -> heads x (nope + rope)), or with ``q_lora_rank`` a low-rank pair,
  ``q_a_proj`` (hidden -> rank), ``q_a_layernorm``, ``q_b_proj`` (rank -> heads x (nope + rope));
- keys and values: ``kv_a_proj_with_mqa`` (hidden -> kv rank + rope, the rotary key shared by all
  heads), ``kv_a_layernorm`` on the rank part, ``kv_b_proj`` (kv rank -> heads x (k nope + v));
- ``o_proj`` (heads x v -> hidden).

Megatron's ``MLASelfAttention`` keeps the down-projections and their norms whole on every rank,
splits the up-projections by output heads and the output projection by input heads. Both
up-projections lay each head's features out as one contiguous block (queries ``[nope | rope]``,
keys and values ``[k nope | v]``, viewed by HF as ``(..., heads, features)``), so a plain split of
their output rows into equal parts is a split by whole heads. :class:`LatentAttentionHeads` places
the children so:

- ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` column-parallel, without input reductions of their own:
  the attention module is one ``ParallelRegionInput`` (one input-gradient all-reduce per block, or
  the sequence's all-gather under ``--sequence-parallel``), given beside this placement in the plan;
- ``o_proj`` row-parallel (all-reduce, or reduce-scatter along the sequence);
- the down-projections and norms whole: they feed this rank's heads only, so their parameters'
  gradients are partial sums, tagged ``sequence_parallel`` (as Megatron tags such parameters) for
  every engine to sum over the tensor-parallel ranks;
- ``num_heads`` divided by the TP size (HF reshapes with ``-1`` heads; the count is kept true).

The block is entered as every attention block here is, at its input. Megatron, under
``--sequence-parallel``, runs the down-projections on this rank's part of the sequence and
all-gathers their narrow outputs instead (queries' and keys/values' ranks and the rotary key: 2112
features in DeepSeek-V3, against 7168 hidden); doing so here would need a region inside the HF
module's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from megatron_slapo.plans.styles import ColumnParallel, LocalHeads, RowParallel
from megatron_slapo.primitives.attention_core import core_kind

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule

# Split by output heads (q_proj without a query rank, q_b_proj with one)
UP_PROJECTIONS = ("q_proj", "q_b_proj", "kv_b_proj")
# Whole on every rank, feeding this rank's heads only: their gradients are partial sums
DOWN_PROJECTIONS = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")


def is_latent_attention(module: nn.Module) -> bool:
    """Whether ``module`` is an HF multi-head latent attention module (DeepSeek-V2/V3 and the families
    built on them): an attention core between a ``kv_a_proj_with_mqa`` / ``kv_b_proj`` pair."""
    return (
        core_kind(module) is not None
        and isinstance(getattr(module, "kv_a_proj_with_mqa", None), nn.Linear)
        and isinstance(getattr(module, "kv_b_proj", None), nn.Linear)
        and isinstance(getattr(module, "o_proj", None), nn.Linear)
    )


@dataclass(frozen=True)
class LatentAttentionHeads:
    """Plan placement on an MLA module: its children split by heads (see the module docstring).
    The plan gives the module a ``ParallelRegionInput`` too, which reduces the input gradient the
    column-parallel up-projections leave partial."""

    sequence_parallel: bool = False
    sequence_dim: int = 1  # as in RowParallel: where o_proj's output is reduce-scattered

    def apply(self, sch: Schedule) -> None:
        LocalHeads("num_heads").apply(sch)  # first: heads the TP size does not divide are one error
        for name in UP_PROJECTIONS:
            if getattr(sch.mod, name, None) is not None:
                ColumnParallel(reduce_input_grad=False).apply(sch[name])
        RowParallel(sequence_parallel=self.sequence_parallel, sequence_dim=self.sequence_dim).apply(sch["o_proj"])
        for name in DOWN_PROJECTIONS:
            if getattr(sch.mod, name, None) is not None:
                for param, _ in sch[name].mod.named_parameters(recurse=False):
                    sch[name].annotate(param, "sequence_parallel", True)
