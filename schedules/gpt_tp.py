"""Megatron-style tensor parallelism for HF GPT-2 (GPT2LMHeadModel).

Vocabulary-parallel (tied) embedding and LM head with a vocabulary-parallel loss; fused q|k|v and
the MLP's first layer column-parallel; both output projections row-parallel, their biases added
after the all-reduce. Two all-reduces per block forward, two backward, as in Megatron.

Known gap: HF applies attention-probability dropout inside the attention kernel call, so it is not
yet on the model-parallel RNG stream (Megatron forks it); with attn_pdrop > 0 the ranks' heads draw
masks from the same stream. Numerics are otherwise exact; training with dropout remains valid.
"""

from typing import Any

from megatron_slapo.parallel.plans import (
    ColumnParallel,
    LocalHeads,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    apply_plan,
)
from megatron_slapo.schedule import Schedule

MODEL_TYPES = ("gpt2",)  # HF config.model_type values this schedule is written for

PLAN = {
    "transformer.wte": VocabParallelEmbedding(),
    "transformer.h.*.attn": LocalHeads("split_size", "num_heads", "embed_dim"),
    "transformer.h.*.attn.c_attn": ColumnParallel(stride=3),  # q|k|v: each rank keeps its heads of each
    "transformer.h.*.attn.c_proj": RowParallel(),
    "transformer.h.*.mlp.c_fc": ColumnParallel(),
    "transformer.h.*.mlp.c_proj": RowParallel(),
    "lm_head": VocabParallelHead(),
}


def apply(sch: Schedule, config: Any = None, args: Any = None) -> None:
    apply_plan(sch, PLAN)
