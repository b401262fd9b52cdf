"""Megatron-style placements read from an HF model's own tensor-parallel plan (``--schedule auto``).

transformers 5 configs publish ``base_model_tp_plan``: module-path patterns of the base model
(``layers.*.self_attn.q_proj``) with a style (``colwise``, ``rowwise``, ...). HF runs such a plan
with DTensor, one collective per projection. :func:`plan_from_hf` turns it into this project's
placements, with Megatron's collectives:

- ``colwise`` layers are :class:`ColumnParallel` without an input reduction of their own; their
  parent (the attention module, the MLP) is one :class:`ParallelRegionInput`, so q, k and v (or
  gate and up) share one input-gradient all-reduce, as in Megatron;
- ``rowwise`` layers are :class:`RowParallel` (all-reduce of the output, then the bias);
- ``replicated_with_grad_allreduce`` parameters (Qwen3's per-head q/k norms) see only this rank's
  heads: their gradients are partial sums, tagged as Megatron tags such parameters
  (``sequence_parallel``), so every engine sums them over the tensor-parallel ranks;
- the input embedding is vocabulary-parallel and the LM head vocabulary-parallel with the
  vocabulary-parallel loss (the plan itself leaves both whole); the final norm gathers the
  sequence under ``--sequence-parallel``;
- attention modules get their head counts divided where they keep them as attributes (found
  generically: integer attributes named like head or width counts whose value is the config's),
  and their attention-probability dropout on the model-parallel RNG stream.

A style this translation cannot honour is one error naming the module pattern and the style.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn
from transformers import PreTrainedModel

from megatron_slapo.errors import SchedulingError
from megatron_slapo.parallel.plans import (
    ColumnParallel,
    HeadParallelDropout,
    ParallelRegionInput,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from megatron_slapo.parallel.sequence import SplitAlongSequence
from megatron_slapo.primitives.attention_core import core_kind

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule

STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")  # what plan_from_hf honours
# Attributes an attention module may size its reshapes from, and the config fields they mirror
HEAD_ATTRS = {
    "num_heads": "num_attention_heads", "num_attention_heads": "num_attention_heads", "n_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads", "num_kv_heads": "num_key_value_heads",
    "hidden_size": "hidden_size", "embed_dim": "hidden_size", "all_head_size": "hidden_size",
}  # fmt: skip


@dataclass(frozen=True)
class PartialGradients:
    """A replicated module applied to this rank's heads only: its parameters' gradients are partial
    sums over the tensor-parallel ranks (tagged ``sequence_parallel``: the engines sum them)."""

    def apply(self, sch: Schedule) -> None:
        for name, _ in sch.mod.named_parameters(recurse=False):
            sch.annotate(name, "sequence_parallel", True)


@dataclass(frozen=True)
class LocalHeadAttrs:
    """Divide, by the TP size, the integer attributes of an attention module that count heads or
    features of the whole model (:data:`HEAD_ATTRS` whose value is the config's)."""

    config: Any

    def apply(self, sch: Schedule) -> None:
        for attr, field in HEAD_ATTRS.items():
            value, whole = getattr(sch.mod, attr, None), getattr(self.config, field, None)
            if isinstance(value, int) and value == whole:
                if value % sch.world_size:
                    raise sch._error(f"{attr}={value} is not divisible by the tensor-parallel size {sch.world_size}")
                setattr(sch.mod, attr, value // sch.world_size)


def _path_of(model: nn.Module, module: nn.Module) -> str:
    return next(path for path, m in model.named_modules() if m is module)


def _adds_positions(model: PreTrainedModel, embedding: nn.Module) -> bool:
    """Whether another embedding (positions, token types) is added to the token lookup."""
    return any(isinstance(m, nn.Embedding) and m is not embedding for m in model.base_model.modules())


def plan_from_hf(model: PreTrainedModel) -> dict[str, Any]:
    """This project's plan (see :func:`~megatron_slapo.parallel.plans.apply_plan`) for ``model``,
    from its config's ``base_model_tp_plan``; SchedulingError for a style it cannot honour."""
    name = type(model).__name__
    tp_plan = getattr(model.config, "base_model_tp_plan", None)
    if not tp_plan:
        raise SchedulingError(f"--schedule auto: {name}'s config publishes no base_model_tp_plan to follow")
    base = _path_of(model, model.base_model)
    prefix = f"{base}." if base else ""
    embedding = model.get_input_embeddings()
    plan: dict[str, Any] = {
        _path_of(model, embedding): VocabParallelEmbedding(positions=_adds_positions(model, embedding))
    }
    regions: dict[str, None] = {}
    for pattern, style in tp_plan.items():
        path = prefix + pattern
        if style == "colwise":
            plan[path] = ColumnParallel(reduce_input_grad=False)
            regions[path.rpartition(".")[0]] = None
        elif style == "rowwise":
            plan[path] = RowParallel()
        elif style == "replicated_with_grad_allreduce":
            plan[path] = PartialGradients()
        elif not (style == "embedding_rowwise" and path == _path_of(model, embedding)):  # that one is ours already
            raise SchedulingError(f"--schedule auto: {name} plans {pattern!r} as {style!r}, which it cannot honour "
                                  f"yet (it follows {', '.join(STYLES)})")  # fmt: skip
    sample = dict(model.named_modules())
    for parent in regions:  # the first layer's module stands for the pattern's
        module = sample.get(parent.replace("*", "0"))
        attention = module is not None and core_kind(module) is not None
        placements = (ParallelRegionInput(), LocalHeadAttrs(model.config), HeadParallelDropout())
        plan = {parent: placements if attention else (ParallelRegionInput(),), **plan}
    norm = _final_norm(model, prefix)
    if norm:
        plan[norm] = SplitAlongSequence(gather_output=True)
    head = model.get_output_embeddings()
    if head is None:
        raise SchedulingError(f"--schedule auto: {name} has no output embeddings (LM head) to split")
    plan[_path_of(model, head)] = VocabParallelHead()
    return plan


def _final_norm(model: PreTrainedModel, prefix: str) -> str | None:
    """The module after the layers: the last entry of the config's ``base_model_pp_plan``, or
    (configs without one) the base model's last child named as a norm."""
    pp_plan = getattr(model.config, "base_model_pp_plan", None) or {}
    last = list(pp_plan)[-1] if pp_plan else None
    if last and last != "layers":
        return f"{prefix}{last}"
    norms = [name for name, _ in model.base_model.named_children() if "norm" in name or name == "ln_f"]
    return f"{prefix}{norms[-1]}" if norms else None
