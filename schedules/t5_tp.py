"""Megatron-style tensor parallelism for HF T5: heads and FFN split, the relative position bias by head.

The shared embedding is vocabulary-parallel and tied to the (vocabulary-parallel) LM head. In
every attention module q, k, v are column-parallel and o row-parallel; the relative position bias
(the first layer of each stack computes it for all) keeps this rank's heads' columns. In the
decoder's cross-attention, k and v read the encoder's output: one GEMM for both and one all-reduce
of that input's gradient, as Megatron's fused key-value projection. The FFN's wi (wi_0 and wi_1,
as one GEMM, when gated) are column-parallel and wo row-parallel. LayerNorms replicate.
"""

from megatron_slapo.plans.kernel_swap import swap_in_kernels
from megatron_slapo.plans.sequence import plan_schedule
from megatron_slapo.plans.styles import (
    ColumnParallel,
    ColumnParallelEmbedding,
    HeadParallelDropout,
    LocalHeads,
    ParallelRegionInput,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)

MODEL_TYPES = ("t5",)  # HF config.model_type values this schedule is written for

LAYER = "{encoder,decoder}.block.*.layer"
ATTENTION = f"{LAYER}.*.{{SelfAttention,EncDecAttention}}"
PLAN = {
    "shared": VocabParallelEmbedding(),
    "{encoder,decoder}.embed_tokens": VocabParallelEmbedding(),  # the shared table, as each stack looks it up
    ATTENTION: (LocalHeads("n_heads", "inner_dim"), HeadParallelDropout()),
    f"{LAYER}.0.SelfAttention": ParallelRegionInput(fuse="{q,k,v}"),
    "decoder.block.*.layer.1.EncDecAttention": (
        ParallelRegionInput(),
        ParallelRegionInput(input="key_value_states", fuse="{k,v}"),
    ),
    f"{ATTENTION}.{{q,k,v}}": ColumnParallel(reduce_input_grad=False),
    f"{ATTENTION}.o": RowParallel(),
    f"{LAYER}.0.SelfAttention.relative_attention_bias?": ColumnParallelEmbedding(),  # the first layer's
    f"{LAYER}.*.DenseReluDense": ParallelRegionInput(fuse="{wi_0,wi_1}?"),  # gated (T5 v1.1): one GEMM
    f"{LAYER}.*.DenseReluDense.{{wi,wi_0,wi_1}}": ColumnParallel(reduce_input_grad=False),
    f"{LAYER}.*.DenseReluDense.wo": RowParallel(),
    "lm_head": VocabParallelHead(causal=False),
}
apply = plan_schedule(PLAN, swap_in_kernels)
