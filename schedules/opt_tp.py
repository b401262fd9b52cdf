"""Megatron-style tensor parallelism for HF OPT (OPTForCausalLM)."""

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

MODEL_TYPES = ("opt",)  # HF config.model_type values this schedule is written for

PLAN = {
    "model.decoder.embed_tokens": VocabParallelEmbedding(),
    # OPT reshapes with self.num_heads; one GEMM and one input-gradient all-reduce for q, k, v
    "model.decoder.layers.*.self_attn": (LocalHeads(), ParallelRegionInput(fuse="{q,k,v}_proj"), HeadParallelDropout()),
    "model.decoder.layers.*.self_attn.{q,k,v}_proj": ColumnParallel(reduce_input_grad=False),
    "model.decoder.layers.*.self_attn.out_proj": RowParallel(),
    # OPT's MLP runs on tokens flattened to rows: under sequence parallelism its rows are split
    "model.decoder.layers.*.fc1": ColumnParallel(sequence_dim=0),
    "model.decoder.layers.*.fc2": RowParallel(sequence_dim=0),
    # after the layers (OPT-350m has a project_out instead of the final norm): split, then gathered under SP
    "model.decoder.{final_layer_norm,project_out}?": SplitAlongSequence(gather_output=True),
    "lm_head": VocabParallelHead(),
}
apply = plan_schedule(PLAN, swap_in_kernels)
