"""Megatron-style tensor parallelism for any transformers-5 model whose config publishes a TP plan.

Reads ``base_model_tp_plan`` (see ``megatron_slapo/parallel/hf_plan.py``): one input-gradient
all-reduce per attention block and per MLP, vocabulary-parallel embedding, LM head and loss.
"""

from typing import Any

from transformers import CONFIG_MAPPING

from megatron_slapo.kernels.drop_in import swap_in_kernels
from megatron_slapo.parallel.hf_plan import plan_from_hf
from megatron_slapo.parallel.plans import apply_plan
from megatron_slapo.parallel.sequence import plan_for
from megatron_slapo.schedule import Schedule

MODEL_TYPES = None  # any model whose config has base_model_tp_plan (refused with a reason otherwise)


def fits(model_type: str) -> bool:
    """Whether transformers publishes a tensor-parallel plan for ``model_type``."""
    return model_type in CONFIG_MAPPING and bool(getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None))


def apply(sch: Schedule, config: Any = None, args: Any = None) -> None:
    apply_plan(sch, plan_for(plan_from_hf(sch.mod, config or sch.mod.config), args))
    swap_in_kernels(sch)
