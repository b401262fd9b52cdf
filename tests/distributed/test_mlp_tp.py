"""Megatron's f/g MLP pattern on real HF modules: GPT2MLP, LlamaMLP, BertIntermediate+BertOutput."""

import pytest
import torch
from torch import nn
from transformers.models.bert.modeling_bert import BertIntermediate, BertOutput
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.llama.modeling_llama import LlamaMLP

from megatron_slapo import create_schedule
from tests.utils import assert_grads_match, max_diff, tiny_bert_config, tiny_gpt2_config, tiny_llama_config

TOL = 1e-5


class BertFFN(nn.Module):
    """The feed-forward half of a BertLayer."""

    def __init__(self, config):
        super().__init__()
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden):
        return self.output(self.intermediate(hidden), hidden)


def column(sch, param_axis):
    sch.shard("weight", axis=param_axis)
    if getattr(sch.mod, "bias", None) is not None:
        sch.shard("bias", axis=0)
    sch.sync("bwd_post", "all_reduce")


def row(sch, param_axis):
    sch.shard("weight", axis=param_axis)
    sch.sync("fwd_post", "all_reduce")


def gpt2_case():
    def schedule(sch):
        column(sch["c_fc"], 1)  # Conv1D: output axis 1
        row(sch["c_proj"], 0)

    cfg = tiny_gpt2_config()
    return (lambda: GPT2MLP(4 * cfg.n_embd, cfg)), schedule, cfg.n_embd


def llama_case():
    def schedule(sch):
        column(sch["gate_proj"], 0)
        column(sch["up_proj"], 0)
        row(sch["down_proj"], 1)

    cfg = tiny_llama_config()
    return (lambda: LlamaMLP(cfg)), schedule, cfg.hidden_size


def bert_case():
    def schedule(sch):
        column(sch["intermediate.dense"], 0)
        row(sch["output.dense"], 1)

    cfg = tiny_bert_config()
    return (lambda: BertFFN(cfg)), schedule, cfg.hidden_size


def built_pair(make):
    torch.manual_seed(0)
    ref = make()
    for p in ref.parameters():  # HF leaves biases at zero: randomise so misplaced biases show
        torch.nn.init.normal_(p, std=0.1)
    tp = make()
    tp.load_state_dict(ref.state_dict())
    return ref, tp


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("case", [gpt2_case, llama_case, bert_case], ids=["gpt2", "llama", "bert"])
def test_mlp_tensor_parallel(group, rank, world, case):
    make, schedule, hidden = case()
    ref, tp = built_pair(make)
    sch = create_schedule(tp, group)
    schedule(sch)
    x = torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(1))
    g = torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(2))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(x_ref), tp(x_tp)
    (y_ref * g).sum().backward()
    (y * g).sum().backward()

    assert max_diff(y, y_ref) < TOL
    assert max_diff(x_tp.grad, x_ref.grad) < TOL
    assert_grads_match(tp, ref, rank, world)
