"""Sequence parallelism (Megatron's ``--sequence-parallel``) on top of a tensor-parallel plan.

Between the tensor-parallel regions of a layer (norms, dropout, residual adds) every rank holds the
same activations; sequence parallelism splits them along the sequence instead, so each rank keeps
and computes ``1/t`` of them. A region is then entered by all-gathering the sequence (its backward
reduce-scatters the partial gradients) instead of Megatron's ``f``, and left by reduce-scattering
the partial outputs instead of the all-reduce ``g``: the same bytes, fewer activations.

The split spans what Megatron's spans, from the first layer's input to the LM head's input:

- *start*: a model that adds position (or token-type) embeddings to the vocabulary-parallel lookup
  all-reduces the lookup and the first layer keeps its part of the sum (a local split; all-gather
  backward), as Megatron does. A model without them (Llama) leaves the lookup a partial sum and
  the first layer reduce-scatters it (``VocabParallelEmbedding(positions=False)``), as Megatron's
  ``reduce_scatter_embeddings``; HF computes masks and positions from the embedding's output
  shape, so the split cannot happen at the embedding itself.
- *end*: the modules after the last layer (the final norm, BERT's MLM transform) run on the split
  sequence; the plan names them :class:`SplitAlongSequence`, and the last of them all-gathers its
  output for the LM head, reduce-scattering the head's partial input gradient backward (Megatron
  gathers in the output layer itself; HF reshapes the final norm's output to the full sequence
  first, so the gather comes before). BERT's pooler gathers the sequence for itself
  (:class:`GatherSequence`).

A parameter used on the split activations (a norm's weight, a row-parallel layer's bias) sees only
this rank's part of the sequence, so its gradient is a partial sum: it is tagged
``sequence_parallel``, Megatron's attribute, and the engines sum it over the tensor-parallel ranks.
Dropout on the split activations must draw a mask per rank, not one mask repeated on every part:
the layers run on the model-parallel RNG stream, as Megatron's transformer block does under
sequence parallelism.

Activations are batch-first in HF models: the sequence is dim 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedModel

from megatron_slapo.errors import SchedulingError
from megatron_slapo.plans.styles import (
    apply_plan,
)

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule

SEQUENCE_DIM = 1
# HF model classes whose last hidden state feeds only the (vocabulary-parallel) LM head (and BERT's
# pooler, which gathers for itself): the gathered output's gradient may be reduce-scattered.
_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForPreTraining")


def _tag_split_parameters(sch: Schedule) -> None:
    """Tag every parameter of ``sch``'s subtree that is not sharded: it sees part of the sequence.
    Expert-parallel weights are not: each rank holds other experts, which see the tokens routed to
    them from every rank (their gradients are reduced over the expert-data-parallel ranks)."""
    for _, node in sch.named_schedules():
        for name, _ in node.mod.named_parameters(recurse=False):
            tagged = node.metadata.annotations.get(name, {}).get("sequence_parallel")
            split = name in node.metadata.shards or name in node.metadata.expert_shards
            if not split and not tagged:
                node.annotate(name, "sequence_parallel", True)


@dataclass(frozen=True)
class SplitAlongSequence:
    """A replicated module between the last layer and the LM head (a final norm, BERT's MLM
    transform). Under sequence parallelism it runs on this rank's part of the sequence and its
    parameters' gradients are partial sums; ``gather_output`` (the last such module) all-gathers
    the sequence for the vocabulary-parallel head, whose input gradient, a partial sum over the
    vocabulary shards, it reduce-scatters backward: its output must feed only that head. Without
    sequence parallelism the placement does nothing."""

    gather_output: bool = False
    sequence_parallel: bool = False

    def apply(self, sch: Schedule) -> None:
        if self.sequence_parallel:
            _tag_split_parameters(sch)
            if self.gather_output:
                sch.sync("fwd_post", "all_gather", axis=SEQUENCE_DIM, backward="reduce_scatter")
                sch.metadata.sequence_split = "gathers"


@dataclass(frozen=True)
class GatherSequence:
    """A replicated module that needs the whole sequence (BERT's pooler reads the first token).
    Under sequence parallelism it all-gathers its input; backward each rank keeps its part of the
    (replicated) gradient. Otherwise the placement does nothing."""

    sequence_parallel: bool = False

    def apply(self, sch: Schedule) -> None:
        if self.sequence_parallel:
            sch.sync("fwd_pre", "all_gather", axis=SEQUENCE_DIM, backward="split")


def sequence_parallel_plan(plan: Mapping[str, Any]) -> dict[str, Any]:
    """``plan`` with every region entry and exit in its sequence-parallel form: each placement
    with a ``sequence_parallel`` field (ColumnParallel, RowParallel, the vocabulary-parallel ends,
    SplitAlongSequence, GatherSequence, ...) has it set."""

    def rewrite(placement: Any) -> Any:
        if isinstance(placement, tuple):
            return tuple(rewrite(p) for p in placement)
        if dataclasses.is_dataclass(placement) and "sequence_parallel" in {
            f.name for f in dataclasses.fields(placement)
        }:
            return dataclasses.replace(placement, sequence_parallel=True)
        return placement

    return {pattern: rewrite(placement) for pattern, placement in plan.items()}


def plan_for(plan: Mapping[str, Any], args: Any) -> Mapping[str, Any]:
    """The plan a schedule applies: sequence-parallel when ``--sequence-parallel`` is given."""
    return sequence_parallel_plan(plan) if getattr(args, "sequence_parallel", False) else plan


def plan_schedule(plan: Mapping[str, Any], *passes: Callable[[Schedule], Any]) -> Callable[..., None]:
    """The ``apply(sch, config, args)`` of a schedule that is one plan: applied in its
    sequence-parallel form under ``--sequence-parallel``, then each of ``passes`` (say
    :func:`~megatron_slapo.plans.kernel_swap.swap_in_kernels`) in order, so a schedule's file lists
    everything it does."""

    def apply(sch: Schedule, config: Any = None, args: Any = None) -> None:
        apply_plan(sch, plan_for(plan, args))
        for run in passes:
            run(sch)

    return apply


def split_layers(sch: Schedule, layers: list[str]) -> None:
    """Split the activations along the sequence from the first layer's input on (see the module
    docstring for where the split ends), and tag the layers' parameters that see part of it."""
    model = type(sch.mod).__name__
    if isinstance(sch.mod, PreTrainedModel) and not model.endswith(_HEADS):
        raise SchedulingError(f"--sequence-parallel gathers the sequence for the LM head only; {model} has other "
                              f"consumers of the last hidden state (use a model ending in {', '.join(_HEADS)})")  # fmt: skip
    splits = [node.metadata.sequence_split for _, node in sch.named_schedules()]
    if splits.count("gathers") > 1:
        raise SchedulingError("--sequence-parallel: more than one module after the layers gathers the sequence")
    if "gathers" not in splits:
        raise SchedulingError("--sequence-parallel: nothing after the layers gathers the sequence for the LM head; "
                              "give the final norm SplitAlongSequence(gather_output=True) and apply the plan with "
                              "plan_for(plan, args)")  # fmt: skip
    if "partial lookup" in splits:  # VocabParallelEmbedding(positions=False): a partial sum until here
        sch[layers[0]].sync("fwd_pre", "reduce_scatter", axis=SEQUENCE_DIM)
    else:
        sch[layers[0]].sync("fwd_pre", "scatter", axis=SEQUENCE_DIM)
    for layer in layers:
        _tag_split_parameters(sch[layer])
        if not sch[layer].metadata.forked_rng:  # dropout on this rank's part of the sequence: masks of its own
            sch[layer].fork_rng()
