"""--schedule auto: the HF plan of each family, translated, reproduces the unscheduled model under TP2
(Verify: outputs and every gradient), with and without sequence parallelism."""

import argparse
import os

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING

import megatron_slapo as ms
from megatron_slapo.errors import SchedulingError
from megatron_slapo.parallel.sequence import split_layers
from megatron_slapo.training.model import transformer_layers
from schedules import auto
from tests.distributed.runs import PARITY, assert_parity, layout_case, reference_losses, train_losses

# Every family auto is for, each a tiny config of the family's defaults: grouped-query attention (2
# key/value heads for 4), per-head norms (qwen3), packed q|k|v (gpt_neox), biases (starcoder2).
FAMILIES = auto.MODEL_TYPES
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, head_dim=16, pad_token_id=0, bos_token_id=0,
             eos_token_id=0)  # fmt: skip


def tiny(family: str) -> transformers.PretrainedConfig:
    """The family's config class with its defaults, scaled down (fields it lacks are dropped)."""
    cls = CONFIG_MAPPING[family]
    fields = {k: v for k, v in SIZES.items() if k in cls().to_dict() or k in ("vocab_size", "hidden_size")}
    return cls(**fields)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_auto_matches_the_unscheduled_model(group, family, sequence_parallel):
    config = tiny(family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    sch = ms.create_schedule(model, group)
    if sequence_parallel and family in auto.NO_SEQUENCE_PARALLEL:  # refused, with the reason
        with pytest.raises(SchedulingError, match=f"cannot split {family} along the sequence"):
            auto.apply(sch, config, argparse.Namespace(sequence_parallel=True))
        return
    with ms.Verify(sch, [ids], seed=7) as verify:
        auto.apply(sch, config, argparse.Namespace(sequence_parallel=sequence_parallel))
        if sequence_parallel:
            split_layers(sch, transformer_layers(model, config.num_hidden_layers))
    assert verify.report.grads and not verify.report.failures, verify.report.failures
    sharded = [path for path, node in sch.named_schedules() if node.metadata.shards]
    assert len(sharded) >= 4 * config.num_hidden_layers, sharded


def test_a_parameter_the_plan_leaves_replicated_in_a_region_is_refused(group):
    """Phi with q/k layer norms: they see this rank's heads only, and the plan says nothing of them."""
    config = tiny("phi")
    config.qk_layernorm = True
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(SchedulingError, match=r"model.layers.0.self_attn.q_layernorm.weight is replicated inside"):
        auto.apply(ms.create_schedule(model, group), config)


def test_a_style_auto_cannot_honour_is_one_error_naming_it(group):
    config = tiny("phi3")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(SchedulingError, match=r"plans 'layers.\*.self_attn.qkv_proj' as 'colwise_gather_output'"):
        auto.apply(ms.create_schedule(model, group), config)


TRAINED = ["qwen3", "mistral", "starcoder2", "gpt_neox", "granite"]  # per-head norms, GQA, biases, packed q|k|v
LAYOUTS = {"tp2": ((2,), ["--tensor-model-parallel-size", "2"]),
           "tp2-pp2": ((4,), ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])}  # fmt: skip


@pytest.fixture(scope="module")
def reference(shared_tmp, cache):
    """One process's losses per family."""
    return reference_losses(shared_tmp, lambda family: ("gpt", [*_trained(family), "--data-cache-path", cache]))


def _trained(family: str) -> list[str]:
    return [*PARITY, "--model-type", family, "--schedule", "auto", "--num-query-groups", "2"]


@pytest.mark.parametrize("family, flags", [layout_case(f, name, sizes, flags)
                                           for name, (sizes, flags) in LAYOUTS.items() for f in TRAINED])  # fmt: skip
def test_auto_trains_as_one_process(family, flags, reference, shared_tmp, cache, request):
    """pretrain_gpt.py --model-type FAMILY --schedule auto: 10 fp32 steps at TP2 and at TP2 x PP2
    (the pipeline cut through the traced model) give one process's losses."""
    tb = os.path.join(shared_tmp, f"tb-auto-{request.node.callspec.id}")
    losses = train_losses("gpt", [*_trained(family), *flags, "--data-cache-path", cache], tb)
    assert_parity(losses, reference(family), 1e-5)
