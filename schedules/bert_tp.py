"""Megatron-style tensor parallelism for HF BERT and RoBERTa (pretraining and masked-LM heads).

Vocabulary-parallel word embedding and (tied) MLM decoder, whose logits stay split across ranks
for the vocabulary-parallel loss; q, k, v and the intermediate dense layer column-parallel; the
attention output and output dense layers row-parallel. Pooler, SOP head and LayerNorms replicate.
"""

from typing import Any

from megatron_slapo.parallel.plans import (
    ColumnParallel,
    HeadParallelDropout,
    ParallelRegionInput,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    apply_plan,
)
from megatron_slapo.parallel.sequence import GatherSequence, SplitAlongSequence, plan_for
from megatron_slapo.schedule import Schedule

MODEL_TYPES = ("bert", "roberta")  # HF config.model_type values this schedule is written for

HEADS = {"bert": "cls.predictions.decoder", "roberta": "lm_head.decoder"}
TRANSFORMS = {"bert": ("cls.predictions.transform",), "roberta": ("lm_head.dense", "lm_head.layer_norm")}


def plan(prefix: str) -> dict:
    layer = f"{prefix}.encoder.layer.*"
    return {
        f"{prefix}.embeddings.word_embeddings": VocabParallelEmbedding(),
        # one GEMM and one input-gradient all-reduce for q, k, v; each rank's heads their own dropout masks
        f"{layer}.attention.self": (ParallelRegionInput(fuse="{query,key,value}"), HeadParallelDropout()),
        f"{layer}.attention.self.{{query,key,value}}": ColumnParallel(reduce_input_grad=False),
        f"{layer}.attention.output.dense": RowParallel(),
        f"{layer}.intermediate.dense": ColumnParallel(),
        f"{layer}.output.dense": RowParallel(),
        # under --sequence-parallel the MLM transform runs on this rank's part of the sequence; the pooler gathers it
        **{path: SplitAlongSequence(gather_output=path == TRANSFORMS[prefix][-1]) for path in TRANSFORMS[prefix]},
        f"{prefix}.pooler?": GatherSequence(),  # masked-LM models have none
        HEADS[prefix]: VocabParallelHead(causal=False),
    }


def apply(sch: Schedule, config: Any = None, args: Any = None) -> None:
    # The model type names the base model's attribute; a traced root (pipeline) lacks HF's own field.
    apply_plan(sch, plan_for(plan(getattr(config, "model_type", None) or sch.mod.base_model_prefix), args))
