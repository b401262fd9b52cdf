"""Megatron-style tensor parallelism for HF BERT, RoBERTa and ALBERT (pretraining and masked-LM heads).

Vocabulary-parallel word embedding and (tied) MLM decoder, whose logits stay split across ranks
for the vocabulary-parallel loss; q, k, v and the intermediate dense layer column-parallel; the
attention output and output dense layers row-parallel. Pooler, SOP head and LayerNorms replicate.
ALBERT's factorised embedding is split the same way, and its one shared layer is sharded once and
runs at every depth; its attention block adds its own input to its output, so no enclosing region
can reduce q, k and v together: they reduce their input gradients each.
"""

from typing import Any

from megatron_slapo.plans.kernel_swap import swap_in_kernels
from megatron_slapo.plans.sequence import GatherSequence, SplitAlongSequence, plan_for
from megatron_slapo.plans.styles import (
    ColumnParallel,
    HeadParallelDropout,
    ParallelRegionInput,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    apply_plan,
)
from megatron_slapo.schedule import Schedule

MODEL_TYPES = ("bert", "roberta", "albert")  # HF config.model_type values this schedule is written for

# BERT's and RoBERTa's layers, then ALBERT's: where they are, their attention module, attention output, FFN in and out
LAYERS = {"bert": ("encoder.layer.*", "attention.self", "attention.output.dense", "intermediate.dense", "output.dense"),
          "albert": ("encoder.albert_layer_groups.*.albert_layers.*", "attention", "attention.dense", "ffn", "ffn_output")}  # fmt: skip
HEADS = {"bert": "cls.predictions.decoder", "roberta": "lm_head.decoder", "albert": "predictions.decoder"}
# the MLM transform's modules, and whether each ends it (gathers the sequence under --sequence-parallel)
TRANSFORMS = {"bert": {"cls.predictions.transform": True}, "roberta": {"lm_head.dense": False, "lm_head.layer_norm": True}}  # fmt: skip


def plan(prefix: str) -> dict:
    layers, attention, attention_out, ffn_in, ffn_out = LAYERS["albert" if prefix == "albert" else "bert"]
    # ALBERT's attention adds its input to its output: no region around q, k, v can reduce their input gradients
    region = (ParallelRegionInput(fuse="{query,key,value}"),) if prefix != "albert" else ()
    return {
        f"{prefix}.embeddings.word_embeddings": VocabParallelEmbedding(),
        # one GEMM and one input-gradient all-reduce for q, k, v; each rank's heads their own dropout masks
        f"{prefix}.{layers}.{attention}": (*region, HeadParallelDropout()),
        f"{prefix}.{layers}.{attention}.{{query,key,value}}": ColumnParallel(reduce_input_grad=not region),
        f"{prefix}.{layers}.{attention_out}": RowParallel(),
        f"{prefix}.{layers}.{ffn_in}": ColumnParallel(),
        f"{prefix}.{layers}.{ffn_out}": RowParallel(),
        # under --sequence-parallel the MLM transform runs on this rank's part of the sequence; the pooler gathers it
        **{path: SplitAlongSequence(gather_output=last) for path, last in TRANSFORMS.get(prefix, {}).items()},
        f"{prefix}.pooler?": GatherSequence(),  # masked-LM models have none
        HEADS[prefix]: VocabParallelHead(causal=False),
    }


def apply(sch: Schedule, config: Any = None, args: Any = None) -> None:
    # The model type names the base model's attribute; a traced root (pipeline) lacks HF's own field.
    prefix = getattr(config, "model_type", None) or sch.mod.base_model_prefix
    apply_plan(sch, plan_for(plan(prefix), args))
    swap_in_kernels(sch)  # a formula GeLU (ALBERT's gelu_new) as one kernel; BERT's and RoBERTa's are one already
