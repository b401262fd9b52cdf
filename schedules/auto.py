"""Megatron-style tensor parallelism from the TP plan transformers publishes (the families verified).

Reads ``base_model_tp_plan`` (see ``megatron_slapo/plans/hf_plan.py``): one input-gradient
all-reduce per attention block and per MLP, every expert of an MoE block split by its features
(``plans/experts.py``), or with ``--expert-model-parallel-size`` whole experts on ranks and the tokens
sent to them (``base_model_ep_plan``, ``plans/expert_parallel.py``), vocabulary-parallel embedding, LM head and loss. Without ``--schedule``,
the families listed here that have no schedule of their own get this one.
"""

from typing import Any

from megatron_slapo.plans.expert_capacity import limit_expert_capacity
from megatron_slapo.plans.expert_parallel import expert_parallel_placement
from megatron_slapo.plans.hf_plan import check_regions, plan_from_hf
from megatron_slapo.plans.kernel_swap import swap_in_kernels
from megatron_slapo.plans.sequence import plan_for
from megatron_slapo.plans.styles import apply_plan
from megatron_slapo.schedule import Schedule

# The families verified against their unscheduled model (tests/distributed/test_auto.py runs each);
# others are refused until they are: a plan can be followed to the letter and still be wrong for a
# model (codegen packs q|v|k in blocks that a plain column split cuts through).
MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "granite", "starcoder2", "cohere", "cohere2",
               "smollm3", "gpt_neox", "olmo", "helium", "arcee", "ernie4_5", "exaone", "exaone4", "internlm3",
               "nemotron", "phi", "seed_oss", "jais2", "nanochat", "cwm", "iquestcoder", "hyperclovax",
               "mixtral", "qwen3_moe", "qwen2_moe", "minimax", "ernie4_5_moe", "glm4_moe", "deepseek_v3",
               "deepseek_v2", "dots1", "gemma", "gemma2", "gemma3_text", "vaultgemma", "phi3", "olmo2", "olmo3",
               "glm4", "apertus", "ministral3", "granitemoe", "olmoe", "qwen3_next")  # fmt: skip


def apply(sch: Schedule, config: Any = None, args: Any = None) -> None:
    config = config or sch.mod.config
    plan = plan_from_hf(sch.mod, config, getattr(args, "sequence_parallel", False), expert_parallel_placement(args))
    plan = plan_for(limit_expert_capacity(plan, args), args)
    apply_plan(sch, plan)
    check_regions(sch, plan)
    swap_in_kernels(sch)
