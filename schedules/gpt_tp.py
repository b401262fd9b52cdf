"""Megatron-style tensor parallelism for HF GPT-2 (GPT2LMHeadModel).

Vocabulary-parallel (tied) embedding and LM head with a vocabulary-parallel loss; fused q|k|v and
the MLP's first layer column-parallel; both output projections row-parallel, their biases added
after the all-reduce. Two all-reduces per block forward, two backward, as in Megatron.
Attention-probability dropout draws from the model-parallel RNG stream (each rank's heads their own
masks); the residual dropout, on replicated activations, from the stream all ranks share.
"""

from megatron_slapo.plans.kernel_swap import swap_in_kernels
from megatron_slapo.plans.sequence import SplitAlongSequence, plan_schedule
from megatron_slapo.plans.styles import (
    ColumnParallel,
    HeadParallelDropout,
    LocalHeads,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)

MODEL_TYPES = ("gpt2",)  # HF config.model_type values this schedule is written for

PLAN = {
    "transformer.wte": VocabParallelEmbedding(),
    "transformer.h.*.attn": (LocalHeads("split_size", "num_heads", "embed_dim"), HeadParallelDropout()),
    "transformer.h.*.attn.c_attn": ColumnParallel(stride=3),  # q|k|v: each rank keeps its heads of each
    "transformer.h.*.attn.c_proj": RowParallel(),
    "transformer.h.*.mlp.c_fc": ColumnParallel(),
    "transformer.h.*.mlp.c_proj": RowParallel(),
    "transformer.ln_f": SplitAlongSequence(gather_output=True),  # under --sequence-parallel: split, then gathered
    "lm_head": VocabParallelHead(),
}
apply = plan_schedule(PLAN, swap_in_kernels)
