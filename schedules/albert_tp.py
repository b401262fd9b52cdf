"""Megatron-style tensor parallelism for HF ALBERT (pretraining and masked-LM heads).

As ``bert_tp``, on ALBERT's factorised embedding (vocabulary-parallel, tied to the MLM decoder)
and its one shared layer, sharded once and run at every depth. Its attention block also adds its
input to its output, so q, k and v reduce their input gradients each (no enclosing region).
"""

from megatron_slapo.parallel.plans import (
    ColumnParallel,
    HeadParallelDropout,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from megatron_slapo.parallel.sequence import plan_schedule

MODEL_TYPES = ("albert",)  # HF config.model_type values this schedule is written for

LAYER = "albert.encoder.albert_layer_groups.*.albert_layers.*"
PLAN = {
    "albert.embeddings.word_embeddings": VocabParallelEmbedding(),
    f"{LAYER}.attention": HeadParallelDropout(),
    f"{LAYER}.attention.{{query,key,value}}": ColumnParallel(),
    f"{LAYER}.attention.dense": RowParallel(),
    f"{LAYER}.ffn": ColumnParallel(),
    f"{LAYER}.ffn_output": RowParallel(),
    "predictions.decoder": VocabParallelHead(causal=False),
}
apply = plan_schedule(PLAN)
