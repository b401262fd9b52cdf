"""Megatron-style tensor parallelism from the TP plan transformers publishes (the families verified).

Reads ``base_model_tp_plan`` (see ``megatron_slapo/plans/hf_plan.py``): one input-gradient
all-reduce per attention block and per MLP, every expert of an MoE block split by its features
(``plans/experts.py``), or with ``--expert-model-parallel-size`` whole experts on ranks and the tokens
sent to them (``base_model_ep_plan``, ``plans/expert_parallel.py``), vocabulary-parallel embedding, LM head and loss. Without ``--schedule``,
the families listed here that have no schedule of their own get this one.
"""

from typing import Any

from megatron_slapo.parallel.state import expert_groups
from megatron_slapo.plans.expert_capacity import ExpertCapacity
from megatron_slapo.plans.expert_parallel import ExpertParallelExperts
from megatron_slapo.plans.experts import TensorParallelExperts
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
               "deepseek_v2", "dots1")  # fmt: skip


def apply(sch: Schedule, config: Any = None, args: Any = None) -> None:
    config = config or sch.mod.config
    sequence_parallel = getattr(args, "sequence_parallel", False)
    experts = None
    if getattr(args, "expert_model_parallel_size", 1) > 1:  # whole experts on ranks (plans/expert_parallel.py)
        experts = ExpertParallelExperts(expert_groups(), args.moe_token_dispatcher_type, sequence_parallel)
    plan = plan_from_hf(sch.mod, config, sequence_parallel, experts)
    if getattr(args, "moe_expert_capacity_factor", None) is not None:  # Megatron's token dropping
        capacity = ExpertCapacity(args.moe_expert_capacity_factor, args.moe_token_drop_policy)
        plan = {k: (v, capacity) if isinstance(v, (ExpertParallelExperts, TensorParallelExperts)) else v
                for k, v in plan.items()}  # fmt: skip
    plan = plan_for(plan, args)
    apply_plan(sch, plan)
    check_regions(sch, plan)
    swap_in_kernels(sch)
