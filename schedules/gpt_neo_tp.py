"""Megatron-style tensor parallelism for HF GPT-Neo (GPTNeoForCausalLM)."""

from megatron_slapo.plans.kernel_swap import swap_in_kernels
from megatron_slapo.plans.sequence import SplitAlongSequence, plan_schedule
from megatron_slapo.plans.styles import (
    ColumnParallel,
    HeadParallelDropout,
    LocalHeads,
    ParallelRegionInput,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)

MODEL_TYPES = ("gpt_neo",)  # HF config.model_type values this schedule is written for

PLAN = {
    "transformer.wte": VocabParallelEmbedding(),
    # GPT-Neo splits heads with self.num_heads; one GEMM and one input-gradient all-reduce for q, k, v
    "transformer.h.*.attn.attention": (LocalHeads(), ParallelRegionInput(fuse="{q,k,v}_proj"), HeadParallelDropout()),
    "transformer.h.*.attn.attention.{q,k,v}_proj": ColumnParallel(reduce_input_grad=False),
    "transformer.h.*.attn.attention.out_proj": RowParallel(),
    "transformer.h.*.mlp.c_fc": ColumnParallel(),
    "transformer.h.*.mlp.c_proj": RowParallel(),
    "transformer.ln_f": SplitAlongSequence(gather_output=True),  # under --sequence-parallel: split, then gathered
    "lm_head": VocabParallelHead(),
}
apply = plan_schedule(PLAN, swap_in_kernels)
