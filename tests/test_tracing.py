"""trace(): structure-preserving fx graphs of transformers-5 modules, exact in train and eval mode."""

import copy

import pytest
import torch
import transformers
from torch import nn
from transformers.models.bert.modeling_bert import BertLayer, BertSelfAttention
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Block
from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.opt.modeling_opt import OPTDecoderLayer
from transformers.models.t5.modeling_t5 import T5Block

import megatron_slapo as ms
from megatron_slapo.tracing import TraceError
from tests.utils import tiny_bert_config, tiny_gpt2_config, tiny_llama_config

B, S, H = 2, 16, 32
DROP = 0.25  # attention/hidden dropout on, so train mode is really exercised


def _h():
    return torch.randn(B, S, H, generator=torch.Generator().manual_seed(0))


def _ids():
    return torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(1))


def _llama_cfg():
    return tiny_llama_config(attention_dropout=DROP)


def _rope():
    return tuple(LlamaRotaryEmbedding(_llama_cfg())(_h(), torch.arange(S)[None].expand(B, S)))


def _gpt2_cfg():
    return tiny_gpt2_config(attn_pdrop=DROP, resid_pdrop=DROP)


def _bert_cfg():
    return tiny_bert_config(attention_probs_dropout_prob=DROP, hidden_dropout_prob=DROP)


def _neo_cfg():  # one global and one local (sliding-window) attention layer
    return transformers.GPTNeoConfig(
        vocab_size=128, max_position_embeddings=64, hidden_size=H, num_layers=2, num_heads=4, window_size=8,
        attention_types=[[["global", "local"], 1]], attention_dropout=DROP, resid_dropout=DROP, embed_dropout=DROP,
        bos_token_id=0, eos_token_id=0)  # fmt: skip


CASES = {
    "GPT2Attention": (lambda: GPT2Attention(_gpt2_cfg(), layer_idx=0), lambda: {"hidden_states": _h()}, {}),
    "GPT2Block": (lambda: GPT2Block(_gpt2_cfg(), layer_idx=0), lambda: {"hidden_states": _h()}, {"use_cache": False}),
    "BertSelfAttention": (lambda: BertSelfAttention(_bert_cfg()), lambda: {"hidden_states": _h()}, {}),
    "BertLayer": (lambda: BertLayer(_bert_cfg()), lambda: {"hidden_states": _h()}, {}),
    "LlamaDecoderLayer": (lambda: LlamaDecoderLayer(_llama_cfg(), layer_idx=0),
                          lambda: {"hidden_states": _h(), "position_embeddings": _rope()}, {}),
    "OPTDecoderLayer": (lambda: OPTDecoderLayer(transformers.OPTConfig(
        hidden_size=H, num_attention_heads=4, ffn_dim=64, num_hidden_layers=2, vocab_size=128,
        word_embed_proj_dim=H, dropout=DROP, attention_dropout=DROP), layer_idx=0), lambda: {"hidden_states": _h()}, {}),
    "T5Block": (lambda: T5Block(transformers.T5Config(d_model=H, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
                                                      vocab_size=128, dropout_rate=DROP), has_relative_attention_bias=True),
                lambda: {"hidden_states": _h()}, {}),
    "GPT2LMHeadModel": (lambda: transformers.GPT2LMHeadModel(_gpt2_cfg()), lambda: {"input_ids": _ids()},
                        {"use_cache": False}),
    # Real (non-meta) weights: the causal-mask buffer meets torch.tensor(min, device=x.device) in torch.where.
    "GPTNeoSelfAttention": (lambda: GPTNeoSelfAttention(_neo_cfg(), "local"), lambda: {"hidden_states": _h()}, {}),
    "GPTNeoForCausalLM": (lambda: transformers.GPTNeoForCausalLM(_neo_cfg()), lambda: {"input_ids": _ids()},
                          {"use_cache": False}),
    "BertForMaskedLM": (lambda: transformers.BertForMaskedLM(_bert_cfg()), lambda: {"input_ids": _ids()}, {}),
    "LlamaForCausalLM": (lambda: transformers.LlamaForCausalLM(_llama_cfg()), lambda: {"input_ids": _ids()},
                         {"use_cache": False}),
}  # fmt: skip


def tensors(out):
    """Every tensor of a module's output (tuples, lists, dicts and HF ModelOutputs)."""
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else []
    return [t for v in values for t in tensors(v)]


@pytest.mark.parametrize("name", list(CASES))
def test_traced_levels_equal_the_module_in_train_and_eval(name):
    make, inputs, constants = CASES[name]
    torch.manual_seed(0)
    original = make()
    model = copy.deepcopy(original)
    sch = ms.create_schedule(model)
    sch.trace(example_inputs=inputs(), concrete_args=constants)
    traced = sch.mod
    assert isinstance(traced, torch.fx.GraphModule)
    for mode in ("train", "eval"):
        for module in (original, traced):
            module.train(mode == "train")
            module.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        expected = tensors(original(**inputs(), **constants))
        torch.manual_seed(3)
        got = tensors(traced(**inputs(), **constants))
        assert len(got) == len(expected) and all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), mode
        sum(t.float().sum() for t in expected if t.requires_grad).backward()
        sum(t.float().sum() for t in got if t.requires_grad).backward()
        grads = dict(traced.named_parameters(remove_duplicate=False))
        for pname, p in original.named_parameters():
            assert (p.grad is None) == (grads[pname].grad is None), pname
            # Same ops in the same order; autograd may accumulate a grad from several uses in another order.
            assert p.grad is None or (grads[pname].grad - p.grad).abs().max() <= 1e-6 * p.grad.abs().max(), pname


