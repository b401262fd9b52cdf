"""Megatron-style tensor parallelism for HF GPT-Neo (GPTNeoForCausalLM)."""

from typing import Any

from megatron_slapo.parallel.plans import (
    ColumnParallel,
    HeadParallelDropout,
    LocalHeads,
    ParallelRegionInput,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    apply_plan,
)
from megatron_slapo.parallel.sequence import SplitAlongSequence, plan_for
from megatron_slapo.schedule import Schedule

MODEL_TYPES = ("gpt_neo",)  # HF config.model_type values this schedule is written for

ATTN = "transformer.h.*.attn.attention"
PLAN = {
    "transformer.wte": VocabParallelEmbedding(),
    # GPT-Neo splits heads with self.num_heads; one input-gradient all-reduce for q, k, v
    ATTN: (LocalHeads("num_heads", "embed_dim"), ParallelRegionInput(), HeadParallelDropout()),
    f"{ATTN}.q_proj": ColumnParallel(reduce_input_grad=False),
    f"{ATTN}.k_proj": ColumnParallel(reduce_input_grad=False),
    f"{ATTN}.v_proj": ColumnParallel(reduce_input_grad=False),
    f"{ATTN}.out_proj": RowParallel(),
    "transformer.h.*.mlp.c_fc": ColumnParallel(),
    "transformer.h.*.mlp.c_proj": RowParallel(),
    "transformer.ln_f": SplitAlongSequence(gather_output=True),  # under --sequence-parallel: split, then gathered
    "lm_head": VocabParallelHead(),
}


def apply(sch: Schedule, config: Any = None, args: Any = None) -> None:
    apply_plan(sch, plan_for(PLAN, args))
