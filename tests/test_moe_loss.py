"""An MoE model's load-balancing loss in the trainer's loss (``training/moe_loss.py``): HF's own
value, when it is on, and the combinations refused before compute (one process; tensor and
sequence parallelism are in tests/distributed/test_moe_aux_loss.py)."""

from __future__ import annotations

import argparse

import pytest
import torch
import transformers

from megatron_slapo.errors import ConfigError
from megatron_slapo.training.moe_loss import LoadBalancingLoss, load_balancing_loss
from megatron_slapo.training.tasks import GPTTask

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, n_group=1, topk_group=1)  # fmt: skip


def model_of(family: str, device: str = "meta", **config: object) -> torch.nn.Module:
    """A tiny model of ``family`` (its config's fields among SIZES, then ``config``)."""
    cls = transformers.CONFIG_MAPPING[family]
    fields = {k: v for k, v in SIZES.items() if k in cls().to_dict() or k in ("vocab_size", "hidden_size")}
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cls(**fields, **config))


def args_of(coeff: float = 0.0, **flags: object) -> argparse.Namespace:
    defaults = dict(pipeline_model_parallel_size=1, reset_position_ids=False, reset_attention_mask=False,
                    sequence_parallel=False)  # fmt: skip
    return argparse.Namespace(moe_aux_loss_coeff=coeff, **{**defaults, **flags})


@pytest.mark.parametrize("switch", ["flag", "config"])
def test_the_loss_is_the_models_own_with_its_auxiliary_loss(switch):
    """The trainer's loss on a GPT batch equals HF's ``labels=`` loss with ``output_router_logits``
    (cross-entropy + router_aux_loss_coef x HF's load-balancing loss), turned on by the flag or by
    the model's config; so do the router's gradients."""
    torch.manual_seed(0)
    model = model_of("qwen3_moe", "cpu", output_router_logits=switch == "config", router_aux_loss_coef=0.25)
    task = GPTTask(64, None, load_balancing=load_balancing_loss(model, args_of(0.25 if switch == "flag" else 0), None))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones(2, 12)
    loss_mask[:, -1] = 0  # the last token has no next one (HF shifts the labels itself)
    batch = {"tokens": ids, "labels": torch.roll(ids, -1, dims=1), "loss_mask": loss_mask}
    loss, metrics = task.loss(model, batch)
    (router,) = {m.weight for name, m in model.named_modules() if name == "model.layers.0.mlp.gate"}
    mine = torch.autograd.grad(loss, router)[0]
    hf = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    assert torch.allclose(loss, hf.loss, atol=1e-6, rtol=0)
    assert torch.allclose(mine, torch.autograd.grad(hf.loss, router)[0], atol=1e-7, rtol=0)
    assert torch.allclose(metrics["load balancing loss"], hf.aux_loss, atol=1e-6, rtol=0) and hf.aux_loss > 1.0
    assert torch.allclose(loss, metrics["lm loss"] + 0.25 * hf.aux_loss, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "family, config, coeff",
    [("qwen3_moe", {}, 0.0), ("qwen3_moe", {"output_router_logits": True, "router_aux_loss_coef": 0.0}, 0.0),
     ("glm4_moe", {"output_router_logits": True}, 0.0), ("llama", {}, 0.0)],
    ids=["off", "config-coefficient-0", "config-on-no-loss-defined", "dense"],
)  # fmt: skip
def test_off_unless_turned_on_for_a_model_that_defines_it(family, config, coeff):
    assert load_balancing_loss(model_of(family, **config), args_of(coeff), None) is None


def test_on_takes_hf_function_and_the_models_sizes():
    found = load_balancing_loss(model_of("mixtral"), args_of(0.5), None)
    module = transformers.models.mixtral.modeling_mixtral
    assert found == LoadBalancingLoss(module.load_balancing_loss_func, 4, 2, 0.5, None)


MASK = (
    "--moe-aux-loss-coeff 0.1: HF's Qwen3MoeForCausalLM computes the load-balancing loss in its forward with the "
    "attention mask as a padding mask, which the 4D mask of --reset-position-ids / --reset-attention-mask is not"
)


@pytest.mark.parametrize(
    "family, coeff, flags, message",
    [("qwen3_moe", -1.0, {}, "--moe-aux-loss-coeff -1: give a coefficient >= 0"),
     ("glm4_moe", 0.1, {}, "--moe-aux-loss-coeff 0.1: HF's Glm4MoeForCausalLM defines no load-balancing loss"),
     ("llama", 0.1, {}, "--moe-aux-loss-coeff 0.1: HF's LlamaForCausalLM defines no load-balancing loss"),
     ("qwen3_moe", 0.1, {"pipeline_model_parallel_size": 2}, "--moe-aux-loss-coeff 0.1: the load-balancing loss pools "
      "the routing statistics of every layer, which --pipeline-model-parallel-size 2 puts on different stages"),
     ("qwen3_moe", 0.1, {"reset_attention_mask": True}, MASK), ("qwen3_moe", 0.1, {"reset_position_ids": True}, MASK)],
    ids=["negative", "aux-free-family", "dense", "pipeline", "reset-attention-mask", "reset-position-ids"],
)  # fmt: skip
def test_what_it_cannot_compute_as_one_device_is_refused(family, coeff, flags, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        load_balancing_loss(model_of(family), args_of(coeff, **flags), None)


def test_the_models_config_turning_it_on_is_named_in_a_refusal():
    model = model_of("qwen3_moe", output_router_logits=True)
    with pytest.raises(ConfigError, match=r"^the model's config \(output_router_logits, coefficient 0.001\): .* "
                                          "--pipeline-model-parallel-size 2"):  # fmt: skip
        load_balancing_loss(model, args_of(pipeline_model_parallel_size=2), None)


def test_router_logits_of_other_tokens_than_the_micro_batchs_are_refused():
    """A router that saw part of the micro-batch (a sequence split left ungathered) would give a
    loss of other tokens: an error, not a value."""
    function = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func
    with pytest.raises(RuntimeError, match=r"router logits of \[8\] tokens for a micro-batch of 16"):
        LoadBalancingLoss(function, 4, 2, 1.0)((torch.randn(8, 4),), 16)
