"""Megatron-style tensor parallelism for HF OPT (OPTForCausalLM)."""

from typing import Any

from megatron_slapo.parallel.plans import (
    ColumnParallel,
    HeadParallelDropout,
    LocalHeads,
    ParallelRegionInput,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    apply_plan,
)
from megatron_slapo.parallel.sequence import SplitAlongSequence, plan_for, present
from megatron_slapo.schedule import Schedule

MODEL_TYPES = ("opt",)  # HF config.model_type values this schedule is written for

LAYER = "model.decoder.layers.*"
PLAN = {
    "model.decoder.embed_tokens": VocabParallelEmbedding(),
    # OPT reshapes with self.num_heads; one input-gradient all-reduce for q, k, v
    f"{LAYER}.self_attn": (LocalHeads("num_heads", "embed_dim"), ParallelRegionInput(), HeadParallelDropout()),
    f"{LAYER}.self_attn.q_proj": ColumnParallel(reduce_input_grad=False),
    f"{LAYER}.self_attn.k_proj": ColumnParallel(reduce_input_grad=False),
    f"{LAYER}.self_attn.v_proj": ColumnParallel(reduce_input_grad=False),
    f"{LAYER}.self_attn.out_proj": RowParallel(),
    # OPT's MLP runs on tokens flattened to rows: under sequence parallelism its rows are split
    f"{LAYER}.fc1": ColumnParallel(sequence_dim=0),
    f"{LAYER}.fc2": RowParallel(sequence_dim=0),
    "lm_head": VocabParallelHead(),
}
# after the layers: under --sequence-parallel split, the last one gathers (OPT-350m: project_out only)
TAIL = ("model.decoder.final_layer_norm", "model.decoder.project_out")


def apply(sch: Schedule, config: Any = None, args: Any = None) -> None:
    tail = present(sch, *TAIL)
    tail = {path: SplitAlongSequence(gather_output=path == tail[-1]) for path in tail}
    apply_plan(sch, plan_for({**PLAN, **tail}, args))
