"""Megatron-style tensor parallelism for HF Llama (LlamaForCausalLM), grouped-query attention included."""

from megatron_slapo.plans.kernel_swap import swap_in_kernels
from megatron_slapo.plans.sequence import SplitAlongSequence, plan_schedule
from megatron_slapo.plans.styles import (
    ColumnParallel,
    HeadParallelDropout,
    ParallelRegionInput,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)

MODEL_TYPES = ("llama",)  # HF config.model_type values this schedule is written for

PLAN = {
    "model.embed_tokens": VocabParallelEmbedding(positions=False),  # no position embeddings: reduce-scatter under SP
    # one GEMM and one input-gradient all-reduce for q, k, v; each rank's heads their own dropout masks
    "model.layers.*.self_attn": (ParallelRegionInput(fuse="{q,k,v}_proj"), HeadParallelDropout()),
    "model.layers.*.self_attn.{q,k,v}_proj": ColumnParallel(reduce_input_grad=False),  # kv heads split too
    "model.layers.*.self_attn.o_proj": RowParallel(),
    "model.layers.*.mlp": ParallelRegionInput(fuse="{gate,up}_proj"),  # and for gate and up
    "model.layers.*.mlp.{gate,up}_proj": ColumnParallel(reduce_input_grad=False),
    "model.layers.*.mlp.down_proj": RowParallel(),
    "model.norm": SplitAlongSequence(gather_output=True),  # under --sequence-parallel: split, then gathered
    "lm_head": VocabParallelHead(),
}
apply = plan_schedule(PLAN, swap_in_kernels)
