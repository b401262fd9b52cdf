"""Every tensor-parallel schedule in schedules/ reproduces its unscheduled model (Verify: outputs and grads),
with and without sequence parallelism."""

import argparse

import pytest
import torch
import transformers

import megatron_slapo as ms
from megatron_slapo.models.layers import transformer_layers
from megatron_slapo.plans.sequence import split_layers
from schedules import SCHEDULES
from tests.utils import tiny_albert, tiny_bert_config, tiny_gpt2_config, tiny_llama_config, tiny_roberta

CASES = {
    "gpt_tp": lambda: transformers.GPT2LMHeadModel(tiny_gpt2_config()),
    "gpt_neo_tp": lambda: transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=128, max_position_embeddings=64, hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=8, resid_dropout=0.0, embed_dropout=0.0,
        attention_dropout=0.0)),
    "opt_tp": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=128, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
        num_attention_heads=4, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, pad_token_id=1)),
    "llama_tp": lambda: transformers.LlamaForCausalLM(tiny_llama_config()),
    "bert_tp": lambda: transformers.BertForPreTraining(tiny_bert_config()),
    "bert_tp/albert": tiny_albert,
    "bert_tp/roberta": tiny_roberta,
}  # fmt: skip


# ALBERT runs one shared layer at every depth: there is no layer per depth to split along the
# sequence (the trainer refuses --sequence-parallel for it), so it has no tp-sp case
LAYOUTS = [pytest.param(case, sp, id=f"{case}-{'tp-sp' if sp else 'tp'}") for case in sorted(CASES)
           for sp in (False, True) if not (sp and case == "bert_tp/albert")]  # fmt: skip


@pytest.mark.parametrize("case, sequence_parallel", LAYOUTS)
def test_schedule_matches_the_unscheduled_model(group, case, sequence_parallel):
    name = case.split("/")[0]
    with torch.device("meta"):
        model = CASES[case]().eval()
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    sch = ms.create_schedule(model, group)
    with ms.Verify(sch, [ids], seed=7) as verify:
        SCHEDULES[name].apply(sch, model.config, argparse.Namespace(sequence_parallel=sequence_parallel))
        if sequence_parallel:
            split_layers(sch, transformer_layers(model, model.config.num_hidden_layers))
    assert verify.report.grads and not verify.report.failures
    sharded = [path for path, node in sch.named_schedules() if node.metadata.shards]
    assert len(sharded) >= 4, sharded
    split = [name for name, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]
    after_layers = ("ln_f", "norm", "final_layer_norm", "predictions.transform", "lm_head.dense", "lm_head.layer_norm")
    in_layers = (".layer", ".h.", *after_layers)  # the layers, then the final norm / MLM transform up to the head
    assert bool(split) == sequence_parallel and all(any(k in name for k in in_layers) for name in split), split
    assert sequence_parallel == any(any(k in name for k in after_layers) for name in split), split


def test_every_schedule_is_covered():
    # default and gpt_fused shard nothing (gpt_fused's parity: test_engines.py::test_gpt_fused_loss_parity);
    # auto serves every family with a plan: test_auto.py; t5_tp and wideresnet_tp take other inputs than
    # token ids alone: test_t5.py, test_wideresnet.py
    others = {"default", "gpt_fused", "auto", "t5_tp", "wideresnet_tp"}
    assert {case.split("/")[0] for case in CASES} == set(SCHEDULES) - others


def test_sequence_parallel_needs_a_gather_before_the_head(group):
    """A plan whose final norm does not gather the sequence would hand the LM head part of it."""
    from megatron_slapo.errors import SchedulingError
    from megatron_slapo.plans.sequence import plan_for
    from megatron_slapo.plans.styles import apply_plan
    from schedules.gpt_tp import PLAN

    with torch.device("meta"):
        model = CASES["gpt_tp"]()
    sch = ms.create_schedule(model, group)
    plan = {k: v for k, v in PLAN.items() if k != "transformer.ln_f"}
    apply_plan(sch, plan_for(plan, argparse.Namespace(sequence_parallel=True)))
    with pytest.raises(SchedulingError, match="nothing after the layers gathers the sequence"):
        split_layers(sch, transformer_layers(model, model.config.num_hidden_layers))


def test_sequence_parallel_refuses_models_with_other_heads_on_the_last_hidden_state(group):
    """GPT2DoubleHeadsModel's multiple-choice head reads what the final norm gathers for the LM head:
    its gradient would be reduce-scattered (summed over the ranks) with the head's."""
    from megatron_slapo.errors import SchedulingError

    with torch.device("meta"):
        model = transformers.GPT2DoubleHeadsModel(tiny_gpt2_config())
    sch = ms.create_schedule(model, group)
    SCHEDULES["gpt_tp"].apply(sch, model.config, argparse.Namespace(sequence_parallel=True))
    with pytest.raises(SchedulingError, match="GPT2DoubleHeadsModel has other consumers of the last hidden state"):
        split_layers(sch, transformer_layers(model, model.config.num_hidden_layers))
