"""Megatron-style tensor parallelism for HF BERT, RoBERTa and ALBERT (pretraining and masked-LM heads).

Vocabulary-parallel word embedding and (tied) MLM decoder, whose logits stay split across ranks
for the vocabulary-parallel loss; q, k, v and the intermediate dense layer column-parallel; the
attention output and output dense layers row-parallel. Pooler, SOP head and LayerNorms replicate.
ALBERT's one shared layer is sharded once and runs on every depth; its attention block also adds
its input to its output, so q, k and v reduce their input gradients each (no enclosing region).
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
from megatron_slapo.parallel.sequence import GatherSequence, SplitAlongSequence, plan_for, present
from megatron_slapo.schedule import Schedule

MODEL_TYPES = ("bert", "roberta", "albert")  # HF config.model_type values this schedule is written for

HEADS = {"bert": "cls.predictions.decoder", "roberta": "lm_head.decoder"}
TRANSFORMS = {"bert": ("cls.predictions.transform",), "roberta": ("lm_head.dense", "lm_head.layer_norm")}


def plan(prefix: str, pooler: bool = False) -> dict:
    layer = f"{prefix}.encoder.layer.*"
    return {
        f"{prefix}.embeddings.word_embeddings": VocabParallelEmbedding(),
        # one input-gradient all-reduce for q, k, v; each rank's heads their own dropout masks
        f"{layer}.attention.self": (ParallelRegionInput(), HeadParallelDropout()),
        f"{layer}.attention.self.query": ColumnParallel(reduce_input_grad=False),
        f"{layer}.attention.self.key": ColumnParallel(reduce_input_grad=False),
        f"{layer}.attention.self.value": ColumnParallel(reduce_input_grad=False),
        f"{layer}.attention.output.dense": RowParallel(),
        f"{layer}.intermediate.dense": ColumnParallel(),
        f"{layer}.output.dense": RowParallel(),
        # under --sequence-parallel the MLM transform runs on this rank's part of the sequence; the pooler gathers it
        **{path: SplitAlongSequence(gather_output=path == TRANSFORMS[prefix][-1]) for path in TRANSFORMS[prefix]},
        **({f"{prefix}.pooler": GatherSequence()} if pooler else {}),
        HEADS[prefix]: VocabParallelHead(causal=False),
    }


ALBERT_LAYER = "albert.encoder.albert_layer_groups.*.albert_layers.*"
ALBERT_PLAN = {
    "albert.embeddings.word_embeddings": VocabParallelEmbedding(),
    f"{ALBERT_LAYER}.attention": HeadParallelDropout(),
    **{f"{ALBERT_LAYER}.attention.{name}": ColumnParallel() for name in ("query", "key", "value")},
    f"{ALBERT_LAYER}.attention.dense": RowParallel(),
    f"{ALBERT_LAYER}.ffn": ColumnParallel(),
    f"{ALBERT_LAYER}.ffn_output": RowParallel(),
    "predictions.decoder": VocabParallelHead(causal=False),
}


def apply(sch: Schedule, config: Any = None, args: Any = None) -> None:
    # The model type names the base model's attribute; a traced root (pipeline) lacks HF's own field.
    prefix = getattr(config, "model_type", None) or sch.mod.base_model_prefix
    if prefix == "albert":
        apply_plan(sch, ALBERT_PLAN)
        return
    apply_plan(sch, plan_for(plan(prefix, pooler=bool(present(sch, f"{prefix}.pooler"))), args))