def test_levels_stay_addressable_and_keep_their_schedules():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    sch = ms.create_schedule(model)
    c_attn = model.transformer.h[0].attn.c_attn
    sch["transformer.h.0.attn.c_attn"].annotate("weight", "tag", 7)
    sch.trace(example_inputs={"input_ids": _ids()}, concrete_args={"use_cache": False})
    attn = sch["transformer.h.0.attn"]
    assert isinstance(attn.mod, torch.fx.GraphModule) and attn.metadata.traced
    assert sch["transformer.h.0.attn.c_attn"].mod is c_attn
    assert sch["transformer.h.0.attn.c_attn"].metadata.annotations == {"weight": {"tag": 7}}
    calls = [n.target for n in sch["transformer.h.0"].mod.graph.nodes if n.op == "call_module"]
    assert calls == ["ln_1", "attn", "ln_2", "mlp"]


def test_flatten_and_leaf_modules():
    block = GPT2Block(tiny_gpt2_config(), layer_idx=0).eval()
    expected = block(_h())
    sch = ms.create_schedule(copy.deepcopy(block))
    sch.trace(example_inputs={"hidden_states": _h()}, flatten=True)
    calls = [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]
    assert "attn.c_attn" in calls and "attn" not in calls
    assert torch.equal(sch.mod(_h()), expected)
    sch = ms.create_schedule(copy.deepcopy(block))
    sch.trace(example_inputs={"hidden_states": _h()}, flatten=True, leaf_modules=[GPT2Attention])
    calls = [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]
    assert "attn" in calls and "attn.c_attn" not in calls
    sch = ms.create_schedule(copy.deepcopy(block))
    sch.trace(example_inputs={"hidden_states": _h()}, recursive=False)
    assert not isinstance(sch["attn"].mod, torch.fx.GraphModule) and torch.equal(sch.mod(_h()), expected)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # control flow on tensor values: not traceable
            return self.inner(x)
        return x


class TrainOnlyBranch(nn.Module):
    def forward(self, x):
        return x * 2 if self.training else x


def test_guards_and_errors_name_the_module():
    sch = ms.create_schedule(nn.Sequential(DataDependent()))
    with pytest.raises(
        TraceError, match=r"\[0\] cannot trace DataDependent: .*at .*test_tracing.py:\d+ `if x.sum\(\) > 0:"
    ):
        sch.trace(example_inputs=torch.randn(2, 4))

    model = transformers.GPT2LMHeadModel(tiny_gpt2_config()).eval()
    sch = ms.create_schedule(model)
    sch.trace(example_inputs={"input_ids": _ids()}, concrete_args={"use_cache": False})
    with pytest.raises(
        TraceError, match=r"traced for input_ids of shape \(2, 16\) \(int64\) and called with shape \(2, 8\)"
    ):
        sch.mod(torch.zeros(2, 8, dtype=torch.long), use_cache=False)
    with pytest.raises(TraceError, match="traced with use_cache=False baked in and called with use_cache=True"):
        sch.mod(_ids(), use_cache=True)

    sch = ms.create_schedule(nn.Sequential(TrainOnlyBranch()))
    sch.trace(example_inputs=torch.ones(2))
    assert torch.equal(sch.mod.train()(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(TraceError, match="depends on train/eval mode beyond dropout"):
        sch.mod.eval()(torch.ones(2))


def test_trace_refuses_to_lose_primitives():
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    sch = ms.create_schedule(model)
    sch["transformer.h.0.mlp.c_fc"].shard("weight", axis=1)  # a leaf: kept as is
    sch["transformer.h.1"].checkpoint()  # a level whose forward was rewritten: would be lost
    with pytest.raises(ms.SchedulingError, match=r"transformer.h.1 has checkpoint; trace\(\) before"):
        sch.trace(example_inputs={"input_ids": _ids()}, concrete_args={"use_cache": False})
    with pytest.raises(ms.SchedulingError, match="needs example_inputs"):
        sch.trace()


class Flagged(nn.Module):
    def forward(s, x, flag=False):  # noqa: N805 - a first parameter not called self
        return -x if flag else x


def test_guard_covers_omitted_constants_and_dtypes():
    sch = ms.create_schedule(nn.Sequential(Flagged()))
    sch["0"].trace(example_inputs=torch.ones(2), concrete_args={"flag": True})
    traced = sch["0"].mod
    assert torch.equal(traced(torch.ones(2), flag=True), -torch.ones(2))
    with pytest.raises(TraceError, match=r"traced with \['flag'\] given"):
        traced(torch.ones(2))  # the default (False) is not what was traced
    with pytest.raises(TraceError, match=r"shape \(2,\) \(float32\) and called with shape \(2,\) \(float64\)"):
        traced(torch.ones(2, dtype=torch.float64), flag=True)


class SizesAndRealTensors(nn.Module):
    """``x.size(0)`` (MetaProxy.size returned the whole shape for dim 0) and a real tensor that is no
    registered buffer meeting meta values in ``torch.where`` (MetaTracer's meta evaluation failed)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.keep = torch.tensor([True, False, True, True])  # a plain attribute: stays a real tensor

    def forward(self, x):
        y = self.proj(x.reshape(x.size(0), -1, 8))
        floor = torch.tensor(-1.0, dtype=y.dtype, device=y.device)
        return torch.where(self.keep, y, floor).reshape(x.size(0), -1)


def test_size_of_dim_zero_and_real_tensors_next_to_traced_values():
    module = SizesAndRealTensors()
    x = torch.randn(2, 3, 8)
    sch = ms.create_schedule(copy.deepcopy(module))
    sch.trace(example_inputs=x)
    out = sch.mod(x)
    assert out.shape == (2, 12) and torch.equal(out, module(x))
